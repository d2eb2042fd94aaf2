"""The sparsifiers' two-phase exchange (TopK, DGC, SparseLoCo) against references computed here, and its bytes."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from lightning_gradcomp import CompressionState, compression_hook
from lightning_gradcomp.compressors import DGC, SparseLoCo, TopK
from lightning_gradcomp.compressors.base import BucketContext, layers_from_shapes
from lightning_gradcomp.compressors.transports.hashed_sum import owner_of, zen_seed
from lightning_gradcomp.compressors.transports.sparse_shards import capacity, reselected, two_phase_wire
from lightning_gradcomp.compressors.transports.two_phase import owner_residuals
from lightning_gradcomp.engine import wire
from lightning_gradcomp.engine.telemetry import Telemetry
from lightning_gradcomp.engine.wire_model import bucket_wire_bytes, traced_wire_bytes
from lightning_gradcomp.testing import simulate_reduce
from tests.distributed import run_distributed

SHAPES = [(24, 30), (40, 9), (7, 5, 3, 3)]  # 720 + 360 + 315 elements


def _layers():
    return layers_from_shapes(SHAPES)


def _grads(n, seed, dtype=torch.float64):
    numel = sum(layer.numel for layer in _layers())
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(numel, generator=g, dtype=dtype) for _ in range(n)]


def _ctx(n, rank=0, seed=0, dtype=torch.float64):
    layers = _layers()
    return BucketContext(
        index=0, step=0, rank=rank, world_size=n, layers=layers, dtype=dtype, seed=seed, device=torch.device("cpu")
    )


class _TopKReference:
    """TopK's two-phase exchange written out element by element: routing, owners' sums, re-selection, owed debts."""

    def __init__(self, ratio, n):
        self.ratio, self.n = ratio, n
        self.owed = torch.zeros(sum(layer.numel for layer in _layers()), dtype=torch.float64)
        self.unsent = 0  # pairs an owner's row had no slot for

    def step(self, xs):
        n, ctx = self.n, _ctx(self.n)
        numel = xs[0].numel()
        owners = owner_of(torch.arange(numel), n, zen_seed(ctx))
        k = sum(max(1, int(layer.numel * self.ratio)) for layer in _layers())
        slots, keep = capacity(k, n), reselected(k, n)
        residuals, sums = [], torch.zeros(numel, dtype=torch.float64)
        for x in xs:  # rank order
            # TopK's own call (unsorted): the order the pairs are routed in
            picked = torch.cat(
                [
                    torch.topk(layer.flat(x).abs(), max(1, int(layer.numel * self.ratio)), sorted=False).indices
                    + layer.offset
                    for layer in _layers()
                ]
            )
            taken = dict.fromkeys(range(n), 0)
            residual = x.clone()
            for i in picked.tolist():
                p = int(owners[i])
                if taken[p] < slots:  # the first C pairs per owner, in selection order
                    taken[p] += 1
                    sums[i] += x[i]
                    residual[i] = 0.0
                else:
                    self.unsent += 1
            residuals.append(residual)
        average = sums / n + self.owed
        out = torch.zeros(numel, dtype=torch.float64)
        for p in range(n):
            mine = torch.nonzero(owners == p).squeeze(1)
            best = mine[torch.topk(average[mine].abs(), keep).indices]
            out[best] = average[best]
        self.owed = average - out
        return out, residuals


@pytest.mark.parametrize(("n", "ratio"), [(3, 0.05), (4, 0.05), (8, 0.005)])
def test_topk_two_phase_matches_the_reference_over_steps(n, ratio):
    """Every rank ends with the reference's average, bitwise alike; the ranks' and the owners' debts are the
    reference's; with 5 pairs per rank over 8 owners (rows of 2 slots) some pairs find no slot and stay owed."""
    compressors = [TopK(ratio=ratio, transport="two_phase") for _ in range(n)]
    reference = _TopKReference(ratio, n)
    numel = sum(layer.numel for layer in _layers())
    residuals = [torch.zeros(numel, dtype=torch.float64) for _ in range(n)]
    for step in range(3):
        grads = _grads(n, seed=10 + step)
        xs = [g + r for g, r in zip(grads, residuals)]
        expected, expected_residuals = reference.step(xs)
        outs = simulate_reduce(compressors, grads, _layers(), step=step, residuals=residuals)
        for out in outs:
            assert torch.equal(out, outs[0])
        torch.testing.assert_close(outs[0], expected, rtol=1e-12, atol=1e-12)
        for got, want in zip(residuals, expected_residuals):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        torch.testing.assert_close(owner_residuals(compressors, _ctx(n)), reference.owed, rtol=1e-12, atol=1e-12)
    assert (reference.unsent > 0) == (ratio < 0.01), reference.unsent


