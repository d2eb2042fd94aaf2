"""DGC against a step-by-step reference of the authors' code: momentum correction, clipping, masking, selection."""

import contextlib
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_gradcomp.compressors import DGC, TopK
from lightning_gradcomp.compressors.base import BucketContext, Layer, layers_from_shapes
from lightning_gradcomp.compressors.dgc import sample_plan
from lightning_gradcomp.compressors.ops.dgc_select import layer_streams, sample_positions, select_layers
from lightning_gradcomp.ddp.checks import optimizer_momentum_warning
from lightning_gradcomp.ddp.hook import CompressionState
from lightning_gradcomp.engine.telemetry import Telemetry
from lightning_gradcomp.optim import DGCSGD
from lightning_gradcomp.testing import SimulatedHook, simulate_reduce

FLAG = 8  # the non-finite flag rides on the all-gather: one 8-byte aligned word

# two sparsified matrices, a bias and a small matrix (dense: below min_compress_numel)
LAYERS = layers_from_shapes([(64, 80), (16,), (200, 30), (4, 4)], names=["a.weight", "a.bias", "b.weight", "c.weight"])
NUMEL = sum(layer.numel for layer in LAYERS)
MIN_NUMEL = 64


def _dgc(**kwargs):
    return DGC(**kwargs)


def _hook(compressors):
    """The real hook on simulated ranks: small layers go dense and get DGC's momentum there (finish_dense)."""
    states = [CompressionState(c, min_compress_numel=MIN_NUMEL) for c in compressors]
    return SimulatedHook(states, LAYERS)


def _grads(n, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(NUMEL, generator=g, dtype=torch.float64) * (1 + r) for r in range(n)]


def test_sample_plan_follows_the_reference_code():
    # 100000 elements at 0.1%: at least max(1% = 1000, 2 / 0.001 = 2000) samples; stride 65 -> 57 -> 49
    assert sample_plan(100_000, 0.001, 0.01) == (2040, 3, 49)
    assert sample_plan(1500, 0.001, 0.01) == (1500, 2, 1)  # at most 2 / ratio elements: no sampling
    assert sample_plan(5000, 0.01, 1.0) == (5000, 50, 1)


def _stream(seed):
    """A layer's sample stream, as the hook derives it (layer_streams)."""
    ctx = BucketContext(index=0, step=seed, rank=0, world_size=1, layers=LAYERS[:1], dtype=torch.float64)
    return layer_streams(ctx)[0]


