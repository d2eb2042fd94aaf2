"""The compressor contract, checked for every compressor (single process, simulated ranks)."""

import copy
import os
import pickle
import re

import pytest
import torch

from lightning_gradcomp import CompressionState
from lightning_gradcomp.compressors import (
    DGC,
    QSGD,
    Compressor,
    Identity,
    MaskedCompressor,
    PowerSGD,
    RandomK,
    SignSGD,
    TernGrad,
    TopK,
)
from lightning_gradcomp.compressors.base import BucketContext, Layer, layers_from_shapes
from lightning_gradcomp.compressors.transports.two_phase import owner_residuals
from lightning_gradcomp.engine.comm import Comm
from lightning_gradcomp.engine.requests import StepUpdates
from lightning_gradcomp.engine.telemetry import Telemetry
from lightning_gradcomp.testing import EXAMPLES, SimulatedWorld, exported_compressor_classes, simulate_reduce
from tests.contract_examples import BucketTopK, ScaledSign

# GRADCOMP_TEST_DEVICE=cuda runs the whole contract on CUDA tensors (tests/test_gpu.py does, on a GPU machine)
DEVICE = torch.device(os.environ.get("GRADCOMP_TEST_DEVICE", "cpu"))
if DEVICE.type == "cuda" and not torch.cuda.is_available():
    pytest.skip("GRADCOMP_TEST_DEVICE=cuda needs a GPU", allow_module_level=True)

# a conv weight, two same-shape matrices apart (batching groups them out of layer order), a tall and a wide matrix
SHAPES = [(16, 4, 3, 3), (48, 64), (96, 24), (48, 64), (24, 96)]


def _pruning_masks() -> dict[str, torch.Tensor]:
    """Masks of every kind MaskedCompressor handles: compacted elements (50%, 90% pruned), compacted rows, none
    (param3: sent whole) and a dense one (5% pruned: above the threshold, masked in place)."""
    g = torch.Generator().manual_seed(42)
    rows = torch.zeros(96, 1, dtype=torch.bool)
    rows[torch.randperm(96, generator=g)[:40]] = True
    return {
        "param0": torch.rand(SHAPES[0], generator=g) < 0.5,
        "param1": torch.rand(SHAPES[1], generator=g) < 0.1,
        "param2": rows.expand(SHAPES[2]).clone(),
        "param4": torch.rand(SHAPES[4], generator=g) < 0.95,
    }


# every example of the shared table, plus MaskedCompressor with masks of every kind (the masks fit SHAPES)
COMPRESSORS = {name: factory() for name, factory in EXAMPLES.items()}
COMPRESSORS["masked-pruned"] = MaskedCompressor(Identity(), _pruning_masks())
COMPRESSORS["masked-pruned-topk"] = MaskedCompressor(TopK(ratio=0.2), _pruning_masks())
COMPRESSORS["masked-pruned-powersgd"] = MaskedCompressor(PowerSGD(rank=2), _pruning_masks())
# the smallest sparsifier and quantizer of docs/concepts.md: compress, decompress and class facts are the whole method
COMPRESSORS["doc-bucket-topk"] = BucketTopK(ratio=0.1)
COMPRESSORS["doc-scaled-sign"] = ScaledSign()
# half-precision casts round: compare them loosely, everything else tightly
TOLERANCE = {"fp16": {"rtol": 2e-3, "atol": 1e-3}, "bf16": {"rtol": 2e-2, "atol": 1e-2}}
# PowerSGD's orthogonalisation adds epsilon (1e-8) to column norms: the sum of P over ranks and P of the average differ
# in scale, so the normalised factors agree to about epsilon, not to rounding
TOLERANCE.update({name: {"rtol": 1e-6, "atol": 1e-7} for name in COMPRESSORS if "powersgd" in name})
# casts sum their payloads in half precision (as torch's hooks do); that rounding is not a compression error, so error
# feedback does not carry it and it accumulates over the 6 steps of the telescoping test (values of order 1)
EF_TOLERANCE = {"fp16": {"rtol": 0, "atol": 6 * 4e-3}, "bf16": {"rtol": 0, "atol": 6 * 3e-2}}
# Ranks agree on something before compressing (ScaleCom: the leader's indices; TernGrad: the largest scaler), so the
# reduction is not a function of each rank's own payload; the reduction identity is checked with every rank holding
# the same gradient, and against explicit references in tests/test_scalecom.py and tests/test_quantize.py.
# LGC: the leader's indices and code.
COORDINATED = {"scalecom", "scalecom-lowpass"} | {name for name in COMPRESSORS if name.startswith("terngrad")}
COORDINATED |= {name for name in COMPRESSORS if name.startswith("lgc")}
# Where the error-feedback identity does not apply, and why (checked in the named tests instead)
NO_TELESCOPING = {
    "dgc": "momentum correction accumulates u, not g: tests/test_dgc.py checks sum sent + v == sum u",
    "dgc-bitmap": "momentum correction accumulates u, not g: tests/test_dgc.py",
    "dgc-warmup-nesterov-clip": "momentum correction accumulates u, not g: tests/test_dgc.py",
    "dgc-zen": "momentum correction accumulates u, not g: tests/test_dgc.py",
    # the all-reduce variant's default accounting in stage 3 (residual="own")
    **dict.fromkeys(
        ("lgc-allreduce-stages", "lgc-allreduce-stage3"),
        "each rank's deviation from the average and the decoder's error are dropped, not owed: tests/test_lgc.py"
        " checks the memory it keeps",
    ),
}
# casts to a 16-bit format, which refuse 16-bit gradients
CASTS = {"fp16", "bf16"}
# lossless on what they send: nothing is owed
LOSSLESS = {"identity", "topk-all", "masked", "masked-pruned", "zen", "zen-always", "zen-bitmap"}
# the majority vote is not an average of compressed gradients: error feedback is refused
REFUSES_ERROR_FEEDBACK = {"signsgd", "signum", "signsgd-two-phase", "signum-two-phase"}
# the two-phase exchange: the owners re-encode the average of their shards, so the result is not the average of the
# ranks' decoded payloads (tests/test_two_phase.py checks it against a reference), its bytes are two encodings'
TWO_PHASE = {name for name in COMPRESSORS if "two-phase" in name}
# of which the sparsifiers' select per layer before the exchange, so per-layer levels apply
SELECTS_PER_LAYER = {"topk-two-phase", "dgc-two-phase"}


def _layers(compressor):
    layers = layers_from_shapes(SHAPES)
    kept = [layer for layer in layers if compressor.compresses(layer, 0)]
    assert kept, "the test shapes must exercise the compressor"
    offset, out = 0, []
    for layer in kept:
        out.append(Layer(layer.name, layer.index, layer.shape, offset))
        offset += layer.numel
    return tuple(out)


def _ctx(layers, dtype=torch.float64, step=0, seed=0, rank=0, world_size=1, updates=None):
    return BucketContext(
        index=0,
        step=step,
        rank=rank,
        world_size=world_size,
        layers=layers,
        dtype=dtype,
        seed=seed,
        updates=updates,
        device=DEVICE,
    )