def test_sparseloco_two_phase_is_the_chunk_encoding_of_the_average_of_the_encodings():
    """At the first step the owners hold nothing: the result is SparseLoCo's own encoding of the fp32 average of the
    ranks' encodings (chunk by chunk, so the owners' rows together encode the whole bucket), on every rank."""
    n = 3
    make = lambda transport: SparseLoCo(ratio=0.05, chunk_size=64, transport=transport)  # noqa: E731
    grads = _grads(n, seed=4, dtype=torch.float32)
    outs = simulate_reduce(
        [make("two_phase") for _ in range(n)],
        grads,
        _layers(),
        residuals=[torch.zeros_like(grads[0]) for _ in range(n)],
    )
    codec, ctx = make("allgather"), _ctx(n, dtype=torch.float32)
    average = torch.zeros_like(grads[0])
    for g in grads:
        average += codec.decompress(codec.compress(g, ctx), ctx)
    expected = codec.decompress(codec.compress(average / n, ctx), ctx)
    for out in outs:
        assert torch.equal(out, outs[0])
    torch.testing.assert_close(outs[0], expected, rtol=0, atol=1e-7)


def test_dgc_two_phase_with_momentum_agrees_across_ranks_and_masks_what_went():
    """Momentum correction and factor masking over the two-phase exchange: the ranks agree bitwise, and a rank's
    momentum is zero exactly where its residual was cleared (what went out of ``v``)."""
    n = 4
    compressors = [DGC(ratio=0.05, transport="two_phase") for _ in range(n)]
    numel = sum(layer.numel for layer in _layers())
    residuals = [torch.zeros(numel, dtype=torch.float64) for _ in range(n)]
    for step in range(3):
        outs = simulate_reduce(compressors, _grads(n, seed=20 + step), _layers(), step=step, residuals=residuals)
        assert all(torch.equal(out, outs[0]) for out in outs)
        assert outs[0].abs().sum() > 0
    for compressor, residual in zip(compressors, residuals):
        momenta = compressor.state_dict()["momentum"]
        for layer in _layers():
            cleared = layer.flat(residual) == 0
            assert cleared.any()
            assert torch.all(momenta[layer.name][cleared] == 0)


@pytest.mark.parametrize(
    ("factory", "n"),
    [
        (lambda: TopK(ratio=0.05), 8),
        (lambda: DGC(ratio=0.05, momentum=0.0), 5),
        (lambda: SparseLoCo(ratio=0.05, chunk_size=64), 4),
    ],
    ids=["topk", "dgc", "sparseloco"],
)
def test_the_byte_model_is_what_the_telemetry_counts(factory, n):
    """Defaults (``"auto"``) at a world size where they take the two-phase exchange: what each rank's telemetry
    counted equals the declared byte model (the traced requests); for TopK also the closed form."""
    layers = _layers()
    numel = sum(layer.numel for layer in layers)
    telemetry = [Telemetry() for _ in range(n)]
    for t in telemetry:
        t.add_bucket(4 * numel)
    residuals = [torch.zeros(numel) for _ in range(n)]
    grads = _grads(n, seed=5, dtype=torch.float32)
    compressors = [factory() for _ in range(n)]
    assert compressors[0].rounds == 2
    simulate_reduce(compressors, grads, layers, residuals=residuals, telemetry=telemetry)
    stats = [t.pop_step() for t in telemetry]
    counted = wire.Wire(sum(s.bytes_sent for s in stats) / n, sum(s.bytes_received for s in stats) / n)
    model = traced_wire_bytes(factory(), layers, n, error_feedback=True)
    assert math.isclose(counted.sent, model.sent)
    assert math.isclose(counted.received, model.received)
    if isinstance(compressors[0], TopK):
        k = sum(max(1, int(layer.numel * 0.05)) for layer in layers)
        flag = wire.all_gather(8, n)  # the non-finite flag rides on the pull, packed
        closed = two_phase_wire(k, n, 4) + flag
        assert math.isclose(model.sent, closed.sent)
        assert math.isclose(model.received, closed.received)
        assert model.moved < wire.all_gather(8 * k, n).moved