def test_selection_with_a_clear_top_k_is_exact():
    """100 outliers: a sample (this one) whose threshold admits them and few others selects exactly them.

    (A sample whose threshold admits between k and 1.3 k candidates keeps the first k in index order, outliers or
    not: the reference's rule, exercised by test_candidates_near_k_are_kept_as_they_are.)
    """
    x = torch.rand(100_000, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    top = torch.randperm(100_000, generator=torch.Generator().manual_seed(1))[:100]
    x[top] += 10
    picked = DGC().select(x, 0.001, _stream(3))
    assert sorted(picked.tolist()) == sorted(top.tolist())


def _sampled_positions(numel, ratio, stream):
    return sample_positions(numel, ratio, 0.01, True, stream)


def test_too_many_candidates_fall_back_to_exact_top_k_among_them():
    """The sample sits low: its threshold admits far more than 1.3 k candidates; exact top-k among them."""
    generator = _stream(4)
    x = 0.5 + 0.5 * torch.rand(100_000, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    sampled = _sampled_positions(100_000, 0.001, generator)
    x[sampled] = 0.1 * torch.rand(sampled.numel(), generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    x[sampled[:3]] = 0.6
    picked = DGC().select(x, 0.001, generator)
    assert sorted(picked.tolist()) == sorted(torch.topk(x, 100).indices.tolist())


def test_candidates_near_k_are_kept_as_they_are():
    """Between 0.8 k and 1.3 k candidates: every element at or above the sampled threshold, at most k of them."""
    x = torch.rand(100_000, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    generator = _stream(8)
    sampled = _sampled_positions(100_000, 0.001, generator)
    threshold = torch.topk(x[sampled], 3).values.min()
    candidates = torch.nonzero(x >= threshold).squeeze(1)
    assert 80 <= candidates.numel() <= 130, "the data must exercise this path"
    assert DGC().select(x, 0.001, generator).tolist() == candidates[:100].tolist()


def test_too_few_candidates_lower_the_threshold():
    """The sample holds 3 large values the rest of the layer lacks: the threshold drops by 0.8 until enough pass."""
    numel, ratio = 100_000, 0.001
    generator = _stream(5)
    sampled = _sampled_positions(numel, ratio, generator)
    x = torch.full((numel,), 0.5, dtype=torch.float64)
    x[sampled[:3]] = 2.0
    x[7] = 0.6
    picked = DGC().select(x, ratio, generator).tolist()
    assert len(picked) == 100
    assert set(sampled[:3].tolist()) | {7} <= set(picked)


@pytest.mark.parametrize("case", ["clear", "too many", "near k", "too few", "gaussian", "unsampled", "uniform sample"])
def test_the_bucket_selection_selects_what_the_loop_does(case):
    """``select_layers`` (every layer at once, no host reads) against the reference loop, on each of its paths."""
    numel, ratio, kwargs = 100_000, 0.001, {}
    g = torch.Generator().manual_seed(3)
    x = torch.rand(numel, generator=g, dtype=torch.float64)
    stream = _stream(4)
    sampled = _sampled_positions(numel, ratio, stream)
    if case == "clear":
        x[torch.randperm(numel, generator=g)[:100]] += 10
    elif case == "too many":
        x = 0.5 + 0.5 * x
        x[sampled] = 0.1 * torch.rand(sampled.numel(), generator=g, dtype=torch.float64)
        x[sampled[:3]] = 0.6
    elif case == "too few":
        x = torch.full((numel,), 0.5, dtype=torch.float64)
        x[sampled[:3]] = 2.0
        x[7] = 0.6
    elif case == "gaussian":
        x, ratio = torch.randn(numel, generator=g), 0.01
    elif case == "unsampled":
        x, ratio = torch.randn(1500, generator=g), 0.001
    elif case == "uniform sample":
        x, kwargs = torch.randn(numel, generator=g), {"strided_sample": False}
    compressor = DGC(ratio=ratio, **kwargs)
    expected = compressor.select(x, ratio, stream)
    if case == "too few":  # the exact top-k among tied magnitudes (0.5): the lowest indices, where topk's are its own
        k = math.ceil(numel * ratio)
        assert set(torch.topk(x, 4).indices.tolist()) <= set(expected.tolist())
        expected = torch.sort(x.abs(), descending=True, stable=True).indices[:k]
    layer = Layer("w", 0, torch.Size((x.numel(),)))
    found, used = select_layers(x, [layer], [ratio], stream.view(1), compressor.sample_ratio, compressor.strided_sample)
    assert sorted(expected.tolist()) == found[used].tolist()
    assert found.numel() == math.ceil(x.numel() * ratio)
    assert torch.all(found[~used] == found[0])


@pytest.mark.parametrize("kwargs", [{}, {"strided_sample": False}, {"sample_ratio": 1.0}])
@pytest.mark.parametrize("ratio", [0.001, 0.01, 0.05])
def test_every_layer_of_a_bucket_is_selected_as_the_loop_selects_it(kwargs, ratio):
    """A bucket at once (layers of every size, sampled or not) equals the reference loop layer by layer."""
    layers = layers_from_shapes([(64, 80), (16,), (200, 30), (4, 4), (300, 400)])
    x = torch.randn(sum(layer.numel for layer in layers), generator=torch.Generator().manual_seed(0))
    ctx = BucketContext(index=0, step=3, rank=1, world_size=2, layers=layers, dtype=x.dtype)
    compressor, streams = DGC(ratio=ratio, **kwargs), layer_streams(ctx)
    found, used = select_layers(
        x, layers, [ratio] * len(layers), streams, compressor.sample_ratio, compressor.strided_sample
    )
    at = 0
    for i, layer in enumerate(layers):
        k = math.ceil(layer.numel * ratio)
        expected = compressor.select(layer.flat(x), ratio, streams[i])
        assert found[at : at + k][used[at : at + k]].sub(layer.offset).tolist() == sorted(expected.tolist())
        assert torch.all(found[at : at + k][~used[at : at + k]] == found[at])
        at += k


def _tensors(state):
    if isinstance(state, torch.Tensor):
        yield state
    elif isinstance(state, dict):
        for key in sorted(state):
            yield from _tensors(state[key])
    elif isinstance(state, list | tuple):
        for item in state:
            yield from _tensors(item)


def _reference(grads_per_step, momentum=0.9, nesterov=False, masking=True, clip_norm=None, ratio=0.01):
    """Every rank's DGC by hand (selection through DGC.select, with the generators the compressor uses)."""
    n = len(grads_per_step[0])
    sparse = [layer for layer in LAYERS if layer.ndim >= 2 and layer.numel >= MIN_NUMEL]
    dense = [layer for layer in LAYERS if layer not in sparse]
    u = [{layer.name: torch.zeros(layer.numel, dtype=torch.float64) for layer in LAYERS} for _ in range(n)]
    v = [{layer.name: torch.zeros(layer.numel, dtype=torch.float64) for layer in sparse} for _ in range(n)]
    selector = DGC(ratio=ratio)
    results = []
    for step, grads in enumerate(grads_per_step):
        out = torch.zeros(NUMEL, dtype=torch.float64)
        for rank, g_all in enumerate(grads):
            ctx = BucketContext(index=0, step=step, rank=rank, world_size=n, layers=LAYERS, dtype=torch.float64)
            for layer in sparse:
                g = layer.flat(g_all).clone()
                if clip_norm is not None:
                    g *= min(1.0, (clip_norm / math.sqrt(n)) / (g.norm().item() + 1e-6))
                m, acc = u[rank][layer.name], v[rank][layer.name]
                if nesterov:
                    m.add_(g).mul_(momentum)
                    acc.add_(m).add_(g)
                else:
                    m.mul_(momentum).add_(g)
                    acc.add_(m)
                idx = selector.select(acc, ratio, layer_streams(ctx)[ctx.layers.index(layer)])
                layer.flat(out).index_add_(0, idx, acc[idx])
                acc[idx] = 0
                if masking:
                    m[idx] = 0
        for layer in sparse:
            layer.flat(out).div_(n)
        for layer in dense:  # averaged, then momentum on the average (every rank alike)
            avg = sum(layer.flat(g) / n for g in grads)
            if clip_norm is not None:
                avg = avg * min(1.0, clip_norm / (avg.norm().item() + 1e-6))
            m = u[0][layer.name]
            if nesterov:
                m.add_(avg).mul_(momentum)
                avg = avg + m
            else:
                m.mul_(momentum).add_(avg)
                avg = m.clone()
            layer.flat(out).copy_(avg)
        results.append(out)
    return results, v


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"nesterov": True}, {"momentum_masking": False}, {"clip_norm": 1.0}, {"momentum": 0.5, "ratio": 0.05}],
    ids=["plain", "nesterov", "no-masking", "clipped", "bitmap"],
)
def test_dgc_equals_the_reference_over_steps(kwargs):
    ratio = kwargs.pop("ratio", 0.01)
    momentum = kwargs.get("momentum", 0.9)
    steps = [_grads(3, seed=s) for s in range(4)]
    hook = _hook([_dgc(ratio=ratio, **kwargs) for _ in range(3)])
    expected, velocities = _reference(
        steps,
        momentum=momentum,
        nesterov=kwargs.get("nesterov", False),
        masking=kwargs.get("momentum_masking", True),
        clip_norm=kwargs.get("clip_norm"),
        ratio=ratio,
    )
    for step, grads in enumerate(steps):
        outs = hook.step(grads)
        for out in outs:
            torch.testing.assert_close(out, expected[step], rtol=1e-13, atol=1e-13)
    for rank in range(3):  # v is the error-feedback residual; the dense layers owe nothing
        for layer in LAYERS:
            want = velocities[rank].get(layer.name, torch.zeros(layer.numel, dtype=torch.float64))
            got = hook.residual(rank, layer.name)
            got = torch.zeros(layer.numel, dtype=torch.float64) if got is None else got.reshape(-1)
            torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-13)


