"""The optimizer step fused into CompressedDDP's hook: the same weights as stepping after the backward pass."""

import copy
import csv
import math
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from lightning_gradcomp import CompressedDDP, CompressionState, compression_hook
from lightning_gradcomp.compressors import Identity, PowerSGD
from lightning_gradcomp.optim.fused import FusedAdaLomo, FusedSGD, bind_fused_optimizer
from lightning_gradcomp.runtime.rank_state import checkpoint_file
from tests.distributed import run_distributed
from tests.fit_worker import run_fits, run_name
from tests.models import TinyNet

STEPS = 4


def small_net(dtype=torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3),
        nn.ReLU(),
        nn.Conv2d(8, 16, 3),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(16 * 4 * 4, 64),
        nn.ReLU(),
        nn.Linear(64, 10),
    ).to(dtype)


def _batch(rank: int, step: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(8, 3, 8, 8, generator=g).to(dtype) * (1 + rank), torch.randint(0, 10, (8,), generator=g)


SGD = {"lr": 0.05, "momentum": 0.9, "weight_decay": 1e-3}
CASES = {
    # name: (compressor, optimizer factory, fused?, dtype)
    "sgd-identity-torch": (Identity, lambda p: torch.optim.SGD(p, **SGD), False, torch.float32),
    "sgd-identity-fused": (Identity, lambda p: FusedSGD(p, **SGD), True, torch.float32),
    "sgd-powersgd-torch": (lambda: PowerSGD(rank=2), lambda p: torch.optim.SGD(p, **SGD), False, torch.float32),
    "sgd-powersgd-fused": (lambda: PowerSGD(rank=2), lambda p: FusedSGD(p, **SGD), True, torch.float32),
    "clip-after": (
        Identity,
        lambda p: FusedSGD(p, lr=0.1, clip_grad_norm=0.5, clip_grad_value=0.05),
        False,
        torch.float32,
    ),
    "clip-fused": (
        Identity,
        lambda p: FusedSGD(p, lr=0.1, clip_grad_norm=0.5, clip_grad_value=0.05),
        True,
        torch.float32,
    ),
    "view-fused": (Identity, lambda p: FusedSGD(p, **SGD), True, torch.float32),  # gradient_as_bucket_view=True
    "adalomo-bf16-after": (Identity, lambda p: FusedAdaLomo(p, lr=1e-2, weight_decay=0.1), False, torch.bfloat16),
    "adalomo-bf16-fused": (Identity, lambda p: FusedAdaLomo(p, lr=1e-2, weight_decay=0.1), True, torch.bfloat16),
}


def _train_raw_ddp(rank: int, world_size: int) -> dict:
    """Every case on raw DDP over several buckets; the fused ones step inside the hook."""
    results = {}
    for name, (compressor, factory, fused, dtype) in CASES.items():
        model = small_net(dtype)
        # ~1000 floats per bucket: several buckets
        ddp = DDP(model, bucket_cap_mb=0.004, gradient_as_bucket_view=name.startswith("view"))
        state = CompressionState(compressor(), min_compress_numel=200)
        state.attach(ddp)
        ddp.register_comm_hook(state, compression_hook)
        optimizer = factory(model.parameters())
        if fused:
            state.after_reduce = optimizer.bind()
        for step in range(STEPS):
            x, y = _batch(rank, step, dtype)
            optimizer.zero_grad()
            nn.functional.cross_entropy(ddp(x).float(), y).backward()
            optimizer.step()
        results[name] = {
            "params": torch.cat([p.detach().float().flatten() for p in model.parameters()]),
            "dtypes": {p.dtype for p in model.parameters()},
            "state": copy.deepcopy(optimizer.state_dict()),
        }
        dist.barrier()
    return results


@pytest.fixture(scope="module")
def raw_runs():
    return run_distributed(_train_raw_ddp)


def test_fused_sgd_in_the_hook_is_bitwise_torch_sgd_with_identity(raw_runs):
    for rank in raw_runs:
        assert torch.equal(rank["sgd-identity-fused"]["params"], rank["sgd-identity-torch"]["params"])
        assert torch.equal(rank["view-fused"]["params"], rank["sgd-identity-torch"]["params"]), "with bucket views"
        # momentum buffers are where torch keeps them, equal too
        ours, theirs = rank["sgd-identity-fused"]["state"]["state"], rank["sgd-identity-torch"]["state"]["state"]
        assert ours.keys() == theirs.keys()
        assert all(torch.equal(ours[k]["momentum_buffer"], theirs[k]["momentum_buffer"]) for k in ours)
    assert not torch.equal(raw_runs[0]["sgd-identity-fused"]["params"], small_net().state_dict()["0.weight"])


def test_fused_sgd_with_powersgd_matches_torch_sgd_to_float_tolerance(raw_runs):
    for rank in raw_runs:
        torch.testing.assert_close(
            rank["sgd-powersgd-fused"]["params"], rank["sgd-powersgd-torch"]["params"], rtol=1e-5, atol=1e-6
        )
    # PowerSGD really compressed: its weights differ from the dense run's
    assert not torch.allclose(raw_runs[0]["sgd-powersgd-fused"]["params"], raw_runs[0]["sgd-identity-fused"]["params"])


@pytest.mark.parametrize("pair", [("clip", "fused", "after"), ("adalomo-bf16", "fused", "after")])
def test_clipping_and_adalomo_in_the_hook_equal_the_same_update_after_backward(raw_runs, pair):
    base, fused, after = pair
    for rank in raw_runs:
        assert torch.equal(rank[f"{base}-{fused}"]["params"], rank[f"{base}-{after}"]["params"])
    assert raw_runs[0]["adalomo-bf16-fused"]["dtypes"] == {torch.bfloat16}


@pytest.mark.parametrize("name", list(CASES))
def test_replicas_identical(raw_runs, name):
    assert torch.equal(raw_runs[0][name]["params"], raw_runs[1][name]["params"])


# ---------------------------------------------------------------------------------------------------------------
# Single process: the update rules against their references
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("nesterov", [False, True])
def test_fused_sgd_unbound_is_bitwise_torch_sgd_and_value_clipping_is_torchs(nesterov):
    models = [small_net(), small_net()]
    kwargs = {"lr": 0.1, "momentum": 0.9, "weight_decay": 1e-2, "nesterov": nesterov}
    ours, theirs = (
        FusedSGD(models[0].parameters(), clip_grad_value=0.01, **kwargs),
        torch.optim.SGD(models[1].parameters(), **kwargs),
    )
    for step in range(4):
        x, y = _batch(0, step)
        for model, opt in zip(models, (ours, theirs)):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            if opt is theirs:
                torch.nn.utils.clip_grad_value_(model.parameters(), 0.01)
            opt.step()
    assert all(torch.equal(p, q) for p, q in zip(*(m.parameters() for m in models)))


def test_norm_clipping_uses_the_previous_steps_global_norm():
    w = nn.Parameter(torch.zeros(2, dtype=torch.float64))
    optimizer = FusedSGD([w], lr=1.0, clip_grad_norm=1.0)
    grads = [torch.tensor([3.0, 4.0]), torch.tensor([0.0, 1.0]), torch.tensor([1.0, 0.0])]
    expected = torch.zeros(2, dtype=torch.float64)
    previous = None
    for g in grads:
        w.grad = g.double()
        optimizer.step()
        coef = 1.0 if previous is None else min(1.0, 1.0 / (previous + 1e-6))
        expected -= coef * g.double()
        previous = float(g.norm())
        torch.testing.assert_close(w.detach(), expected)


def _adalomo_reference(params, grads, state, t, lr, eps1, eps2, threshold, decay, wd):
    """AdaLomo's formulas in float64, straight from the paper's code; a convolution as a matrix of shape[0] rows."""
    beta2 = 1 - t**decay
    for i, (w, g) in enumerate(zip(params, grads)):
        g = g.double()
        if g.dim() >= 2:
            g = g.reshape(g.shape[0], -1)
            u = g * g + eps1
            r, c = state.get(
                i, (torch.zeros(g.shape[0], dtype=torch.float64), torch.zeros(g.shape[1], dtype=torch.float64))
            )
            r = beta2 * r + (1 - beta2) * u.mean(-1)
            c = beta2 * c + (1 - beta2) * u.mean(-2)
            state[i] = (r, c)
            update = (g / torch.sqrt((r / r.mean(-1, keepdim=True)).unsqueeze(-1) * c.unsqueeze(-2))).view_as(w)
        else:
            u = g * g + eps1
            v = state.get(i, torch.zeros_like(g))
            v = beta2 * v + (1 - beta2) * u
            state[i] = v
            update = g / v.sqrt()
        rms = lambda x: math.sqrt(float((x * x).mean()))  # noqa: E731
        update = update / max(1.0, rms(update) / threshold)
        step = lr * max(eps2, rms(w.double()))
        w.copy_(w.double() * (1 - step * wd) - step * update)


def test_adalomo_equals_its_formulas():
    models = [small_net(), small_net()]
    kwargs = {"lr": 1e-2, "eps": (1e-30, 1e-3), "clip_threshold": 1.0, "decay_rate": -0.8, "weight_decay": 0.1}
    optimizer = FusedAdaLomo(models[0].parameters(), **kwargs)
    ref_params, state = list(models[1].parameters()), {}
    for step in range(1, 11):
        x, y = _batch(0, step)
        for model in models:
            model.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
        grads = [p.grad.clone() for p in ref_params]
        optimizer.step()
        with torch.no_grad():
            _adalomo_reference(ref_params, grads, state, step, 1e-2, 1e-30, 1e-3, 1.0, -0.8, 0.1)
        for p, q in zip(models[0].parameters(), ref_params):
            torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6, msg=f"step {step}")
    conv = optimizer.state[models[0][0].weight]  # 8 x 3 x 3 x 3: factored as 8 rows x 27 columns
    assert conv["exp_avg_sq_row"].shape == (8,)
    assert conv["exp_avg_sq_col"].shape == (27,)
    assert not torch.equal(models[0][0].weight, small_net()[0].weight)