def _data(layers, n, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    numel = sum(layer.numel for layer in layers)
    return [torch.randn(numel, generator=g, dtype=dtype).to(DEVICE) for _ in range(n)]


def _fresh(compressor, n=1):
    return [copy.deepcopy(compressor) for _ in range(n)]


@pytest.fixture(params=list(COMPRESSORS), ids=list(COMPRESSORS))
def case(request):
    return request.param, COMPRESSORS[request.param]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_round_trip_keeps_shape_dtype_and_device(case, dtype):
    name, compressor = case
    if name in CASTS and dtype.itemsize == 2:
        pytest.skip("a cast refuses 16-bit gradients (tests/test_cast.py)")
    layers = _layers(compressor)
    (x,) = _data(layers, 1, dtype)
    ctx = _ctx(layers, dtype)
    out = copy.deepcopy(compressor).decompress(compressor.compress(x.clone(), ctx), ctx)
    assert out.shape == x.shape
    assert out.dtype == dtype
    assert out.device == x.device


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_sixteen_bit_gradients_are_averaged_as_well_as_float32_ones(case, dtype):
    """Training in 16 bits (``precision="16-true"``, ``"bf16-true"``) hands the hook 16-bit gradients and keeps
    16-bit residuals. Over 3 steps at 2 ranks, with error feedback where the compressor allows it, every output is
    finite, identical on both ranks and in the gradient's dtype, and as close to the exact average of the 16-bit
    gradients as float32 gradients of the same values get to theirs (within a 16-bit rounding or two)."""
    name, compressor = case
    if name in CASTS:
        pytest.skip("a cast refuses 16-bit gradients (tests/test_cast.py)")
    layers = _layers(compressor)
    numel = sum(layer.numel for layer in layers)
    errors = {}
    for wide in (dtype, torch.float32):
        compressors = _fresh(compressor, 2)
        residuals = None
        if name not in REFUSES_ERROR_FEEDBACK:
            residuals = [torch.zeros(numel, dtype=wide, device=DEVICE) for _ in range(2)]
        errors[wide] = []
        for step in range(3):
            xs = [x.to(dtype) for x in _data(layers, 2, dtype=torch.float32, seed=900 + step)]
            outs = simulate_reduce(compressors, [x.to(wide) for x in xs], layers, step=step, residuals=residuals)
            assert outs[0].dtype == wide
            assert torch.isfinite(outs[0]).all(), f"step {step}: not finite in {wide}"
            assert torch.equal(outs[0], outs[1]), f"step {step}: the ranks differ in {wide}"
            exact = (xs[0].double() + xs[1].double()) / 2
            errors[wide].append(((outs[0].double() - exact).norm() / exact.norm()).item())
    rounding = torch.finfo(dtype).eps * 4  # a few roundings of values of order 1, relative to the average's norm
    for step, (narrow, wide) in enumerate(zip(errors[dtype], errors[torch.float32])):
        assert narrow <= wide * (1 + 0.02) + rounding, f"step {step}: {narrow:.4g} in {dtype}, {wide:.4g} in float32"


def test_decompressing_into_a_spent_buffer_gives_the_same_result(case):
    """The template decodes into the tensor that was compressed (no allocation per step); results must not change."""
    _, compressor = case
    layers = _layers(compressor)
    xs = _data(layers, 2, seed=9)
    ctx = _ctx(layers)
    payloads = [compressor.compress(x.clone(), ctx) for x in xs]
    expected = compressor.decompress(payloads[0], ctx).clone()
    buffer = torch.full_like(xs[0], float("nan"))
    torch.testing.assert_close(compressor.decompress(payloads[0], ctx, out=buffer), expected, rtol=0, atol=0)
    expected_sum = compressor.aggregate(payloads, ctx).clone()
    buffer = torch.full_like(xs[0], float("nan"))
    torch.testing.assert_close(compressor.aggregate(payloads, ctx, out=buffer), expected_sum, rtol=0, atol=0)


def test_the_aggregate_is_the_rank_order_sum_from_zeros_bit_for_bit(case):
    """``aggregate`` equals adding every decoded payload, in rank order, into zeros, bit for bit (signed zeros too),
    into a buffer full of NaN, and leaves the payloads as they were (the base class's ``aggregate``; overrides sum
    sparse payloads their own way, checked by their own tests)."""
    _, compressor = case
    if type(compressor).aggregate is not Compressor.aggregate:
        pytest.skip(f"{type(compressor).__name__} overrides aggregate")
    layers = _layers(compressor)
    xs = _data(layers, 3, seed=11)
    ctx = _ctx(layers)
    payloads = [compressor.compress(x.clone(), ctx) for x in xs]
    sent = [tuple(t.clone() for t in payload) for payload in payloads]
    expected = torch.zeros_like(xs[0])
    for payload in payloads:
        expected += compressor.decompress(payload, ctx).clone()
    found = compressor.aggregate(payloads, ctx, out=torch.full_like(xs[0], float("nan")))
    assert found.dtype == expected.dtype
    assert torch.equal(found.view(torch.uint8), expected.view(torch.uint8))
    for payload, before in zip(payloads, sent):
        assert all(torch.equal(a, b) for a, b in zip(payload, before))


@pytest.mark.parametrize("n", [1, 2, 3])
def test_the_average_is_the_aggregate_divided_bit_for_bit(case, n):
    """``average`` (what the all-gather exchange returns) is ``aggregate`` divided by the world size, bit for bit,
    into a buffer full of NaN: overrides fold the division into their decoding without changing a bit."""
    _, compressor = case
    if compressor.collective != "allgather":
        pytest.skip("an all-reduce compressor divides its payload before the sum")
    layers = _layers(compressor)
    xs = _data(layers, n, seed=13)
    ctx = _ctx(layers, world_size=n)
    payloads = [c.compress(x.clone(), ctx) for c, x in zip(_fresh(compressor, n), xs)]
    expected = compressor.aggregate(payloads, ctx).clone().div_(n)
    found = compressor.average(payloads, ctx, out=torch.full_like(xs[0], float("nan")))
    assert found.dtype == expected.dtype
    assert torch.equal(found.view(torch.uint8), expected.view(torch.uint8))


def test_an_aggregate_of_negative_zeros_is_positive_zero():
    """As from zeros: ``0 + (-0.0)`` is ``+0.0``, also when the first payload is decoded straight into the result (and
    a payload that decodes to itself is copied, never written)."""
    layers = layers_from_shapes([(4, 4)])
    ctx = _ctx(layers)
    minus_zero = torch.full((16,), -0.0, dtype=torch.float64, device=DEVICE)
    payloads = [(minus_zero.clone(),), (minus_zero.clone(),)]
    found = Identity().aggregate(payloads, ctx)
    assert not torch.signbit(found).any()
    assert all(torch.signbit(p).all() for (p,) in payloads)
    single = Identity().aggregate(payloads[:1], ctx)
    assert not torch.signbit(single).any()
    assert torch.signbit(payloads[0][0]).all()


def test_payload_shapes_depend_only_on_the_layout(case):
    """Ranks hold different gradients but must hand collectives tensors of the same shapes.

    Compressors whose payload sizes depend on the data (AdaComp) exchange the sizes first: every collective they issue
    must then agree across ranks, which the simulated world checks (it raises on a mismatch, as gloo would).
    """
    _, compressor = case
    layers = _layers(compressor)
    if compressor.exchanges_sizes:
        outs = simulate_reduce(_fresh(compressor, 3), _data(layers, 3, seed=1), layers)
        assert all(torch.equal(outs[0], out) for out in outs)
        return
    payloads = [
        copy.deepcopy(compressor).compress(x, _ctx(layers, rank=r, world_size=3))
        for r, x in enumerate(_data(layers, 3, seed=1))
    ]
    signatures = {tuple((tuple(p.shape), p.dtype) for p in payload) for payload in payloads}
    assert len(signatures) == 1


def test_allreduce_payloads_are_linear(case):
    """For single-round all-reduce compressors, decompress(sum of payloads) == sum of decompressed payloads."""
    name, compressor = case
    if compressor.collective != "allreduce" or compressor.rounds != 1:
        pytest.skip("not a single-round all-reduce compressor")
    layers = _layers(compressor)
    ctx = _ctx(layers)
    p1, p2 = (compressor.compress(x, ctx) for x in _data(layers, 2, seed=2))
    summed = tuple(a + b for a, b in zip(p1, p2))
    torch.testing.assert_close(
        compressor.decompress(summed, ctx),
        compressor.decompress(p1, ctx) + compressor.decompress(p2, ctx),
        **TOLERANCE.get(name, {"rtol": 1e-12, "atol": 1e-12}),
    )


def test_reduction_is_the_collective_it_declares(case):
    """All-reduce: the average over ranks equals compressing the average gradient (linearity through shared
    randomness; this is PowerSGD's all-reduce compatibility too). All-gather: the average of each rank's
    decompressed payload."""
    name, compressor = case
    layers = _layers(compressor)
    xs = _data(layers, 2, seed=3)
    if name in COORDINATED:
        xs = [xs[0], xs[0].clone()]  # what the ranks agree on is then each rank's own choice
    outs = simulate_reduce(_fresh(compressor, 2), xs, layers, step=5, seed=7)
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)  # every rank holds the same average
    if name in TWO_PHASE:
        return  # a second encoding at the shard owner: tests/test_two_phase.py
    if compressor.collective == "allreduce" and name not in COORDINATED:
        (expected,) = simulate_reduce(_fresh(compressor), [(xs[0] + xs[1]) / 2], layers, step=5, seed=7)
    else:
        ctxs = [_ctx(layers, step=5, seed=7, rank=r, world_size=2, updates=StepUpdates()) for r in range(2)]
        locals_ = []
        for c, x, ctx in zip(_fresh(compressor, 2), xs, ctxs):
            x = x.clone()
            c.accumulate(x, ctx)  # what is compressed (DGC: clipped, momentum-corrected)
            locals_.append(c.decompress(c.compress(x, ctx), ctx))
        expected = (locals_[0] + locals_[1]) / 2
    torch.testing.assert_close(outs[0], expected, **TOLERANCE.get(name, {"rtol": 1e-10, "atol": 1e-10}))


