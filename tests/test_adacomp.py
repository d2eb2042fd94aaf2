"""AdaComp against a bin-by-bin reference of the operator's algorithm, and its fixed-size payload on the wire."""

import math

import pytest
import torch

from lightning_gradcomp.compressors import AdaComp
from lightning_gradcomp.compressors.adacomp import pack_trits, unpack_trits
from lightning_gradcomp.compressors.base import BucketContext, Layer, layers_from_shapes
from lightning_gradcomp.compressors.transports.two_phase import owner_residuals
from lightning_gradcomp.engine.telemetry import Telemetry
from lightning_gradcomp.engine.wire_model import traced_wire_bytes
from lightning_gradcomp.testing import SimulatedWorld, simulate_reduce

# a convolution (bins of 50), a fully-connected layer (bins of 500) with a short last bin
LAYERS = layers_from_shapes([(16, 8, 3, 3), (30, 70)], names=["conv.weight", "fc.weight"])
NUMEL = sum(layer.numel for layer in LAYERS)


def _grads(n, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(NUMEL, generator=g, dtype=dtype) * (1 + r) for r in range(n)]


def _reference_step(grad, residue, bins=(50, 500)):
    """One rank, bin by bin in Python: G = R + dW, H = G + dW, select |H| >= max |G| of the bin (a bin of zeros:
    nothing), send +-(mean of the bin maxima) by the sign of G (G > 0: plus); R = G - sent."""
    sent = torch.zeros_like(grad)
    new_residue = torch.zeros_like(grad)
    for layer, size in zip(LAYERS, bins):
        g = layer.flat(residue) + layer.flat(grad)
        h = g + layer.flat(grad)
        maxima = [g[s : s + size].abs().max() for s in range(0, layer.numel, size)]
        scale = torch.tensor(sum(m.item() for m in maxima) / len(maxima), dtype=torch.float32).double()
        out = layer.flat(sent)
        for b, start in enumerate(range(0, layer.numel, size)):
            for j in range(start, min(start + size, layer.numel)):
                if abs(h[j]) >= maxima[b] and maxima[b] > 0:
                    out[j] = scale if g[j] > 0 else -scale
        layer.flat(new_residue).copy_(g - out)
    return sent, new_residue


def test_adacomp_equals_the_reference_over_steps():
    compressors = [AdaComp(), AdaComp()]
    residuals = [torch.zeros(NUMEL, dtype=torch.float64) for _ in range(2)]
    reference = [torch.zeros(NUMEL, dtype=torch.float64) for _ in range(2)]
    for step in range(4):
        grads = _grads(2, seed=step)
        outs = simulate_reduce(compressors, grads, LAYERS, step=step, residuals=residuals)
        sent = []
        for r in range(2):
            s, reference[r] = _reference_step(grads[r], reference[r])
            sent.append(s)
        for out in outs:
            torch.testing.assert_close(out, (sent[0] + sent[1]) / 2, rtol=1e-6, atol=1e-12)  # fp32 mean vs sum
        for r in range(2):
            torch.testing.assert_close(residuals[r], reference[r], rtol=1e-6, atol=1e-12)


def _counts(payload):
    """How many elements of each layer a payload sends (its non-zero codes)."""
    codes = unpack_trits(payload[0], NUMEL)
    return [int(torch.count_nonzero(layer.flat(codes))) for layer in LAYERS]


def test_one_dominant_element_per_bin_is_all_that_is_sent():
    """With no residue, a bin with one dominant gradient sends exactly that element (the paper's adaptivity)."""
    x = torch.full((NUMEL,), 0.01, dtype=torch.float64)
    dominant = []
    for layer, size in zip(LAYERS, (50, 500)):
        for start in range(0, layer.numel, size):
            j = layer.offset + start + (start * 7) % min(size, layer.numel - start)
            x[j] = 5.0
            dominant.append(j)
    ctx = BucketContext(index=0, step=0, rank=0, world_size=1, layers=LAYERS, dtype=torch.float64)
    payload = AdaComp().compress(x, ctx)
    assert _counts(payload) == [math.ceil(LAYERS[0].numel / 50), math.ceil(LAYERS[1].numel / 500)]
    out = AdaComp().decompress(payload, ctx)
    assert torch.nonzero(out).squeeze(1).tolist() == dominant