def test_sent_plus_velocity_is_the_accumulated_momentum():
    """sum_t sent_t + v_T == sum_t u_t per rank: accumulation delays, never loses (without masking, u is plain
    momentum SGD's buffer, so DGC applies momentum SGD's updates, delayed)."""
    compressor = _dgc(ratio=0.01, momentum_masking=False)
    layer = LAYERS[0]
    alone = (Layer(layer.name, layer.index, layer.shape, 0),)
    residual = torch.zeros(layer.numel, dtype=torch.float64)
    sent = torch.zeros(layer.numel, dtype=torch.float64)
    u = torch.zeros(layer.numel, dtype=torch.float64)
    momentum_sum = torch.zeros(layer.numel, dtype=torch.float64)
    for step in range(6):
        g = torch.randn(layer.numel, generator=torch.Generator().manual_seed(step), dtype=torch.float64)
        sent += simulate_reduce([compressor], [g], alone, step=step, residuals=[residual])[0]
        u = 0.9 * u + g
        momentum_sum += u
    torch.testing.assert_close(sent + residual, momentum_sum, rtol=1e-12, atol=1e-12)


def test_warmup_schedule_by_step():
    compressor = _dgc(ratio=0.001, warmup_steps=2)
    layer = LAYERS[2]  # 6000 elements
    assert [compressor.ratio_at(layer, s) for s in range(10)] == [
        0.25,
        0.25,
        0.0625,
        0.0625,
        0.015625,
        0.015625,
        0.004,
        0.004,
        0.001,
        0.001,
    ]
    compressor.set_levels({layer.name: 0.1})  # a per-layer level above a warm-up stage wins
    assert compressor.ratio_at(layer, 4) == 0.1


