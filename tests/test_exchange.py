"""A compressor on DiLoCo's outer exchange: simulated ranks for the identities, real gloo processes for DiLoCo.

The identities (error feedback telescopes over outer steps, a non-finite round leaves every state as it was, the
state resumes bitwise) run :class:`~lightning_gradcomp.diloco.exchange.OuterExchange` on simulated ranks; the fits
run ``DiLoCo(compressor=...)`` under Lightning's default launcher through tests/fit_worker.py.
"""

import pytest
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_gradcomp import DiLoCo
from lightning_gradcomp.compressors import EFSignSGD, MinMax, PowerSGD, SparseLoCo, TopK
from lightning_gradcomp.compressors.base import layers_from_shapes
from lightning_gradcomp.diloco.exchange import OuterExchange
from lightning_gradcomp.runtime.rank_state import checkpoint_file
from lightning_gradcomp.testing import SimulatedWorld
from tests.fit_worker import assert_same_weights, run_fits
from tests.models import TinyNet

# a conv weight, a bias (dense), two matrices: the pseudo-gradient of one dtype, laid out as a bucket
SHAPES = [(16, 4, 3, 3), (16,), (48, 64), (24, 96)]
LAYERS = layers_from_shapes(SHAPES)
NUMEL = sum(layer.numel for layer in LAYERS)
# error feedback on (their default), a declaration exact to rounding
TELESCOPING = {
    "minmax8": lambda: MinMax(bits=8),
    "minmax4": lambda: MinMax(bits=4),
    "sparseloco": lambda: SparseLoCo(ratio=0.03, chunk_size=256),
    "topk": lambda: TopK(ratio=0.05),
    "powersgd": lambda: PowerSGD(rank=2),
    "efsignsgd": lambda: EFSignSGD(),
}


def _exchanges(factory, world_size: int) -> tuple[SimulatedWorld, list[OuterExchange]]:
    world = SimulatedWorld(world_size)
    exchanges = [OuterExchange(factory(), min_compress_numel=64) for _ in range(world_size)]
    for rank, exchange in enumerate(exchanges):
        exchange.attach(torch.device("cpu"), backend=world.backend(rank))
    return world, exchanges


def _round(world: SimulatedWorld, exchanges: list[OuterExchange], pseudo_gradients: list[torch.Tensor]):
    rounds = [ex.start([g.clone()], [LAYERS]) for ex, g in zip(exchanges, pseudo_gradients)]
    world.assert_quiescent()
    return [r.wait()[0][0] for r in rounds]


def _residual(exchange: OuterExchange) -> torch.Tensor:
    owed = exchange.residuals.state_dict()
    return torch.cat([owed.get(layer.name, torch.zeros(layer.shape)).reshape(-1) for layer in LAYERS])


def _pseudo_gradients(rounds: int, world_size: int, seed: int = 0) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(NUMEL, generator=g) for _ in range(world_size)] for _ in range(rounds)]