@pytest.mark.parametrize(
    ("factory", "kwargs", "name"),
    [
        (FusedSGD, {"lr": -1.0}, "lr"),
        (FusedSGD, {"lr": 0.1, "momentum": 1.0}, "momentum"),
        (FusedSGD, {"lr": 0.1, "clip_grad_norm": 0.0}, "clip_grad_norm"),
        (FusedSGD, {"lr": 0.1, "clip_grad_value": -1.0}, "clip_grad_value"),
        (FusedAdaLomo, {"weight_decay": -0.1}, "weight_decay"),
        (FusedAdaLomo, {"decay_rate": 0.5}, "decay_rate"),
        (FusedAdaLomo, {"clip_threshold": 0.0}, "clip_threshold"),
        (FusedAdaLomo, {"eps": (1e-30,)}, "eps"),
    ],
)
def test_bad_arguments_name_the_argument(factory, kwargs, name):
    with pytest.raises(ValueError, match=f"`{name}"):
        factory([nn.Parameter(torch.ones(2, 2))], **kwargs)


def _trainer(**overrides):
    defaults = {"accumulate_grad_batches": 1, "gradient_clip_val": None, "callbacks": []}
    return SimpleNamespace(**{**defaults, **overrides})


@pytest.mark.parametrize(
    ("optimizers", "trainer", "scaler", "match"),
    [
        ("two", {}, None, "only optimizer"),
        ("partial", {}, None, "every trainable parameter"),
        ("one", {}, object(), "gradient scaler"),
        ("one", {"accumulate_grad_batches": 2}, None, "accumulate_grad_batches"),
        ("one", {"gradient_clip_val": 0.5}, None, "gradient_clip_val"),
        ("sparse", {}, None, r"sparse gradient has none: the embeddings 8 have `sparse=True`"),
    ],
)
def test_incompatible_settings_are_refused_before_training(optimizers, trainer, scaler, match):
    model = small_net()
    if optimizers == "sparse":
        model.append(nn.Embedding(4, 2, sparse=True))
    fused = FusedSGD(model.parameters(), lr=0.1)
    chosen = {
        "two": [fused, torch.optim.SGD(model.parameters(), lr=0.1)],
        "partial": [FusedSGD(list(model.parameters())[:-1], lr=0.1)],
        "one": [fused],
        "sparse": [fused],
    }[optimizers]
    with pytest.raises(MisconfigurationException, match=match):
        bind_fused_optimizer(chosen, _trainer(**trainer), model, scaler)
    if optimizers == "sparse":
        model[-1].sparse = False
    assert bind_fused_optimizer([fused], _trainer(), model, None) is fused
    assert bind_fused_optimizer([torch.optim.SGD(model.parameters(), lr=0.1)], _trainer(), model, None) is None