def test_warmup_bytes_per_step():
    """Step 0 sends 25% (as a bitmap: smaller than int32 indices), later steps fewer; counted as sent."""
    layer = Layer("b.weight", 2, torch.Size([200, 30]), 0)
    compressor = DGC(ratio=0.001, warmup_steps=1)
    sent = []
    for step in range(6):
        telemetry = [Telemetry()]
        telemetry[0].add_bucket(6000 * 4)
        g = torch.randn(6000, generator=torch.Generator().manual_seed(step))
        simulate_reduce([compressor], [g], (layer,), step=step, residuals=[torch.zeros(6000)], telemetry=telemetry)
        sent.append(telemetry[0].pop_step().bytes_payload)  # one rank: handed to the all-gather, nothing moves
    k = [math.ceil(6000 * r) for r in (0.25, 0.0625, 0.015625, 0.004, 0.001, 0.001)]
    indices = [188 * 4 if 4 * k_ > 188 * 4 else 4 * k_ for k_ in k]  # a bitmap is 188 int32 words of 32 bits
    assert sent == [-(-i // 8) * 8 + -(-4 * k_ // 8) * 8 + FLAG for i, k_ in zip(indices, k)]
    assert sent[0] < 6000 * 4 * 0.25 * 2  # the bitmap beat int32 indices


def test_99_9_percent_sparsity_is_about_500x_on_a_large_layer():
    layer = Layer("w", 0, torch.Size([512, 1024]), 0)
    telemetry = [Telemetry()]
    telemetry[0].add_bucket(layer.numel * 4)
    g = torch.randn(layer.numel, generator=torch.Generator().manual_seed(0))
    simulate_reduce([DGC()], [g], (layer,), residuals=[torch.zeros(layer.numel)], telemetry=telemetry)
    # k = ceil(0.001 d) = 525 fp32 values and int32 indices, each padded to 8 bytes in the all-gather, and the flag
    stats = telemetry[0].pop_step()  # one rank: the payload against the dense bytes, as two ranks would move them
    assert stats.bytes_dense / stats.bytes_payload == layer.numel * 4 / (2 * 2104 + FLAG)


def test_optimizer_momentum_is_flagged():
    model = torch.nn.Linear(3, 3)
    with_momentum = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    without = torch.optim.SGD(model.parameters(), lr=0.1)
    assert "momentum=0.9" in optimizer_momentum_warning(DGC(), [with_momentum])
    assert optimizer_momentum_warning(DGC(), [without]) is None
    # the reference optimizer's momentum applies to the weight decay alone
    assert optimizer_momentum_warning(DGC(), [DGCSGD(model.parameters(), lr=0.1, momentum=0.9)]) is None
    assert optimizer_momentum_warning(TopK(), [with_momentum]) is None


def test_state_is_keyed_by_layer_name():
    compressors = [_dgc(ratio=0.01) for _ in range(2)]
    _hook(compressors).step(_grads(2, seed=0))
    state = compressors[0].state_dict()
    assert set(state["momentum"]) == {layer.name for layer in LAYERS}


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"ratio": 0}, "ratio"),
        ({"momentum": 1.0}, "momentum"),
        ({"momentum": 0.0, "nesterov": True}, "momentum"),
        ({"sample_ratio": 0}, "sample_ratio"),
        ({"clip_norm": -1}, "clip_norm"),
        ({"warmup_steps": -1}, "warmup_steps"),
        ({"warmup_ratios": (0.5, 2.0)}, "warmup_ratios"),
        ({"warmup_ratios": ()}, "warmup_ratios"),
        ({"strided_sample": "yes"}, "strided_sample"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=f"`{match}`"):
        DGC(**kwargs)


