"""A bucket's layers as segments of its flat tensor: per-layer reductions and lookups in a bounded number of operators.

A codec that loops over a bucket's layers issues a few operators per layer: on a GPU each one is a kernel launch,
so ResNet-50's 54 compressed layers cost hundreds of launches per bucket where the work is a few memory passes. Here
every layer is cut into rows of :data:`ROW` elements *starting at the layer's own first element* (its last row padded
with a neutral value: 0 for sums and magnitudes); every layer's rows are gathered into one matrix and reduced at once,
and the row values of a layer are reduced the same way again (rows of ``ROW`` row values, starting at the layer's
first), until one value per layer is left: two levels up to a million elements per layer, three up to a billion, a
handful of operators each, whatever the number of layers (:class:`AlignedRows`). The index tensors this needs depend
only on the layout, and are cached per layout and device (:func:`segments_of`).

Because every row starts at its layer's start and has the same width, a layer's result depends on its own elements
only: it is bitwise the same whether the layer is alone or in a bucket with others at any offset, so DDP's rebuild
of its buckets after the first step (or after a resume) changes nothing. Maxima and counts are the same values as a
per-layer reduction; sums are added in another order (within rows, then over rows) than a per-layer ``sum``, so they
differ from it at the rounding level of fp32.

Per-group lookups (a packed byte's 8 signs, say) work the same way: every group takes the table of the layer its
first element is in (one combined table, the group's layer selecting its rows), and the few elements of groups that
a boundary crosses are rewritten afterwards.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch
from torch import Tensor

from lightning_gradcomp.engine.context import Layer

__all__ = ["ROW", "AlignedRows", "GroupLayout", "LayoutCache", "Segments", "segments_of"]

ROW = 1024  # elements per row: long enough for a vectorised row reduction, short enough that padding is little
_CACHE_SIZE = 64

Built = TypeVar("Built")

#: A row reduction: a ``[rows, width]`` matrix to one value per row.
RowReduction = Callable[[Tensor], Tensor]


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


@dataclass(frozen=True)
class _Level:
    """One level of :class:`AlignedRows`: where its rows start, and how their values line up for the next level."""

    width: int
    full_starts: Tensor  # the first element of every row that lies whole in its segment
    tail_positions: Tensor  # [tails, width]: the elements of every segment's last, partial row (clamped in range)
    tail_mask: Tensor  # [tails, width]: which of them are the segment's
    order: Tensor  # the row values (full rows', then tails') in segment order: segment 0's rows first, in order


class AlignedRows:
    """Segments of a flat tensor, each cut into rows of ``width`` elements from its own start, reduced in levels.

    A segment's rows are its elements ``[start + j width, start + (j + 1) width)``, the last padded; their values
    form the next level's segment (rows of ``ROW`` values), until every segment has one value. The rows, their
    padding and the order of every sum depend only on the segment's length, never on where it lies: a segment's
    result is bitwise the same at any offset and next to any other segments.

    Args:
        starts: each segment's first element (segments back to back or apart, in increasing order).
        lengths: each segment's number of elements; an empty segment's value is its reduction of the padding.
        width: elements per row at the first level (the later levels use :data:`ROW`).
        device: where the index tensors live (the tensor's device).
    """

    def __init__(self, starts: Sequence[int], lengths: Sequence[int], width: int, device: torch.device) -> None:
        self.count = len(lengths)
        self.levels: list[_Level] = []
        starts, lengths = list(starts), list(lengths)
        while True:
            level, lengths = _level(starts, lengths, width, device)
            self.levels.append(level)
            if all(n == 1 for n in lengths):
                break
            starts = _cumulative(lengths)
            width = ROW

    def row_values(self, tensor: Tensor, reduction: RowReduction, fill: float | bool = 0) -> Tensor:
        """Every row's value at the first level (rows of ``width``, padded with ``fill``), segment after segment."""
        return _reduce_level(tensor, self.levels[0], reduction, fill)

    def reduce(self, tensor: Tensor, first: RowReduction, then: RowReduction, fill: float | bool = 0) -> Tensor:
        """One value per segment, in the segments' order.

        ``first`` reduces the rows of ``tensor`` (padded with ``fill``), ``then`` the rows of row values (padded the
        same way).
        """
        values, reduction = tensor, first
        for level in self.levels:
            values = _reduce_level(values, level, reduction, fill)
            reduction = then
        return values


def _cumulative(lengths: list[int]) -> list[int]:
    out, at = [], 0
    for n in lengths:
        out.append(at)
        at += n
    return out


def _level(starts: list[int], lengths: list[int], width: int, device: torch.device) -> tuple[_Level, list[int]]:
    """The rows of one level, and each segment's number of rows (the next level's lengths)."""
    full_starts: list[int] = []
    tails: list[int] = []
    limits: list[int] = []  # per tail, its segment's end
    full_index: list[list[int]] = []  # per segment, the indices of its full rows among the full rows
    tail_index: list[int] = []  # per segment, the index of its tail among the tails (-1: none)
    for start, n in zip(starts, lengths):
        whole = n // width
        full_index.append(list(range(len(full_starts), len(full_starts) + whole)))
        full_starts.extend(start + j * width for j in range(whole))
        # an empty segment is one row of padding alone, so that it still has one value (the reduction of ``fill``)
        # and the levels end
        tail_index.append(len(tails) if n % width or n == 0 else -1)
        if n % width or n == 0:
            tails.append(start + whole * width)
            limits.append(start + n)
    order = []
    for rows, tail in zip(full_index, tail_index):
        order.extend(rows)
        if tail >= 0:
            order.append(len(full_starts) + tail)
    positions = torch.tensor(tails, dtype=torch.int64).view(-1, 1) + torch.arange(width)
    mask = positions < torch.tensor(limits, dtype=torch.int64).view(-1, 1)
    top = max(starts[-1] + lengths[-1] - 1, 0) if starts else 0
    level = _Level(
        width=width,
        full_starts=torch.tensor(full_starts, dtype=torch.int64, device=device),
        tail_positions=positions.clamp_(max=top).to(device),
        tail_mask=mask.to(device),
        order=torch.tensor(order, dtype=torch.int64, device=device),
    )
    return level, [len(rows) + (tail >= 0) for rows, tail in zip(full_index, tail_index)]


def _reduce_level(values: Tensor, level: _Level, reduction: RowReduction, fill: float | bool) -> Tensor:
    """The values of one level's rows, in segment order."""
    parts = []
    if level.full_starts.numel():
        parts.append(reduction(values.unfold(0, level.width, 1).index_select(0, level.full_starts)))
    if level.tail_positions.numel():
        tails = values.index_select(0, level.tail_positions.view(-1)).view_as(level.tail_positions)
        parts.append(reduction(tails.masked_fill_(~level.tail_mask, fill)))
    rows = parts[0] if len(parts) == 1 else torch.cat(parts)
    return rows.index_select(0, level.order)


def _l1_rows(dtype: torch.dtype) -> RowReduction:
    return lambda rows: torch.linalg.vector_norm(rows, 1, dim=1, dtype=dtype)


def _sum_rows(dtype: torch.dtype) -> RowReduction:
    return lambda rows: rows.sum(dim=1, dtype=dtype)


def _max_magnitude_rows(dtype: torch.dtype) -> RowReduction:
    def reduce(rows: Tensor) -> Tensor:
        # max(max x, -min x) per row: ``aminmax`` is one vectorised pass (the infinity norm's CPU kernel is a
        # scalar loop); a padded 0 never exceeds a magnitude
        low, high = torch.aminmax(rows, dim=1)
        return torch.maximum(high, low.neg()).to(dtype)

    return reduce


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
        self.starts = torch.tensor(starts, dtype=torch.int64, device=device)
        self.rows = AlignedRows(starts, lengths, ROW, device)
        self._groups: dict[int, GroupLayout] = {}
        self._blocks: dict[int, tuple[AlignedRows, Tensor]] = {}
        self._starts, self._sizes = starts, lengths

    def sums(self, tensor: Tensor, dtype: torch.dtype) -> Tensor:
        """Every layer's sum of ``tensor``'s elements, accumulated in ``dtype`` (rounding-level from ``x.sum()``)."""
        return self.rows.reduce(tensor, _sum_rows(dtype), _sum_rows(dtype))

    def l1(self, tensor: Tensor, dtype: torch.dtype) -> Tensor:
        """Every layer's sum of ``|x|``, accumulated in ``dtype`` (rounding-level from a per-layer 1-norm)."""
        return self.rows.reduce(tensor, _l1_rows(dtype), _sum_rows(dtype))

    def counts(self, mask: Tensor) -> Tensor:
        """Every layer's number of set elements of the bool ``mask`` (int64, exact)."""
        return self.rows.reduce(mask, lambda rows: torch.count_nonzero(rows, dim=1), _sum_rows(torch.int64), False)

    def max_magnitudes(self, tensor: Tensor, dtype: torch.dtype) -> Tensor:
        """Every layer's largest ``|x|`` in ``dtype``: the same values as a per-layer infinity norm (NaN propagates)."""
        found = self.rows.reduce(tensor, _max_magnitude_rows(dtype), lambda rows: rows.amax(dim=1))
        return found.add_(0.0)

    def block_rows(self, size: int) -> tuple[AlignedRows, Tensor]:
        """Every layer cut into blocks of ``size`` elements (the last shorter), one row each, and every block's length.

        The blocks' rows (:class:`AlignedRows` of one level, blocks in layer order) and their lengths (int64), cached
        per size: QSGD's norm buckets.
        """
        found = self._blocks.get(size)
        if found is None:
            starts, lengths = [], []
            for start, n in zip(self._starts, self._sizes):
                for at in range(0, n, size):
                    starts.append(start + at)
                    lengths.append(min(size, n - at))
            found = self._blocks[size] = (
                AlignedRows(starts, lengths, size, self.device),
                torch.tensor(lengths, dtype=torch.int64, device=self.device),
            )
        return found

    def expand(self, values: Tensor) -> Tensor:
        """``values[l]`` for every element of layer ``l``: a flat tensor of ``numel`` elements."""
        return torch.repeat_interleave(values, self.lengths, output_size=self.numel)

    def groups(self, width: int) -> GroupLayout:
        """The layers of groups of ``width`` consecutive elements (cached per width)."""
        layout = self._groups.get(width)
        if layout is None:
            layout = self._groups[width] = _group_layout(self._starts, self._sizes, self.numel, width, self.device)
        return layout


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
    return GroupLayout(
        layer_of_group.to(device),
        torch.tensor(positions, dtype=torch.int64, device=device),
        torch.tensor(layers, dtype=torch.int64, device=device),
    )


class LayoutCache(Generic[Built]):
    """What was built for a layout (index tensors on a device), by key, the most recent ``size`` kept."""

    def __init__(self, size: int = _CACHE_SIZE) -> None:
        self.size = size
        self._found: OrderedDict[Hashable, Built] = OrderedDict()

    def get(self, key: Hashable, build: Callable[[], Built]) -> Built:
        """The value kept under ``key``, built by ``build()`` when missing."""
        found = self._found.get(key)
        if found is None:
            found = self._found[key] = build()
            if len(self._found) > self.size:
                self._found.popitem(last=False)
        else:
            self._found.move_to_end(key)
        return found

    def clear(self) -> None:
        """Forget everything kept."""
        self._found.clear()


_SEGMENTS: LayoutCache[Segments] = LayoutCache()


def segments_of(layers: Sequence[Layer], device: torch.device) -> Segments:
    """The :class:`Segments` of ``layers`` on ``device``, built once per layout (the most recent 64 kept)."""
    key = (tuple((layer.offset, layer.numel) for layer in layers), str(device))
    return _SEGMENTS.get(key, lambda: Segments(layers, device))