def test_lightning_gradient_clipping_is_refused_at_setup(tmp_path, in_process_ddp):
    from lightning.pytorch import Trainer

    class Fused(TinyNet):
        def configure_optimizers(self):
            return FusedSGD(self.parameters(), lr=0.1)

    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        strategy=CompressedDDP(),
        max_steps=1,
        logger=False,
        gradient_clip_val=0.5,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
    )
    with pytest.raises(MisconfigurationException, match="gradient_clip_val"):
        trainer.fit(Fused())


# ---------------------------------------------------------------------------------------------------------------
# Lightning, two processes: a scheduled learning rate, torch SGD's weights, exact resume
# ---------------------------------------------------------------------------------------------------------------
# tests/fit_worker.py's ScheduledNet (64 samples, 4 steps per epoch on 2 ranks) under CompressedDDP(Identity), tiny
# buckets: torch's SGD, FusedSGD (every epoch's checkpoint kept, the learning rate logged), and a resume of the latter
RUNS = [
    "identity:sgd-scheduled",
    "identity:fused-scheduled-logged",
    "identity:fused-scheduled+identity:fused-scheduled-logged@epoch=1",
]


@pytest.mark.slow
def test_lightning_fused_sgd_equals_torch_sgd_and_resumes_exactly(tmp_path):
    code, output, runs = run_fits(tmp_path, 2, RUNS)
    assert code == 0, output[-3000:]
    torch_sgd, fused, resumed = (runs[run] for run in RUNS)
    for rank in range(2):
        assert torch.equal(fused[rank]["params"], torch_sgd[rank]["params"]), f"rank {rank}"
    assert torch.equal(fused[0]["params"], fused[1]["params"])
    with open(tmp_path / run_name(RUNS[1]) / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    lrs = [float(r["lr-FusedSGD"]) for r in rows if r.get("lr-FusedSGD")]
    assert lrs == [0.05 * 0.5 ** (step // 3) for step in range(16)], "the monitor sees the scheduled rate"

    for rank in range(2):
        assert torch.equal(resumed[rank]["params"], fused[rank]["params"]), f"rank {rank}"
    path = tmp_path / run_name(RUNS[1]) / "epoch=1.ckpt"  # written by the run above after 2 of its 4 epochs
    saved = torch.load(checkpoint_file(path), weights_only=False)["optimizer_states"][0]
    assert saved["fused"]["step"] == 8
    assert all("momentum_buffer" in s for s in saved["state"].values())
