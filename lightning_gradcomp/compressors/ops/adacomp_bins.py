"""AdaComp's bins for every layer of a bucket at once: bin maxima, thresholds and scales in a few operators.

AdaComp (Chen et al., AAAI 2018, arXiv:1712.02679) cuts every layer into bins of ``L`` consecutive elements from the
layer's start (``L`` by the layer's kind, the last bin shorter) and sends an element when its soft-thresholded value
reaches its bin's largest ``|G|``. A loop over the layers costs a few operators per layer, each a kernel launch on a
GPU. Here the bins of all layers of one bin length are the rows of one :class:`~.segments.AlignedRows` (rows start at
each layer's start, the last padded with 0, which never exceeds a magnitude): one gather and one row-wise maximum per
bin length. The bins are then put in the order of their positions, and every element compared with its bin's
threshold (repeated along the bin), in one comparison for the bucket. The maxima and the selection are the same as a
per-layer loop's; a layer's scale (the mean of its bin maxima) is a segmented sum over its bins divided by their
count, summed in another order than ``mean``'s, so it differs from the loop's at the rounding level of its dtype.
The index tensors depend only on the layout and the bin lengths, and are cached.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from lightning_gradcomp.compressors.ops.packing import numpy_floats
from lightning_gradcomp.compressors.ops.segments import ROW, AlignedRows, LayoutCache
from lightning_gradcomp.engine.context import Layer

__all__ = ["BinPlan", "bin_plan"]


def _row_maxima(rows: Tensor) -> Tensor:
    return rows.abs_().amax(dim=1)  # the rows are a gathered copy: made absolute in place


@dataclass(frozen=True)
class BinPlan:
    """The bins of a layout's layers, for bin lengths chosen per layer.

    Attributes:
        groups: per bin length, the rows of the layers binned at that length (their bins, layer after layer).
        order: every bin's place among the groups' bins concatenated, in the order of the bins' positions.
        lengths: every bin's number of elements, in that order (int64).
        sizes: the same on the host (NumPy's ``repeat``).
        numel: the layers' elements (they lie back to back).
        per_layer: the bins of every layer, as segments of the bins in position order (for the scales' sums).
        counts: every layer's number of bins (int64).
    """

    groups: tuple[AlignedRows, ...]
    order: Tensor
    lengths: Tensor
    sizes: np.ndarray
    numel: int
    per_layer: AlignedRows
    counts: Tensor

    def maxima(self, values: Tensor) -> Tensor:
        """Every bin's largest ``|values|``, bins in the order of their positions (in ``values``' dtype)."""
        parts = [group.row_values(values, _row_maxima) for group in self.groups]
        return (parts[0] if len(parts) == 1 else torch.cat(parts)).index_select(0, self.order)

    def expand(self, per_bin: Tensor) -> Tensor:
        """``per_bin[b]`` for every element of bin ``b``: a flat tensor of the layers' elements.

        NumPy's ``repeat`` on the CPU (one pass; torch's ``repeat_interleave`` gathers through an index of every
        element, several times slower there).
        """
        if numpy_floats(per_bin):
            return torch.from_numpy(np.repeat(per_bin.detach().numpy(), self.sizes))
        return torch.repeat_interleave(per_bin, self.lengths, output_size=self.numel)

    def means(self, per_bin: Tensor) -> Tensor:
        """Every layer's mean of ``per_bin`` over its bins (a segmented sum, then divided by the count)."""
        sums = self.per_layer.reduce(per_bin, _sum_rows, _sum_rows)
        return sums.div_(self.counts.to(sums.dtype))


def _sum_rows(rows: Tensor) -> Tensor:
    return rows.sum(dim=1)


def _plan(layers: Sequence[Layer], sizes: Sequence[int], device: torch.device) -> BinPlan:
    bins: list[tuple[int, int, int]] = []  # (start, length, index among the groups' rows)
    groups, at = [], 0
    for size in sorted(set(sizes)):
        members = [layer for layer, s in zip(layers, sizes) if s == size]
        groups.append(AlignedRows([m.offset for m in members], [m.numel for m in members], size, device))
        for layer in members:
            for start in range(0, layer.numel, size):
                bins.append((layer.offset + start, min(size, layer.numel - start), at))
                at += 1
    bins.sort()
    counts = [-(-layer.numel // size) for layer, size in zip(layers, sizes)]
    firsts = [0]
    for count in counts[:-1]:
        firsts.append(firsts[-1] + count)
    return BinPlan(
        groups=tuple(groups),
        order=torch.tensor([b[2] for b in bins], dtype=torch.int64, device=device),
        lengths=torch.tensor([b[1] for b in bins], dtype=torch.int64, device=device),
        sizes=np.array([b[1] for b in bins], dtype=np.int64),
        numel=sum(layer.numel for layer in layers),
        per_layer=AlignedRows(firsts, counts, ROW, device),
        counts=torch.tensor(counts, dtype=torch.int64, device=device),
    )


_PLANS: LayoutCache[BinPlan] = LayoutCache()


def bin_plan(layers: Sequence[Layer], size_of: Callable[[Layer], int], device: torch.device) -> BinPlan:
    """The :class:`BinPlan` of ``layers`` (back to back, offsets increasing), each binned at ``size_of(layer)``."""
    sizes = [size_of(layer) for layer in layers]
    key = (tuple((layer.offset, layer.numel) for layer in layers), tuple(sizes), str(device))
    return _PLANS.get(key, lambda: _plan(layers, sizes, device))
