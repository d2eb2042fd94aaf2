"""Bit packing: exact round trips, exact byte counts, the documented bit order, carry-free sums, index encodings."""

import pytest
import torch

from lightning_gradcomp.compressors.ops.packing import (
    INT_OF_SIZE,
    above,
    argsort_distinct,
    decode_indices,
    encode_indices,
    field_planes,
    field_width,
    fields_per_word,
    flat_nonzero,
    index_nbytes,
    lookup_rows,
    lookup_uint,
    magnitude_above,
    max_magnitudes,
    nonzero_mask,
    pack_bits,
    pack_fields,
    pack_uint,
    packed_nbytes,
    signbit,
    sorted_distinct,
    unpack_bits,
    unpack_fields,
    unpack_uint,
    words_needed,
)

SIZES = [0, 1, 7, 8, 9, 15, 16, 17, 63, 64, 65, 1000, 4099]


@pytest.mark.parametrize("bits", range(1, 9))
def test_uint_round_trip_with_exact_byte_count(bits):
    g = torch.Generator().manual_seed(bits)
    for n in SIZES:
        values = torch.randint(0, 2**bits, (n,), generator=g)
        packed = pack_uint(values, bits)
        assert packed.dtype == torch.uint8
        assert packed.numel() == packed_nbytes(n, bits) == (n * bits + 7) // 8
        assert torch.equal(unpack_uint(packed, bits, n).long(), values)


def test_bit_order_is_least_significant_first():
    """Value i occupies bits [b i, b (i + 1)) of the stream; bit t is bit t % 8 of byte t // 8."""
    assert pack_uint(torch.tensor([1, 0, 1, 1, 0, 0, 0, 1, 1]), 1).tolist() == [0b10001101, 0b00000001]
    assert pack_uint(torch.tensor([2, 0, 1, 3]), 2).tolist() == [0b11010010]
    # 3 bits: 5 = 101, 3 = 011, 7 = 111 -> stream 101 110 111 (LSB first) -> byte 0 = 11 110 101, byte 1 = 0000000 1
    assert pack_uint(torch.tensor([5, 3, 7]), 3).tolist() == [0b11011101, 0b00000001]


def test_bits_are_one_per_element():
    mask = torch.rand(1001, generator=torch.Generator().manual_seed(0)) > 0.5
    packed = pack_bits(mask)
    assert packed.numel() == 126
    assert torch.equal(unpack_bits(packed, 1001), mask)


def test_numpy_bit_packing_is_the_int64_gather():
    """pack_bits / unpack_bits (NumPy on the CPU) give the bytes and bits of pack_uint / unpack_uint with one bit, for
    every length and for strided inputs."""
    g = torch.Generator().manual_seed(1)
    for n in SIZES:
        mask = torch.rand(2 * n, generator=g) > 0.5
        for m in (mask[:n], mask[::2]):
            packed = pack_bits(m)
            assert torch.equal(packed, pack_uint(m.to(torch.uint8), 1))
            assert torch.equal(unpack_bits(packed, n), unpack_uint(packed, 1, n).bool())
        noise = torch.randint(0, 256, (2 * packed_nbytes(n, 1) + 2,), generator=g, dtype=torch.uint8)
        for blob in (noise[: packed_nbytes(n, 1)], noise[::2]):  # any byte pattern, contiguous or strided
            assert torch.equal(unpack_bits(blob, n), unpack_uint(blob.contiguous(), 1, n).bool())


def test_out_of_range_bits_are_refused():
    with pytest.raises(ValueError, match="`bits`"):
        pack_uint(torch.zeros(3, dtype=torch.int64), 9)
    with pytest.raises(ValueError, match="`bits`"):
        unpack_uint(torch.zeros(3, dtype=torch.uint8), 0, 3)


@pytest.mark.parametrize("ranks", [2, 3, 4, 7, 8, 64])
def test_summed_words_sum_every_field_without_carries(ranks):
    """Ternaries offset to {0, 1, 2}: fields of ceil(log2(2 n + 1)) bits hold the sum of n of them."""
    width = field_width(2 * ranks)
    assert width == (2 * ranks).bit_length()
    g = torch.Generator().manual_seed(ranks)
    values = [torch.randint(0, 3, (1001,), generator=g) for _ in range(ranks)]
    values[0][:50] = 2  # the largest sums occur
    for v in values[1:]:
        v[:50] = 2
    words = sum(pack_fields(v, width) for v in values)
    assert words.numel() == words_needed(1001, width)
    assert torch.equal(unpack_fields(words, width, 1001), sum(values))


