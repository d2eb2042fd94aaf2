"""The two-phase exchange (all-to-all of compressed shards, owner reduces and re-encodes, all-gather): its numerics."""

import copy
import pickle

import pytest
import torch

from lightning_gradcomp.compressors import QSGD, EFSignSGD, MinMax, OneBit, SignSGD, TernGrad
from lightning_gradcomp.compressors.base import BucketContext, layers_from_shapes
from lightning_gradcomp.compressors.transports.two_phase import owner_residuals, shard_numel, uses_two_phase
from lightning_gradcomp.engine.telemetry import Telemetry
from lightning_gradcomp.engine.wire_model import traced_wire_bytes
from lightning_gradcomp.testing import simulate_reduce

# 1,003 elements: no world size below divides it, so the last shard is padded
LAYERS = layers_from_shapes([(17, 53), (2, 2), (6,)])
NUMEL = 17 * 53 + 4 + 6

SHARDED = {
    "efsignsgd": lambda t: EFSignSGD(transport=t),
    "onebit": lambda t: OneBit(transport=t),
    "qsgd": lambda t: QSGD(transport=t),
    "minmax8": lambda t: MinMax(bits=8, transport=t),
    "minmax4": lambda t: MinMax(bits=4, transport=t),
}


def _grads(n, seed, numel=NUMEL):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(numel, generator=g) for _ in range(n)]


def _reduce(compressors, grads, layers=LAYERS, **kwargs):
    return simulate_reduce(compressors, [g.clone() for g in grads], layers, **kwargs)


@pytest.mark.parametrize("n", [4, 5, 9])
def test_the_two_phase_majority_vote_is_the_reference_vote_on_every_rank(n):
    """Each owner counts its shard's votes exactly (ties at even N give 0; beyond 8 ranks the counting path) and
    sends them in 2 bits: every rank holds sign(sum_r sign(g_r)), a zero voting +1, bitwise the all-gather's vote."""
    grads = _grads(n, seed=n)
    grads[0][:50] = 0.0  # zero coordinates vote +1
    if n % 2 == 0:  # ties: half the ranks one way, half the other
        for r in range(n):
            grads[r][50:80] = 1.0 if r < n // 2 else -1.0
    outs = _reduce([SignSGD(transport="two_phase") for _ in range(n)], grads)
    votes = torch.stack([torch.where(g >= 0, 1.0, -1.0) for g in grads]).sum(0)
    reference = torch.sign(votes)
    for out in outs:
        assert torch.equal(out, reference)
    if n % 2 == 0:
        assert torch.all(reference[50:80] == 0)
    assert torch.equal(outs[0], _reduce([SignSGD(transport="allgather") for _ in range(n)], grads)[0])


@pytest.mark.parametrize("n", [3, 4])
def test_the_qsgd_two_phase_aggregate_is_within_two_quantisations_and_unbiased(n):
    """One step: every element within the first encoding's bound (each rank's ||shard|| / s, averaged) plus the
    owner's (||decoded average|| / s, with |Q(v)_j| <= |v_j| + ||v|| / s). Over many steps (fresh draws) the mean
    of the aggregates approaches the mean gradient: the re-quantisation is unbiased too."""
    levels = 7
    grads = _grads(n, seed=20, numel=400)  # one layer; each shard one norm bucket (S <= 512)
    layers = layers_from_shapes([(20, 20)])
    size = shard_numel(400, n)
    mean = sum(grads) / n
    compressors = [QSGD(levels=levels, transport="two_phase") for _ in range(n)]
    total = torch.zeros(400)
    steps = 40
    for step in range(steps):
        outs = _reduce(compressors, grads, layers, step=step)
        assert all(torch.equal(outs[0], o) for o in outs)
        total += outs[0]
        if step == 0:
            for s in range(n):
                cut = slice(s * size, min((s + 1) * size, 400))
                first = sum(torch.linalg.vector_norm(g[cut]) for g in grads) / n / levels
                decoded = first * (1 + (size**0.5) / levels) * levels  # bound on ||decoded average||
                bound = first + decoded / levels
                assert torch.all((outs[0][cut] - mean[cut]).abs() <= bound * (1 + 1e-5))
            single = (outs[0] - mean).norm()
    drift = (total / steps - mean).norm()
    assert drift < 3 * single / steps**0.5, (drift, single)


