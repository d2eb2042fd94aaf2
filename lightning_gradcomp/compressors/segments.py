"""A bucket's layers as segments of its flat tensor: per-layer reductions and lookups in a bounded number of operators.

A codec that loops over a bucket's layers issues a few operators per layer: on a GPU each one is a kernel launch,
so ResNet-50's 54 compressed layers cost hundreds of launches per bucket where the work is a few memory passes. Here
the flat tensor is cut into rows of :data:`ROW` elements; every row that lies inside one layer is reduced with the
others in one operator, and the few rows that a layer boundary crosses are reduced piece by piece, gathered into one
padded matrix. A layer's value is then the sum (or maximum) of its rows' and pieces' values: about ten operators
whatever the number of layers. The index tensors this needs depend only on the layout, and are cached per layout and
device (:func:`segments_of`).

Per-group lookups (a packed byte's 8 signs, say) work the same way: every group takes the table of the layer its
first element is in (one combined table, the group's layer selecting its rows), and the few elements of groups that
a boundary crosses are rewritten afterwards.

Maxima and counts are the same values as a per-layer reduction; sums are added in another order (rows, then rows
per layer), so they differ from a per-layer ``sum`` at the rounding level of fp32.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_gradcomp.compressors.context import Layer

__all__ = ["ROW", "GroupLayout", "Segments", "segments_of"]

ROW = 1024  # elements per row: long enough for a vectorised row reduction, short enough that boundary rows are few
_CACHE_SIZE = 64


@dataclass(frozen=True)
class GroupLayout:
    """Groups of ``width`` consecutive elements, each given the layer of its first element.

    Attributes:
        group_layer: the layer of every group (int32, ``ceil(n / width)``).
        fix_positions: the elements whose layer is not their group's (int64), in increasing order.
        fix_layer: the layer of each of them (int64).
    """

    group_layer: Tensor
    fix_positions: Tensor
    fix_layer: Tensor


class Segments:
    """The layers of a flat tensor of ``numel`` elements as segments, with the index tensors of their reductions.

    Args:
        layers: the layers, back to back in the flat tensor (offsets increasing, no gaps).
        device: where the index tensors live (the gradient's device).
    """

    def __init__(self, layers: Sequence[Layer], device: torch.device) -> None:
        starts = [layer.offset for layer in layers]
        lengths = [layer.numel for layer in layers]
        self.count = len(layers)
        self.numel = sum(lengths)
        self.device = device
        self.lengths = torch.tensor(lengths, dtype=torch.int64, device=device)
        self.full_rows = self.numel // ROW
        row_layer, clean, pieces = _rows(starts, lengths, self.numel)
        self._clean_rows = torch.tensor(clean, dtype=torch.int64, device=device)
        self._clean_layer = torch.tensor([row_layer[r] for r in clean], dtype=torch.int64, device=device)
        positions = torch.tensor([lo for lo, _, _ in pieces], dtype=torch.int64).view(-1, 1) + torch.arange(ROW)
        ends = torch.tensor([hi for _, hi, _ in pieces], dtype=torch.int64).view(-1, 1)
        self._piece_mask = (positions < ends).to(device)
        self._piece_positions = positions.clamp_(max=max(self.numel - 1, 0)).to(device)
        self._piece_layer = torch.tensor([layer for _, _, layer in pieces], dtype=torch.int64, device=device)
        self._groups: dict[int, GroupLayout] = {}
        self._starts, self._sizes = starts, lengths

    def _rows_of(self, tensor: Tensor) -> Tensor:
        return tensor[: self.full_rows * ROW].view(self.full_rows, ROW)

    def _combine(self, rows: Tensor, pieces: Tensor, reduce: str, dtype: torch.dtype) -> Tensor:
        """Per layer: the reduction of its clean rows' values and its pieces' values."""
        include_self = reduce == "sum"
        out = torch.zeros(self.count, dtype=dtype, device=self.device)
        if rows.numel():
            out.scatter_reduce_(0, self._clean_layer, rows.index_select(0, self._clean_rows).to(dtype), reduce,
                                include_self=include_self)  # fmt: skip
            include_self = True
        return out.scatter_reduce_(0, self._piece_layer, pieces.to(dtype), reduce, include_self=include_self)

    def _gathered(self, tensor: Tensor, fill: float) -> Tensor:
        """The pieces of the rows a boundary crosses (and of the tail), padded with ``fill`` to ``ROW`` elements."""
        values = tensor.index_select(0, self._piece_positions.view(-1)).view_as(self._piece_positions)
        return values.masked_fill_(~self._piece_mask, fill)

    def sums(self, tensor: Tensor, dtype: torch.dtype) -> Tensor:
        """Every layer's sum of ``tensor``'s elements, accumulated in ``dtype`` (rounding-level from ``x.sum()``)."""
        rows = self._rows_of(tensor).sum(dim=1, dtype=dtype)
        return self._combine(rows, self._gathered(tensor, 0.0).sum(dim=1, dtype=dtype), "sum", dtype)

    def l1(self, tensor: Tensor, dtype: torch.dtype) -> Tensor:
        """Every layer's sum of ``|x|``, accumulated in ``dtype`` (rounding-level from a per-layer 1-norm)."""
        rows = torch.linalg.vector_norm(self._rows_of(tensor), 1, dim=1, dtype=dtype)
        pieces = torch.linalg.vector_norm(self._gathered(tensor, 0.0), 1, dim=1, dtype=dtype)
        return self._combine(rows, pieces, "sum", dtype)

    def counts(self, mask: Tensor) -> Tensor:
        """Every layer's number of set elements of the bool ``mask`` (int64, exact)."""
        rows = torch.count_nonzero(self._rows_of(mask), dim=1)
        pieces = torch.count_nonzero(self._gathered(mask, False), dim=1)
        return self._combine(rows, pieces, "sum", torch.int64)

    def max_magnitudes(self, tensor: Tensor, dtype: torch.dtype) -> Tensor:
        """Every layer's largest ``|x|`` in ``dtype``: the same values as a per-layer infinity norm (NaN propagates).

        ``max(max x, -min x) + 0.0`` per row (``aminmax`` is one vectorised pass; the infinity norm's CPU kernel is
        a scalar loop), then the rows' maximum per layer.
        """
        low, high = torch.aminmax(self._rows_of(tensor), dim=1)
        rows = torch.maximum(high, low.neg())
        low, high = torch.aminmax(self._gathered(tensor, 0.0), dim=1)  # a padded 0 never exceeds a magnitude
        pieces = torch.maximum(high, low.neg())
        result = self._combine(rows, pieces, "amax", dtype)
        # scatter_reduce's amax skips NaN on some kernels: a layer with a NaN anywhere reports NaN, as the norm does
        nan = self._combine(torch.isnan(rows), torch.isnan(pieces), "amax", torch.bool)
        return result.masked_fill_(nan, float("nan")).add_(0.0)

    def expand(self, values: Tensor) -> Tensor:
        """``values[l]`` for every element of layer ``l``: a flat tensor of ``numel`` elements."""
        return torch.repeat_interleave(values, self.lengths, output_size=self.numel)

    def groups(self, width: int) -> GroupLayout:
        """The layers of groups of ``width`` consecutive elements (cached per width)."""
        layout = self._groups.get(width)
        if layout is None:
            layout = self._groups[width] = _group_layout(self._starts, self._sizes, self.numel, width, self.device)
        return layout


def _rows(starts: list[int], lengths: list[int], numel: int) -> tuple[list[int], list[int], list[tuple[int, int, int]]]:
    """Per full row: its first element's layer; the rows inside one layer; and the pieces of the others and the tail.

    A piece is ``(lo, hi, layer)``: elements ``[lo, hi)`` of one layer within one row (``hi - lo <= ROW``).
    """
    full = numel // ROW
    ends = [s + n for s, n in zip(starts, lengths)]
    row_layer, clean, pieces = [], [], []
    layer = 0
    for r in range(full + (1 if numel % ROW else 0)):
        lo, hi = r * ROW, min((r + 1) * ROW, numel)
        while layer < len(ends) and ends[layer] <= lo:
            layer += 1
        if r < full:
            row_layer.append(layer)
        if r < full and ends[layer] >= hi:
            clean.append(r)
            continue
        at, current = lo, layer
        while at < hi:
            while ends[current] <= at:
                current += 1
            stop = min(ends[current], hi)
            pieces.append((at, stop, current))
            at = stop
    return row_layer, clean, pieces


def _group_layout(starts: list[int], lengths: list[int], numel: int, width: int, device: torch.device) -> GroupLayout:
    ends = torch.tensor([s + n for s, n in zip(starts, lengths)], dtype=torch.int64)
    firsts = torch.arange(0, numel, width, dtype=torch.int64)  # every group's first element
    layer_of_group = torch.searchsorted(ends, firsts, right=True).to(torch.int32)
    positions, layers = [], []
    for i, (start, n) in enumerate(zip(starts, lengths)):
        head = -(-start // width) * width  # where the first group that starts inside this layer starts
        for p in range(start, min(head, start + n)):  # this layer's elements in a group that started before it
            positions.append(p)
            layers.append(i)
    return GroupLayout(layer_of_group.to(device), torch.tensor(positions, dtype=torch.int64, device=device),
                       torch.tensor(layers, dtype=torch.int64, device=device))  # fmt: skip


_SEGMENTS: OrderedDict[tuple, Segments] = OrderedDict()


def segments_of(layers: Sequence[Layer], device: torch.device) -> Segments:
    """The :class:`Segments` of ``layers`` on ``device``, built once per layout (the most recent 64 kept)."""
    key = (tuple((layer.offset, layer.numel) for layer in layers), str(device))
    found = _SEGMENTS.get(key)
    if found is None:
        found = _SEGMENTS[key] = Segments(layers, device)
        if len(_SEGMENTS) > _CACHE_SIZE:
            _SEGMENTS.popitem(last=False)
    else:
        _SEGMENTS.move_to_end(key)
    return found
