"""RandomK's shared index draw: the same subsets, drawn faster."""

import pytest
import torch

from lightning_gradcomp.compressors.sparsify import _uniform_subset


def _sorted_subset_reference(n, k, generator):
    """The k-subset RandomK drew before its final sort became a mask: the same draws, sorted with ``sort``."""
    if k >= n:
        return torch.arange(n)
    if 2 * k > n:
        return torch.randperm(n, generator=generator)[:k].sort().values
    m = k + 16 + int(2 * k * k / n)
    while True:
        distinct = torch.unique(torch.randint(0, n, (m,), generator=generator))
        if distinct.numel() >= k:
            return distinct[torch.randperm(distinct.numel(), generator=generator)[:k]].sort().values
        m *= 2


@pytest.mark.parametrize(("n", "k"), [(1, 1), (10, 3), (10, 6), (10, 10), (1000, 10), (1000, 499), (1000, 501),
                                      (2_359_296, 23_593), (2_359_296, 707_788),
                                      (2**31, 50), (2**31 + 5, 50)])  # fmt: skip
@pytest.mark.parametrize("seed", [0, 1])
def test_random_k_subsets_are_the_sorted_draws_of_before(n, k, seed):
    """The same subset and the same generator state after (int32 draws below 2^31, int64 above)."""
    generator, reference = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
    found = _uniform_subset(n, k, generator)
    expected = _sorted_subset_reference(n, k, reference)
    assert found.dtype == torch.int64
    assert torch.equal(found, expected)
    assert torch.equal(generator.get_state(), reference.get_state())