def test_fields_too_narrow_for_the_sum_carry_into_their_neighbours():
    """The control: 2-bit fields (the paper's packing) cannot hold the sum of two ternaries."""
    v = torch.full((10,), 2)
    assert not torch.equal(unpack_fields(pack_fields(v, 2) + pack_fields(v, 2), 2, 10), v + v)


def test_words_use_63_bits():
    assert fields_per_word(3) == 21
    assert fields_per_word(4) == 15
    with pytest.raises(ValueError, match="field width"):
        fields_per_word(64)


def test_index_encoding_picks_the_smaller():
    assert index_nbytes(10, 1000) == (False, 40)  # 40-byte list < 128-byte bitmap
    assert index_nbytes(40, 1000) == (True, 128)  # bitmap (32 int32 words) < 160-byte list
    assert index_nbytes(32, 1024) == (False, 128)  # a tie goes to the list


@pytest.mark.parametrize("bitmap", [False, True])
def test_indices_round_trip(bitmap):
    indices = torch.tensor([999, 3, 500, 0, 64])
    blob = encode_indices(indices, 1000, 8, bitmap)
    assert blob.numel() == (128 if bitmap else 32)
    decoded = decode_indices(blob, 1000, 8, bitmap, count=None if bitmap else 5)
    # a bitmap decodes in increasing order; a list keeps the order it was given
    assert decoded.tolist() == (sorted(indices.tolist()) if bitmap else indices.tolist())


def test_list_padding_repeats_the_first_index():
    blob = encode_indices(torch.tensor([7, 9]), 100, 4, bitmap=False)
    assert decode_indices(blob, 100, 4, bitmap=False).tolist() == [7, 9, 7, 7]


def test_misaligned_lists_decode():
    blob = torch.cat([torch.zeros(2, dtype=torch.uint8), encode_indices(torch.tensor([5, 6]), 10, 2, False)])
    assert decode_indices(blob[2:], 10, 2, bitmap=False).tolist() == [5, 6]


@pytest.mark.parametrize(
    "dtype",
    [torch.bool, torch.uint8, torch.int32, torch.int64, torch.float16, torch.float32, torch.float64, torch.bfloat16],
)
@pytest.mark.parametrize("density", [0.0, 0.001, 0.25, 1.0])
def test_flat_nonzero_is_torch_nonzero(dtype, density):
    generator = torch.Generator().manual_seed(3)
    values = (torch.rand(10_007, generator=generator) < density).to(dtype)
    if dtype.is_floating_point:  # non-zero values of every kind, and a negative zero that counts as zero
        values = values * torch.randn(10_007, generator=generator).to(dtype)
        values[:4] = torch.tensor([float("nan"), float("inf"), -0.0, -1e-30], dtype=torch.float64).to(dtype)
    expected = torch.nonzero(values).squeeze(1)
    if dtype.is_floating_point:
        assert torch.equal(nonzero_mask(values), values != 0)
    found = flat_nonzero(values)
    assert found.dtype == torch.int64
    assert torch.equal(found, expected)
    strided = values[1::3]  # a non-contiguous view
    assert torch.equal(flat_nonzero(strided), torch.nonzero(strided).squeeze(1))


@pytest.mark.parametrize("density", [0.0, 0.0005, 0.015, 0.03, 0.2, 1.0])
@pytest.mark.parametrize("numel", [65_536, 65_543, 300_001])
def test_flat_nonzero_of_large_masks_is_torch_nonzero(numel, density):
    """Masks long enough for the word scan (a sparse head) or for NumPy's own loop (a dense head), whatever follows."""
    generator = torch.Generator().manual_seed(5)
    sparse = torch.rand(numel, generator=generator) < density
    dense_head = sparse.clone()
    dense_head[:40_000] = torch.rand(40_000, generator=generator) < 0.5  # judged dense, sparse after
    sparse_head = sparse.clone()
    sparse_head[:70_000] = False  # judged sparse, denser after
    sparse_head[-8:] = True  # set elements in the last word and in a tail that is not a whole word
    for mask in (sparse, dense_head, sparse_head):
        expected = torch.nonzero(mask).squeeze(1)
        for offset in (0, 1, 3, 7):  # views starting inside a word
            view = mask[offset:]
            found = flat_nonzero(view)
            assert found.dtype == torch.int64
            assert torch.equal(found, torch.nonzero(view).squeeze(1))
        assert torch.equal(flat_nonzero(mask), expected)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("inclusive", [False, True])
