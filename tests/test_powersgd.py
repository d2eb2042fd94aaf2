"""PowerSGD against torch's own powerSGD_hook, and across DDP bucket layouts (two gloo processes)."""

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from lightning_gradcomp import CompressionState, compression_hook
from lightning_gradcomp.compressors import PowerSGD
from lightning_gradcomp.compressors.base import layers_from_shapes
from lightning_gradcomp.compressors.powersgd import _reconstruct_into
from tests.distributed import run_distributed

CASES = [(1, True), (2, True), (2, False), (4, True)]  # (rank, warm_start); rank 4 takes the QR path
SEED = 17
STEPS = 6
DENSE_STEPS = 2  # torch requires start_powerSGD_iter >= 2 with error feedback or warm start


def mlp() -> nn.Module:
    torch.manual_seed(0)
    # two same-shaped layers exercise torch's shape grouping; < 1 MB, so DDP keeps one bucket after its rebuild
    return nn.Sequential(
        nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)
    ).double()  # fmt: skip


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(16, 32, generator=g, dtype=torch.float64) * (1 + rank), torch.randint(0, 10, (16,), generator=g)


def _step(ddp: DDP, optimizer: torch.optim.Optimizer, rank: int, step: int) -> list[torch.Tensor]:
    optimizer.zero_grad()
    x, y = _batch(rank, step)
    nn.functional.cross_entropy(ddp(x), y).backward()
    grads = [p.grad.detach().clone() for p in ddp.module.parameters()]
    optimizer.step()
    return grads


def _torch_parity(rank: int, world_size: int) -> dict:
    results = {}
    for r, warm in CASES:
        ours_model, torch_model = mlp(), mlp()
        ours = DDP(ours_model)
        state = CompressionState(
            # torch's hook normalises with epsilon 0; ours defaults to the paper's 1e-8
            PowerSGD(rank=r, warm_start=warm, init="torch", orthogonalization_epsilon=0.0),
            min_compress_numel=0,
            error_feedback=True,
            seed=SEED,
        )
        state.attach(ours)
        ours.register_comm_hook(state, compression_hook)
        theirs = DDP(torch_model)
        theirs.register_comm_hook(
            PowerSGDState(
                process_group=None,
                matrix_approximation_rank=r,
                start_powerSGD_iter=DENSE_STEPS,
                min_compression_rate=2,
                use_error_feedback=True,
                warm_start=warm,
                random_seed=SEED,
            ),
            powerSGD_hook,
        )
        opt_ours = torch.optim.SGD(ours_model.parameters(), lr=0.1, momentum=0.9)
        opt_theirs = torch.optim.SGD(torch_model.parameters(), lr=0.1, momentum=0.9)
        diffs, ratios = [], []
        for step in range(STEPS):
            state.enabled = step >= DENSE_STEPS
            g_ours = _step(ours, opt_ours, rank, step)
            g_theirs = _step(theirs, opt_theirs, rank, step)
            diffs.append(max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(g_ours, g_theirs)))
            ratios.append(state.telemetry.pop_step().compression_ratio)
        results[(r, warm)] = {"diffs": diffs, "ratios": ratios}
    return results


@pytest.fixture(scope="module")
def parity():
    return run_distributed(_torch_parity)


@pytest.mark.parametrize(("r", "warm"), CASES, ids=[f"rank{r}-{'warm' if w else 'cold'}" for r, w in CASES])
def test_powersgd_agrees_with_torch_powersgd_hook(parity, r, warm):
    """Same rank, seed and warm-start setting: every step's averaged gradient agrees to float64 tolerance."""
    for rank_result in parity:
        result = rank_result[(r, warm)]
        assert all(ratio == 1.0 for ratio in result["ratios"][:DENSE_STEPS])
        assert all(ratio > 2.0 for ratio in result["ratios"][DENSE_STEPS:]), "PowerSGD must actually compress"
        assert max(result["diffs"]) < 1e-10, result["diffs"]


