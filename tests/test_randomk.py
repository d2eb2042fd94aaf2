"""RandomK's shared index draw: uniform subsets drawn with tensor operators, per layer, whatever the bucket."""

import pytest
import torch

from lightning_gradcomp.compressors.ops.random_subsets import draws, hash32, shared_subsets, streams, uniform_below
from lightning_gradcomp.engine.context import layers_from_shapes


def _reference(n, k, key, step):
    """The subset drawn one element at a time: the first k distinct draws (or the k smallest hashes), sorted."""
    if k >= n:
        return list(range(n))
    counters = torch.arange(n if 2 * k > n else k + 32 + int(2 * k * k / n), dtype=torch.int64)
    bits = draws(streams(torch.tensor(key), step), counters)
    if 2 * k > n:
        order = sorted(range(n), key=lambda j: (int(bits[j]), j))
        return sorted(order[:k])
    chosen, seen = [], set()
    for value in uniform_below(bits, n).tolist():
        if value not in seen:
            seen.add(value)
            chosen.append(value)
        if len(chosen) == k:
            break
    return sorted(chosen)


def test_hash32_is_lowbias32():
    """Known values of ``lowbias32`` (computed with 32-bit unsigned arithmetic)."""

    def lowbias32(x):
        x ^= x >> 16
        x = (x * 0x7FEB352D) & 0xFFFFFFFF
        x ^= x >> 15
        x = (x * 0x846CA68B) & 0xFFFFFFFF
        return x ^ (x >> 16)

    values = [0, 1, 2, 12345, 2**31 - 1, 2**31, 2**32 - 1]
    assert hash32(torch.tensor(values)).tolist() == [lowbias32(v) for v in values]


@pytest.mark.parametrize("step", [0, 7])
def test_subsets_match_the_one_at_a_time_reference(step):
    shapes = [(10,), (1000,), (30, 10), (7,), (4, 4), (2000,)]
    counts = [3, 10, 200, 7, 9, 1]  # drawn, drawn, drawn, every element, ranked by hash (9 > 16 / 2), one
    layers = layers_from_shapes(shapes)
    keys = [101 + i for i in range(len(layers))]
    found = shared_subsets(layers, counts, keys, step, torch.device("cpu"))
    assert found.dtype == torch.int64
    expected = [
        layer.offset + j for layer, k, key in zip(layers, counts, keys) for j in _reference(layer.numel, k, key, step)
    ]
    assert found.tolist() == expected


def test_a_layers_subset_does_not_depend_on_its_bucket():
    layers = layers_from_shapes([(500,), (64, 9), (300,)])
    together = shared_subsets(layers, [5, 20, 3], [1, 2, 3], 4, torch.device("cpu"))
    alone = shared_subsets(layers_from_shapes([(64, 9)]), [20], [2], 4, torch.device("cpu"))
    assert torch.equal(together[5:25] - layers[1].offset, alone)


@pytest.mark.parametrize(("n", "k"), [(10, 3), (10, 7)])
def test_subsets_are_uniform(n, k):
    """Over 2000 steps every element is kept about ``k / n`` of the time, and so is every pair ``k(k-1)/(n(n-1))``."""
    layers = layers_from_shapes([(n,)])
    hits = torch.zeros(n)
    pairs = torch.zeros(n, n)
    steps = 2000
    for step in range(steps):
        chosen = torch.zeros(n).index_fill_(0, shared_subsets(layers, [k], [9], step, torch.device("cpu")), 1.0)
        hits += chosen
        pairs += torch.outer(chosen, chosen)
    p = k / n
    assert torch.allclose(hits / steps, torch.full((n,), p), atol=4 * (p * (1 - p) / steps) ** 0.5)
    q = k * (k - 1) / (n * (n - 1))
    off = pairs[~torch.eye(n, dtype=torch.bool)] / steps
    assert torch.allclose(off, torch.full_like(off, q), atol=5 * (q * (1 - q) / steps) ** 0.5)


def test_subsets_are_distinct_sorted_and_in_range_for_large_layers():
    layers = layers_from_shapes([(2_359_296,), (512, 256)])
    found = shared_subsets(layers, [23_593, 100_000], [5, 6], 3, torch.device("cpu"))
    first, second = found[:23_593], found[23_593:]
    for part, layer in ((first, layers[0]), (second, layers[1])):
        assert torch.all(part[1:] > part[:-1])
        assert int(part[0]) >= layer.offset
        assert int(part[-1]) < layer.offset + layer.numel


def test_layers_of_2_31_elements_are_refused():
    with pytest.raises(ValueError, match="below 2\\^31"):
        shared_subsets(layers_from_shapes([(2**31,)]), [5], [1], 0, torch.device("meta"))
