"""Sign compressors against their papers' formulas: majority vote, Signum, EF-signSGD, 1-bit SGD."""

import copy

import pytest
import torch

from lightning_gradcomp.compressors import EFSignSGD, OneBit, SignSGD
from lightning_gradcomp.compressors.base import BucketContext, Compressor, Layer, LayerBuffers, layers_from_shapes
from lightning_gradcomp.compressors.ops.packing import unpack_bits
from lightning_gradcomp.compressors.sign import _group_width, _looked_up_codes, _rank_codes
from lightning_gradcomp.engine.requests import StepUpdates
from lightning_gradcomp.engine.telemetry import Telemetry
from lightning_gradcomp.testing import simulate_reduce

LAYERS = layers_from_shapes([(20, 30), (7,), (8, 3, 3, 3)])
NUMEL = sum(layer.numel for layer in LAYERS)


def _grads(n, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(NUMEL, generator=g, dtype=dtype) for _ in range(n)]


def _sign(x):
    return torch.where(x >= 0, 1.0, -1.0).to(x.dtype)


@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 5, 8, 9])  # 9: more ranks than one lookup takes
def test_majority_vote(ranks):
    grads = _grads(ranks)
    grads[0][:5] = 0.0  # a zero votes +1
    outs = simulate_reduce([SignSGD() for _ in range(ranks)], grads, LAYERS)
    expected = torch.sign(sum(_sign(g) for g in grads))
    for out in outs:
        assert torch.equal(out, expected)
    if ranks % 2 == 0:
        assert (expected == 0).any(), "an even number of ranks can tie"


def test_signum_momentum_over_steps():
    compressors = [SignSGD(momentum=0.9) for _ in range(3)]
    momenta = [torch.zeros(NUMEL, dtype=torch.float64) for _ in range(3)]
    for step in range(4):
        grads = _grads(3, seed=step)
        outs = simulate_reduce(compressors, grads, LAYERS, step=step)
        for m, g in zip(momenta, grads):
            m.mul_(0.9).add_(g, alpha=0.1)
        torch.testing.assert_close(outs[0], torch.sign(sum(_sign(m) for m in momenta)), rtol=0, atol=0)
    restored = [SignSGD(momentum=0.9) for _ in range(3)]
    for r, c in zip(restored, compressors):
        r.load_state_dict(copy.deepcopy(c.state_dict()))
    grads = _grads(3, seed=9)
    assert torch.equal(
        simulate_reduce(restored, grads, LAYERS, step=4)[0], simulate_reduce(compressors, grads, LAYERS, step=4)[0]
    )