@pytest.mark.parametrize("name", sorted(TELESCOPING))
@pytest.mark.parametrize("world_size", [1, 2])
def test_error_feedback_telescopes_over_outer_steps(name, world_size):
    """Sum of the averages + the mean final residual == sum of the mean pseudo-gradients (per rank at world size 1)."""
    world, exchanges = _exchanges(TELESCOPING[name], world_size)
    total_sent = torch.zeros(NUMEL, dtype=torch.float64)
    total_in = torch.zeros(NUMEL, dtype=torch.float64)
    for grads in _pseudo_gradients(5, world_size):
        averages = _round(world, exchanges, grads)
        for average in averages[1:]:
            assert torch.equal(average, averages[0]), "every rank holds the same average"
        total_sent += averages[0].double()
        total_in += torch.stack(grads).double().mean(0)
    residual = torch.stack([_residual(ex) for ex in exchanges]).double().mean(0)
    assert residual.abs().max() > 0, "the compressor left something out: the identity is not trivial"
    torch.testing.assert_close(total_sent + residual, total_in, rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", ["sparseloco", "powersgd", "minmax8"])
def test_a_nonfinite_pseudo_gradient_on_one_rank_leaves_every_state_as_it_was(name):
    world, exchanges = _exchanges(TELESCOPING[name], 2)
    rounds = _pseudo_gradients(2, 2)
    _round(world, exchanges, rounds[0])
    before = [ex.state_dict() for ex in exchanges]
    bad = rounds[1][1].clone()
    bad[3] = float("nan")
    averages = _round(world, exchanges, [rounds[1][0], bad])
    assert all(not torch.isfinite(a).all() for a in averages), "every rank sees the round as not finite"
    for ex, saved in zip(exchanges, before):
        after = ex.state_dict()
        assert after["residuals"].keys() == saved["residuals"].keys()
        for key, value in saved["residuals"].items():
            assert torch.equal(after["residuals"][key], value), "the residual is untouched"
        assert _same_nested(after["compressor"], saved["compressor"]), "the compressor's state is untouched"


def _same_nested(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same_nested(a[k], b[k]) for k in a)
    return a == b


@pytest.mark.parametrize("name", ["sparseloco", "powersgd"])
def test_the_exchange_state_resumes_bitwise(name):
    rounds = _pseudo_gradients(4, 2)
    world, exchanges = _exchanges(TELESCOPING[name], 2)
    for grads in rounds[:2]:
        _round(world, exchanges, grads)
    saved = [ex.state_dict() for ex in exchanges]
    expected = [_round(world, exchanges, grads) for grads in rounds[2:]]
    world, resumed = _exchanges(TELESCOPING[name], 2)
    for ex, state in zip(resumed, saved):
        ex.load_state_dict(state)
    got = [_round(world, resumed, grads) for grads in rounds[2:]]
    for e, g in zip(expected, got):
        assert all(torch.equal(x, y) for x, y in zip(e, g))


def test_a_compressor_that_is_not_a_compressor_is_refused():
    with pytest.raises(MisconfigurationException, match="Expected `compressor` to be .* got 'topk'"):
        DiLoCo(sync_every=4, compressor="topk")


# ------------------------------------------------------------------------------------------------------------------
# DiLoCo on two gloo processes
# ------------------------------------------------------------------------------------------------------------------
COMPRESSED = ["topk", "powersgd", "qsgd", "efsignsgd", "minmax8", "minmax4", "sparseloco"]
RESUMED = "diloco-h3-powersgd:epochs4+diloco-h3-powersgd:epochs2"
# the checkpoint after 8 steps holds fragment 1's exchange in flight; RandomK draws from the exchange's step
RESUMED_IN_FLIGHT = "diloco-h4f2t1-randomk:epochs4+diloco-h4f2t1-randomk:epochs2"
LAUNCH = [
    "diloco-h4:steps8",
    "diloco-h4-identity:steps8",
    *(f"diloco-h4-{name}:steps8" for name in COMPRESSED),
    "diloco-h4-sparseloco:nan",
    "diloco-h4f2t1-sparseloco:steps8",
    "diloco-h3-powersgd:epochs4",
    "diloco-h3-powersgd:epochs2",
    RESUMED,
    "diloco-h4f2t1-randomk:epochs4",
    "diloco-h4f2t1-randomk:epochs2",
    RESUMED_IN_FLIGHT,
]


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    root = tmp_path_factory.mktemp("outer_exchange")
    code, output, records = run_fits(root, 2, LAUNCH)
    assert code == 0, output[-3000:]
    return root, output, records


def test_identity_on_the_outer_exchange_is_plain_diloco_bitwise(launch):
    _, _, records = launch
    assert_same_weights(records["diloco-h4:steps8"], records["diloco-h4-identity:steps8"], "Identity")
    plain, identity = records["diloco-h4:steps8"][0], records["diloco-h4-identity:steps8"][0]
    for a, b in zip(plain["steps"], identity["steps"]):
        assert torch.equal(a["global"], b["global"])
    assert identity["bytes_sent"] == plain["bytes_sent"]


@pytest.mark.parametrize("name", COMPRESSED)
def test_compressed_outer_exchanges_keep_the_replicas_identical_after_every_sync(launch, name):
    _, _, records = launch
    ranks = records[f"diloco-h4-{name}:steps8"]
    plain = records["diloco-h4:steps8"][0]
    for i, (mine, theirs) in enumerate(zip(ranks[0]["steps"], ranks[1]["steps"])):
        if (i + 1) % 4 == 0:
            assert torch.equal(mine["params"], theirs["params"]), f"step {i + 1}"
            assert torch.equal(mine["params"], mine["global"])
            assert torch.isfinite(mine["global"]).all()
    assert ranks[0]["syncs"] == 2
    assert not torch.equal(ranks[0]["params"], plain["params"]), "the compressor changed what was averaged"
    assert ranks[0]["bytes_sent"] < plain["bytes_sent"]


def test_eight_bit_outer_exchange_sends_about_a_quarter_of_fp32(launch):
    """Codes of the compressed layers (one byte each) plus the dense small layers, as the telemetry counts them; each
    sync also averages the floating-point buffers training changed (BatchNorm's statistics), uncompressed, after the
    ranks agree on which changed (one float32 flag per buffer)."""
    _, _, records = launch
    fp32 = records["diloco-h4:steps8"][0]["bytes_sent"]
    model = TinyNet()
    buffers = [b for b in model.buffers() if b.is_floating_point()]
    synced = sum(p.numel() for p in model.parameters()) + sum(b.numel() for b in buffers)
    flags = len(buffers)
    assert fp32 == 2 * (synced + flags) * 4
    for name, (low, high) in {"minmax8": (0.25, 0.30), "minmax4": (0.125, 0.17)}.items():
        ratio = records[f"diloco-h4-{name}:steps8"][0]["bytes_sent"] / fp32
        assert low < ratio < high, (name, ratio)
        assert records[f"diloco-h4-{name}:steps8"][0]["bytes_received"] > 0


def test_a_nan_on_one_rank_skips_the_round_and_poisons_no_residual(launch):
    _, output, records = launch
    ranks = records["diloco-h4-sparseloco:nan"]
    assert ranks[0]["skipped"] == 1
    assert ranks[0]["syncs"] == 2
    assert_same_weights(ranks[:1] * 2, ranks, "replicas after a skipped round")
    for rank in ranks:
        residuals = rank["exchange"]["residuals"]
        assert residuals
        assert all(torch.isfinite(r).all() for r in residuals.values())


def test_resume_with_a_compressed_outer_exchange_is_bitwise(launch):
    _, _, records = launch
    assert_same_weights(records["diloco-h3-powersgd:epochs4"], records[RESUMED], "resumed mid-round")
    full, resumed = records["diloco-h3-powersgd:epochs4"], records[RESUMED]
    for a, b in zip(full, resumed):
        assert _same_nested(a["exchange"], b["exchange"]), "the residuals and PowerSGD's state resume bitwise"
    residuals = [rank["exchange"]["residuals"] for rank in full]
    assert not all(torch.equal(residuals[0][k], residuals[1][k]) for k in residuals[0]), "one residual per rank"


def test_streaming_with_overlap_and_a_compressor_keeps_the_replicas_identical(launch):
    """2 fragments, each exchange overlapped with one inner step: sent at 2, 4, 6, 8, applied a step later."""
    _, _, records = launch
    ranks = records["diloco-h4f2t1-sparseloco:steps8"]
    assert_same_weights(ranks[:1] * 2, ranks, "replicas after fit")
    assert ranks[0]["skipped"] == 0
    assert ranks[0]["syncs"] >= 4, "applied at 3, 5, 7 and when fit ends, with the last partial round"
    for rank in ranks:
        assert set(rank["exchange"]["residuals"]), "both fragments keep a residual"


def test_resume_with_a_compressed_exchange_in_flight_is_bitwise(launch):
    """The checkpoint holds the state of before the exchange in flight; the resume sends it again, the same bits."""
    root, _, records = launch
    assert_same_weights(records["diloco-h4f2t1-randomk:epochs4"], records[RESUMED_IN_FLIGHT], "resumed in flight")
    for a, b in zip(records["diloco-h4f2t1-randomk:epochs4"], records[RESUMED_IN_FLIGHT]):
        assert _same_nested(a["exchange"], b["exchange"])
    last = root / "diloco-h4f2t1-randomk-epochs2" / "last.ckpt"
    section = torch.load(checkpoint_file(last), weights_only=False)["diloco"]
    assert section["outer"]["pending"] == {"fragment": 1, "remaining": 1}, "saved with an exchange in flight"