def test_unbiased_compressors_are_unbiased(case):
    name, compressor = case
    if not compressor.unbiased:
        pytest.skip("biased compressor")
    layers = _layers(compressor)
    (x,) = _data(layers, 1, seed=4)
    samples = torch.stack(
        [compressor.decompress(compressor.compress(x, _ctx(layers, step=s)), _ctx(layers, step=s)) for s in range(400)]
    )
    mean, std_err = samples.mean(0), samples.std(0) / 400**0.5
    # every coordinate that varies has its sample mean within 5 standard errors; for an event of small probability the
    # sample's standard error is itself noisy (7 round-ups where 20 are expected), so 5 / 400 of the range is added
    spread = samples.amax(0) - samples.amin(0)
    varies = spread > 0
    assert torch.all(((mean - x).abs() <= 5 * std_err + 5 * spread / 400 + 1e-12)[varies]), name
    # A coordinate that never varied may be a rare event of a quantiser (a 0.05% chance to round up does not happen in
    # 400 draws), so its sample mean is no test. Random projections mix thousands of coordinates: their standard
    # errors are well estimated, and a bias anywhere shows (deterministic compressors: exactly x).
    directions = torch.randn(16, x.numel(), generator=torch.Generator().manual_seed(1), dtype=x.dtype).to(x.device)
    projected = samples @ directions.T
    error = (projected.mean(0) - directions @ x).abs()
    assert torch.all(error <= 5 * projected.std(0) / 400**0.5 + 1e-9), name


def test_kept_residual_buffers_change_nothing(case):
    """Buffers for the updated residual kept between steps (as the hook keeps its twins, and the codec benchmark
    does) give bitwise the averages and residuals of fresh ones."""
    name, compressor = case
    if name in REFUSES_ERROR_FEEDBACK:
        pytest.skip("refuses error feedback")
    layers = _layers(compressor)
    numel = sum(layer.numel for layer in layers)
    runs = []
    for keep in (False, True):
        compressors = _fresh(compressor, 2)
        residuals = [torch.zeros(numel, dtype=torch.float64, device=DEVICE) for _ in range(2)]
        twins = [torch.empty_like(r) for r in residuals] if keep else None
        outs = []
        for step in range(3):
            for twin in twins or ():  # stale contents never leak (a commit may hand back the old residual)
                twin.fill_(float("nan"))
            outs.append(
                simulate_reduce(
                    compressors,
                    _data(layers, 2, seed=200 + step),
                    layers,
                    step=step,
                    residuals=residuals,
                    new_residuals=twins,
                )
            )
        runs.append((outs, residuals))
    (fresh_outs, fresh_res), (kept_outs, kept_res) = runs
    for a, b in zip(fresh_outs, kept_outs):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert all(torch.equal(x, y) for x, y in zip(fresh_res, kept_res))


@pytest.mark.parametrize("finite", [True, False])
def test_a_swapped_commit_moves_no_data(finite):
    """State staged with ``swap=True`` takes its new value's storage on a finite CPU step (no pass over the data),
    and stays as it was, storage and all, on a non-finite one; views are copied, never swapped."""
    target, value = torch.randn(1000, dtype=torch.float64), torch.randn(1000, dtype=torch.float64)
    base = torch.zeros(2000, dtype=torch.float64)
    view_target, view_value = base[1000:], torch.randn(1000, dtype=torch.float64)
    before = {"target": target.clone(), "value": value.clone(), "view": view_target.clone()}
    pointers = (target.data_ptr(), value.data_ptr(), view_target.data_ptr())
    updates = StepUpdates()
    updates.stage(target, value, swap=True)
    updates.stage(view_target, view_value, swap=True)
    updates.observe(torch.tensor(finite))
    updates.commit()
    if finite:
        assert torch.equal(target, before["value"])
        assert torch.equal(value, before["target"])
        assert (target.data_ptr(), value.data_ptr()) == (pointers[1], pointers[0])
        assert torch.equal(view_target, view_value)
        assert view_target.data_ptr() == pointers[2]
        assert torch.equal(base[1000:], view_value)  # the view still belongs to its base
    else:
        assert torch.equal(target, before["target"])
        assert torch.equal(view_target, before["view"])
        assert (target.data_ptr(), value.data_ptr(), view_target.data_ptr()) == pointers


