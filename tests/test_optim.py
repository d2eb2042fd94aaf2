"""DGCSGD against the update written out by hand from the reference optimizer."""

import pytest
import torch

from lightning_gradcomp.optim import DGCSGD


@pytest.mark.parametrize("nesterov", [False, True])
def test_dgcsgd_applies_momentum_to_the_decay_only(nesterov):
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(5, 3))
    optimizer = DGCSGD([w], lr=0.1, momentum=0.9, weight_decay=0.01, nesterov=nesterov)
    ref, buf = w.detach().clone(), None
    for step in range(4):
        grad = torch.randn(5, 3, generator=torch.Generator().manual_seed(step))
        w.grad = grad.clone()
        optimizer.step()
        decay = 0.01 * ref
        buf = decay.clone() if buf is None else 0.9 * buf + decay
        ref = ref - 0.1 * (grad + (decay + 0.9 * buf if nesterov else buf))
        torch.testing.assert_close(w.detach(), ref, rtol=1e-6, atol=1e-7)


def test_dgcsgd_decay_is_ten_times_plain_decay_at_steady_state():
    """With a zero gradient, the decay's momentum makes the steady-state step 1 / (1 - momentum) times wd * w."""
    w = torch.nn.Parameter(torch.ones(1, dtype=torch.float64))
    optimizer = DGCSGD([w], lr=1e-5, momentum=0.9, weight_decay=1.0)
    for _ in range(200):
        before = w.detach().clone()
        w.grad = torch.zeros(1, dtype=torch.float64)
        optimizer.step()
    assert (before - w.detach()).item() == pytest.approx(10 * 1e-5 * before.item(), rel=1e-3)


def test_dgcsgd_without_decay_is_sgd():
    w = torch.nn.Parameter(torch.ones(3))
    optimizer = DGCSGD([w], lr=0.5, momentum=0.9)
    w.grad = torch.tensor([1.0, 2.0, 3.0])
    optimizer.step()
    assert torch.equal(w.detach(), torch.tensor([0.5, 0.0, -0.5]))


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"lr": -1}, "lr"),
        ({"lr": 0.1, "momentum": 1.0}, "momentum"),
        ({"lr": 0.1, "weight_decay": float("nan")}, "weight_decay"),
        ({"lr": 0.1, "nesterov": True}, "momentum"),
    ],
)
def test_dgcsgd_bad_arguments(kwargs, name):
    with pytest.raises(ValueError, match=f"`{name}`"):
        DGCSGD([torch.nn.Parameter(torch.ones(1))], **kwargs)