def test_signsgd_sends_one_bit_per_element_and_refuses_error_feedback():
    telemetry = [Telemetry(), Telemetry()]
    for t in telemetry:
        t.add_bucket(NUMEL * 4)
    simulate_reduce([SignSGD(), SignSGD()], _grads(2, dtype=torch.float32), LAYERS, telemetry=telemetry)
    # the packed signs and the non-finite flag, packed together at 8-byte aligned offsets
    assert telemetry[0].pop_step().bytes_sent == -(-((NUMEL + 7) // 8) // 8) * 8 + 8
    assert SignSGD().compresses(LAYERS[1], 10**9), "every layer takes sign steps, biases too"
    with pytest.raises(ValueError, match="EFSignSGD"):
        simulate_reduce([SignSGD(), SignSGD()], _grads(2), LAYERS, residuals=[torch.zeros(NUMEL)] * 2)


def test_bad_momentum_is_refused():
    with pytest.raises(ValueError, match="`momentum`"):
        SignSGD(momentum=1.0)


def _per_layer(compressor, x):
    ctx = BucketContext(index=0, step=0, rank=0, world_size=1, layers=LAYERS, dtype=x.dtype)
    return compressor.decompress(compressor.compress(x, ctx), ctx)


def test_efsignsgd_is_the_scaled_sign_per_layer():
    (x,) = _grads(1)
    out = _per_layer(EFSignSGD(), x)
    for layer in LAYERS:
        p = layer.flat(x)
        scale = torch.tensor(p.abs().mean().item(), dtype=torch.float32).double()  # sent as fp32
        torch.testing.assert_close(layer.flat(out), scale * _sign(p), rtol=0, atol=0)


def test_efsignsgd_error_feedback_over_steps():
    """The paper's update with error feedback: p = g + e, delta = |p|_1 / d sign(p), e = p - delta (per rank)."""
    compressors = [EFSignSGD(), EFSignSGD()]
    residuals = [torch.zeros(NUMEL, dtype=torch.float64) for _ in range(2)]
    errors = [torch.zeros(NUMEL, dtype=torch.float64) for _ in range(2)]
    for step in range(3):
        grads = _grads(2, seed=10 + step)
        out = simulate_reduce(compressors, grads, LAYERS, step=step, residuals=residuals)[0]
        deltas = []
        for r in range(2):
            p = grads[r] + errors[r]
            delta = torch.cat(
                [
                    torch.tensor(layer.flat(p).abs().mean().item(), dtype=torch.float32).double() * _sign(layer.flat(p))
                    for layer in LAYERS
                ]
            )
            errors[r] = p - delta
            deltas.append(delta)
        torch.testing.assert_close(out, (deltas[0] + deltas[1]) / 2, rtol=0, atol=1e-15)
        for e, res in zip(errors, residuals):
            torch.testing.assert_close(res, e, rtol=0, atol=1e-15)


def test_onebit_reconstructs_with_the_mean_of_each_sign():
    (x,) = _grads(1)
    x[:10] = 0.0
    out = _per_layer(OneBit(), x)
    for layer in LAYERS:
        p = layer.flat(x)
        pos, neg = p[p >= 0].mean(), p[p < 0].mean()
        expected = torch.where(p >= 0, pos.float().double(), neg.float().double())
        torch.testing.assert_close(layer.flat(out), expected, rtol=0, atol=1e-15)
        # the two means minimise the squared error among reconstructions that use the signs
        for shift in (1e-3, -1e-3):
            worse = torch.where(p >= 0, pos + shift, neg + shift)
            assert (p - worse).square().sum() > (p - layer.flat(out)).square().sum()


def test_onebit_with_one_sign_only():
    x = torch.rand(NUMEL, dtype=torch.float64)  # no negative entries: that mean is never used
    out = _per_layer(OneBit(), x)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[: LAYERS[0].numel].mean(), x[: LAYERS[0].numel].mean(), rtol=1e-6, atol=0)


@pytest.mark.parametrize(("compressor", "scales"), [(EFSignSGD(), 1), (OneBit(), 2)])
def test_payload_is_one_bit_per_element_plus_fp32_scales(compressor, scales):
    telemetry = [Telemetry(), Telemetry()]
    for t in telemetry:
        t.add_bucket(NUMEL * 4)
    simulate_reduce(
        [copy.deepcopy(compressor) for _ in range(2)],
        _grads(2, dtype=torch.float32),
        LAYERS,
        residuals=[torch.zeros(NUMEL), torch.zeros(NUMEL)],
        telemetry=telemetry,
    )
    aligned = lambda n: -(-n // 8) * 8  # noqa: E731 (all-gather packs the two tensors at 8-byte offsets)
    flag = 8  # the non-finite flag: one more aligned word
    assert telemetry[0].pop_step().bytes_sent == aligned((NUMEL + 7) // 8) + aligned(4 * scales * len(LAYERS)) + flag


@pytest.mark.parametrize("compressor", [EFSignSGD(), OneBit()], ids=["efsignsgd", "onebit"])
@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 5, 8, 9])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_the_table_aggregate_is_decoding_and_adding_bit_for_bit(compressor, ranks, dtype):
    """The lookup over every rank's bits gives the bits of Compressor.aggregate (decode each payload, add in rank
    order from ``+0.0``): layers that start and end inside a lookup's group of elements, signed zeros (a zero scale,
    ``-0.0`` values), NaN and infinite scales, and more ranks than one lookup takes (9: the default path); and the
    average, the tables divided by the world size, against the decoded sum divided."""
    layers = layers_from_shapes([(5, 3), (1,), (2, 4, 3), (6,), (37,)])  # offsets 0, 15, 16, 40, 46
    numel = sum(layer.numel for layer in layers)
    g = torch.Generator().manual_seed(ranks)
    ctx = BucketContext(index=0, step=0, rank=0, world_size=ranks, layers=layers, dtype=dtype)
    payloads = []
    for r in range(ranks):
        x = torch.randn(numel, generator=g, dtype=torch.float64).to(dtype)
        x[layers[0].offset : layers[0].offset + layers[0].numel] = 0.0  # a zero scale / mean
        x[layers[3].offset] = -0.0
        payloads.append(compressor.compress(x, ctx))
    for packed, values in payloads:  # -0.0 on the wire: -0.0 where a bit is set, +0.0 where clear; -0.0 + 0.0 is +0.0
        values[0] = -0.0
    if ranks > 1:  # a NaN and an infinity on the wire, in different layers
        payloads[1][1][2] = float("nan")
        payloads[-1][1][-1] = float("inf")
    expected = Compressor.aggregate(compressor, payloads, ctx)
    found = compressor.aggregate(payloads, ctx, out=torch.full((numel,), 7.0, dtype=dtype))
    # the average: the tables divided by the world size, the bits of dividing the decoded sum
    expected_average = expected.clone().div_(ranks)
    found_average = compressor.average(payloads, ctx, out=torch.full((numel,), 7.0, dtype=dtype))
    for found, expected in ((found, expected), (found_average, expected_average)):
        assert found.dtype == dtype
        nan = expected.isnan()  # NaN's sign bit differs between torch's bfloat16 kernels: a NaN is all that counts
        assert torch.equal(found.isnan(), nan)
        assert torch.equal(found[~nan].view(torch.uint8), expected[~nan].view(torch.uint8))


@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 5, 8])
def test_rank_codes_put_every_ranks_bits_side_by_side(ranks):
    """Code ``i`` holds bit ``j`` of rank ``r``'s element ``width i + j`` at bit ``r width + j``, from the bits
    themselves; the elementwise codes of one and two ranks are the lookup's, byte for byte."""
    width = _group_width(ranks)
    g = torch.Generator().manual_seed(ranks)
    packed = [torch.randint(0, 256, (13,), generator=g, dtype=torch.uint8) for _ in range(ranks)]
    bits = torch.stack([unpack_bits(p, 13 * 8).long() for p in packed])  # [rank, element]
    weights = 2 ** torch.arange(ranks * width).view(ranks, 1, width)
    expected = (bits.view(ranks, -1, width) * weights).sum(dim=(0, 2))
    found = _rank_codes(packed, width)
    assert found.dtype == torch.uint8
    assert torch.equal(found.long(), expected)
    assert torch.equal(found, _looked_up_codes(packed, width))