def _layout_invariance(rank: int, world_size: int) -> dict:
    out = {}
    for name, cap in (("many", 0.002), ("one", 500.0)):
        model = copy.deepcopy(mlp()).float()
        ddp = DDP(model, bucket_cap_mb=cap)
        state = CompressionState(PowerSGD(rank=2), min_compress_numel=0)
        state.attach(ddp)
        ddp.register_comm_hook(state, compression_hook)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        buckets = 0
        for step in range(STEPS):
            optimizer.zero_grad()
            x, y = _batch(rank, step)
            nn.functional.cross_entropy(ddp(x.float()), y).backward()
            optimizer.step()
            buckets = max(buckets, state.telemetry.pop_step().buckets)
        flat = torch.cat([p.detach().flatten() for p in model.parameters()])
        everyone = [torch.empty_like(flat) for _ in range(world_size)]
        dist.all_gather(everyone, flat)
        out[name] = {"flat": flat, "buckets": buckets, "identical": all(torch.equal(everyone[0], e) for e in everyone)}
    return out


@pytest.mark.slow
def test_powersgd_over_many_buckets_equals_one_bucket():
    """Many buckets (two ordered rounds per bucket on gloo) give bitwise the result of one bucket.

    torch's powerSGD_hook issues its second round from future callbacks on the same process group, in an order that
    differs between ranks, and aborts under gloo on multi-bucket models; ours issues every round in bucket order.
    """
    runs = run_distributed(_layout_invariance)
    for run in runs:
        assert run["many"]["buckets"] >= 4
        assert run["one"]["buckets"] == 1
        assert run["many"]["identical"]
        assert run["one"]["identical"]
        assert torch.equal(run["many"]["flat"], run["one"]["flat"])


def _zero_init_residual(rank: int, world_size: int) -> dict:
    """torchvision's ResNet-18 with zero_init_residual=True: 16 residual-branch convolutions have exactly zero
    gradients at the first step. Our default epsilon, and torch's epsilon 0 as the control."""
    import torchvision

    finite = {}
    for epsilon in (1e-8, 0.0):
        torch.manual_seed(0)
        model = torchvision.models.resnet18(num_classes=10, zero_init_residual=True)
        ddp = DDP(model)
        state = CompressionState(PowerSGD(rank=2, orthogonalization_epsilon=epsilon))
        state.attach(ddp)
        ddp.register_comm_hook(state, compression_hook)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        steps = []
        for step in range(3):
            g = torch.Generator().manual_seed(10 * rank + step)
            x, y = torch.randn(4, 3, 32, 32, generator=g), torch.randint(0, 10, (4,), generator=g)
            optimizer.zero_grad()
            nn.functional.cross_entropy(ddp(x), y).backward()
            steps.append(all(bool(torch.isfinite(p.grad).all()) for p in model.parameters()))
            optimizer.step()
        finite[epsilon] = steps
    return finite


@pytest.mark.slow
def test_powersgd_survives_exactly_zero_gradients():
    for result in run_distributed(_zero_init_residual):
        assert result[1e-8] == [True, True, True]
        # the control: torch's epsilon 0 turns the zero columns into 0 / 0 at the first step
        assert result[0.0][0] is False


@pytest.mark.parametrize("r", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_reconstruction_is_p_q_transposed_wherever_the_layers_sit(r, dtype):
    """``P Q^T`` into a flat bucket: the product to within rounding, and the same bits at any offset in the bucket.

    On the CPU in fp32 at ranks 1 and 2 it is computed as elementwise outer products, elsewhere by one batched
    product; either way DDP's bucket layout (where a layer starts) must not change a bit.
    """
    shapes = [(17, 31), (17, 31), (64, 27), (300, 40)]
    results = []
    for pad in (0, 1, 5):
        layers = layers_from_shapes([(pad,), *shapes])[1:] if pad else layers_from_shapes(shapes)
        g = torch.Generator().manual_seed(3)
        out = torch.full((pad + sum(a * b for a, b in shapes),), float("nan"), dtype=dtype)
        got = []
        for same_shape in ([layers[0], layers[1]], [layers[2]], [layers[3]]):
            n, m = same_shape[0].shape
            pt = torch.randn(len(same_shape), r, n, generator=g, dtype=dtype)
            qt = torch.randn(len(same_shape), r, m, generator=g, dtype=dtype)
            _reconstruct_into(same_shape, pt, qt, out)
            for i, layer in enumerate(same_shape):
                got.append(layer.matrix(out).clone())
                exact = pt[i].double().t() @ qt[i].double()
                bound = (pt[i].double().abs().t() @ qt[i].double().abs()) * (r * torch.finfo(dtype).eps)
                assert ((got[-1].double() - exact).abs() <= bound).all()
        results.append(got)
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))