def test_the_latest_gradient_decides_between_equal_residues():
    """Two elements with the same residue: the one whose new gradient agrees with it is sent, the other is not."""
    layer = (Layer("fc.weight", 0, torch.Size([1, 500]), 0),)
    residue = torch.zeros(500, dtype=torch.float64)
    residue[[10, 20]] = 1.0
    grad = torch.zeros(500, dtype=torch.float64)
    grad[10], grad[20] = 0.2, -0.2  # G = 1.2 and 0.8; H = 1.4 and 0.6; max |G| = 1.2
    out = simulate_reduce([AdaComp()], [grad], layer, residuals=[residue])[0]
    assert torch.nonzero(out).squeeze(1).tolist() == [10]


def test_an_all_zero_bin_sends_nothing():
    x = torch.zeros(NUMEL, dtype=torch.float64)
    x[:50] = torch.linspace(-1, 1, 50, dtype=torch.float64)
    ctx = BucketContext(index=0, step=0, rank=0, world_size=1, layers=LAYERS, dtype=torch.float64)
    counts = _counts(AdaComp().compress(x, ctx))
    assert counts[1] == 0
    assert 0 < counts[0] <= 50


@pytest.mark.parametrize("n", [0, 1, 4, 5, 6, 1001])
def test_codes_pack_five_to_a_byte(n):
    codes = torch.randint(0, 3, (n,), generator=torch.Generator().manual_seed(n), dtype=torch.uint8)
    packed = pack_trits(codes)
    assert packed.dtype == torch.uint8
    assert packed.numel() == math.ceil(n / 5)
    assert torch.equal(unpack_trits(packed, n), codes)