def test_error_feedback_telescopes(case):
    """With error feedback, what was applied plus what is still owed equals what was computed.

    Over T steps in a world of two ranks: sum_t average_t + mean_r residual_r == mean_r sum_t gradient_{r,t}, for
    local-reconstruction error feedback (top-k, random-k) and global-reconstruction error feedback (PowerSGD) alike.
    """
    name, compressor = case
    if name in NO_TELESCOPING:
        pytest.skip(NO_TELESCOPING[name])
    layers = _layers(compressor)
    compressors = _fresh(compressor, 2)
    numel = sum(layer.numel for layer in layers)
    residuals = [torch.zeros(numel, dtype=torch.float64, device=DEVICE) for _ in range(2)]
    if name in REFUSES_ERROR_FEEDBACK:
        with pytest.raises(ValueError, match="error feedback"):
            simulate_reduce(compressors, _data(layers, 2), layers, residuals=residuals)
        return
    applied = torch.zeros(numel, dtype=torch.float64, device=DEVICE)
    computed = torch.zeros(numel, dtype=torch.float64, device=DEVICE)
    for step in range(6):
        grads = _data(layers, 2, seed=100 + step)
        applied += simulate_reduce(compressors, grads, layers, step=step, residuals=residuals)[0]
        computed += (grads[0] + grads[1]) / 2
    # a low-pass filtered memory (ScaleCom's beta) moves by beta (g - sent) per step: what is owed is m / beta
    beta = getattr(compressor, "beta", None)  # None: plain error feedback (LGC's default)
    owed = (residuals[0] + residuals[1]) / 2 / (1.0 if beta is None else beta)
    if name in TWO_PHASE:  # what the shard owners' re-encoding still owes
        owed += owner_residuals(compressors, _ctx(layers, world_size=2))
    kept = _kept(compressor, layers)
    # pruned entries are discarded, not owed: nothing is applied and nothing is kept there
    assert torch.all(owed[~kept] == 0)
    assert torch.all(applied[~kept] == 0)
    torch.testing.assert_close(
        (applied + owed)[kept], computed[kept], **EF_TOLERANCE.get(name, {"rtol": 1e-10, "atol": 1e-10})
    )
    # lossless on what they send (LGC's defaults: still in the dense stage)
    if name not in LOSSLESS | {"lgc", "lgc-allreduce"}:
        assert owed.abs().sum() > 0, "a lossy compressor must leave something owed"


def _kept(compressor, layers):
    """Which elements of the flat layout a MaskedCompressor's masks keep (all for every other compressor)."""
    kept = torch.ones(sum(layer.numel for layer in layers), dtype=torch.bool, device=DEVICE)
    for layer in layers:
        masks = getattr(compressor, "masks", None)
        if masks is not None and layer.name in masks:
            layer.flat(kept).copy_(masks[layer.name].reshape(-1))
    return kept


def test_error_feedback_as_set_is_checked_when_the_hook_s_state_is_made(case):
    """Every compressor runs with its default error feedback; a method that cannot carry a memory refuses it when the
    state is made (before training), not at its first reduction."""
    name, compressor = case
    assert CompressionState(compressor).uses_error_feedback() == compressor.default_error_feedback
    if name in REFUSES_ERROR_FEEDBACK:
        assert not compressor.default_error_feedback
        with pytest.raises(ValueError, match="error feedback"):
            CompressionState(compressor, error_feedback=True)


def test_no_compressor_warns_about_error_feedback_at_its_default(case):
    """The warning of ``Compressor.error_feedback_growth`` is for error feedback switched on by hand."""
    _, compressor = case
    assert compressor.error_feedback_growth(None) is None
    assert compressor.error_feedback_growth(False) is None


def _residual_growth(compressor, steps=(5, 60)):
    """Rank 0's residual norm over the gradient's, after each of ``steps``: 2 ranks, unit Gaussian gradients."""
    layers = layers_from_shapes([(256, 256)])
    compressors = _fresh(compressor, 2)
    residuals = [torch.zeros(layers[0].numel, dtype=torch.float64, device=DEVICE) for _ in range(2)]
    ratios = []
    for step in range(max(steps)):
        xs = _data(layers, 2, seed=300 + step)
        simulate_reduce(compressors, xs, layers, step=step, residuals=residuals)
        if step + 1 in steps:
            ratios.append((residuals[0].norm() / xs[0].norm()).item())
    return ratios


GROWS = [name for name, compressor in COMPRESSORS.items() if compressor.error_feedback_growth(True) is not None]


def test_the_configurations_that_warn_about_error_feedback_are_the_expected_ones():
    """Every quantizer with an error bound of at least 1 and the rescaled random-k; no contraction."""
    terngrad = {name for name in COMPRESSORS if name.startswith("terngrad")}
    assert (
        set(GROWS)
        == {
            "randomk-unbiased",
            "qsgd",
            "qsgd-2bit-small-buckets",
            "qsgd-16bit-draws",
            "qsgd-two-phase",
            "qsgd-2bit-two-phase",
            "qsgd-allgather",
        }
        | terngrad
    )


@pytest.mark.parametrize("name", GROWS)
def test_error_feedback_grows_where_the_compressor_says_it_can(name):
    """Where a configuration gives a reason (QSGD's Lemma 3.1 bound at least 1, rescaled random-k, TernGrad), its
    residual does grow: at least 3 times larger after 60 steps than after 5."""
    early, late = _residual_growth(COMPRESSORS[name])
    assert late > 3 * early, (early, late)


@pytest.mark.parametrize("compressor", [QSGD(levels=127, bucket_size=2048), RandomK(ratio=0.6, rescale=True)], ids=repr)
def test_error_feedback_stays_bounded_below_the_bound(compressor):
    """Unbiased, with an error bound ``w`` below 1 (0.13 and 0.67): no reason is given, and the residual settles at
    most near ``sqrt(w / (1 - w))`` times the gradient (1.41 for rescaled random-k at 60 %)."""
    assert compressor.error_feedback_growth(True) is None
    early, late = _residual_growth(compressor)
    assert late < 1.2 * early, (early, late)
    assert late < 1.5, late


