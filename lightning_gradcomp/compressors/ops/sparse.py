"""Sparse payloads: each layer's selected indices in one byte blob (int32 lists or bitmaps) and values in slots.

Used by the sparsifiers that send different indices per rank (DGC, AdaComp) or one rank's indices (ScaleCom). Every
layer gets a fixed number of *slots* (decided from the layout, or from sizes exchanged beforehand), so payload shapes
agree across ranks; each layer's index set is sent as whichever is smaller, an int32 list of its slots or a bitmap of
the layer (:func:`~lightning_gradcomp.compressors.ops.packing.index_nbytes`). Indices are layer-local, so payloads do
not depend on how DDP buckets the layers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_gradcomp.compressors.base import Layer
from lightning_gradcomp.compressors.ops.packing import argsort_distinct, decode_indices, encode_indices, index_nbytes


@dataclass(frozen=True)
class Segment:
    """Where one layer's indices and values sit in a sparse payload."""

    layer: Layer
    slots: int
    bitmap: bool
    blob_at: int
    nbytes: int
    value_at: int


@dataclass(frozen=True)
class SparseLayout:
    """The segments of a sparse payload, with the sizes of its two tensors."""

    segments: tuple[Segment, ...]
    nbytes: int  # index blob
    slots: int  # values


def sparse_layout(layers: Sequence[Layer], slots: Sequence[int], *, bitmaps: bool = True) -> SparseLayout:
    """Lay out ``slots[i]`` values of ``layers[i]`` (an int32 list or a bitmap each, whichever is smaller).

    ``bitmaps=False`` sends every layer as an int32 list, for senders whose slot order carries meaning (a bitmap
    decodes in increasing index order).
    """
    segments, blob_at, value_at = [], 0, 0
    for layer, n in zip(layers, slots):
        bitmap, nbytes = index_nbytes(n, layer.numel) if bitmaps else (False, 4 * n)
        segments.append(Segment(layer, n, bitmap, blob_at, nbytes, value_at))
        blob_at += nbytes
        value_at += n
    return SparseLayout(tuple(segments), blob_at, value_at)


def encode_sparse(
    layout: SparseLayout,
    indices: Sequence[Tensor],
    values: Sequence[Tensor] | None,
    like: Tensor,
    ordered_: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """The index blob and the slot values for layer-local ``indices`` (at most ``slots`` per layer).

    Values of a bitmap-encoded layer are put in increasing index order (the order a bitmap decodes to); unused slots
    are zero. Returns ``(blob, values)``; ``values`` is ``None`` when none are given (a caller that sends something
    else per selected element, such as signs, orders it with :func:`ordered`).
    """
    blobs, slotted = [], []
    for segment, idx, val in zip(layout.segments, indices, values if values is not None else [None] * len(indices)):
        if segment.bitmap and not ordered_:
            idx, val = ordered(idx, val)
        blobs.append(encode_indices(idx, segment.layer.numel, segment.slots, segment.bitmap))
        if val is not None:
            slotted.append(torch.nn.functional.pad(val, (0, segment.slots - val.numel())))
    blob = torch.cat(blobs) if blobs else torch.empty(0, dtype=torch.uint8, device=like.device)
    if values is None:
        return blob, None
    out = torch.cat(slotted) if slotted else torch.empty(0, dtype=like.dtype, device=like.device)
    return blob, out


def ordered(indices: Tensor, values: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """The distinct ``indices`` in increasing order, with ``values`` permuted alike (no-op if already sorted).

    The gathers are ``index_select``: 5x faster than advanced indexing on the CPU, the same elements.
    """
    if indices.numel() < 2:
        return indices, values
    order = argsort_distinct(indices)
    if order is None:  # already increasing
        return indices, values
    return indices.index_select(0, order), None if values is None else values.index_select(0, order)


def decode_sparse(layout: SparseLayout, blob: Tensor, counts: Sequence[int] | None = None) -> list[Tensor]:
    """Every layer's selected indices, global (offset by the layer's place in the flat tensor), as int64.

    A list's unused slots are included unless ``counts`` gives each layer's number of selected indices; a bitmap
    yields exactly its set bits. Slot values line up with the returned indices (``values[value_at:][:len]``).
    """
    out = []
    for i, segment in enumerate(layout.segments):
        part = blob[segment.blob_at : segment.blob_at + segment.nbytes]
        count = None if counts is None else counts[i]
        local = decode_indices(part, segment.layer.numel, segment.slots, segment.bitmap, count)
        out.append(local + segment.layer.offset)
    return out