def test_payloads_are_fixed_size_whatever_is_selected():
    """One all-gather of ``ceil(d / 5)`` bytes of codes and one fp32 scale per layer, however many are sent: a rank
    that sends nothing from a layer moves as many bytes as one that sends much."""
    grads = _grads(3, seed=7, dtype=torch.float32)
    grads[2][: LAYERS[0].numel] = 0.0  # rank 2 sends nothing from the convolution
    ctx = BucketContext(index=0, step=0, rank=0, world_size=1, layers=LAYERS, dtype=torch.float32)
    counts = [_counts(AdaComp().compress(g, ctx)) for g in grads]
    assert counts[2][0] == 0 < counts[0][0]
    telemetry = [Telemetry() for _ in range(3)]
    for t in telemetry:
        t.add_bucket(NUMEL * 4)
    gathering = [AdaComp(transport="allgather") for _ in range(3)]  # "auto" would take the two-phase exchange at 3
    world_checked = simulate_reduce(gathering, grads, LAYERS, telemetry=telemetry)
    assert all(torch.equal(world_checked[0], out) for out in world_checked)
    aligned = lambda n: -(-n // 8) * 8  # noqa: E731
    # the codes, the scales and the non-finite flag (one aligned word)
    expected = aligned(math.ceil(NUMEL / 5)) + aligned(4 * len(LAYERS)) + 8
    for t in telemetry:
        assert t.pop_step().bytes_payload == expected  # handed to the collective (the wire: n - 1 times at 3 ranks)


def test_one_round():
    world = SimulatedWorld(2)
    from lightning_gradcomp.engine.comm import Comm

    futures = []
    for rank, g in enumerate(_grads(2, seed=1, dtype=torch.float32)):
        ctx = BucketContext(
            index=0,
            step=0,
            rank=rank,
            world_size=2,
            layers=LAYERS,
            dtype=torch.float32,
            comm=Comm(world.backend(rank), Telemetry(), g.device),
        )
        futures.append(AdaComp().reduce(g, ctx))
    world.assert_quiescent()
    assert [kind for _, kind in world.issued] == [("all_gather",)] * 2  # the payloads, from both ranks
    assert torch.equal(futures[0].wait(), futures[1].wait())


def test_bin_sizes_per_layer_type():
    compressor = AdaComp(bin_size_conv=40, bin_size_fc=300)
    assert [compressor.bin_size(layer) for layer in LAYERS] == [40, 300]
    with pytest.raises(ValueError, match="`bin_size_fc`"):
        AdaComp(bin_size_fc=0)


@pytest.mark.parametrize("n", [3, 4])
def test_two_phase_error_feedback_telescopes_through_the_owners(n):
    """Over 5 steps at N ranks (a padded last shard): sum of aggregates + mean of the ranks' residuals + the owners'
    residuals == sum of the mean gradients; every rank holds the same aggregate."""
    compressors = [AdaComp(transport="two_phase") for _ in range(n)]
    residuals = [torch.zeros(NUMEL, dtype=torch.float64) for _ in range(n)]
    applied = torch.zeros(NUMEL, dtype=torch.float64)
    computed = torch.zeros(NUMEL, dtype=torch.float64)
    for step in range(5):
        grads = _grads(n, seed=40 + step)
        outs = simulate_reduce(compressors, grads, LAYERS, step=step, residuals=residuals)
        assert all(torch.equal(outs[0], o) for o in outs)
        applied += outs[0]
        computed += sum(grads) / n
    ctx = BucketContext(index=0, step=0, rank=0, world_size=n, layers=LAYERS, dtype=torch.float64)
    by_owners = owner_residuals(compressors, ctx)
    assert by_owners.abs().sum() > 0, "the re-encoding loses something: the owners keep it"
    torch.testing.assert_close(applied + sum(residuals) / n + by_owners, computed, rtol=1e-9, atol=1e-9)


def test_two_phase_owner_sends_adacomp_codes_of_the_average():
    """At 3 ranks without error feedback: every element of the result is 0 or +-(its piece's scale) of the owner's
    AdaComp selection over the ranks' averaged first encodings, which the test recomputes shard by shard."""
    n = 3
    grads = _grads(n, seed=5, dtype=torch.float32)
    outs = simulate_reduce([AdaComp(transport="two_phase") for _ in range(n)], grads, LAYERS)
    ctx = BucketContext(index=0, step=0, rank=0, world_size=1, layers=LAYERS, dtype=torch.float32)
    first = [AdaComp().decompress(AdaComp().compress(g, ctx), ctx) for g in grads]  # H = 2 G: no residue
    average = (first[0] + first[1] + first[2]) / n
    size = -(-NUMEL // n)
    expected = torch.zeros(NUMEL)
    for shard in range(n):
        lo, hi = shard * size, min((shard + 1) * size, NUMEL)
        pieces = []
        for layer in LAYERS:
            start, stop = max(lo, layer.offset), min(hi, layer.offset + layer.numel)
            if start < stop:
                shape = torch.Size((stop - start, *([1] * (layer.ndim - 1))))
                pieces.append(Layer(layer.name, layer.index, shape, start - lo))
        owner = BucketContext(index=0, step=0, rank=0, world_size=1, layers=tuple(pieces), dtype=torch.float32)
        part = average[lo:hi].clone()
        expected[lo:hi] = AdaComp().decompress(AdaComp().compress(part, owner), owner)
    assert all(torch.equal(outs[0], o) for o in outs)
    torch.testing.assert_close(outs[0], expected, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    ("transport", "n", "two_phase"),
    [("auto", 2, False), ("auto", 3, True), ("two_phase", 2, True), ("allgather", 8, False)],
)
def test_auto_takes_the_two_phase_exchange_from_three_ranks(transport, n, two_phase):
    ctx = BucketContext(index=0, step=0, rank=0, world_size=n, layers=LAYERS, dtype=torch.float32)
    assert AdaComp(transport=transport).two_phase(ctx) is two_phase


def test_two_phase_bytes_per_rank_stay_flat():
    """What a rank receives against a dense fp32 ring all-reduce: the all-gather grows with N, the two-phase exchange
    stays at about two encodings (2 x 1.6 bits of 32, plus the scales)."""
    layers = layers_from_shapes([(64, 32, 3, 3), (256, 64)])
    fractions = {}
    for transport in ("allgather", "two_phase"):
        for n in (2, 16):
            moved = traced_wire_bytes(AdaComp(transport=transport), layers, n, error_feedback=True)
            numel = sum(layer.numel for layer in layers)
            fractions[transport, n] = moved.received / (2 * (n - 1) / n * 4 * numel)
    assert fractions["allgather", 16] > 7 * fractions["allgather", 2]
    assert fractions["two_phase", 16] < 0.12
    assert fractions["two_phase", 16] < 1.2 * fractions["two_phase", 2]
