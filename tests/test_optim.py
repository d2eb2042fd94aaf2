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


def _gpt():
    from lightning_gradcomp.models.gpt import GPT

    torch.manual_seed(0)
    return GPT(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16)


def _losses(model, optimizer, steps=3):
    x = torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(1))
    for _ in range(steps):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()).backward()
        optimizer.step()


def test_muon_adamw_is_torchs_muon_on_the_hidden_matrices_and_adamw_on_the_rest():
    """Bit for bit the two torch optimizers stepped side by side, over the split ``muon_param_groups`` makes: the
    blocks' linear weights to Muon; the tied embedding, biases and norms to AdamW (decay on the embedding only)."""
    from lightning_gradcomp.optim import MuonAdamW, muon_param_groups

    ours, theirs = _gpt(), _gpt()
    groups = muon_param_groups(ours, weight_decay=0.1)
    split = [(g["use_muon"], len(g["params"]), g["weight_decay"]) for g in groups]
    assert split == [(True, 4, 0.1), (False, 2, 0.1), (False, 10, 0.0)]
    assert all(p is not ours.wte.weight for p in groups[0]["params"]), "the tied output layer is an embedding"
    optimizer = MuonAdamW(groups, lr=0.02, adamw_lr=3e-3)
    split = muon_param_groups(theirs, weight_decay=0.1)
    muon = torch.optim.Muon(split[0]["params"], lr=0.02, weight_decay=0.1)
    adamw = torch.optim.AdamW(
        [{"params": g["params"], "weight_decay": g["weight_decay"]} for g in split[1:]], lr=3e-3, betas=(0.9, 0.95)
    )

    class Both:
        def zero_grad(self):
            muon.zero_grad()
            adamw.zero_grad()

        def step(self):
            muon.step()
            adamw.step()

    _losses(ours, optimizer)
    _losses(theirs, Both())
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(ours.blocks[0].mlp[0].weight, _gpt().blocks[0].mlp[0].weight), "it trained"


def test_muon_adamw_resumes_bitwise_and_shares_its_groups_with_a_scheduler():
    import copy as copy_module

    from lightning_gradcomp.optim import MuonAdamW, muon_param_groups

    model = _gpt()
    optimizer = MuonAdamW(muon_param_groups(model, 0.1), lr=0.02, adamw_lr=3e-3)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5)
    assert optimizer._muon.param_groups[0]["lr"] == 0.01, "the scheduler sets the lr Muon steps with"
    _losses(model, optimizer, 2)
    saved = copy_module.deepcopy(optimizer.state_dict())  # as from a file: not the live state's tensors
    copy = _gpt()
    copy.load_state_dict(model.state_dict())
    resumed = MuonAdamW(muon_param_groups(copy, 0.1), lr=0.02, adamw_lr=3e-3)
    resumed.load_state_dict(saved)
    assert resumed._adamw.state is resumed.state
    assert resumed._muon.param_groups[0] is resumed.param_groups[0]
    _losses(model, optimizer, 2)
    _losses(copy, resumed, 2)
    for a, b in zip(model.parameters(), copy.parameters(), strict=True):
        assert torch.equal(a, b)
    schedule.step()


def test_muon_adamw_refuses_a_muon_group_that_is_not_a_matrix():
    from lightning_gradcomp.optim import MuonAdamW

    with pytest.raises(ValueError, match="Muon only supports 2D parameters"):
        MuonAdamW([{"params": [torch.nn.Parameter(torch.zeros(3))], "use_muon": True}])