def test_auto_takes_the_two_phase_exchange_where_it_moves_fewer_bytes():
    """TopK's ``"auto"`` keeps the all-gather up to 3 ranks (2 k s and (2 k + k) s against 1 and 2 payloads),
    takes the two-phase exchange from 4 on; SparseLoCo's (two encodings) from 3; and the bytes stay flat in N."""
    layers = _layers()
    for n, topk, sparseloco in [(1, False, False), (2, False, False), (3, False, True), (4, True, True)]:
        ctx = _ctx(n, dtype=torch.float32)
        k = sum(max(1, int(layer.numel * 0.05)) for layer in layers)
        assert TopK(ratio=0.05).sparse_two_phase(ctx, k, 8 * k) is topk
        assert SparseLoCo(ratio=0.05, chunk_size=64).two_phase(ctx) is sparseloco
    k = max(1, int(0.01 * 2**20))
    fractions = [two_phase_wire(k, n, 4).moved / wire.all_reduce(4 * 2**20, n).moved for n in (4, 64, 1024)]
    assert max(fractions) <= 2 * 8 * k / (4 * 2**20)
    assert math.isclose(fractions[0], fractions[2], rel_tol=0.2)


@pytest.mark.parametrize("n", [2, 3])
def test_auto_below_its_threshold_is_the_all_gather_bitwise(n):
    """Where ``"auto"`` keeps the all-gather (TopK and DGC up to 3 ranks, SparseLoCo at 2), it is
    ``transport="allgather"`` bit for bit, residuals included."""
    makers = [lambda t: TopK(ratio=0.05, transport=t), lambda t: DGC(ratio=0.05, transport=t)]
    if n == 2:
        makers.append(lambda t: SparseLoCo(ratio=0.05, chunk_size=64, transport=t))
    for make in makers:
        results = []
        for transport in ("auto", "allgather"):
            compressors = [make(transport) for _ in range(n)]
            residuals = [torch.zeros(sum(layer.numel for layer in _layers()), dtype=torch.float64) for _ in range(n)]
            outs = [
                simulate_reduce(compressors, _grads(n, seed=30 + step), _layers(), step=step, residuals=residuals)
                for step in range(2)
            ]
            results.append((outs, residuals))
        (auto, auto_residuals), (gathered, gathered_residuals) = results
        assert all(torch.equal(x, y) for at, gt in zip(auto, gathered) for x, y in zip(at, gt))
        assert all(torch.equal(x, y) for x, y in zip(auto_residuals, gathered_residuals))


def _train_on_gloo(rank: int, world_size: int) -> dict:
    """Three steps of a two-layer MLP under DDP with each default sparsifier's hook; replicas and bytes per step."""
    out = {}
    for name, make in (
        ("topk", lambda: TopK(ratio=0.05)),
        ("dgc", lambda: DGC(ratio=0.05, momentum=0.0)),
        ("sparseloco", lambda: SparseLoCo(ratio=0.05, chunk_size=256)),
    ):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32))
        ddp = DDP(model)
        state = CompressionState(make())
        state.attach(ddp)
        ddp.register_comm_hook(state, compression_hook)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        received = []
        for step in range(3):
            g = torch.Generator().manual_seed(100 * step + rank)
            x, y = torch.randn(8, 32, generator=g), torch.randn(8, 32, generator=g)
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(ddp(x), y).backward()
            optimizer.step()
            received.append(state.telemetry.pop_step().bytes_received)
        flat = torch.cat([p.detach().flatten() for p in model.parameters()])
        everyone = [torch.empty_like(flat) for _ in range(world_size)]
        dist.all_gather(everyone, flat)
        out[name] = {"identical": all(torch.equal(everyone[0], e) for e in everyone), "received": received}
    return out


@pytest.mark.slow
def test_the_defaults_on_four_gloo_processes_keep_replicas_identical_and_receive_fewer_bytes():
    """Four processes over gloo (the real all-to-all): each default takes its two-phase exchange, the replicas stay
    bitwise identical, and each rank receives what the byte model declares, less than the all-gather would."""
    results = run_distributed(_train_on_gloo, world_size=4)
    layers = layers_from_shapes([(64, 32), (64,), (32, 64), (32,)])
    for name, make in (
        ("topk", lambda t: TopK(ratio=0.05, transport=t)),
        ("dgc", lambda t: DGC(ratio=0.05, momentum=0.0, transport=t)),
        ("sparseloco", lambda t: SparseLoCo(ratio=0.05, chunk_size=256, transport=t)),
    ):
        model = bucket_wire_bytes(make("auto"), layers, 4).received
        assert model < bucket_wire_bytes(make("allgather"), layers, 4).received, name
        for result in results:
            assert result[name]["identical"], name
            assert result[name]["received"][1:] == [model, model], (name, result[name]["received"], model)
