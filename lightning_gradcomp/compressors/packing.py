"""Bit packing for payloads: small integers in uint8 tensors, sum-safe integer words, index sets.

Signs (1 bit), ternaries (2 bits) and quantisation levels (n bits) pack into uint8 tensors; fields that a SUM
all-reduce may add pack into int64 words; sparse index sets travel as int32 lists or bitmaps.

Everything here is vectorised (no per-element Python) and runs on any device. Payloads are packed *before* they are
handed to a collective, so the bytes the telemetry counts are the packed bytes that move.

Bit order: value ``i`` of an ``n``-bit packing occupies bits ``[b i, b (i + 1))`` of the packed stream, where bit ``t``
of the stream is bit ``t % 8`` (least significant first) of byte ``t // 8``. The layout does not depend on the
machine's byte order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

_WORD_BITS = 63  # usable bits of an int64 word: the sign bit stays clear, so sums never overflow into it


def packed_nbytes(n: int, bits: int) -> int:
    """Bytes that :func:`pack_uint` uses for ``n`` values of ``bits`` bits: ``ceil(n * bits / 8)``."""
    return (n * bits + 7) // 8


def _check_bits(bits: int) -> None:
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 8:
        raise ValueError(f"Expected `bits` to be an integer in [1, 8], got {bits!r}.")


def pack_uint(values: Tensor, bits: int) -> Tensor:
    """Pack the integers of the 1-D ``values`` (each in ``[0, 2**bits)``) into ``ceil(n * bits / 8)`` bytes.

    Args:
        values: a 1-D integer or bool tensor.
        bits: bits per value, 1 to 8.

    Returns:
        A 1-D uint8 tensor on ``values``' device.
    """
    _check_bits(bits)
    n = values.numel()
    device = values.device
    if n == 0:
        return torch.empty(0, dtype=torch.uint8, device=device)
    if 8 % bits == 0:  # 1, 2, 4, 8 bits: whole values per byte, all in uint8
        per = 8 // bits
        v = values.reshape(-1).to(torch.uint8)
        if n % per:
            v = F.pad(v, (0, per - n % per))
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=device)
        return (v.view(-1, per) << shifts).sum(1, dtype=torch.uint8)  # disjoint bits: the sum is a bitwise or
    # 3, 5, 6, 7 bits: 8 values make exactly `bits` bytes; assemble them in an int64 and split it into bytes
    v = values.reshape(-1).to(torch.int64)
    if n % 8:
        v = F.pad(v, (0, 8 - n % 8))
    words = (v.view(-1, 8) << torch.arange(0, 8 * bits, bits, device=device)).sum(1)
    out = (words.unsqueeze(1) >> torch.arange(0, 8 * bits, 8, device=device)) & 0xFF
    return out.to(torch.uint8).reshape(-1)[: packed_nbytes(n, bits)]


def unpack_uint(packed: Tensor, bits: int, n: int) -> Tensor:
    """Inverse of :func:`pack_uint`: the first ``n`` values, as a uint8 tensor."""
    _check_bits(bits)
    device = packed.device
    if n == 0:
        return torch.empty(0, dtype=torch.uint8, device=device)
    mask = (1 << bits) - 1
    if 8 % bits == 0:
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=device)
        return ((packed[: packed_nbytes(n, bits)].unsqueeze(1) >> shifts) & mask).reshape(-1)[:n]
    groups = (n + 7) // 8
    b = packed[: packed_nbytes(n, bits)].to(torch.int64)
    if b.numel() < groups * bits:
        b = F.pad(b, (0, groups * bits - b.numel()))
    words = (b.view(groups, bits) << torch.arange(0, 8 * bits, 8, device=device)).sum(1)
    values = (words.unsqueeze(1) >> torch.arange(0, 8 * bits, bits, device=device)) & mask
    return values.to(torch.uint8).reshape(-1)[:n]


def pack_bits(mask: Tensor) -> Tensor:
    """One bit per element of the boolean ``mask`` (``ceil(n / 8)`` bytes)."""
    return pack_uint(mask.reshape(-1), 1)


def unpack_bits(packed: Tensor, n: int) -> Tensor:
    """The first ``n`` bits of ``packed`` as a bool tensor."""
    return unpack_uint(packed, 1, n).bool()


# ----------------------------------------------------------------------------------------------------------------
# Sum-safe words: fields that a SUM all-reduce adds without carries
# ----------------------------------------------------------------------------------------------------------------
def field_width(max_sum: int) -> int:
    """Bits a field needs to hold every integer in ``[0, max_sum]``: ``max(1, ceil(log2(max_sum + 1)))``."""
    return max(1, int(max_sum).bit_length())


def fields_per_word(width: int) -> int:
    """How many ``width``-bit fields one int64 word holds (63 usable bits)."""
    if width > _WORD_BITS:
        raise ValueError(f"Expected a field width <= {_WORD_BITS} bits, got {width}.")
    return _WORD_BITS // width


def words_needed(n: int, width: int) -> int:
    """int64 words that :func:`pack_fields` uses for ``n`` values."""
    per = fields_per_word(width)
    return (n + per - 1) // per


def pack_fields(values: Tensor, width: int) -> Tensor:
    """Pack non-negative integers into int64 words of ``width``-bit fields, so that words can be *summed*.

    If every field of the summed words stays below ``2**width`` (the caller picks ``width`` with
    :func:`field_width` for the largest possible sum), a SUM all-reduce of the words sums every field exactly, with no
    carry between fields: an exact integer-domain reduction of many small values in one collective.
    """
    per = fields_per_word(width)
    n = values.numel()
    v = values.reshape(-1).to(torch.int64)
    if n % per:
        v = F.pad(v, (0, per - n % per))
    shifts = torch.arange(0, per * width, width, device=values.device)
    return (v.view(-1, per) << shifts).sum(1)


def unpack_fields(words: Tensor, width: int, n: int) -> Tensor:
    """The first ``n`` fields of ``words`` (int64)."""
    per = fields_per_word(width)
    shifts = torch.arange(0, per * width, width, device=words.device)
    return ((words.unsqueeze(1) >> shifts) & ((1 << width) - 1)).reshape(-1)[:n]


# ----------------------------------------------------------------------------------------------------------------
# Index sets: int32 lists or bitmaps, whichever is smaller
# ----------------------------------------------------------------------------------------------------------------
def index_nbytes(slots: int, numel: int) -> tuple[bool, int]:
    """How a set of up to ``slots`` indices into ``numel`` elements is sent: ``(use_bitmap, nbytes)``.

    An int32 list costs ``4 slots`` bytes, a bitmap ``ceil(numel / 8)``; the smaller wins (the bitmap from a density of
    1/32 up). The choice depends only on the sizes, so ranks that agree on the sizes agree on the encoding. Bitmaps
    are rounded up to whole int32 words so that the lists that follow them in a payload stay 4-byte aligned.
    """
    list_bytes = 4 * slots
    bitmap_bytes = -(-numel // 32) * 4
    return (True, bitmap_bytes) if bitmap_bytes < list_bytes else (False, list_bytes)


def encode_indices(indices: Tensor, numel: int, slots: int, bitmap: bool) -> Tensor:
    """Encode distinct layer-local ``indices`` (at most ``slots`` of them) as uint8 bytes.

    A list is padded to ``slots`` entries by repeating its first index (or 0), so its size depends only on ``slots``.
    A bitmap carries no order: values sent with it must be in increasing index order (see :func:`decode_indices`).
    """
    device = indices.device
    if bitmap:
        mask = torch.zeros(-(-numel // 32) * 32, dtype=torch.bool, device=device)
        mask[indices] = True
        return pack_bits(mask)
    listed = indices.to(torch.int32)
    if listed.numel() < slots:
        fill = listed[:1] if listed.numel() else torch.zeros(1, dtype=torch.int32, device=device)
        listed = torch.cat([listed, fill.expand(slots - listed.numel())])
    return listed.view(torch.uint8)


def decode_indices(blob: Tensor, numel: int, slots: int, bitmap: bool, count: int | None = None) -> Tensor:
    """Layer-local int64 indices from :func:`encode_indices`; ``count`` keeps only the first entries of a list.

    For a bitmap the indices come back in increasing order (on CUDA, ``nonzero`` synchronises with the host).
    """
    if bitmap:
        return torch.nonzero(unpack_bits(blob, numel)).squeeze(1)
    if blob.storage_offset() % 4:
        blob = blob.clone()  # a view as int32 needs 4-byte alignment
    listed = blob.view(torch.int32)
    return listed[: slots if count is None else count].long()
