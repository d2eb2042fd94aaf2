"""A sparse payload's index blob for every layer at once: the bytes of :func:`~.sparse.encode_sparse`, no layer loop.

:func:`~lightning_gradcomp.compressors.ops.sparse.encode_sparse` and ``decode_sparse`` encode a layer at a time: a few
operators per layer, each a kernel launch on a GPU. When every layer fills its slots (a top-k), the blob is the same
bytes written at once: the int32-listed layers' local indices go to their byte positions in one scatter, and the
bitmap layers' bits are set in one mask over all their bitmaps (each a whole number of 32-bit words, so one packing of
the mask is every bitmap back to back) whose bytes are scattered likewise. Decoding reads the lists with one gather
and the bitmaps with one unpacking and a running count of their set bits, into a fixed-size output. The positions
depend only on the layout, and are cached per layout and device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_gradcomp.compressors.ops.packing import pack_bits, unpack_bits
from lightning_gradcomp.compressors.ops.segments import LayoutCache
from lightning_gradcomp.compressors.ops.sparse import SparseLayout

__all__ = ["decode_blob", "decode_pairs", "encode_full_blob"]


@dataclass(frozen=True)
class _BlobPlan:
    """Where a layout's entries go in its blob; the entries are its layers' slots, layer after layer."""

    listed: Tensor  # int64: the entries of the int32-listed layers
    listed_offsets: Tensor  # int64: their layer's offset in the flat tensor, per entry
    listed_bytes: Tensor  # int64: their 4 bytes' positions in the blob, entry after entry
    mapped: Tensor  # int64: the entries of the bitmap layers
    mapped_shift: Tensor  # int64: per entry, its bit's place in the bitmaps minus its flat index
    bitmap_ends: Tensor  # int64: every bitmap layer's end in the bitmaps' bits
    bitmap_shift: Tensor  # int64: every bitmap layer's offset in the flat tensor minus its start in the bits
    bitmap_bytes: Tensor  # int64: the bitmaps' bytes' positions in the blob
    bitmap_starts: Tensor  # int64: every bitmap layer's start in the bitmaps' bits
    bitmap_slots: Tensor  # int64: every bitmap layer's first entry among the bitmap layers' entries
    mapped_first: Tensor  # int64: per bitmap entry, its layer's start in the bitmaps' bits
    bits: int  # the bitmaps' bits (a multiple of 32)


def _plan(layout: SparseLayout, device: torch.device) -> _BlobPlan:
    listed, listed_offsets, listed_bytes, mapped, mapped_shift = [], [], [], [], []
    bitmap_ends, bitmap_shift, bitmap_bytes, bitmap_starts, bitmap_slots, mapped_first = [], [], [], [], [], []
    entry, bits, mapped_count = 0, 0, 0
    for segment in layout.segments:
        entries = torch.arange(entry, entry + segment.slots)
        if segment.bitmap:
            bitmap_starts.append(bits)
            bitmap_slots.append(mapped_count)
            mapped_count += segment.slots
            mapped_first.append(torch.full((segment.slots,), bits))
            mapped.append(entries)
            mapped_shift.append(torch.full((segment.slots,), bits - segment.layer.offset))
            bitmap_shift.append(segment.layer.offset - bits)
            bitmap_bytes.append(torch.arange(segment.blob_at, segment.blob_at + segment.nbytes))
            bits += 8 * segment.nbytes
            bitmap_ends.append(bits)
        else:
            listed.append(entries)
            listed_offsets.append(torch.full((segment.slots,), segment.layer.offset))
            listed_bytes.append(torch.arange(segment.blob_at, segment.blob_at + segment.nbytes))
        entry += segment.slots

    def joined(parts: list[Tensor]) -> Tensor:
        return (torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)).to(device)

    return _BlobPlan(
        listed=joined(listed),
        listed_offsets=joined(listed_offsets),
        listed_bytes=joined(listed_bytes),
        mapped=joined(mapped),
        mapped_shift=joined(mapped_shift),
        bitmap_ends=torch.tensor(bitmap_ends, dtype=torch.int64, device=device),
        bitmap_shift=torch.tensor(bitmap_shift, dtype=torch.int64, device=device),
        bitmap_bytes=joined(bitmap_bytes),
        bitmap_starts=torch.tensor(bitmap_starts, dtype=torch.int64, device=device),
        bitmap_slots=torch.tensor(bitmap_slots, dtype=torch.int64, device=device),
        mapped_first=joined(mapped_first),
        bits=bits,
    )


_PLANS: LayoutCache[_BlobPlan] = LayoutCache()


def _plan_of(layout: SparseLayout, device: torch.device) -> _BlobPlan:
    return _PLANS.get((layout, str(device)), lambda: _plan(layout, device))


def encode_full_blob(layout: SparseLayout, indices: Tensor) -> Tensor:
    """The index blob of ``layout`` when every layer fills its slots: ``encode_sparse``'s bytes, for all layers at once.

    Args:
        layout: the payload's layout.
        indices: flat indices (int64, offset by each layer's place), ``slots`` distinct ones per layer, layer after
            layer; a listed layer's are sent in the order given. A layer may repeat one of its indices in slots it
            leaves unused (sent with the value 0): its bitmap then has fewer set bits than slots, which
            :func:`decode_pairs` reads.

    Returns:
        The blob (uint8, ``layout.nbytes`` bytes).
    """
    plan = _plan_of(layout, indices.device)
    blob = torch.empty(layout.nbytes, dtype=torch.uint8, device=indices.device)
    if plan.listed.numel():
        local = indices.index_select(0, plan.listed).sub_(plan.listed_offsets).to(torch.int32)
        blob.index_copy_(0, plan.listed_bytes, local.view(torch.uint8))
    if plan.bits:
        mask = torch.zeros(plan.bits, dtype=torch.bool, device=indices.device)
        mask.index_fill_(0, indices.index_select(0, plan.mapped).add_(plan.mapped_shift), True)
        blob.index_copy_(0, plan.bitmap_bytes, pack_bits(mask))
    return blob


def decode_blob(layout: SparseLayout, blob: Tensor) -> Tensor:
    """Every flat index of a blob whose layers fill their slots (int64, offset by each layer's place), all at once.

    First every listed layer's slots, layer after layer, in their order; then every bitmap layer's set bits, in
    increasing order. A bitmap layer has exactly ``slots`` set bits, so the bits are found in a fixed-size output
    (the ``i``-th set bit at slot ``i``, through a running count): no size read on the host, on any device.
    """
    plan = _plan_of(layout, blob.device)
    listed = blob.index_select(0, plan.listed_bytes).view(torch.int32).long().add_(plan.listed_offsets)
    if not plan.bits:
        return listed
    mask = unpack_bits(blob.index_select(0, plan.bitmap_bytes), plan.bits)
    total = plan.mapped.numel()
    slot = torch.where(mask, torch.cumsum(mask, 0).sub_(1), total)  # every unset bit to a slot past the end
    where = torch.zeros(total + 1, dtype=torch.int64, device=blob.device)
    where = where.scatter_(0, slot, torch.arange(plan.bits, device=blob.device))[:total]
    layer = torch.searchsorted(plan.bitmap_ends, where, right=True)
    return torch.cat([listed, where.add_(plan.bitmap_shift.index_select(0, layer))])


def decode_pairs(layout: SparseLayout, blob: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
    """Every slot's flat index and value, for layers that may leave slots unused: all layers at once.

    An unused slot of a listed layer repeats one of its indices with the value 0; a bitmap layer with fewer set bits
    than slots gives its ``i``-th set bit the ``i``-th slot (a running count of the bits within the layer) and its
    unused slots the layer's first element, with their value (0). Adding every pair into a dense tensor is then the
    sum of what was sent, in tensors whose sizes depend only on the layout: no host read.

    Returns:
        ``(indices, values)``: int64 flat indices and the slot values aligned with them (listed layers' slots first,
        then the bitmap layers').
    """
    plan = _plan_of(layout, blob.device)
    listed = blob.index_select(0, plan.listed_bytes).view(torch.int32).long().add_(plan.listed_offsets)
    order = torch.cat([plan.listed, plan.mapped]) if plan.bits else plan.listed
    if not plan.bits:
        return listed, values.index_select(0, order)
    mask = unpack_bits(blob.index_select(0, plan.bitmap_bytes), plan.bits)
    layer = torch.searchsorted(plan.bitmap_ends, torch.arange(plan.bits, device=blob.device), right=True)
    running = torch.cumsum(mask, 0)
    before = torch.cat([running.new_zeros(1), running]).index_select(0, plan.bitmap_starts)
    slot = running.sub_((before - plan.bitmap_slots + 1).index_select(0, layer))
    total = plan.mapped.numel()
    slot = torch.where(mask, slot, total)  # every unset bit to a slot past the end
    where = torch.cat([plan.mapped_first, plan.mapped_first.new_zeros(1)])
    where = where.scatter_(0, slot, torch.arange(plan.bits, device=blob.device))[:total]
    found = torch.searchsorted(plan.bitmap_ends, where, right=True)
    mapped = where.add_(plan.bitmap_shift.index_select(0, found))
    return torch.cat([listed, mapped]), values.index_select(0, order)