def test_compressors_pickle(case):
    name, compressor = case
    layers = _layers(compressor)
    copy_ = pickle.loads(pickle.dumps(compressor))
    assert repr(copy_) == repr(compressor)
    (x,) = _data(layers, 1, seed=5)
    ctx = _ctx(layers, step=3)
    for a, b in zip(compressor.compress(x.clone(), ctx), copy_.compress(x.clone(), ctx)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_state_dict_round_trip_resumes_exactly(case):
    """After a few steps, a fresh compressor loaded from state_dict() continues exactly like the original."""
    _, compressor = case
    layers = _layers(compressor)
    original = _fresh(compressor, 2)
    for step in range(3):
        simulate_reduce(original, _data(layers, 2, seed=200 + step), layers, step=step)
    restored = _fresh(compressor, 2)
    for r in range(2):
        restored[r].load_state_dict(pickle.loads(pickle.dumps(original[r].state_dict())))
    grads = _data(layers, 2, seed=300)
    expected = simulate_reduce(original, grads, layers, step=3)
    got = simulate_reduce(restored, grads, layers, step=3)
    torch.testing.assert_close(got[0], expected[0], rtol=0, atol=0)


def test_telemetry_counts_the_payload_bytes(case):
    """The bytes counted are the bytes of the tensors handed to the collectives, every round included, and they are
    the payload's bytes plus at most one 8-byte word: the non-finite flag (and the padding it adds when packed)."""
    name, compressor = case
    layers = _layers(compressor)
    xs = _data(layers, 2, dtype=torch.float32, seed=6)
    counted, handed = _bytes_counted_and_handed(compressor, xs, layers)
    assert counted == handed
    if compressor.exchanges_sizes or name in TWO_PHASE:
        return  # padded to sizes known only after the exchange, or two encodings (the compressor's own tests)
    payload = copy.deepcopy(compressor).compress(xs[0].clone(), _ctx(layers, dtype=torch.float32, world_size=2))
    nbytes = [p.numel() * p.element_size() for p in payload]
    if compressor.collective == "allgather" and len(payload) > 1:
        nbytes = [-(-n // 8) * 8 for n in nbytes]  # packed at 8-byte aligned offsets
    flag = 0 if compressor.propagates_nonfinite else 16
    assert sum(nbytes) <= counted <= sum(nbytes) + flag, name


class _RecordingBackend:
    """A simulated rank's collectives, adding up the bytes handed to them (a broadcast's only at its source)."""

    def __init__(self, backend):
        self.backend, self.rank, self.world_size, self.handed = backend, backend.rank, backend.world_size, 0

    def all_reduce(self, tensor, round, op):
        self.handed += tensor.numel() * tensor.element_size()
        return self.backend.all_reduce(tensor, round, op)

    def all_gather(self, tensor, round):
        self.handed += tensor.numel() * tensor.element_size()
        return self.backend.all_gather(tensor, round)

    def broadcast(self, tensor, src, round):
        self.handed += tensor.numel() * tensor.element_size() if src == self.rank else 0
        return self.backend.broadcast(tensor, src, round)

    def all_to_all(self, tensor, send_splits, recv_splits, round):
        # what leaves this rank: the chunk it keeps for itself does not move
        self.handed += (sum(send_splits) - send_splits[self.rank]) * tensor.element_size()
        return self.backend.all_to_all(tensor, send_splits, recv_splits, round)


def _bytes_counted_and_handed(compressor, xs, layers):
    """What rank 0 counted, and what it handed to the collectives (a broadcast's bytes at its source only)."""
    world = SimulatedWorld(len(xs))
    backends = [_RecordingBackend(world.backend(r)) for r in range(len(xs))]
    telemetry = [Telemetry() for _ in xs]
    futures = []
    for rank, (c, x) in enumerate(zip(_fresh(compressor, len(xs)), xs)):
        telemetry[rank].add_bucket(x.numel() * x.element_size())
        ctx = BucketContext(
            index=0,
            step=0,
            rank=rank,
            world_size=len(xs),
            layers=layers,
            dtype=x.dtype,
            device=x.device,
            comm=Comm(backends[rank], telemetry[rank], x.device),
        )
        futures.append(c.reduce(x.clone(), ctx))
    world.assert_quiescent()
    for future in futures:
        future.wait()
    stats = telemetry[0].pop_step()
    assert stats.bytes_dense == xs[0].numel() * xs[0].element_size()
    return stats.bytes_sent, backends[0].handed


def test_per_layer_levels_set_each_layers_payload_and_round_trip(case):
    """Compressors with a level compress each layer at its own level when told (Accordion's switch)."""
    name, compressor = case
    if compressor.level_attribute is None:
        with pytest.raises(TypeError, match="no compression level"):
            copy.deepcopy(compressor).set_levels({"param0": 1})
        return
    layers = _layers(compressor)
    default = getattr(compressor, compressor.level_attribute)
    changes = True
    if compressor.level_attribute == "limit":  # Planned: the least lossy candidate caps the whole bucket
        low = next(iter(compressor.candidates))
        changes = compressor.candidate_name(layers) != low
    else:
        other = {"rank": {1: 2}, "ratio": {0.5: 0.25}, "levels": {1: 3}}[compressor.level_attribute]  # not the default
        low = other.get(default, {"rank": 1, "ratio": 0.5, "levels": 1}[compressor.level_attribute])
    tuned = copy.deepcopy(compressor)
    if name in TWO_PHASE - SELECTS_PER_LAYER:  # shards are not layers
        with pytest.raises(ValueError, match="per-layer levels"):
            tuned.set_levels({layers[0].name: low})
        return
    tuned.set_levels({layers[0].name: low})
    assert tuned.level(layers[0]) == low
    assert tuned.level(layers[-1]) == getattr(compressor, compressor.level_attribute)
    assert tuned.plan_key() != copy.deepcopy(compressor).plan_key()
    (x,) = _data(layers, 1, seed=10)
    sizes = [sum(p.numel() for p in c.compress(x.clone(), _ctx(layers))) for c in (compressor, tuned)]
    assert (sizes[0] != sizes[1]) == changes, "the level must change the payload"
    restored = copy.deepcopy(compressor)
    restored.load_state_dict(pickle.loads(pickle.dumps(tuned.state_dict())))
    assert restored.layer_levels == {layers[0].name: low}
    assert pickle.loads(pickle.dumps(tuned)).layer_levels == {layers[0].name: low}
    with pytest.raises(ValueError, match=f"`{compressor.level_attribute}`"):
        tuned.set_levels({layers[0].name: 0})
    outs = simulate_reduce([copy.deepcopy(tuned) for _ in range(2)], _data(layers, 2, seed=11), layers)
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)


def test_collective_mismatch_is_detected():
    """The simulated world refuses ranks that issue different collectives at one position, like gloo does."""
    world = SimulatedWorld(2)
    world.backend(0).all_reduce(torch.zeros(3), 0, "sum")
    with pytest.raises(RuntimeError, match="Collective mismatch"):
        world.backend(1).all_reduce(torch.zeros(4), 0, "sum")


@pytest.mark.parametrize(
    ("factory", "match"),
    [
        (lambda: TopK(ratio=0), "ratio"),
        (lambda: TopK(ratio=1.5), "ratio"),
        (lambda: TopK(ratio="0.1"), "ratio"),
        (lambda: TopK(ratio=True), "ratio"),
        (lambda: RandomK(ratio=-0.1), "ratio"),
        (lambda: RandomK(ratio=0.1, rescale="yes"), "rescale"),
        (lambda: PowerSGD(rank=0), "rank"),
        (lambda: PowerSGD(rank=1.5), "rank"),
        (lambda: PowerSGD(rank=True), "rank"),
        (lambda: PowerSGD(rank=2, min_compression_rate=-1), "min_compression_rate"),
        (lambda: PowerSGD(rank=2, init="svd"), "init"),
        # the reliability probe's cases: NaN and infinity used to train silently
        (lambda: PowerSGD(min_compression_rate=float("nan")), "min_compression_rate"),
        (lambda: PowerSGD(min_compression_rate=float("inf")), "min_compression_rate"),
        (lambda: PowerSGD(orthogonalization_epsilon=float("nan")), "orthogonalization_epsilon"),
        (lambda: PowerSGD(orthogonalization_epsilon=float("inf")), "orthogonalization_epsilon"),
        (lambda: PowerSGD(orthogonalization_epsilon=True), "orthogonalization_epsilon"),
        (lambda: DGC(clip_norm=float("nan")), "clip_norm"),
        (lambda: DGC(clip_norm=float("inf")), "clip_norm"),
        (lambda: TernGrad(clip=float("nan")), "clip"),
        (lambda: TernGrad(clip=float("inf")), "clip"),
        (lambda: MaskedCompressor(dense_threshold=float("nan")), "dense_threshold"),
        (lambda: QSGD(levels=0), "levels"),
        (lambda: SignSGD(momentum=float("nan")), "momentum"),
    ],
)
def test_bad_arguments_are_refused_with_the_argument_named(factory, match):
    with pytest.raises(ValueError, match=f"`{match}`"):
        factory()


def test_every_exported_compressor_has_an_example():
    """The shared table (lightning_gradcomp.testing.EXAMPLES) covers every compressor the package exports."""
    covered = {type(factory()) for factory in EXAMPLES.values()}
    missing = [cls.__name__ for cls in exported_compressor_classes() if cls not in covered]
    assert not missing, f"add an entry to lightning_gradcomp.testing.EXAMPLES for {missing}"


def test_no_compressor_overrides_reduce():
    """reduce() is the base class's template; multi-round methods declare their rounds with exchange()."""
    assert [cls.__name__ for cls in exported_compressor_classes() if "reduce" in vars(cls)] == []
    with pytest.raises(TypeError, match="implement `exchange`"):

        class _Sneaky(Compressor):  # noqa: F841 (defining it is the test)
            def compress(self, tensor, ctx):
                return (tensor,)

            def decompress(self, payload, ctx, out=None):
                return payload[0]

            def reduce(self, tensor, ctx):
                return None


def _state_snapshot(compressor):
    return pickle.loads(pickle.dumps(compressor.state_dict()))


def _assert_same_state(a, b):
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), "state changed"
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            _assert_same_state(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same_state(x, y)
    else:
        assert a == b


@pytest.mark.slow_beyond_core("case")
@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_a_nonfinite_step_leaves_every_state_as_it_was(case, bad):
    """A NaN or an infinity on one rank: the aggregate is non-finite on every rank (so the usual skip works), no
    residual, momentum or warm-start factor changes, and the next clean step is exactly what it would have been."""
    name, compressor = case
    layers = _layers(compressor)
    numel = sum(layer.numel for layer in layers)
    use_residuals = name not in REFUSES_ERROR_FEEDBACK
    compressors = _fresh(compressor, 2)
    residuals = [torch.zeros(numel, dtype=torch.float64, device=DEVICE) for _ in range(2)] if use_residuals else None
    for step in range(2):
        simulate_reduce(compressors, _data(layers, 2, seed=400 + step), layers, step=step, residuals=residuals)
    twins = [copy.deepcopy(c) for c in compressors]
    twin_residuals = [r.clone() for r in residuals] if use_residuals else None
    states = [_state_snapshot(c) for c in compressors]

    grads = _data(layers, 2, seed=402)
    grads[1][layers[-1].offset] = bad
    outs = simulate_reduce(compressors, grads, layers, step=2, residuals=residuals)
    assert all(not torch.isfinite(out).all() for out in outs), "every rank must see a non-finite aggregate"
    for c, state in zip(compressors, states):
        _assert_same_state(_state_snapshot(c), state)
    if use_residuals:
        for r, twin in zip(residuals, twin_residuals):
            assert torch.equal(r, twin), "the residual changed on a non-finite step"

    clean = _data(layers, 2, seed=403)
    after = simulate_reduce(compressors, clean, layers, step=3, residuals=residuals)
    expected = simulate_reduce(twins, clean, layers, step=3, residuals=twin_residuals)
    assert all(torch.isfinite(out).all() for out in after)
    torch.testing.assert_close(after[0], expected[0], rtol=0, atol=0)


# finite gradients that a compressor's payload or its fp32 arithmetic may not hold: one element above FP16's range, one
# whose square overflows fp32 (QSGD's bucket norms, LGC's scales), one rank's whole gradient at about 1e15 (sums of
# squares overflow)
SPIKES = {"above-fp16": ("one", 1e5), "square-overflows": ("one", 3e19), "whole-rank": ("all", 1e18)}


@pytest.mark.slow_beyond_core("case")
@pytest.mark.parametrize("ranks", [1, 2, 3])
@pytest.mark.parametrize("spike", list(SPIKES), ids=list(SPIKES))
def test_a_finite_spike_never_reaches_the_state(case, spike, ranks):
    """A finite fp32 gradient the payload cannot hold must not leave a NaN or an infinity in any residual, which error
    feedback would add to every later step: the spike step is either finite on every rank or non-finite on every rank
    (the usual skip) with no residual changed, and the clean steps after it are finite."""
    name, compressor = case
    layers = _layers(compressor)
    numel = sum(layer.numel for layer in layers)
    use_residuals = name not in REFUSES_ERROR_FEEDBACK
    compressors = _fresh(compressor, ranks)
    residuals = [torch.zeros(numel, device=DEVICE) for _ in range(ranks)] if use_residuals else None
    where, size = SPIKES[spike]
    for step in range(4):
        grads = [g * 1e-3 for g in _data(layers, ranks, dtype=torch.float32, seed=520 + step)]
        if step == 1:  # on the last rank
            if where == "one":
                grads[-1][layers[-1].offset] = size
            else:
                grads[-1] *= size  # values of order 1e-3 * size
        before = [r.clone() for r in residuals] if use_residuals else []
        outs = simulate_reduce(compressors, grads, layers, step=step, residuals=residuals)
        finite = [bool(torch.isfinite(out).all()) for out in outs]
        if use_residuals:
            assert all(torch.isfinite(r).all() for r in residuals), (name, spike, step)
        if step != 1:
            assert all(finite), (name, spike, step)
        elif not all(finite):
            assert not any(finite), "a non-finite step must be non-finite on every rank"
            if use_residuals:
                assert all(torch.equal(r, b) for r, b in zip(residuals, before)), (name, spike)


# a zero coordinate votes +1 in signSGD's majority vote (one bit cannot encode 0; docs/signsgd.md)
ZERO_VOTES_PLUS_ONE = {"signsgd", "signum", "signsgd-two-phase", "signum-two-phase"}


@pytest.mark.slow_beyond_core("case")
@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_an_all_zero_gradient_averages_to_zero(case, ranks):
    """Gradients that are zero on every rank, from the first step on (layers no batch touched, a loss that does not
    depend on them): plain DDP averages them to zero, and so must every compressor, with finite residuals; LGC's
    autoencoder used to decode a zero code to what its biases make of it."""
    name, compressor = case
    if name in ZERO_VOTES_PLUS_ONE:
        pytest.skip("a zero coordinate votes +1 (docs/signsgd.md)")
    layers = _layers(compressor)
    numel = sum(layer.numel for layer in layers)
    compressors = _fresh(compressor, ranks)
    residuals = [torch.zeros(numel, device=DEVICE) for _ in range(ranks)]
    for step in range(4):
        zeros = [torch.zeros(numel, device=DEVICE) for _ in range(ranks)]
        outs = simulate_reduce(compressors, zeros, layers, step=step, residuals=residuals)
        for out in outs:
            assert torch.equal(out, torch.zeros_like(out)), (name, step, out.abs().max().item())
        assert all(torch.isfinite(r).all() for r in residuals), (name, step)


WITNESSED = sorted(
    name for name, factory in EXAMPLES.items() if type(factory()).nonfinite_witness is not Compressor.nonfinite_witness
)


def test_the_witnessed_compressors_are_the_expected_ones():
    """The table below tests every compressor that names a witness; a new one must be reasoned about here."""
    assert WITNESSED == [
        "bf16",
        "efsignsgd",
        "efsignsgd-allgather",
        "efsignsgd-two-phase",
        "fp16",
        "onebit",
        "onebit-two-phase",
        "qsgd",
        "qsgd-16bit-draws",
        "qsgd-2bit-small-buckets",
        "qsgd-2bit-two-phase",
        "qsgd-8bit",
        "qsgd-allgather",
        "qsgd-two-phase",
    ]


@pytest.mark.slow_beyond_core("name")
@pytest.mark.parametrize("name", WITNESSED)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")], ids=["nan", "inf", "-inf"])
def test_a_nonfinite_element_anywhere_reaches_the_witness(name, bad):
    """Where the guard reads only the payload's witness (nonfinite_witness), a NaN or an infinity at the first or the
    last element of any layer, on either rank, makes the step non-finite on every rank and changes no residual."""
    compressor = EXAMPLES[name]()
    layers = _layers(compressor)
    numel = sum(layer.numel for layer in layers)
    for layer in layers:
        for at in (layer.offset, layer.offset + layer.numel - 1):
            for rank in range(2):
                compressors = _fresh(compressor, 2)
                residuals = [torch.zeros(numel, dtype=torch.float64, device=DEVICE) for _ in range(2)]
                simulate_reduce(compressors, _data(layers, 2, seed=450), layers, step=0, residuals=residuals)
                before = [r.clone() for r in residuals]
                grads = _data(layers, 2, seed=451)
                grads[rank][at] = bad
                outs = simulate_reduce(compressors, grads, layers, step=1, residuals=residuals)
                assert all(not torch.isfinite(out).all() for out in outs), (name, layer.name, at, rank)
                assert all(torch.equal(r, b) for r, b in zip(residuals, before)), (name, layer.name, at, rank)


def test_a_witness_that_names_nothing_is_a_clear_error():
    """Overriding nonfinite_witness turns the guard's own read off; naming no tensor must not leave it unguarded."""

    class _NoWitness(Compressor):
        def compress(self, tensor, ctx):
            return (tensor.clone(),)

        def decompress(self, payload, ctx, out=None):
            return payload[0]

        def nonfinite_witness(self, payload):
            return None

    layers = layers_from_shapes([(8, 8)])
    residuals = [torch.zeros(64, dtype=torch.float64, device=DEVICE) for _ in range(2)]
    with pytest.raises(RuntimeError, match="nonfinite_witness named no tensor"):
        simulate_reduce([_NoWitness(), _NoWitness()], _data(layers, 2), layers, residuals=residuals)


@pytest.mark.parametrize("name", ["powersgd", "topk", "randomk", "efsignsgd", "adacomp"])
def test_an_overflowing_error_feedback_sum_is_caught(name):
    """A finite gradient plus a finite residual can overflow: the guard checks the sum where ``accumulate`` put it
    (PowerSGD, TopK, RandomK and AdaComp write it into the updated residual's buffer), so the step is non-finite on
    every rank and no residual changes."""
    compressor = EXAMPLES[name]()
    layers = _layers(compressor)
    numel = sum(layer.numel for layer in layers)
    compressors = _fresh(compressor, 2)
    residuals = [torch.zeros(numel, dtype=torch.float64, device=DEVICE) for _ in range(2)]
    simulate_reduce(compressors, _data(layers, 2, seed=500), layers, step=0, residuals=residuals)
    residuals[1][layers[0].offset] = 1.5e308
    before = [r.clone() for r in residuals]
    grads = _data(layers, 2, seed=501)
    grads[1][layers[0].offset] = 1.5e308  # finite, and so is the residual; their sum is not
    assert torch.isfinite(grads[1]).all()
    outs = simulate_reduce(compressors, grads, layers, step=1, residuals=residuals)
    assert all(not torch.isfinite(out).all() for out in outs)
    for r, b in zip(residuals, before):
        assert torch.equal(r, b)


def _walkthrough_compressors():
    """The example compressors of docs/writing_a_compressor.md, executed from the page itself."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "writing_a_compressor.md")
    with open(path) as f:
        section = f.read()
    namespace: dict = {}
    for block in re.findall(r"```python\n(.*?)```", section, flags=re.S):
        exec(block, namespace)  # noqa: S102 (the documentation's own code)
    return namespace["ScaledSign"], namespace["LeaderRandomK"]


def test_the_writing_a_compressor_walkthrough_works():
    """The page's single-round and multi-round examples keep the contract: ranks agree, error feedback telescopes."""
    layers = layers_from_shapes(SHAPES[1:3])
    numel = sum(layer.numel for layer in layers)
    for cls in _walkthrough_compressors():
        compressors = [cls(), cls()]
        residuals = [torch.zeros(numel, dtype=torch.float64, device=DEVICE) for _ in range(2)]
        applied = torch.zeros(numel, dtype=torch.float64, device=DEVICE)
        computed = torch.zeros(numel, dtype=torch.float64, device=DEVICE)
        for step in range(4):
            torch.manual_seed(step)  # LeaderRandomK draws its indices on the leader only
            grads = _data(layers, 2, seed=500 + step)
            outs = simulate_reduce(compressors, grads, layers, step=step, residuals=residuals)
            assert torch.equal(outs[0], outs[1]), cls.__name__
            applied += outs[0]
            computed += (grads[0] + grads[1]) / 2
        torch.testing.assert_close(applied + (residuals[0] + residuals[1]) / 2, computed, rtol=1e-10, atol=1e-10)


def test_zero_size_parameters_go_dense_for_every_compressor(case):
    """The probe: a zero-size parameter with min_compress_numel=0 crashed TopK, PowerSGD, ScaleCom, DGC, AdaComp."""
    from lightning_gradcomp.ddp.hook import CompressionState
    from lightning_gradcomp.testing import SimulatedHook

    name, compressor = case
    layers = layers_from_shapes([(48, 64), (0, 5), (24, 96), (0,)], names=["a", "empty", "b", "empty1d"])
    numel = sum(layer.numel for layer in layers)
    states = [CompressionState(copy.deepcopy(compressor), min_compress_numel=0) for _ in range(2)]
    if name in REFUSES_ERROR_FEEDBACK:
        states = [
            CompressionState(copy.deepcopy(compressor), min_compress_numel=0, error_feedback=False) for _ in range(2)
        ]
    outs = SimulatedHook(states, layers).step(_data(layers, 2, seed=600))
    assert outs[0].numel() == numel
    assert torch.equal(outs[0], outs[1])
    assert torch.isfinite(outs[0]).all()


@pytest.mark.parametrize("per_run", [True, False], ids=["per-run", "gather-then-add"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_gradient_runs_gather_and_sum_as_cat_then_add(per_run, dtype):
    """Both forms of GradientRuns.into (sums per run on the CPU; a gather, then one add, elsewhere) give the bits of
    concatenating the runs and adding: runs of one element, adjacent runs, a run at the buffer's end, signed zeros."""
    from lightning_gradcomp.compressors.base import GradientRuns

    g = torch.Generator().manual_seed(9)
    buffer = torch.randn(300, generator=g).to(dtype=dtype, device=DEVICE)
    buffer[[3, 7, 40]] = torch.tensor([-0.0, 0.0, -0.0], dtype=dtype, device=DEVICE)
    runs = ((0, 5), (6, 7), (7, 40), (100, 101), (250, 300))
    numel = sum(end - start for start, end in runs)
    plus = torch.randn(numel, generator=g).to(dtype=dtype, device=DEVICE)
    plus[:3] = -0.0
    gathered = torch.cat([buffer[start:end] for start, end in runs])
    out = torch.full((numel,), float("nan"), dtype=dtype, device=DEVICE)
    assert GradientRuns(buffer, runs).into(out, per_run=per_run) is out
    assert torch.equal(out, gathered)
    out.fill_(float("nan"))
    assert GradientRuns(buffer, runs).into(out, plus, per_run=per_run) is out
    expected = gathered + plus
    assert torch.equal(out, expected)
    assert torch.equal(out.signbit(), expected.signbit())


def _interleaved_layers():
    """The suite's matrices (their names are what the examples' masks and plans refer to), each followed by a bias:
    in one bucket the compressed layers are several runs, as DDP lays out a convolution and its normalisation."""
    shapes = [shape for i, shape in enumerate(SHAPES) for shape in (shape, (shape[0] + i,))]
    names = [name for i in range(len(SHAPES)) for name in (f"param{i}", f"bias{i}")]
    return layers_from_shapes(shapes, names=names)


@pytest.mark.slow_beyond_core("case")
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_the_hook_gathers_interleaved_layers_as_one_contiguous_tensor_bitwise(case, world_size):
    """Compressed matrices interleaved with dense biases in one bucket: the hook's compressed layers, averaged and in
    every rank's residual, are bitwise the compressor's on the same layers laid out contiguously, over three steps.
    With error feedback the hook leaves the gradient in the bucket's runs for the accumulation to gather
    (``GradientRuns``); without, it gathers first."""
    from lightning_gradcomp.ddp.hook import CompressionState
    from lightning_gradcomp.testing import SimulatedHook

    name, compressor = case
    layers = _interleaved_layers()
    bucket_compressor = compressor.bucket_compressor(layers)  # a Planned compressor's candidate for the bucket
    compressed = [layer for layer in layers if bucket_compressor.compresses(layer, 100)]
    at = torch.tensor([i for layer in compressed for i in range(layer.offset, layer.offset + layer.numel)])
    contiguous, offset = [], 0
    for layer in compressed:
        contiguous.append(Layer(layer.name, layer.index, layer.shape, offset))
        offset += layer.numel
    ef = False if name in REFUSES_ERROR_FEEDBACK else None
    states = [
        CompressionState(copy.deepcopy(compressor), min_compress_numel=100, error_feedback=ef)
        for _ in range(world_size)
    ]
    hook = SimulatedHook(states, layers)
    reference = _fresh(bucket_compressor, world_size)
    keeps = states[0].uses_error_feedback(bucket_compressor)
    residuals = [torch.zeros(offset, dtype=torch.float64, device=DEVICE) for _ in range(world_size)] if keeps else None
    for step in range(3):
        grads = _data(layers, world_size, seed=800 + step)
        torch.manual_seed(step)  # LeaderRandomK draws its indices on the leader only
        got = hook.step(grads)
        torch.manual_seed(step)
        want = simulate_reduce(reference, [g[at] for g in grads], tuple(contiguous), step=step, residuals=residuals)
        for rank in range(world_size):
            assert torch.equal(got[rank][at], want[rank]), f"{name}: step {step}, rank {rank}"
            for layer, kept in zip(compressed, contiguous):
                if residuals is not None:
                    assert torch.equal(hook.residual(rank, layer.name).reshape(-1), kept.flat(residuals[rank])), name


@pytest.mark.slow_beyond_core("case")
def test_the_hook_state_resumes_bitwise(case):
    """Every rank's whole hook state (residuals, the compressor's own state, the step) saved after 3 steps and loaded
    into fresh states: the next steps are bitwise those of the uninterrupted run (the checkpoint path, per method)."""
    from lightning_gradcomp.ddp.hook import CompressionState
    from lightning_gradcomp.testing import SimulatedHook

    name, compressor = case
    layers = _interleaved_layers()  # biases go dense: the gradient is gathered out of several runs
    ef = False if name in REFUSES_ERROR_FEEDBACK else None

    def hook():
        states = [
            CompressionState(copy.deepcopy(compressor), min_compress_numel=100, error_feedback=ef) for _ in range(2)
        ]
        return SimulatedHook(states, layers)

    straight = hook()
    for step in range(3):
        straight.step(_data(layers, 2, seed=700 + step))
    saved = [pickle.loads(pickle.dumps(state.state_dict())) for state in straight.states]
    resumed = hook()
    for state, state_dict in zip(resumed.states, saved):
        state.load_state_dict(state_dict)
    for step in range(3, 6):
        grads = _data(layers, 2, seed=700 + step)
        expected, got = straight.step(grads), resumed.step(grads)
        for a, b in zip(expected, got):
            assert torch.equal(a, b), f"{name}: step {step} differs after the resume"
