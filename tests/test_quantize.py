"""QSGD and TernGrad against reference implementations of their papers' formulas, and their exact wire sizes."""

import copy
import math
import re

import numpy as np
import pytest
import torch

from lightning_gradcomp.compressors import QSGD, TernGrad
from lightning_gradcomp.compressors.base import BucketContext, Layer, layers_from_shapes
from lightning_gradcomp.compressors.ops.draws import uniform_draws
from lightning_gradcomp.engine.telemetry import Telemetry
from lightning_gradcomp.testing import simulate_reduce
from tests.test_draws import reference_hashes

LAYERS = layers_from_shapes([(20, 30), (16, 3, 3, 3), (50, 41)])
NUMEL = sum(layer.numel for layer in LAYERS)


def _grads(n, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(NUMEL, generator=g, dtype=dtype) * (1 + r) for r in range(n)]


def _ctx(layers=LAYERS, step=0, rank=0, world_size=1, dtype=torch.float64, seed=0):
    return BucketContext(index=0, step=step, rank=rank, world_size=world_size, layers=layers, dtype=dtype, seed=seed)


def _draws(ctx, layer, random_bits=None):
    """The compressor's uniform draws of ``layer``, from the reference hash (tests/test_draws.py): ``h 2^-32`` in
    float64, or ``(floor(h / 2^16) + 1/2) 2^-16`` with 16 random bits."""
    h = reference_hashes(ctx, layer)
    return torch.from_numpy((np.floor(h / 2**16) + 0.5) / 2**16 if random_bits == 16 else h / 2**32)


def _wire(value):
    """A float64 norm or scaler as sent: fp32, rounded up to the next fp32 where rounding went down."""
    wire = torch.tensor(value, dtype=torch.float32)
    if wire.item() < value:
        wire = torch.nextafter(wire, torch.tensor(math.inf))
    return wire.item()


def _qsgd_reference(x, ctx, levels, bucket_size, random_bits=None):
    """Per bucket: l = floor(s |v| / ||v|| + u), u uniform: l is floor(s |v| / ||v||) + 1 with probability equal to
    the fractional part (the paper's stochastic rounding), every draw from the compressor's generator."""
    out = torch.empty_like(x)
    for layer in ctx.layers:
        v, u = layer.flat(x), _draws(ctx, layer, random_bits)
        for start in range(0, layer.numel, bucket_size):
            b = slice(start, min(start + bucket_size, layer.numel))
            norm = _wire(v[b].norm().item())
            level = (v[b].abs() * (levels / norm) + u[b]).floor()
            layer.flat(out)[b] = torch.sign(v[b]) * level * (norm / levels)
    return out


@pytest.mark.parametrize("random_bits", [None, 16])
@pytest.mark.parametrize(("levels", "bucket_size"), [(7, 512), (1, 100), (127, 5000), (3, 7)])
def test_qsgd_equals_the_reference(levels, bucket_size, random_bits):
    (x,) = _grads(1)
    ctx = _ctx(step=3, rank=1, world_size=2)
    compressor = QSGD(levels=levels, bucket_size=bucket_size, random_bits=random_bits)
    out = compressor.decompress(compressor.compress(x, ctx), ctx)
    expected = _qsgd_reference(x, ctx, levels, bucket_size, random_bits)
    torch.testing.assert_close(out, expected, rtol=1e-15, atol=0)


def test_qsgd_buckets_stay_inside_layers():
    """A layer's result does not depend on what is around it in the bucket (DDP's layout changes)."""
    (x,) = _grads(1)
    compressor = QSGD(levels=3, bucket_size=100)
    full = compressor.decompress(compressor.compress(x, _ctx()), _ctx())
    layer = LAYERS[1]
    alone = (Layer(layer.name, layer.index, layer.shape, 0),)
    part = compressor.decompress(compressor.compress(layer.flat(x).clone(), _ctx(alone)), _ctx(alone))
    assert torch.equal(part, layer.flat(full))