def test_a_nonfinite_step_is_forgotten_by_the_hook_dense_layers_included():
    """Through the hook on simulated ranks: rank 1 all NaN at step 2. Every later step is the same on both ranks and
    equal to a run that never saw step 2 (the dense layers' momentum is staged and rolled back too).

    Regression: the dense layers' verdict was once recorded into the *next* step when the collective completed after
    the hook had moved on, so a rank skipped a clean step's commit and the ranks diverged.
    """
    hook = _hook([_dgc(ratio=0.05) for _ in range(2)])
    twin = _hook([_dgc(ratio=0.05) for _ in range(2)])
    for step in range(5):
        grads = _grads(2, seed=50 + step)
        if step == 2:
            outs = hook.step([grads[0], grads[1] * float("nan")])
            assert not any(torch.isfinite(out).all() for out in outs)
            for state in twin.states:
                state.step += 1  # the twin skips the step but keeps the same step count
            continue
        outs, expected = hook.step(grads), twin.step(grads)
        assert torch.equal(outs[0], outs[1])
        torch.testing.assert_close(outs[0], expected[0], rtol=0, atol=0)


class _Operators(TorchDispatchMode):
    """Counts the torch operators dispatched (each one a kernel launch or more on a GPU)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"ratio": 0.01},
        {"ratio": 0.05, "strided_sample": False, "momentum_masking": False},
        {"ratio": 0.01, "warmup_steps": 1, "nesterov": True, "clip_norm": 0.5},
        {"ratio": 0.1, "transport": "two_phase"},
    ],
)
def test_operators_per_bucket_do_not_grow_with_the_layers(kwargs, monkeypatch):
    """A bucket of twice the layers costs the same number of operators: no loop over the layers on the hook path
    (the CPU's layer-by-layer selection off, as on every other device)."""
    from lightning_gradcomp.compressors import dgc

    monkeypatch.setattr(dgc, "LOOP_ON_CPU", False)
    counts = []
    for repeats in (3, 6):
        layers = layers_from_shapes([(32, 100), (50, 60)] * repeats)
        numel = sum(layer.numel for layer in layers)
        compressors = [DGC(**kwargs) for _ in range(2)]
        residuals = [torch.zeros(numel) for _ in range(2)]
        for step in range(5):  # the last step is counted: layouts (and the warm-up's) are built before
            grads = [torch.randn(numel, generator=torch.Generator().manual_seed(10 * step + r)) for r in range(2)]
            mode = _Operators()
            with mode if step == 4 else contextlib.nullcontext():
                simulate_reduce(compressors, grads, layers, step=step, residuals=residuals)
        counts.append(mode.count)
    assert counts[0] == counts[1] > 0


@pytest.mark.parametrize(
    "kwargs",
    [
        {"ratio": 0.01},
        {"ratio": 0.05, "strided_sample": False, "momentum_masking": False},
        {"ratio": 0.01, "warmup_steps": 1, "nesterov": True, "clip_norm": 0.5},
    ],
)
def test_both_selections_give_the_same_steps(kwargs, monkeypatch):
    """The reduction with the bucket's selection (every device's) is bitwise the one with the CPU's loop."""
    from lightning_gradcomp.compressors import dgc

    results = []
    for loop in (True, False):
        monkeypatch.setattr(dgc, "LOOP_ON_CPU", loop)
        compressors = [DGC(**kwargs) for _ in range(2)]
        residuals = [torch.zeros(NUMEL, dtype=torch.float64) for _ in range(2)]
        outs = [
            simulate_reduce(compressors, _grads(2, step), LAYERS, step=step, residuals=residuals) for step in range(3)
        ]
        results.append((outs, residuals, [c.state_dict() for c in compressors]))
    (outs_a, res_a, state_a), (outs_b, res_b, state_b) = results
    for a, b in zip(outs_a, outs_b):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert all(torch.equal(x, y) for x, y in zip(res_a, res_b))
    tensors_a, tensors_b = list(_tensors(state_a)), list(_tensors(state_b))
    assert len(tensors_a) == len(tensors_b) > 0  # the momenta
    assert all(torch.equal(u, v) for u, v in zip(tensors_a, tensors_b))
