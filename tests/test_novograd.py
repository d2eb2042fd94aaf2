"""NovoGrad against the paper's formulas written out by hand, its foreach path against its loop, and its checks."""

import copy
import math

import pytest
import torch
from torch import nn

from lightning_gradcomp.optim import NovoGrad


def _digits():
    """A real small dataset: scikit-learn's bundled 8x8 digits (offline)."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    return torch.tensor(x[:256] / 16.0, dtype=torch.float32), torch.tensor(y[:256])


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 16), nn.Tanh(), nn.Linear(16, 10))


def _paper(params, grads, state, lr, beta1, beta2, eps, wd, grad_averaging):
    """One step of the paper's rule, tensor by tensor, in float64 Python-level arithmetic on the norms."""
    for i, (w, g) in enumerate(zip(params, grads)):
        norm_sq = float((g.double() ** 2).sum())
        if i not in state:
            state[i] = {"v": norm_sq, "m": torch.zeros_like(w, dtype=torch.float64)}
        else:
            state[i]["v"] = beta2 * state[i]["v"] + (1 - beta2) * norm_sq
        d = g.double() / (math.sqrt(state[i]["v"]) + eps) + wd * w.double()
        if grad_averaging:
            d = (1 - beta1) * d
        state[i]["m"] = beta1 * state[i]["m"] + d
        w.copy_(w.double() - lr * state[i]["m"])


@pytest.mark.parametrize(
    ("wd", "grad_averaging", "betas"),
    [(0.0, False, (0.95, 0.98)), (1e-3, False, (0.95, 0.98)), (1e-2, True, (0.8, 0.5))],
    ids=["plain", "weight-decay", "decay+averaging-nemo-betas"],
)
@pytest.mark.parametrize("foreach", [True, False])
def test_novograd_equals_the_papers_formulas_over_50_steps(wd, grad_averaging, betas, foreach):
    x, y = _digits()
    model, ref = _model(), _model()
    optimizer = NovoGrad(
        model.parameters(), lr=0.01, betas=betas, weight_decay=wd, grad_averaging=grad_averaging, foreach=foreach
    )
    ref_params, state = list(ref.parameters()), {}
    with torch.no_grad():
        initial = nn.functional.cross_entropy(model(x), y)
    for step in range(50):
        batch = slice(32 * (step % 8), 32 * (step % 8 + 1))
        for net in (model, ref):
            net.zero_grad()
            nn.functional.cross_entropy(net(x[batch]), y[batch]).backward()
        grads = [p.grad.clone() for p in ref_params]
        optimizer.step()
        with torch.no_grad():
            _paper(ref_params, grads, state, 0.01, *betas, 1e-8, wd, grad_averaging)
        for p, q in zip(model.parameters(), ref_params):
            torch.testing.assert_close(p, q, rtol=2e-5, atol=2e-6, msg=f"step {step}")
    # the model trained (the comparison is not between two frozen models)
    with torch.no_grad():
        assert nn.functional.cross_entropy(model(x), y) < 0.95 * initial


def test_foreach_and_loop_paths_agree_and_leave_the_gradient_alone():
    x, y = _digits()
    models = [_model(), _model()]
    opts = [
        NovoGrad(m.parameters(), lr=0.02, weight_decay=1e-3, grad_averaging=True, amsgrad=True, foreach=f)
        for m, f in zip(models, (True, False))
    ]
    for _ in range(10):
        for m, o in zip(models, opts):
            m.zero_grad()
            nn.functional.cross_entropy(m(x), y).backward()
            grads = [p.grad.clone() for p in m.parameters()]
            o.step()
            assert all(torch.equal(g, p.grad) for g, p in zip(grads, m.parameters())), "p.grad is not modified"
    for p, q in zip(*(m.parameters() for m in models)):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_two_steps_in_closed_form_and_beta2_zero_is_layerwise_normalised_momentum():
    w = nn.Parameter(torch.tensor([3.0, 4.0], dtype=torch.float64))
    b = nn.Parameter(torch.tensor([1.0], dtype=torch.float64))
    optimizer = NovoGrad([w, b], lr=0.1, betas=(0.9, 0.0), eps=0.0)
    w.grad, b.grad = torch.tensor([3.0, 4.0], dtype=torch.float64), torch.tensor([-2.0], dtype=torch.float64)
    optimizer.step()  # m = g / |g|
    assert torch.allclose(w.detach(), torch.tensor([3 - 0.1 * 0.6, 4 - 0.1 * 0.8], dtype=torch.float64))
    assert torch.allclose(b.detach(), torch.tensor([1.1], dtype=torch.float64))
    w.grad, b.grad = torch.tensor([0.0, 10.0], dtype=torch.float64), torch.tensor([5.0], dtype=torch.float64)
    before = w.detach().clone()
    optimizer.step()  # beta2 = 0: v = |g_2|^2, m = 0.9 m + g_2 / |g_2|
    expected = before - 0.1 * (0.9 * torch.tensor([0.6, 0.8], dtype=torch.float64) + torch.tensor([0.0, 1.0]))
    assert torch.allclose(w.detach(), expected)


def test_first_moment_starts_at_the_first_squared_norm_and_restarts_while_zero():
    w = nn.Parameter(torch.zeros(3))
    optimizer = NovoGrad([w], lr=1.0)
    w.grad = torch.zeros(3)
    optimizer.step()
    assert optimizer.state[w]["exp_avg_sq"].item() == 0.0
    w.grad = torch.tensor([0.0, 3.0, 4.0])
    optimizer.step()
    assert optimizer.state[w]["exp_avg_sq"].item() == pytest.approx(25.0)  # not 0.02 * 25: the layer's first step


def test_state_dict_resume_is_bitwise():
    x, y = _digits()
    model = _model()
    optimizer = NovoGrad(model.parameters(), lr=0.01, weight_decay=1e-3, grad_averaging=True)

    def train(net, opt, steps):
        for _ in range(steps):
            net.zero_grad()
            nn.functional.cross_entropy(net(x), y).backward()
            opt.step()

    train(model, optimizer, 3)
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict())
    train(model, optimizer, 3)
    resumed = _model()
    resumed.load_state_dict(saved_model)
    resumed_opt = NovoGrad(resumed.parameters(), lr=0.01, weight_decay=1e-3, grad_averaging=True)
    resumed_opt.load_state_dict(saved_opt)
    train(resumed, resumed_opt, 3)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), resumed.parameters()))


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"lr": -0.1}, "lr"),
        ({"betas": (1.0, 0.9)}, "betas[0]"),
        ({"betas": (0.9, -0.1)}, "betas[1]"),
        ({"betas": (0.9,)}, "betas"),
        ({"eps": -1e-8}, "eps"),
        ({"weight_decay": -1.0}, "weight_decay"),
        ({"grad_averaging": 1}, "grad_averaging"),
        ({"foreach": None}, "foreach"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=f"`{name}`".replace("[", r"\[").replace("]", r"\]")):
        NovoGrad([nn.Parameter(torch.ones(1))], **kwargs)
