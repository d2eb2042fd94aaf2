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

import sys
from collections.abc import Iterator, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

_WORD_BITS = 63  # usable bits of an int64 word: the sign bit stays clear, so sums never overflow into it
# the dtypes whose tensors NumPy reads without a copy (flat_nonzero)
_NUMPY_DTYPES = frozenset(
    {
        torch.bool,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.float16,
        torch.float32,
        torch.float64,
    }
)


def flat_nonzero(values: Tensor) -> Tensor:
    """The int64 positions of the non-zero entries of the 1-D ``values``, in increasing order: ``nonzero().squeeze(1)``.

    The same indices, faster on the CPU: there ``torch.nonzero`` costs about 3 ns per element (ten memory passes
    over a 0.5M-element mask at 25% density, one thread), NumPy's ``flatnonzero`` about 0.55 ns (five times less).
    Top-k candidates, AdaComp's and DGC's selections and every bitmap decode go through here. On other devices it is
    ``torch.nonzero`` (which synchronises with the host on CUDA: its output size is data-dependent).
    """
    if numpy_floats(values):
        # NumPy's flatnonzero of a float array runs at about a quarter of its speed on the mask it is equal to
        values = nonzero_mask(values)
    if values.device.type == "cpu" and values.dtype == torch.bool:
        return torch.from_numpy(_flat_nonzero_of_mask(values.detach().numpy())).to(torch.int64)
    if values.device.type == "cpu" and values.dtype in _NUMPY_DTYPES:
        return torch.from_numpy(np.flatnonzero(values.detach().numpy())).to(torch.int64)
    return torch.nonzero(values).squeeze(1)


# below this many elements NumPy's flatnonzero is used as it is (the word pass would not pay for its extra calls)
_WORD_SCAN_MIN = 1 << 16


