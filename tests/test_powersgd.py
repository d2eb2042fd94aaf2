"""PowerSGD against torch's own powerSGD_hook, and across DDP bucket layouts (two gloo processes)."""

import copy
import math

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from lightning_gradcomp import CompressionState, compression_hook
from lightning_gradcomp.compressors import PowerSGD
from lightning_gradcomp.compressors.base import BucketContext, Layer, layers_from_shapes
from lightning_gradcomp.compressors.ops.powersgd_plan import Workspace, plan_runs
from lightning_gradcomp.testing import simulate_reduce
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
    ).double()


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


# odd sizes: a matrix's factors and its place in a batch are not 64-byte aligned unless padded
ODD_SHAPES = [(17, 31), (64, 27), (17, 31), (300, 40), (17, 31), (5, 7, 3)]


def _at_offsets(shapes, lead):
    """``shapes`` laid out back to back after ``lead`` elements of another layer (which is then dropped)."""
    return layers_from_shapes([(lead,), *shapes])[1:] if lead else layers_from_shapes(shapes)


@pytest.mark.parametrize("r", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_layer_s_result_is_the_same_alone_or_batched_anywhere_in_a_bucket(r, dtype):
    """Every layer compressed alone, in a bucket of all (same shapes batched) and at odd offsets: the same ``P Q^T``
    bit for bit. DDP's bucket layout changes after the first step and
    after a resume; a resumed run is bitwise an uninterrupted one only if this holds."""
    g = torch.Generator().manual_seed(3)
    grads = [torch.randn(math.prod(shape), generator=g, dtype=dtype) for shape in ODD_SHAPES]

    def run(layers, batch_same_shape=None):
        compressor = PowerSGD(rank=r, min_compression_rate=0.0, batch_same_shape=batch_same_shape)
        flat = torch.cat([torch.zeros(layers[0].offset, dtype=dtype), *(grads[layer.index] for layer in layers)])
        ctx = BucketContext(index=0, step=1, rank=0, world_size=1, layers=tuple(layers), dtype=dtype, seed=5)
        payload = compressor.compress(flat[layers[0].offset :], _shifted(ctx))
        out = torch.full_like(flat, float("nan"))
        compressor.decompress(payload, _shifted(ctx), out=out[layers[0].offset :])
        return [layer.matrix(out).clone() for layer in layers]

    alone = []
    for i, shape in enumerate(ODD_SHAPES):
        (layer,) = layers_from_shapes([shape], names=[f"param{i}"])
        alone.append(run([Layer(layer.name, i, layer.shape, 0)], batch_same_shape=False)[0])
    for lead in (0, 1, 5):
        layers = [
            Layer(f"param{i}", i, layer.shape, layer.offset) for i, layer in enumerate(_at_offsets(ODD_SHAPES, lead))
        ]
        for a, b in zip(alone, run(layers)):
            assert torch.equal(a, b), (r, dtype, lead)
    assert all(approx.isfinite().all() for approx in alone)


def _shifted(ctx):
    """``ctx`` with its layers' offsets counted from the first layer's (the compressor's flat tensor starts there)."""
    start = ctx.layers[0].offset
    layers = tuple(Layer(layer.name, layer.index, layer.shape, layer.offset - start) for layer in ctx.layers)
    return BucketContext(
        index=ctx.index,
        step=ctx.step,
        rank=ctx.rank,
        world_size=ctx.world_size,
        layers=layers,
        dtype=ctx.dtype,
        seed=ctx.seed,
    )


@pytest.mark.parametrize("r", [1, 2, 3])
def test_reconstruction_is_p_q_transposed(r):
    """``P Q^T`` written into a flat bucket is the product of the payload's factors to within rounding."""
    shapes = [(17, 31), (17, 31), (64, 27), (300, 40)]
    layers = layers_from_shapes(shapes)
    runs = plan_runs(layers, [r] * len(layers), True, 8)
    workspace = Workspace.build(runs, torch.float64, torch.device("cpu"), memory=False)
    g = torch.Generator().manual_seed(3)
    pt = {layer.name: torch.randn(r, layer.shape[0], generator=g, dtype=torch.float64) for layer in layers}
    qt = {layer.name: torch.randn(r, layer.shape[1], generator=g, dtype=torch.float64) for layer in layers}
    order = [layer for run in runs for layer in run.layers]  # the payload's order: run after run
    out = torch.full((sum(a * b for a, b in shapes),), float("nan"), dtype=torch.float64)
    workspace.reconstruct_from(
        torch.cat([pt[layer.name].reshape(-1) for layer in order]),
        torch.cat([qt[layer.name].reshape(-1) for layer in order]),
        out,
    )
    for layer in layers:
        exact = pt[layer.name].t() @ qt[layer.name]
        bound = (pt[layer.name].abs().t() @ qt[layer.name].abs()) * (r * torch.finfo(torch.float64).eps)
        assert ((layer.matrix(out) - exact).abs() <= bound).all()


def _operators(layers, r=2):
    """Top-level torch operators of one PowerSGD reduction of ``layers`` (2 simulated ranks, after a warm-up step)."""
    from torch.profiler import profile

    numel = sum(layer.numel for layer in layers)
    compressors = [PowerSGD(rank=r) for _ in range(2)]
    grads = [torch.randn(numel, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    residuals = [torch.zeros(numel) for _ in range(2)]
    simulate_reduce(compressors, [g.clone() for g in grads], layers, step=0, residuals=residuals)
    with profile() as prof:
        simulate_reduce(compressors, [g.clone() for g in grads], layers, step=1, residuals=residuals)
    return sum(1 for e in prof.events() if e.cpu_parent is None and e.name.startswith("aten::"))


@pytest.mark.parametrize("r", [1, 2, 4])
def test_the_operators_per_bucket_do_not_grow_with_layers_of_one_shape(r):
    """A bucket of eight same-shaped layers issues as many operators as a bucket of one (one run of each shape); two
    shapes alternating are two runs, at a fixed number of operators more."""
    one = _operators(layers_from_shapes([(32, 72)]), r)
    assert _operators(layers_from_shapes([(32, 72)] * 8), r) == one
    two = _operators(layers_from_shapes([(32, 72), (16, 40)]), r)
    assert two > one
    assert _operators(layers_from_shapes([(32, 72), (16, 40)] * 4), r) == two  # equally spaced: still two runs


def test_a_saved_query_that_is_not_a_matrix_is_a_clear_error():
    with pytest.raises(ValueError, match="queries must be m x r matrices"):
        PowerSGD(rank=2).load_state_dict({"queries": {"param0": torch.zeros(3)}})