@pytest.mark.parametrize("random_bits", [None, 16])
def test_qsgd_variance_bound(random_bits):
    """QSGD's Lemma 3.1: E ||Q(v) - v||^2 <= min(d / s^2, sqrt(d) / s) ||v||^2 for every bucket v."""
    layer = Layer("w", 0, torch.Size([4096]), 0)
    x = torch.randn(4096, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    for levels, bucket in ((1, 4096), (7, 512), (15, 64)):
        compressor = QSGD(levels=levels, bucket_size=bucket, random_bits=random_bits)
        errors = torch.stack(
            [
                (compressor.decompress(compressor.compress(x, _ctx((layer,), step=s)), _ctx((layer,), step=s)) - x)
                .square()
                .view(-1, bucket)
                .sum(1)
                for s in range(100)
            ]
        ).mean(0)
        bound = min(bucket / levels**2, math.sqrt(bucket) / levels) * x.view(-1, bucket).square().sum(1)
        assert torch.all(errors <= 1.1 * bound), (levels, bucket)


def test_qsgd_wire_size():
    compressor = QSGD(levels=7, bucket_size=512)
    telemetry = [Telemetry(), Telemetry()]
    for t in telemetry:
        t.add_bucket(NUMEL * 4)
    simulate_reduce(
        [copy.deepcopy(compressor) for _ in range(2)], _grads(2, dtype=torch.float32), LAYERS, telemetry=telemetry
    )
    norms = sum(math.ceil(layer.numel / 512) for layer in LAYERS)
    fields = sum(math.ceil(layer.numel * 4 / 8) for layer in LAYERS)  # 3 bits of level + 1 of sign
    aligned = lambda n: -(-n // 8) * 8  # noqa: E731
    assert telemetry[0].pop_step().bytes_sent == aligned(4 * norms) + aligned(fields) + 8  # + the non-finite flag


def test_qsgd_levels_are_validated():
    with pytest.raises(ValueError, match="`levels`"):
        QSGD(levels=128)
    with pytest.raises(ValueError, match="`bucket_size`"):
        QSGD(bucket_size=0)


@pytest.mark.parametrize("compressor", [QSGD, TernGrad])
@pytest.mark.parametrize("value", [8, 24, 16.0, True, "16"])
def test_random_bits_are_validated(compressor, value):
    with pytest.raises(ValueError, match=r"`random_bits` to be None or 16, got " + re.escape(repr(value))):
        compressor(random_bits=value)


def _terngrad_reference(grads, step, clip, random_bits=None):
    n = len(grads)
    clipped, scalers = [], []
    for x in grads:
        x = x.clone()
        local = []
        for layer in LAYERS:
            v = layer.flat(x)
            if clip is None:
                local.append(v.abs().max().item())
            else:
                bound = clip * (v - v.mean()).square().mean().sqrt()
                v.copy_(v.clamp(-bound, bound))
                local.append(bound.item())
        clipped.append(x)
        scalers.append(local)
    shared = [_wire(max(s[i] for s in scalers)) for i in range(len(LAYERS))]
    total = torch.zeros(NUMEL, dtype=torch.float64)
    for rank, x in enumerate(clipped):
        ctx = _ctx(step=step, rank=rank, world_size=n)
        for i, layer in enumerate(LAYERS):
            v = layer.flat(x)
            keep = _draws(ctx, layer, random_bits) * shared[i] < v.abs()  # Bernoulli(|g| / s)
            layer.flat(total).add_(torch.sign(v) * keep)
    return torch.cat([layer.flat(total) * shared[i] / n for i, layer in enumerate(LAYERS)])


@pytest.mark.parametrize("random_bits", [None, 16])
@pytest.mark.parametrize("aggregation", ["allreduce", "allgather"])
@pytest.mark.parametrize("clip", [2.5, None])
@pytest.mark.parametrize("ranks", [2, 3])
def test_terngrad_equals_the_reference(aggregation, clip, ranks, random_bits):
    """Different gradients per rank: shared max scaler, per-rank Bernoulli draws, exact integer sum, average."""
    grads = _grads(ranks, seed=ranks)
    compressors = [TernGrad(clip=clip, aggregation=aggregation, random_bits=random_bits) for _ in range(ranks)]
    outs = simulate_reduce(compressors, grads, LAYERS, step=4)
    expected = _terngrad_reference(grads, 4, clip, random_bits)
    for out in outs:
        torch.testing.assert_close(out, expected, rtol=1e-15, atol=0)
    if clip is not None:  # clipping bounds the values: at most the scaler
        assert all(out.abs().max() <= 2.5 * max(g.std() for g in grads) * 1.01 for out in outs)


@pytest.mark.parametrize(("ranks", "fields"), [(2, 21), (4, 15), (8, 12)])
def test_terngrad_wire_sizes(ranks, fields):
    """Sum-safe words: fields of ceil(log2(2 n + 1)) bits, 63 bits used per int64 word; all-gather: 2 bits."""
    for aggregation, values in (("allreduce", 8 * math.ceil(NUMEL / fields)), ("allgather", None)):
        telemetry = [Telemetry() for _ in range(ranks)]
        for t in telemetry:
            t.add_bucket(NUMEL * 4)
        simulate_reduce(
            [TernGrad(aggregation=aggregation) for _ in range(ranks)],
            _grads(ranks, dtype=torch.float32),
            LAYERS,
            telemetry=telemetry,
        )
        sent = telemetry[0].pop_step().bytes_payload  # what is handed to the collectives, before their factor
        if aggregation == "allreduce":
            assert sent == 4 * len(LAYERS) + 4 + values  # + 4: the non-finite flag rides with the scalers
        else:  # scalers and 2-bit values, each padded to whole 8-byte words
            assert sent == -(-4 * len(LAYERS) // 8) * 8 + 4 + -(-math.ceil(NUMEL / 4) // 8) * 8


def test_terngrad_is_unbiased_for_the_clipped_gradient():
    """Averaged over steps, the result approaches the clipped gradient (not the raw one)."""
    grads = _grads(2, seed=3)
    compressors = [TernGrad(), TernGrad()]
    mean = sum(simulate_reduce(compressors, grads, LAYERS, step=s)[0] for s in range(300)) / 300
    clipped = []
    for x in grads:
        x = x.clone()
        for layer in LAYERS:
            v = layer.flat(x)
            bound = 2.5 * (v - v.mean()).square().mean().sqrt()
            v.clamp_(-bound, bound)
        clipped.append(x)
    target, raw = (clipped[0] + clipped[1]) / 2, (grads[0] + grads[1]) / 2
    moved = (raw - target).abs() > 0.05  # where clipping changed the average
    direction = torch.sign(raw - target)[moved]
    assert ((mean - target)[moved] * direction).mean().abs() < 0.02  # no bias towards the raw gradient
    assert ((raw - mean)[moved] * direction).mean() > 0.2  # the raw gradient is clearly elsewhere


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64])
def test_terngrad_ternaries_follow_the_formula_at_special_values(dtype):
    """``t + 1`` is 2 where ``u s < |g|`` and ``g > 0``, 0 where ``u s < |g|`` and ``g <= 0``, else 1: at signed
    zeros, NaN, infinities, values equal to their draw, and a layer whose scaler is 0 (fp32 and fp64 take the NumPy
    comparisons, fp16 torch's)."""
    ctx = _ctx(step=2, dtype=dtype)
    x = torch.cat(_grads(1, seed=7, dtype=dtype))
    special = torch.tensor([float("nan"), float("inf"), float("-inf"), 0.0, -0.0, 1e-3, -1e-3], dtype=dtype)
    x[: special.numel()] = special
    scales = torch.tensor([1.0, 0.0, 2.0], dtype=torch.float32)
    compute = torch.promote_types(dtype, torch.float32)
    first = LAYERS[0]
    draws = uniform_draws(ctx, compute)  # the reference hash's (tests/test_draws.py)
    first.flat(x)[10:20] = (first.flat(draws)[10:20] * scales[0]).to(dtype)  # ties with the draw: not kept
    found = TernGrad()._ternarize(x, scales, ctx)
    for i, layer in enumerate(LAYERS):
        v = layer.flat(x)
        keep = layer.flat(draws) * scales[i].to(compute) < v.abs()
        expected = torch.where(keep, torch.where(v > 0, 2, 0), 1).to(torch.uint8)
        assert torch.equal(layer.flat(found), expected), layer.name
    assert found[:3].tolist() == [1, 2, 0]  # NaN never kept; +-inf always, with their signs


def test_terngrad_arguments_are_validated():
    with pytest.raises(ValueError, match="`clip`"):
        TernGrad(clip=0)
    with pytest.raises(ValueError, match="`aggregation`"):
        TernGrad(aggregation="sum")


def test_fp32_draws_carry_24_random_bits():
    """What docs/qsgd.md and docs/terngrad.md say of the draws: an fp32 uniform draw is a multiple of 2^-24 and
    uses all 24 bits, so rounding probabilities are resolved to 2^-24."""
    ctx = _ctx(layers=layers_from_shapes([(1000, 1000)]), dtype=torch.float32)
    draws = uniform_draws(ctx, torch.float32).double()
    assert bool((draws * 2**24 == (draws * 2**24).round()).all())
    assert bool((draws * 2**23 != (draws * 2**23).round()).any())  # the lowest bit is drawn too
    assert float(draws.min()) >= 0
    assert float(draws.max()) < 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_16bit_draws_are_cell_centres(dtype):
    """``random_bits=16``: every draw is ``(k + 1/2) 2^-16`` for ``k`` in [0, 2^16), exact in the compute dtype, and
    every cell and every bit of ``k`` is uniform."""
    ctx = _ctx(layers=layers_from_shapes([(1 << 10, 1 << 10)]), dtype=dtype)
    draws = uniform_draws(ctx, dtype, 16).double()
    k = draws * 2**16 - 0.5
    assert bool((k == k.round()).all())
    assert float(k.min()) >= 0
    assert float(k.max()) <= 2**16 - 1
    k = k.long()
    assert int(torch.bincount(k, minlength=1 << 16).min()) > 0  # 16 expected per cell: every cell is hit
    bits = (k[:, None] >> torch.arange(16)) & 1
    assert float((bits.double().mean(0) - 0.5).abs().max()) < 0.005  # 5 standard deviations at 2^20 draws


def test_16bit_draws_bias_is_at_most_2_to_the_minus_17():
    """What docs/qsgd.md says of ``random_bits=16``: over all 2^16 draws, ``E[floor(x + u)]`` (fp32 sums, as QSGD
    computes them) and ``P(u s < |g|)`` (TernGrad's keep) are within ``2^-17`` of ``x`` and ``|g| / s``."""
    cells = torch.arange(1 << 16, dtype=torch.float64).add_(0.5).div_(1 << 16).float()  # the values u can take
    g = torch.Generator().manual_seed(5)
    for top in (1.0, 8.0, 127.0):
        edges = torch.tensor([0.0, 2**-18, 2**-17, 1.5 * 2**-17, 1 - 2**-18])
        x = torch.cat([torch.rand(500, generator=g) * top, edges])
        expectation = torch.floor(x[:, None] + cells[None, :]).double().mean(1)
        assert float((expectation - x.double()).abs().max()) <= 2**-17, top
    s = torch.tensor(0.37)
    g_abs = torch.rand(500, generator=g) * s
    keep = ((cells[None, :] * s) < g_abs[:, None]).double().mean(1)
    assert float((keep - g_abs.double() / s.double()).abs().max()) <= 2**-17 + 1e-7  # + the product's rounding