def test_signum_momentum_is_bitwise_the_per_layer_update_across_a_bucket_rebuild() -> None:
    """Signum's momentum is updated a bucket at once (its layers' buffers are views of one flat tensor), yet it is
    still kept and saved per layer: after a rebuild into other buckets, and after a load, it goes on bitwise as
    ``m <- beta m + (1 - beta) g`` layer by layer."""
    layers = layers_from_shapes([(30,), (7, 5), (100,)])
    beta = 0.9
    compressor = SignSGD(momentum=beta)
    expected = {layer.name: torch.zeros(layer.numel) for layer in layers}
    generator = torch.Generator().manual_seed(3)
    layouts = [layers, layers[:1], layers[1:]]  # one bucket, then DDP's rebuild into two
    for step in range(4):
        for bucket in layouts[:1] if step < 2 else layouts[1:]:
            offsets = [sum(layer.numel for layer in bucket[:i]) for i in range(len(bucket))]
            bucket = tuple(Layer(layer.name, layer.index, layer.shape, at) for layer, at in zip(bucket, offsets))
            g = torch.randn(sum(layer.numel for layer in bucket), generator=generator)
            for layer in bucket:
                expected[layer.name] = torch.mul(layer.flat(g), 1 - beta).add_(expected[layer.name], alpha=beta)
            ctx = BucketContext(index=0, step=step, rank=0, world_size=1, layers=bucket, updates=StepUpdates())
            compressor._momentum_step(g, ctx)
            ctx.updates.commit()
        if step == 2:  # a resume: the per-layer state loaded into a fresh compressor
            state = compressor.state_dict()
            compressor = SignSGD(momentum=beta)
            compressor.load_state_dict(state)
    saved = compressor.state_dict()["momentum"]
    assert set(saved) == set(expected)
    for name, value in expected.items():
        assert torch.equal(saved[name], value), name
    assert isinstance(compressor.layer_state("momentum"), LayerBuffers)