def test_above_is_torch_comparison(dtype, inclusive):
    """The same mask as torch's ``>`` / ``>=``: signed zeros, NaN, infinities, ties at the bound, bounds given as
    Python numbers or 0-d tensors of another dtype (compared in the values' dtype), strided views."""
    generator = torch.Generator().manual_seed(5)
    values = torch.randn(10_007, generator=generator, dtype=torch.float64).to(dtype)
    values[:6] = torch.tensor([float("nan"), float("inf"), float("-inf"), -0.0, 0.0, 1e-30]).to(dtype)
    bound = values[100].clone()  # ties: the bound itself is in the values
    values[200:210] = bound
    bounds = [0, 0.0, -0.0, float(bound), bound, bound.to(torch.float64) + 1e-9, torch.tensor(0.1, dtype=torch.float64)]
    for b in bounds:
        for v in (values, values[1::3]):
            expected = v >= b if inclusive else v > b
            found = above(v, b, inclusive=inclusive)
            assert found.dtype == torch.bool
            assert torch.equal(found, expected), (b, v.is_contiguous())
    assert above(values, bound, inclusive=inclusive)[200:210].all() == inclusive


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("inclusive", [False, True])
def test_magnitude_above_is_torch_abs_then_comparison(dtype, inclusive):
    """The same mask as ``values.abs() > bound`` (``>=``): both signs tie at the bound, NaN is never above, ``-0.0``
    is ``0``, infinities, negative and NaN bounds (every non-NaN value is above a negative one), strided views."""
    generator = torch.Generator().manual_seed(7)
    values = torch.randn(10_007, generator=generator, dtype=torch.float64).to(dtype)
    values[:6] = torch.tensor([float("nan"), float("inf"), float("-inf"), -0.0, 0.0, -1e-30]).to(dtype)
    bound = values[100].abs()
    values[200:205], values[205:210] = bound, -bound  # ties on both sides
    bounds = [0, -0.0, float(bound), bound, -bound, float("nan"), float("inf"), torch.tensor(0.1, dtype=torch.float64)]
    for b in bounds:
        for v in (values, values[1::3]):
            expected = v.abs() >= b if inclusive else v.abs() > b
            found = magnitude_above(v, b, inclusive=inclusive)
            assert found.dtype == torch.bool
            assert torch.equal(found, expected), (b, v.is_contiguous())
    assert magnitude_above(values, bound, inclusive=inclusive)[200:210].all() == inclusive
    assert not magnitude_above(values, -1.0, inclusive=inclusive)[0]  # NaN


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_signbit_is_torch_signbit(dtype):
    """The sign bit itself: ``-0.0`` and NaNs with the sign bit set count as negative, as in torch."""
    values = torch.randn(10_007, generator=torch.Generator().manual_seed(6), dtype=torch.float64).to(dtype)
    values[:6] = torch.tensor([float("nan"), float("inf"), float("-inf"), -0.0, 0.0, -1e-30]).to(dtype)
    values[6] = -values[0]  # a NaN with the sign bit set
    for v in (values, values[1::3]):
        found = signbit(v)
        assert found.dtype == torch.bool
        assert torch.equal(found, torch.signbit(v))
    found = signbit(values)
    assert found[1:6].tolist() == [False, True, True, False, True]
    assert found[0] != found[6]  # NaNs of both signs


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64, torch.int64])
def test_lookup_is_unpack_then_index(bits, dtype):
    """Decoding by a byte table equals unpacking then looking up, bit for bit, for every length (partly used last
    bytes), every table element size (rows of 1 to 16 bytes) and outputs at offsets the byte rows cannot view."""
    g = torch.Generator().manual_seed(bits)
    table = torch.randn(1 << bits, generator=g).to(dtype)
    table[0] = -0.0 if dtype.is_floating_point else table[0]  # signed zeros survive the lookup
    for n in SIZES:
        packed = pack_uint(torch.randint(0, 1 << bits, (n,), generator=g), bits)
        expected = torch.index_select(table, 0, unpack_uint(packed, bits, n).int())
        for offset in (0, 1, 3):
            out = torch.full((n + offset,), 7, dtype=dtype)
            found = lookup_uint(packed, bits, n, table, out[offset:])
            assert torch.equal(found.view(torch.uint8), expected.view(torch.uint8)), (n, offset)
            assert torch.equal(out[:offset], torch.full((offset,), 7, dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_argsort_distinct_is_torch_argsort(dtype):
    """The permutation torch's argsort gives distinct values (the only one), through the packed keys; None for
    increasing values; torch's own beyond the packed keys' range (negative, or 2^31 and above)."""
    g = torch.Generator().manual_seed(1)
    for n in (2, 3, 1000, 118_000):
        values = torch.randperm(5 * n, generator=g)[:n].to(dtype)
        if bool((values[1:] > values[:-1]).all()):  # not increasing already
            values = values.flip(0)
        assert torch.equal(argsort_distinct(values), torch.argsort(values))
        assert argsort_distinct(values.sort().values) is None
        assert torch.equal(argsort_distinct(values.sort(descending=True).values), torch.arange(n - 1, -1, -1))
        shifted = values - n  # some negative
        assert torch.equal(argsort_distinct(shifted), torch.argsort(shifted))
    if dtype == torch.int64:
        large = torch.tensor([3, (1 << 31) + 5, 1, 1 << 40])
        assert torch.equal(argsort_distinct(large), torch.argsort(large))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_max_magnitudes_are_the_infinity_norms(dtype):
    """``max(max x, -min x) + 0.0`` per tensor is ``vector_norm(x, inf)`` bit for bit, in fp32 and fp64 results:
    mixed signs, the largest magnitude negative, signed zeros only, infinities, NaN, one element, strided views."""
    g = torch.Generator().manual_seed(0)
    big = (torch.randn(70_000, generator=g) * 3).to(dtype)
    negative = big.clone()
    negative[123] = -100.0
    tensors = [
        big,
        negative,
        big[::3],
        torch.tensor([-0.0, 0.0, -0.0]).to(dtype),
        torch.tensor([-0.0]).to(dtype),
        torch.tensor([1.0, -float("inf"), 2.0]).to(dtype),
        torch.tensor([1.0, float("nan"), -2.0]).to(dtype),
        torch.tensor([-float("nan"), 5.0]).to(dtype),
        torch.tensor([-3.5]).to(dtype),
    ]
    for result in (torch.float32, torch.float64):
        if torch.promote_types(dtype, result) != result:
            continue  # the norm does not narrow (and TernGrad computes in at least the gradient's dtype)
        expected = torch.stack([torch.linalg.vector_norm(x, float("inf"), dtype=result) for x in tensors])
        found = max_magnitudes(tensors, result)
        assert found.dtype == result
        same = found.view(INT_OF_SIZE[found.element_size()]) == expected.view(INT_OF_SIZE[found.element_size()])
        assert bool((same | (found.isnan() & expected.isnan())).all()), (found, expected)
        assert not found[3].signbit()
        assert not found[4].signbit()


@pytest.mark.parametrize("width", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64, torch.int64])
def test_lookup_rows_is_index_select(width, dtype):
    """Rows gathered as one element each (1-16 bytes, 16 as complex128) are index_select's rows, byte for byte:
    NaN payloads of either sign (pairs of which read as double signalling NaNs), signed zeros, and outputs at
    offsets the row type cannot view."""
    g = torch.Generator().manual_seed(width)
    table = torch.randn(256, width, generator=g).to(dtype)
    if dtype.is_floating_point:
        bits = table.view(INT_OF_SIZE[table.element_size()])
        bits[1] = -1  # every bit set: a NaN with the sign bit in every element
        bits[2, ::2] = 1 << (8 * table.element_size() - 2)  # 0x40...: with an exponent of ones next to it, an sNaN
        bits[2, 1::2] = (1 << (8 * table.element_size() - 1)) - 1  # 0x7f..f: a NaN
        table[3] = -0.0
    rows = torch.randint(0, 256, (1000,), generator=g, dtype=torch.int32)
    rows[:4] = torch.arange(4)
    expected = torch.index_select(table, 0, rows)
    for offset in (0, 1, width):
        out = torch.full((1000 * width + offset,), 7).to(dtype)
        found = lookup_rows(table, rows, out[offset:].view(1000, width))
        assert found.data_ptr() == out[offset:].data_ptr()
        assert torch.equal(found.reshape(-1).view(torch.uint8), expected.reshape(-1).view(torch.uint8)), offset
        assert torch.equal(out[:offset], torch.full((offset,), 7).to(dtype))


@pytest.mark.parametrize("width", [1, 3, 4, 7, 21, 63])
def test_field_planes_are_unpack_fields(width):
    """Plane by plane, the same values in the same order as the whole unpacking, and no more than ``n``."""
    g = torch.Generator().manual_seed(width)
    for n in SIZES:
        values = torch.randint(0, 1 << min(width, 62), (n,), generator=g)
        words = pack_fields(values, width)
        pieces, at = [], 0
        for start, plane in field_planes(words, width, n):
            assert start == at
            pieces.append(plane.clone())  # the buffer is reused for the next plane
            at += plane.numel()
        assert at == n
        found = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int64)
        assert torch.equal(found, unpack_fields(words, width, n)), n


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("size", [0, 1, 2, 1000, 24_080])
def test_sorted_distinct_is_torch_unique(dtype, size):
    draws = torch.randint(-50, 5000, (size,), generator=torch.Generator().manual_seed(size), dtype=dtype)
    found = sorted_distinct(draws)
    assert found.dtype == dtype
    assert torch.equal(found, torch.unique(draws))
    assert torch.equal(sorted_distinct(draws[::2]), torch.unique(draws[::2]))  # a strided view
