"""TopK's CPU fast path: the exact top-k by magnitude."""

import pytest
import torch

from lightning_gradcomp.compressors.sparsify import topk_indices


@pytest.mark.parametrize("n", [1000, 70_000, 2_359_296])
@pytest.mark.parametrize("ratio", [0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0])
def test_topk_indices_are_the_k_largest_magnitudes(n, ratio):
    """The set torch.topk of |values| selects, through the sampled bound, on both signs (distinct magnitudes)."""
    k = max(1, int(ratio * n))
    values = torch.randn(n, generator=torch.Generator().manual_seed(n + k), dtype=torch.float64).float()
    found = topk_indices(values, k)
    expected = torch.topk(values.abs(), k).indices
    assert torch.equal(found.sort().values, expected.sort().values)
    if k >= 10:  # both signs are selected
        assert (values[found] < 0).any()
        assert (values[found] > 0).any()


def test_topk_indices_fall_back_when_the_sampled_bound_is_too_high():
    """A layer with fewer non-zeros than k: the sample's bound is 0, too few exceed it, the full topk decides."""
    values = torch.zeros(100_000)
    values[::1000] = torch.linspace(-1, 1, 100)  # 100 non-zeros (one of them 0), k = 1000
    found = topk_indices(values, 1000)
    assert found.numel() == 1000
    assert torch.equal(values[found].abs().sort().values, torch.topk(values.abs(), 1000).values.sort().values)