def _flat_nonzero_of_mask(mask: np.ndarray) -> np.ndarray:
    """``np.flatnonzero`` of a 1-D bool array, scanning 8 elements per word where most words are zero.

    NumPy's loop over a bool array slows down where set elements are neither rare nor common (branch mispredictions:
    about 0.7 ms for a 2.36M-element mask at 1.5 % density on one thread of the 2-core machine). Viewed as 8-byte
    words, the mask's non-zero words are found first (a comparison and a scan of an eighth as many elements), and
    only their bytes are scanned: the same indices in the same order, about 1.6x faster at 1.5 % (``python
    benchmarks/torch_ops.py``, pair ``nonzero``): a top-k's candidates, DGC's selection. Where more than a quarter
    of the first 8192 words hold a set element (a density above about 3.5 %) NumPy's loop is used as it is.
    """
    n = mask.size
    full = n - n % 8
    if n < _WORD_SCAN_MIN or not mask.flags.c_contiguous:
        return np.flatnonzero(mask)
    words = mask[:full].view(np.uint64)
    head = words[: _WORD_SCAN_MIN // 8]  # the density is judged from the first words: either path is exact
    if 4 * np.count_nonzero(head) > head.size:
        return np.flatnonzero(mask)
    occupied = np.flatnonzero(words != 0)
    # byte j of word w is element 8 w + j (a view keeps the bytes' order, whatever the machine's byte order)
    within = np.flatnonzero(np.take(words, occupied).view(np.bool_))
    indices = np.take(occupied, within >> 3)
    indices <<= 3
    indices |= within & 7
    if full < n:
        return np.concatenate((indices, np.flatnonzero(mask[full:]) + full))
    return indices


def sorted_distinct(values: Tensor) -> Tensor:
    """The distinct values of the 1-D integer tensor ``values``, ascending: ``torch.unique(values)``.

    The same values, faster on the CPU: there torch sorts 24k int64 in about 1.1 ms on one thread, NumPy in 0.07 ms.
    RandomK's shared subsets are drawn through here (on the CPU, for every device).
    """
    if values.device.type == "cpu" and values.dtype in (torch.int32, torch.int64):
        ordered = np.sort(values.numpy())
        first = np.empty(ordered.shape, dtype=bool)
        first[:1] = True
        np.not_equal(ordered[1:], ordered[:-1], out=first[1:])
        return torch.from_numpy(ordered[first])
    return torch.unique(values)


def argsort_distinct(values: Tensor) -> Tensor | None:
    """``torch.argsort`` of the distinct values of the 1-D integer ``values``; on the CPU, None if already increasing.

    For distinct values there is one such permutation, so any sort finds torch's. On the CPU, for values in
    ``[0, 2^31)``: none when they are increasing already (one comparison pass; a selection by ``nonzero`` is), else
    NumPy's sort of ``value << 32 | position``, whose low half is the permutation (about twice as fast as torch's
    argsort: ``python benchmarks/torch_ops.py``, pair ``argsort``; NumPy's own argsort was slower than torch's).
    Elsewhere torch's argsort (checking the order would be a host sync).
    """
    n = values.numel()
    if values.device.type == "cpu" and values.dtype in (torch.int32, torch.int64) and 0 < n < (1 << 32):
        array = values.numpy()
        if array.min() >= 0 and array.max() < (1 << 31):
            if bool(np.all(array[1:] > array[:-1])):
                return None
            keys = np.left_shift(array, 32, dtype=np.int64)
            np.bitwise_or(keys, np.arange(n, dtype=np.int64), out=keys)
            keys.sort()
            return torch.from_numpy(np.bitwise_and(keys, 0xFFFFFFFF, out=keys))
    return torch.argsort(values)


_NUMPY_FLOATS = frozenset({torch.float16, torch.float32, torch.float64})


def numpy_floats(*tensors: Tensor) -> bool:
    """Whether NumPy can run an elementwise step on ``tensors`` in place: CPU tensors of one float dtype it has.

    The CPU fast paths of this package (comparisons, signs, clipping) run through NumPy on such tensors, with torch's
    results; elsewhere (CUDA, bfloat16, mixed dtypes) torch runs them.
    """
    first = tensors[0]
    return first.dtype in _NUMPY_FLOATS and all(t.device.type == "cpu" and t.dtype == first.dtype for t in tensors)


def above(values: Tensor, bound: Tensor | float, *, inclusive: bool = False) -> Tensor:
    """The bool mask ``values > bound`` (``>=`` when ``inclusive``), for a number or 0-d tensor ``bound``.

    ``bound`` is compared in ``values``' dtype, as torch compares. The same mask, faster on the CPU: there torch's
    comparison with a scalar costs about 1.4 ns per element on one thread (three memory passes over an fp32
    gradient), NumPy's about 0.3 ns. Signs (``x >= 0``: ``-0.0`` counts as non-negative, NaN as neither) and sampled
    top-k thresholds go through here. On other devices it is torch's comparison, which reads no tensor on the host.
    """
    if numpy_floats(values):
        array = values.detach().numpy()
        # the bound in the values' dtype, as torch compares with a 0-d tensor or a Python number
        scalar = array.dtype.type(bound.item() if isinstance(bound, Tensor) else bound)
        return torch.from_numpy(np.greater_equal(array, scalar) if inclusive else np.greater(array, scalar))
    return values >= bound if inclusive else values > bound


def magnitude_above(values: Tensor, bound: Tensor | float, *, inclusive: bool = False) -> Tensor:
    """The bool mask ``values.abs() > bound`` (``>=`` when ``inclusive``), without writing ``|values|``.

    ``|x| > t`` exactly when ``x > t`` or ``x < -t``, for every ``t`` (NaN: neither side holds; ``-0.0`` compares as
    ``0``), so the mask is the same. On the CPU the two comparisons read the values twice where ``abs`` then
    :func:`above` wrote a gradient-sized ``|values|`` and read it back: the sampled top-k thresholds of TopK, DGC,
    ScaleCom and LGC go through here. On other devices it is torch's ``abs`` and comparison.
    """
    if numpy_floats(values):
        array = values.detach().numpy()
        scalar = array.dtype.type(bound.item() if isinstance(bound, Tensor) else bound)
        upper, lower = (np.greater_equal, np.less_equal) if inclusive else (np.greater, np.less)
        mask = upper(array, scalar)
        return torch.from_numpy(np.logical_or(mask, lower(array, -scalar), out=mask))
    magnitudes = values.abs()
    return magnitudes >= bound if inclusive else magnitudes > bound


def nonzero_mask(values: Tensor) -> Tensor:
    """The bool mask ``values != 0``: ``-0.0`` is zero, NaN is non-zero (as ``torch.nonzero`` counts them).

    The same mask, faster on the CPU (NumPy's comparison, as :func:`above`).
    """
    if numpy_floats(values):
        array = values.detach().numpy()
        return torch.from_numpy(np.not_equal(array, array.dtype.type(0)))
    return values != 0


def signbit(values: Tensor) -> Tensor:
    """The bool mask ``torch.signbit(values)``: set for negative numbers, ``-0.0`` and NaNs with the sign bit set.

    The same mask, faster on the CPU, where torch's ``signbit`` costs about 1.6 ns per element on one thread (four
    memory passes over an fp32 gradient) and NumPy's about 0.2 ns. Both read the sign bit itself.
    """
    if numpy_floats(values):
        return torch.from_numpy(np.signbit(values.detach().numpy()))
    return torch.signbit(values)


def max_magnitudes(tensors: Sequence[Tensor], dtype: torch.dtype) -> Tensor:
    """``torch.stack([torch.linalg.vector_norm(x, inf, dtype=dtype) for x in tensors])``, the same bits, faster.

    The infinity norm's CPU kernel is a scalar loop, about 13x slower than ``aminmax``, one vectorised pass
    (``python benchmarks/torch_ops.py``, pair ``inf_norm``). ``max(max x, -min x)`` is the same exact value; a NaN
    propagates through both; adding ``0.0`` turns a maximum of signed zeros into ``+0.0``, as the norm's ``|x|``
    does. Five small ops follow the per-tensor ``aminmax``, for all tensors at once (no per-tensor launches on a GPU).
    """
    bounds = torch.stack([torch.stack(torch.aminmax(x)) for x in tensors]).to(dtype)  # [tensor, (min, max)]
    return torch.maximum(bounds[:, 1], bounds[:, 0].neg()).add_(0.0)


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
    if n == 0:
        return torch.empty(0, dtype=torch.uint8, device=values.device)
    v = values.reshape(-1).to(torch.uint8)
    if bits == 1 and _LITTLE_ENDIAN:
        # 8 bytes of 0/1 read as one int64; the multiplication gathers bit 0 of byte j at bit 56 + j (every partial
        # product lands on its own bit, so nothing carries): the top byte is the packed byte
        v = _pad_to(v, 8)
        if v.storage_offset() % 8:
            v = v.clone()  # a view as int64 needs 8-byte alignment
        return ((v.view(torch.int64) * _GATHER) >> 56).to(torch.uint8)
    if 8 % bits == 0:  # 2, 4, 8 bits: whole values per byte, combined column by column (strided, in place)
        per = 8 // bits
        columns = _pad_to(v, per).view(-1, per)
        out = columns[:, per - 1].clone()
        for j in range(per - 2, -1, -1):
            out.bitwise_left_shift_(bits).bitwise_or_(columns[:, j])
        return out
    # 3, 5, 6, 7 bits: 8 values make exactly `bits` bytes; assemble them in an int64, then split it into bytes
    columns = _pad_to(v, 8).view(-1, 8)
    words = columns[:, 7].to(torch.int64, copy=True)
    for j in range(6, -1, -1):
        words.bitwise_left_shift_(bits).bitwise_or_(columns[:, j])
    out = torch.empty(words.numel(), bits, dtype=torch.uint8, device=v.device)
    for j in range(bits):
        out[:, j] = words & 0xFF
        words.bitwise_right_shift_(8)
    return out.reshape(-1)[: packed_nbytes(n, bits)]


def unpack_uint(packed: Tensor, bits: int, n: int) -> Tensor:
    """Inverse of :func:`pack_uint`: the first ``n`` values, as a uint8 tensor."""
    _check_bits(bits)
    device = packed.device
    if n == 0:
        return torch.empty(0, dtype=torch.uint8, device=device)
    packed = packed[: packed_nbytes(n, bits)]
    if bits == 1 and _LITTLE_ENDIAN:
        # spread: the byte copied into all 8 bytes of an int64, byte j keeps its bit j (non-zero iff set)
        spread = (packed.to(torch.int64) * _SPREAD) & _PICK
        return spread.view(torch.uint8).ne(0).view(torch.uint8)[:n]
    mask = (1 << bits) - 1
    if 8 % bits == 0:
        per = 8 // bits
        out = torch.empty(packed.numel(), per, dtype=torch.uint8, device=device)
        rest = packed.clone()
        for j in range(per):
            torch.bitwise_and(rest, mask, out=out[:, j])
            rest.bitwise_right_shift_(bits)
        return out.reshape(-1)[:n]
    groups = (n + 7) // 8
    columns = _pad_to(packed, groups * bits).view(groups, bits)
    words = columns[:, bits - 1].to(torch.int64, copy=True)
    for j in range(bits - 2, -1, -1):
        words.bitwise_left_shift_(8).bitwise_or_(columns[:, j])
    out = torch.empty(groups, 8, dtype=torch.uint8, device=device)
    for j in range(8):
        out[:, j] = words & mask
        words.bitwise_right_shift_(bits)
    return out.reshape(-1)[:n]


# the integer dtype of each size, for reading a row of a byte table as one element
INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# a row of a lookup table read as one element: 16-byte rows as complex128, which a gather only copies (bit for bit)
ROW_OF_SIZE = {**INT_OF_SIZE, 16: torch.complex128}


def _as_rows(t: Tensor, row: torch.dtype) -> Tensor | None:
    """The contiguous ``t`` viewed as 1-D elements of ``row``, or None where its offset or address does not allow it."""
    ratio = row.itemsize // t.element_size()
    if not t.is_contiguous() or t.numel() % ratio or t.storage_offset() % ratio or t.data_ptr() % row.itemsize:
        return None  # complex128 is 16-byte aligned in C++: never hand a kernel a misaligned one
    return t.view(-1).view(row)


def lookup_rows(table: Tensor, rows: Tensor, out: Tensor) -> Tensor:
    """``out[i] = table[rows[i]]`` for a 2-D ``table``: ``torch.index_select(table, 0, rows, out=out)``, faster.

    A row of 1, 2, 4, 8 or 16 bytes is gathered as one element of that size from the table viewed as 1-D, the same
    bytes: torch's index_select copies each row of a 2-D table as a slice, which on the CPU costs about 3x as much for
    16-byte rows (``python benchmarks/torch_ops.py``, pair ``rows``).

    Args:
        table: the rows, 2-D.
        rows: row indices (int32 or int64), 1-D.
        out: ``[len(rows), table.shape[1]]`` of ``table``'s dtype, written in place and returned.
    """
    row = ROW_OF_SIZE.get(table.shape[1] * table.element_size())
    if row is not None:
        flat_table, flat_out = _as_rows(table, row), _as_rows(out, row)
        if flat_table is not None and flat_out is not None:
            torch.index_select(flat_table, 0, rows, out=flat_out)
            return out
    return torch.index_select(table, 0, rows, out=out)


def lookup_uint(packed: Tensor, bits: int, n: int, table: Tensor, out: Tensor) -> Tensor:
    """``out[i] = table[v_i]`` for the first ``n`` values ``v_i`` of :func:`pack_uint`'s packing: decode by table.

    Equal to ``torch.index_select(table, 0, unpack_uint(packed, bits, n).int(), out=out)``, in fewer passes where
    ``bits`` divides 8: a byte holds ``8 / bits`` whole values, so a 256-row table of their looked-up values
    (:func:`lookup_rows`: one element per byte where a row is 1, 2, 4, 8 or 16 bytes) decodes every byte with a
    single lookup, with no unpacked fields in memory (QSGD's 4-bit fields in fp32: one 8-byte row per byte, a third
    of the unpack-then-look-up time on the CPU).

    Args:
        packed: the bytes (uint8), at least ``packed_nbytes(n, bits)`` of them.
        bits: bits per value, 1 to 8.
        n: how many values to decode.
        table: the ``2**bits`` values (1-D).
        out: ``n`` elements of ``table``'s dtype and device, written in place and returned.
    """
    _check_bits(bits)
    per = 8 // bits
    full = n // per  # bytes whose values all belong to the output
    if 8 % bits or full == 0 or not out.is_contiguous():
        return torch.index_select(table, 0, unpack_uint(packed, bits, n).int(), out=out)
    # the values of every byte: value j of byte b is field j (least significant first) of b
    every_byte = torch.arange(256, dtype=torch.uint8, device=table.device)
    byte_table = table.index_select(0, unpack_uint(every_byte, bits, 256 * per).int()).view(256, per)
    lookup_rows(byte_table, packed[:full].int(), out[: full * per].view(full, per))
    if full * per < n:  # the values of the last, partly used byte
        rest = unpack_uint(packed[full : full + 1], bits, n - full * per).int()
        torch.index_select(table, 0, rest, out=out[full * per :])
    return out


def pack_bits(mask: Tensor) -> Tensor:
    """One bit per element of the boolean ``mask`` (``ceil(n / 8)`` bytes): :func:`pack_uint` with one bit.

    On the CPU NumPy's ``packbits`` writes the same bytes in one pass (``bitorder="little"`` is this module's order:
    element ``8 i + j`` is bit ``j`` of byte ``i``), where the int64 gather of :func:`pack_uint` takes several.
    """
    flat = mask.reshape(-1)
    if flat.device.type == "cpu" and flat.dtype == torch.bool:
        return torch.from_numpy(np.packbits(flat.detach().numpy(), bitorder="little"))
    return pack_uint(flat, 1)


def unpack_bits(packed: Tensor, n: int) -> Tensor:
    """The first ``n`` bits of ``packed`` as a bool tensor (NumPy's ``unpackbits`` on the CPU, the same bits)."""
    if packed.device.type == "cpu" and packed.dtype == torch.uint8 and n <= 8 * packed.numel():
        bits = np.unpackbits(packed.detach().numpy(), count=n, bitorder="little")
        return torch.from_numpy(bits.view(np.bool_))
    return unpack_uint(packed, 1, n).view(torch.bool)


def _pad_to(v: Tensor, multiple: int) -> Tensor:
    return F.pad(v, (0, -v.numel() % multiple)) if v.numel() % multiple else v


# bit tricks on int64 words (two's complement: the constants are the signed values of the 64-bit patterns)
_LITTLE_ENDIAN = sys.byteorder == "little"
_GATHER = 0x0102040810204080  # bit 0 of byte j -> bit 56 + j
_SPREAD = 0x0101010101010101  # a byte copied into every byte
_PICK = 0x8040201008040201 - (1 << 64)  # byte j keeps bit j


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

    Layout (planar, so that every step reads and writes contiguous memory): with ``W`` words, value ``i`` sits in
    field ``i // W`` of word ``i % W``.
    """
    per = fields_per_word(width)
    v = values.reshape(-1)
    count = -(-v.numel() // per)
    planes = _pad_to(v, per * count).view(per, count) if v.numel() else v.new_zeros(per, 0)
    words = planes[per - 1].to(torch.int64, copy=True)
    for j in range(per - 2, -1, -1):  # Horner, plane by plane, in place
        words.bitwise_left_shift_(width).bitwise_or_(planes[j])
    return words


def unpack_fields(words: Tensor, width: int, n: int) -> Tensor:
    """The first ``n`` fields of ``words`` (int64), in the order :func:`pack_fields` took them."""
    per = fields_per_word(width)
    out = torch.empty(per, words.numel(), dtype=torch.int64, device=words.device)
    rest = words.clone()
    for j in range(per):
        torch.bitwise_and(rest, (1 << width) - 1, out=out[j])
        rest.bitwise_right_shift_(width)
    return out.reshape(-1)[:n]


def field_planes(words: Tensor, width: int, n: int) -> Iterator[tuple[int, Tensor]]:
    """The first ``n`` fields of ``words``, plane by plane: ``(start, values)`` for values ``start, start + 1, ...``.

    The same values as :func:`unpack_fields`, without its ``n``-element int64 result: each plane (field ``j`` of every
    word, which :func:`pack_fields` filled with consecutive values) is written into one word-sized int64 buffer,
    *reused* for the next plane, so a consumer that decodes each plane as it comes (TernGrad's table lookup) touches
    a few megabytes where the whole unpacking wrote eight bytes per value into fresh memory. Consume each plane
    before asking for the next.
    """
    per = fields_per_word(width)
    count = words.numel()
    rest = words.clone()
    plane = torch.empty(count, dtype=torch.int64, device=words.device)
    for j in range(per):
        start = j * count
        if start >= n:
            return
        torch.bitwise_and(rest, (1 << width) - 1, out=plane)
        yield start, plane[: min(count, n - start)]
        rest.bitwise_right_shift_(width)


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
        mask.index_fill_(0, indices.long(), True)  # `mask[indices] = True` copies a host scalar: a CUDA sync
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
        return flat_nonzero(unpack_bits(blob, numel))
    if blob.storage_offset() % 4:
        blob = blob.clone()  # a view as int32 needs 4-byte alignment
    listed = blob.view(torch.int32)
    return listed[: slots if count is None else count].long()