@pytest.mark.parametrize("name", list(SHARDED))
@pytest.mark.parametrize("n", [3, 4])
def test_error_feedback_telescopes_through_the_owners(name, n):
    """Over T steps at N ranks (a padded last shard): sum of aggregates + mean of the ranks' residuals + the owners'
    residuals == sum of the mean gradients; every rank holds the same aggregate."""
    compressors = [SHARDED[name]("two_phase") for _ in range(n)]
    residuals = [torch.zeros(NUMEL, dtype=torch.float64) for _ in range(n)]
    applied = torch.zeros(NUMEL, dtype=torch.float64)
    computed = torch.zeros(NUMEL, dtype=torch.float64)
    for step in range(5):
        grads = [g.double() for g in _grads(n, seed=40 + step)]
        outs = _reduce(compressors, grads, step=step, residuals=residuals)
        assert all(torch.equal(outs[0], o) for o in outs)
        applied += outs[0]
        computed += sum(grads) / n
    ctx = BucketContext(index=0, step=0, rank=0, world_size=n, layers=LAYERS, dtype=torch.float64)
    by_owners = owner_residuals(compressors, ctx)
    assert by_owners.abs().sum() > 0, "the re-encoding loses something: the owners keep it"
    torch.testing.assert_close(applied + sum(residuals) / n + by_owners, computed, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("name", ["efsignsgd", "qsgd", "minmax4"])
def test_a_nan_on_one_rank_reaches_every_rank_and_no_owner_state(name):
    """At 3 ranks: a NaN on the last rank makes the aggregate non-finite everywhere; no residual, the owners' or the
    ranks', changes, and the next clean step is what it would have been."""
    n = 3
    compressors = [SHARDED[name]("two_phase") for _ in range(n)]
    residuals = [torch.zeros(NUMEL) for _ in range(n)]
    _reduce(compressors, _grads(n, seed=60), residuals=residuals)
    twins, twin_residuals = copy.deepcopy(compressors), [r.clone() for r in residuals]
    states = [c.state_dict()["owner_residual"] for c in compressors]
    grads = _grads(n, seed=61)
    grads[-1][7] = float("nan")
    outs = _reduce(compressors, grads, step=1, residuals=residuals)
    assert all(not torch.isfinite(out).all() for out in outs)
    for c, state in zip(compressors, states):
        now = c.state_dict()["owner_residual"]
        assert now.keys() == state.keys()
        assert all(torch.equal(now[k], state[k]) for k in state)
    assert all(torch.equal(a, b) for a, b in zip(residuals, twin_residuals))
    clean = _grads(n, seed=62)
    after = _reduce(compressors, clean, step=2, residuals=residuals)
    expected = _reduce(twins, clean, step=2, residuals=twin_residuals)
    assert torch.equal(after[0], expected[0])


def test_the_owners_residual_resumes_bitwise():
    """The owner's residual is per-rank state: saved and loaded with the compressor's, the next steps are bitwise."""
    n = 3
    original = [EFSignSGD(transport="two_phase") for _ in range(n)]
    residuals = [torch.zeros(NUMEL) for _ in range(n)]
    for step in range(2):
        _reduce(original, _grads(n, seed=80 + step), step=step, residuals=residuals)
    assert all(c.state_dict()["owner_residual"] for c in original)
    restored = [EFSignSGD(transport="two_phase") for _ in range(n)]
    for c, o in zip(restored, original):
        c.load_state_dict(pickle.loads(pickle.dumps(o.state_dict())))
    twin_residuals = [r.clone() for r in residuals]
    grads = _grads(n, seed=90)
    expected = _reduce(original, grads, step=2, residuals=residuals)
    got = _reduce(restored, grads, step=2, residuals=twin_residuals)
    assert torch.equal(got[0], expected[0])


def test_auto_picks_the_exchange_with_fewer_bytes_per_rank():
    """``N > 1 + P_2 / P_1``: the sign vote (1 bit up, 2 down) from 4 ranks, the others from 3; all-gather below."""
    for n, sign, other in [(1, False, False), (2, False, False), (3, False, True), (4, True, True), (64, True, True)]:
        assert uses_two_phase("auto", n, SignSGD.second_over_first) is sign
        for factory in SHARDED.values():
            assert uses_two_phase("auto", n, factory("auto").second_over_first) is other
    assert uses_two_phase("two_phase", 2, 2.0)
    assert not uses_two_phase("allgather", 64, 1.0)


@pytest.mark.parametrize("name", ["signsgd", *SHARDED])
def test_auto_at_two_ranks_is_the_all_gather_bitwise(name):
    """Where ``"auto"`` takes the all-gather, it is today's exchange, bit for bit (the fingerprints at N = 2)."""
    factory = (lambda t: SignSGD(transport=t)) if name == "signsgd" else SHARDED[name]
    grads = _grads(2, seed=100)
    residuals = None if name == "signsgd" else [[torch.zeros(NUMEL) for _ in range(2)] for _ in range(2)]
    outs = [
        _reduce([factory(t) for _ in range(2)], grads, residuals=None if residuals is None else residuals[i])
        for i, t in enumerate(("auto", "allgather"))
    ]
    assert torch.equal(outs[0][0], outs[1][0])


def _received(compressors, numel, n):
    telemetry = [Telemetry() for _ in range(n)]
    for t in telemetry:
        t.add_bucket(4 * numel)
    layers = layers_from_shapes([(numel,)])
    _reduce(compressors, _grads(n, seed=3, numel=numel), layers, telemetry=telemetry)
    return telemetry[0].pop_step().bytes_received


@pytest.mark.parametrize(
    ("factory", "n", "at_most", "allgather_at_least"),
    [
        # 3 bits of 64 (1 up, 2 down): 0.047 at any N; the all-gather N / 64
        (lambda t: SignSGD(transport=t), 16, 0.05, 0.25),
        pytest.param(lambda t: SignSGD(transport=t), 64, 0.05, 1.0, marks=pytest.mark.slow),
        # (4 + 4 bits + a norm per 512 elements each way) of 64: 0.127; the all-gather N / 16 of it
        (lambda t: QSGD(transport=t), 16, 0.13, 1.0),
    ],
    ids=["signsgd-16", "signsgd-64", "qsgd-16"],
)
def test_bytes_per_rank_stay_flat_where_the_all_gather_grows(factory, n, at_most, allgather_at_least):
    """Bytes a rank receives, as the collectives count them, against a dense fp32 ring all-reduce's
    ``2 (N - 1) / N * 4 d``: the two-phase exchange far below, the all-gather at or above it."""
    numel = n * 2048  # large enough that the non-finite flag (8 bytes per rank) does not show
    ring = 2 * (n - 1) / n * 4 * numel
    two_phase = _received([factory("two_phase") for _ in range(n)], numel, n)
    allgather = _received([factory("allgather") for _ in range(n)], numel, n)
    assert two_phase / ring <= at_most, two_phase / ring
    assert allgather / ring >= allgather_at_least, allgather / ring


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_terngrad_two_phase_sums_exactly_bitwise_as_the_all_reduce(n):
    """TernGrad's ternaries summed by their shard owners: exact integers, so the result is bitwise the all-reduce's
    and the all-gather's, on every rank, with ``"auto"`` whichever it picks."""
    grads = _grads(n, seed=11)
    reference = _reduce([TernGrad(aggregation="allreduce") for _ in range(n)], grads, step=2)
    for aggregation in ("two_phase", "auto", "allgather"):
        outs = _reduce([TernGrad(aggregation=aggregation) for _ in range(n)], grads, step=2)
        assert all(torch.equal(out, expected) for out, expected in zip(outs, reference)), aggregation


def test_terngrad_two_phase_sums_past_127_ranks_in_16_bits():
    """At 130 ranks a sum of ternaries needs 9 bits: the sums travel as 16-bit integers, still exact."""
    n, layers = 130, layers_from_shapes([(40,)])
    grads = _grads(n, seed=5, numel=40)
    expected = _reduce([TernGrad(aggregation="allreduce") for _ in range(n)], grads, layers)[0]
    assert torch.equal(_reduce([TernGrad(aggregation="two_phase") for _ in range(n)], grads, layers)[0], expected)


@pytest.mark.parametrize(("n", "mode"), [(2, "allgather"), (3, "two_phase"), (64, "two_phase")])
def test_terngrad_auto_picks_the_fewest_bytes_and_stays_under_a_sixth_of_dense(n, mode):
    """``(n - 1) / n (2 + ceil(log2(2 n + 1)))`` bits per element: 0.156 of a dense fp32 ring all-reduce at 64 ranks
    (the all-reduce's sum-safe words move 0.28), as the collectives count it."""
    numel = n * 2048
    assert TernGrad(aggregation="auto").mode(numel, n) == mode
    if n == 64:
        ring = 2 * (n - 1) / n * 4 * numel
        moved = traced_wire_bytes(TernGrad(aggregation="auto"), numel, n, error_feedback=False).received
        assert moved / ring <= 0.17, moved / ring
        words = traced_wire_bytes(TernGrad(aggregation="allreduce"), numel, n, error_feedback=False).received
        assert words / ring >= 0.27, words / ring
