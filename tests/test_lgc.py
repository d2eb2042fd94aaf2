"""LGC: its stages, error feedback against what the aggregate used, ranks agreeing, bytes, state, a real resume."""

import copy
import os
import pickle

import pytest
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_gradcomp import CompressedDDP, CompressionState
from lightning_gradcomp.compressors import LGC, LGCAllReduce, ScaleCom
from lightning_gradcomp.compressors.base import BucketContext, ResidualBuffers, keep_count, layers_from_shapes
from lightning_gradcomp.compressors.lgc.base import layer_dots
from lightning_gradcomp.engine.collectives import TorchCollectives
from lightning_gradcomp.engine.comm import Comm
from lightning_gradcomp.engine.telemetry import Telemetry
from lightning_gradcomp.runtime.rank_state import load_rank_state
from lightning_gradcomp.testing import SimulatedWorld, simulate_reduce
from tests.distributed import run_distributed
from tests.fit_worker import STRATEGIES, run_fits, run_name
from tests.selection import selected_params

LAYERS = layers_from_shapes([(40, 50), (8, 4, 3, 3), (30, 30)])
NUMEL = sum(layer.numel for layer in LAYERS)
VARIANTS = {"ps": LGC, "allreduce": LGCAllReduce}


def _lgc(variant, **kwargs):
    options = {"ratio": 0.05, "dense_steps": 1, "training_steps": 3}
    if variant == "ps":
        options["innovation_ratio"] = 0.01
    options.update(kwargs)
    return VARIANTS[variant](**options)


def _grads(n, seed, dtype=torch.float64):
    """Correlated gradients: a common part plus each rank's own noise (what LGC's premise expects)."""
    g = torch.Generator().manual_seed(seed)
    common = torch.randn(NUMEL, generator=g, dtype=dtype)
    return [common + 0.3 * torch.randn(NUMEL, generator=g, dtype=dtype) for _ in range(n)]


def _run(compressors, steps, residuals=None, seed=0):
    """Steps ``steps`` of ``simulate_reduce``; returns every step's per-rank averages."""
    n = len(compressors)
    return [
        simulate_reduce(compressors, _grads(n, seed + step), LAYERS, step=step, residuals=residuals) for step in steps
    ]


def test_stages_follow_the_step():
    lgc = LGC(dense_steps=2, training_steps=3)
    assert [lgc.stage(step) for step in range(7)] == [1, 1, 2, 2, 2, 3, 3]
    assert LGC(dense_steps=0, training_steps=0).stage(0) == 3


@pytest.mark.parametrize(
    ("variant", "expected"),
    [
        ("ps", [["all_reduce"], ["all_gather"], ["broadcast", "all_gather"]]),
        ("allreduce", [["all_reduce"], ["broadcast", "all_gather"], ["broadcast", "all_reduce", "all_reduce"]]),
    ],
)
def test_each_stage_issues_its_collectives_and_no_more(variant, expected):
    """Stage 1 dense, stage 2 top-k (the autoencoder trains on what was received: no extra collective), stage 3 the
    code."""
    compressors = [_lgc(variant) for _ in range(2)]
    for step, kinds in zip(range(5), [expected[0], expected[1], expected[1], expected[1], expected[2]]):
        world = SimulatedWorld(2)
        futures = []
        for rank, (c, g) in enumerate(zip(compressors, _grads(2, step))):
            ctx = BucketContext(
                index=0,
                step=step,
                rank=rank,
                world_size=2,
                layers=LAYERS,
                dtype=g.dtype,
                comm=Comm(world.backend(rank), Telemetry(), g.device),
            )
            futures.append(c.reduce(g, ctx))
        world.assert_quiescent()
        outs = [f.wait() for f in futures]
        assert torch.equal(outs[0], outs[1])
        assert [kind[0] for rank, kind in world.issued if rank == 0] == kinds


@pytest.mark.parametrize("variant", ["ps", "allreduce"])
@pytest.mark.parametrize("leader", ["fixed", "rotating"])
def test_every_rank_holds_the_same_aggregate_in_every_stage(variant, leader):
    compressors = [_lgc(variant, leader=leader) for _ in range(3)]
    residuals = [torch.zeros(NUMEL, dtype=torch.float64) for _ in range(3)]
    for outs in _run(compressors, range(7), residuals):
        assert all(torch.equal(outs[0], out) for out in outs)
        assert torch.isfinite(outs[0]).all()


@pytest.mark.parametrize("variant", ["ps", "allreduce"])
def test_error_feedback_subtracts_what_the_aggregate_used_for_this_rank(variant):
    """Stage 3, per step: n * aggregate == sum_i (p_i - new residual_i), so every rank's residual is exactly what its
    share of the aggregate left out. PS: a rank owes nothing at its innovation (sent exactly) and all of p_i off the
    leader's indices and its innovation; all-reduce with ``residual="average"``: every rank's share is the aggregate
    itself (the default, ``"own"``, has its own test below)."""
    n = 2
    accounting = {"residual": "average"} if variant == "allreduce" else {}
    compressors = [_lgc(variant, dense_steps=0, training_steps=2, **accounting) for _ in range(n)]
    residuals = [torch.zeros(NUMEL, dtype=torch.float64) for _ in range(n)]
    _run(compressors, range(2), residuals)
    for step in (2, 3):
        grads = _grads(n, 50 + step)
        p = [g + r for g, r in zip(grads, residuals)]
        outs = simulate_reduce(compressors, grads, LAYERS, step=step, residuals=residuals)
        shares = [pi - ri for pi, ri in zip(p, residuals)]
        torch.testing.assert_close(outs[0] * n, shares[0] + shares[1], rtol=1e-12, atol=1e-12)
        leader = 0 if variant == "ps" else step % n
        chosen = torch.cat(
            [
                torch.topk(layer.flat(p[leader]).abs(), keep_count(layer.numel, 0.05)).indices + layer.offset
                for layer in LAYERS
            ]
        )
        off = torch.ones(NUMEL, dtype=torch.bool)
        off[chosen] = False
        if variant == "allreduce":
            torch.testing.assert_close(shares[0], shares[1], rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(shares[0], outs[0], rtol=1e-12, atol=1e-12)
        for rank in range(n):
            owed_off = off.clone()
            if variant == "ps":
                own = torch.cat(
                    [
                        torch.topk(layer.flat(p[rank]).abs(), keep_count(layer.numel, 0.01)).indices + layer.offset
                        for layer in LAYERS
                    ]
                )
                assert torch.all(residuals[rank][own] == 0), "the innovation is sent exactly"
                owed_off[own] = False
            assert torch.equal(residuals[rank][owed_off], p[rank][owed_off]), "unsent entries are owed whole"
            assert residuals[rank][chosen].abs().sum() > 0, "the decoded values are not exact"


def _smooth_grads(n, seed):
    """Gradients with structure a convolutional autoencoder can learn: a few random low-frequency waves, common to the
    ranks, plus a little noise of each rank's own."""
    g = torch.Generator().manual_seed(seed)
    t = torch.arange(NUMEL, dtype=torch.float64)
    a = torch.randn(3, generator=g, dtype=torch.float64)
    common = sum(a[i] * torch.sin(t * (i + 1) * 0.01 + a[i]) for i in range(3))
    return [common + 0.05 * torch.randn(NUMEL, generator=g, dtype=torch.float64) for _ in range(n)]


@pytest.mark.parametrize("variant", ["ps", "allreduce"])
def test_the_autoencoder_trains_in_stage_2_only_and_learns(variant):
    """The committed weights change at every stage-2 step (from the step before's data) and never in stage 3, and the
    trained autoencoder's loss on the last stage-2 data is below the initial autoencoder's."""
    compressors = [_lgc(variant, dense_steps=0, training_steps=60, lr=1e-2) for _ in range(2)]
    residuals = [torch.zeros(NUMEL, dtype=torch.float64) for _ in range(2)]
    snapshots = []
    for step in range(63):
        simulate_reduce(compressors, _smooth_grads(2, step), LAYERS, step=step, residuals=residuals)
        snapshots.append(copy.deepcopy(compressors[0].state_dict()["autoencoder"]))
        if step == 59:
            lgc = compressors[0]
            entries = list(lgc._pending.values())  # one per layer
            with torch.no_grad():
                untrained_model = lgc._build(lgc._decoders, torch.device("cpu"))
                initial = sum(lgc._loss(untrained_model, entry, torch.Generator()) for entry in entries)
                trained = sum(lgc._loss(lgc._model, entry, torch.Generator()) for entry in entries)

    def same(a, b):
        return all(torch.equal(a[k], b[k]) for k in a)

    assert not any(same(snapshots[s], snapshots[s + 1]) for s in range(59)), "every stage-2 step trains"
    # step 60 trains on step 59's data (the last of stage 2); then nothing
    assert not same(snapshots[59], snapshots[60])
    assert same(snapshots[60], snapshots[61])
    assert same(snapshots[61], snapshots[62])
    assert float(snapshots[-1]["step"]) == 60, "one optimizer step per stage-2 step"
    assert trained < 0.8 * initial, (float(trained), float(initial))


@pytest.mark.parametrize("variant", ["ps", "allreduce"])
def test_state_dict_holds_the_autoencoder_its_optimizer_and_the_pending_data(variant):
    """Saved in stage 2 (data waiting to be trained on) the restored compressors continue bitwise; dropping the
    autoencoder state changes the result (the control)."""
    original = [_lgc(variant, optimizer="sgd", momentum=0.9) for _ in range(2)]
    _run(original, range(3))
    state = [pickle.loads(pickle.dumps(c.state_dict())) for c in original]
    assert any(key.startswith("m.encoder") for key in state[0]["autoencoder"])
    assert state[0]["pending"], "the last step's values wait for the next step's training"
    restored = [_lgc(variant, optimizer="sgd", momentum=0.9) for _ in range(2)]
    for c, s in zip(restored, state):
        c.load_state_dict(s)
    dropped = [_lgc(variant, optimizer="sgd", momentum=0.9) for _ in range(2)]
    for c, s in zip(dropped, state):
        c.load_state_dict({k: v for k, v in s.items() if k not in ("autoencoder", "decoders")})
    expected, got, control = (_run(cs, range(3, 6), seed=7) for cs in (original, restored, dropped))
    for a, b in zip(expected, got):
        assert torch.equal(a[0], b[0])
    assert not torch.equal(expected[-1][0], control[-1][0])


@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.parametrize("leader", ["fixed", "rotating"])
def test_the_gather_form_of_ps_gives_the_all_gather_form_s_results_bitwise(ranks, leader):
    """``ps_form="gather"`` (the leader alone decodes everyone and broadcasts the average) against the all-gather form
    (every rank decodes everyone): the same aggregate and the same residuals on every rank, in every stage; in stage 3
    it issues the all-gather form's two rounds (the leader's code, then the innovations and factors) and then the
    leader's broadcast of the average."""
    forms = {form: [_lgc("ps", leader=leader, ps_form=form) for _ in range(ranks)] for form in ("allgather", "gather")}
    residuals = {form: [torch.zeros(NUMEL, dtype=torch.float64) for _ in range(ranks)] for form in forms}
    for step in range(7):
        outs = {
            form: simulate_reduce(cs, _grads(ranks, 20 + step), LAYERS, step=step, residuals=residuals[form])
            for form, cs in forms.items()
        }
        for rank in range(ranks):
            assert torch.equal(outs["gather"][rank], outs["allgather"][0]), (step, rank)
            assert torch.equal(residuals["gather"][rank], residuals["allgather"][rank]), (step, rank)
    assert forms["gather"][0].stage(6) == 3
    assert residuals["gather"][1].abs().sum() > 0
    world = SimulatedWorld(ranks)
    futures = []
    for rank, (c, g) in enumerate(zip(forms["gather"], _grads(ranks, 99))):
        ctx = BucketContext(
            index=0,
            step=7,
            rank=rank,
            world_size=ranks,
            layers=LAYERS,
            dtype=g.dtype,
            comm=Comm(world.backend(rank), Telemetry(), g.device),
        )
        futures.append(c.reduce(g, ctx))
    world.assert_quiescent()
    assert [kind[0] for rank, kind in world.issued if rank == 0] == ["broadcast", "all_gather", "broadcast"]


def _both_forms_on_gloo(rank, world_size):
    """Every step's aggregate and residual of both PS forms, reduced over this process group (float32)."""
    backend = TorchCollectives()
    backend.ensure_rounds(LGC.rounds)
    out = {}
    for form in ("allgather", "gather"):
        compressor, residual, steps = _lgc("ps", ps_form=form), torch.zeros(NUMEL), []
        for step in range(6):
            ctx = BucketContext(
                index=0,
                step=step,
                rank=rank,
                world_size=world_size,
                layers=LAYERS,
                comm=Comm(backend, Telemetry(), torch.device("cpu")),
            )
            grad = _grads(world_size, 40 + step, torch.float32)[rank]
            steps.append((compressor.reduce(grad, ctx, ResidualBuffers(residual)).wait().clone(), residual.clone()))
        out[form] = steps
    return out


@pytest.mark.slow
def test_the_gather_form_agrees_with_the_all_gather_form_on_real_gloo_processes():
    ranks = run_distributed(_both_forms_on_gloo, world_size=2)
    for step in range(6):
        for rank in range(2):
            gathered, residual = ranks[rank]["gather"][step]
            assert torch.equal(gathered, ranks[0]["allgather"][step][0]), (step, rank)
            assert torch.equal(residual, ranks[rank]["allgather"][step][1]), (step, rank)
    assert ranks[1]["gather"][-1][1].abs().sum() > 0


@pytest.mark.parametrize(("variant", "form"), [("ps", None), ("ps", "gather"), ("allreduce", None)])
@pytest.mark.parametrize("ranks", [2, 4])
def test_telemetry_counts_the_documented_bytes_in_every_stage(variant, form, ranks):
    options = {"ps_form": form} if form else {}
    compressors = [_lgc(variant, leader="rotating", **options) for _ in range(ranks)]
    for step in range(6):
        telemetry = [Telemetry() for _ in range(ranks)]
        for t in telemetry:
            t.add_bucket(NUMEL * 4)
        grads = _grads(ranks, step, torch.float32)
        simulate_reduce(compressors, grads, LAYERS, step=step, telemetry=telemetry)
        for rank, t in enumerate(telemetry):
            ctx = BucketContext(index=0, step=step, rank=rank, world_size=ranks, layers=LAYERS)
            assert t.pop_step().bytes_payload == compressors[rank].bytes_per_step(ctx), (step, rank)


def test_the_code_is_about_a_quarter_of_the_values():
    lgc = LGC()
    k = 11_000
    length = k
    for _ in range(4):
        length = (length - 3) // 2 + 1
    assert lgc.latent_numel(k) == 4 * length
    assert 0.24 < lgc.latent_numel(k) / k < 0.25
    assert lgc.latent_numel(1) == 4, "short inputs are padded to the receptive field"


@pytest.mark.parametrize(
    ("variant", "kwargs", "match"),
    [
        ("ps", {"ratio": 0}, "ratio"),
        ("allreduce", {"ratio": 1.5}, "ratio"),
        ("ps", {"innovation_ratio": 1e-3}, "innovation_ratio"),  # not below ratio (1e-3)
        ("ps", {"innovation_ratio": 0.0}, "innovation_ratio"),
        ("ps", {"innovation_ratio": None}, "innovation_ratio"),
        ("ps", {"dense_steps": -1}, "dense_steps"),
        ("allreduce", {"training_steps": 2.5}, "training_steps"),
        ("ps", {"dense_steps": True}, "dense_steps"),
        ("allreduce", {"leader": "random"}, "leader"),
        ("ps", {"channels": ()}, "channels"),
        ("allreduce", {"decoder_channels": (8, 0)}, "decoder_channels"),
        ("ps", {"latent_channels": 0}, "latent_channels"),
        ("allreduce", {"optimizer": "lbfgs"}, "optimizer"),
        ("ps", {"momentum": 0.9}, "momentum"),  # Adam has none
        ("allreduce", {"lr": 0}, "lr"),
        ("ps", {"similarity_weight": -1}, "similarity_weight"),
        ("allreduce", {"normalize": 1}, "normalize"),
        ("allreduce", {"project": "yes"}, "project"),
        ("ps", {"ps_form": "ring"}, "ps_form"),
        ("allreduce", {"beta": 0.0}, "beta"),
        ("allreduce", {"beta": 1.5}, "beta"),
        ("allreduce", {"similarity_weight": float("nan")}, "similarity_weight"),
        ("allreduce", {"order": "magnitude"}, "order"),
        ("allreduce", {"residual": "rank"}, "residual"),
        ("allreduce", {"residual": "own", "project": False}, "project"),  # own needs the factor
        ("allreduce", {"max_factor": 0.0}, "max_factor"),
        ("allreduce", {"max_factor": 2.0, "project": False}, "max_factor"),  # it bounds the projection's factor
    ],
)
def test_bad_arguments_are_refused_with_the_argument_named(variant, kwargs, match):
    with pytest.raises(ValueError, match=f"`{match}`"):
        VARIANTS[variant](**kwargs)


@pytest.mark.parametrize(
    ("variant", "name", "given"),
    [
        ("ps", "beta", 0.5),
        ("ps", "order", "value"),
        ("ps", "residual", "own"),
        ("ps", "variant", "allreduce"),
        ("allreduce", "innovation_ratio", 1e-5),  # a per-rank innovation does not survive a sum
        ("allreduce", "ps_form", "gather"),
    ],
)
def test_the_other_variant_s_arguments_are_refused_by_name(variant, name, given):
    """Each class takes only its own variant's arguments: another's is Python's error naming it."""
    with pytest.raises(TypeError, match=f"'{name}'"):
        VARIANTS[variant](**{name: given})


@pytest.mark.parametrize("name", ["beta", "residual"])
def test_memory_settings_without_error_feedback_are_refused_before_training(name):
    """``beta`` and ``residual`` act only on the error-feedback memory: set without it, the hook's state and the
    strategy refuse them, naming the setting (they would be silently ignored); left unset, the variant runs."""
    given = {"beta": 0.5, "residual": "own"}[name]
    with pytest.raises(ValueError, match=f"`{name}`"):
        CompressionState(LGCAllReduce(**{name: given}), error_feedback=False)
    with pytest.raises(MisconfigurationException, match=f"`{name}`.*error feedback"):
        CompressedDDP(LGCAllReduce(**{name: given}), error_feedback=False)
    strategy = CompressedDDP(LGCAllReduce(), error_feedback=False)
    with pytest.raises(MisconfigurationException, match=f"`error_feedback=False`.*`{name}`"):
        strategy.compressor = LGCAllReduce(**{name: given})
    assert CompressionState(LGCAllReduce(**{name: given})).uses_error_feedback()
    assert not CompressionState(LGCAllReduce(), error_feedback=False).uses_error_feedback()


def test_the_all_reduce_variant_s_defaults_resolve_per_variant():
    """``None`` resolves per variant: the all-reduce variant's repaired stage 3 (value order, no code-similarity term,
    ScaleCom's accounting; ``"average"`` without the projection), the PS variant's index order without the
    code-similarity term either (chosen on seeds 0-2 of the CIFAR-shaped digits: docs/lgc.md); the constructor
    keeps what was given (``repr`` shows the user's arguments)."""
    allreduce, ps = LGCAllReduce(), LGC()
    explicit = LGCAllReduce(order="index", similarity_weight=0.5, residual="average")

    def resolved(lgc):
        return lgc.slot_order, lgc.code_similarity_weight, getattr(lgc, "residual_accounting", None)

    assert resolved(allreduce) == ("value", 0.0, "own")
    assert resolved(ps) == ("index", 0.0, None)
    assert resolved(LGC(similarity_weight=0.5)) == ("index", 0.5, None)  # the third-party code's lambda2
    assert allreduce.lr == ps.lr == 1e-2
    assert resolved(explicit) == ("index", 0.5, "average")
    assert LGCAllReduce(project=False).residual_accounting == "average"
    assert "order=None" in repr(allreduce)
    assert "order='index'" in repr(explicit)


@pytest.mark.parametrize("beta", [None, 0.5])
@pytest.mark.parametrize("leader", ["fixed", "rotating"])
def test_allreduce_stage_2_is_scalecom_with_its_memory(beta, leader):
    """Stage 2 of the all-reduce variant sends what ScaleCom (CLT-k) sends, with ScaleCom's memory: the same
    aggregate and the same residuals step after step, for ``beta`` 1 and 0.5 (to rounding: ScaleCom divides before
    its all-reduce, LGC after its all-gather). The seed-3 failure on the CIFAR-shaped digits is in this stage
    (docs/lgc.md), so it is CLT-k's behaviour; ScaleCom's low-pass filter rescued that seed and stalled another."""
    n = 3
    lgc = [_lgc("allreduce", dense_steps=0, training_steps=100, beta=beta, leader=leader) for _ in range(n)]

    class FixedLeader(ScaleCom):
        def leader(self, ctx):
            return 0

    kind = ScaleCom if leader == "rotating" else FixedLeader
    scalecom = [kind(ratio=0.05, beta=1.0 if beta is None else beta) for _ in range(n)]
    res_lgc = [torch.zeros(NUMEL, dtype=torch.float64) for _ in range(n)]
    res_scalecom = [torch.zeros(NUMEL, dtype=torch.float64) for _ in range(n)]
    for step in range(6):
        grads = _grads(n, 70 + step)
        ours = simulate_reduce(lgc, grads, LAYERS, step=step, residuals=res_lgc)
        theirs = simulate_reduce(scalecom, grads, LAYERS, step=step, residuals=res_scalecom)
        torch.testing.assert_close(ours[0], theirs[0], rtol=1e-12, atol=1e-12)
        for a, b in zip(res_lgc, res_scalecom):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
        assert (ours[0] != 0).sum() < NUMEL // 10, "sparse: this is stage 2, not a dense step"


@pytest.mark.parametrize("stage", [2, 3])
def test_the_low_pass_memory_moves_by_beta_times_what_was_owed(stage):
    """With ``beta`` the all-reduce variant's memory is ``(1 - beta) m + beta r``, ``r`` the residual that plain
    error feedback keeps: one step from the same state with ``beta`` 0.5 and 1 (stage 3: the same autoencoder)."""
    n = 2
    steps = {"dense_steps": 0, "training_steps": 2 if stage == 3 else 100}
    plain = [_lgc("allreduce", **steps) for _ in range(n)]
    memory = [torch.zeros(NUMEL, dtype=torch.float64) for _ in range(n)]
    _run(plain, range(2), memory)
    filtered = [copy.deepcopy(c) for c in plain]
    for c in filtered:
        c.beta = 0.5
    r_plain = [m.clone() for m in memory]
    r_filtered = [m.clone() for m in memory]
    out_plain = simulate_reduce(plain, _grads(n, 90), LAYERS, step=2, residuals=r_plain)
    out_filtered = simulate_reduce(filtered, _grads(n, 90), LAYERS, step=2, residuals=r_filtered)
    assert plain[0].stage(2) == stage
    assert torch.equal(out_plain[0], out_filtered[0]), "the filter changes the memory, not what is sent"
    for m, r, f in zip(memory, r_plain, r_filtered):
        torch.testing.assert_close(f, 0.5 * m + 0.5 * r, rtol=1e-12, atol=1e-12)
        assert not torch.allclose(f, r)


@pytest.mark.parametrize("stage", [2, 3])
def test_value_order_sends_the_leader_s_slots_largest_value_first(stage):
    """``order="value"`` changes the order of the leader's slots, not what is summed: the aggregate and the residuals
    equal the index order's bitwise (every slot is summed over the ranks alike); the training data staged in stage 2
    are the leader's values, largest first, in every layer; every layer's indices go as an int32 list."""
    n = 2
    steps = {"dense_steps": 0, "training_steps": 100 if stage == 2 else 0, "leader": "fixed", "project": False}
    if stage == 3:
        steps["linear_encoder"] = True  # the code of the sum is the sum of the codes: the order cannot change it
    by_index = [_lgc("allreduce", order="index", **steps) for _ in range(n)]
    by_value = [_lgc("allreduce", order="value", **steps) for _ in range(n)]
    r_index = [torch.zeros(NUMEL, dtype=torch.float64) for _ in range(n)]
    r_value = [torch.zeros(NUMEL, dtype=torch.float64) for _ in range(n)]
    grads = _grads(n, 31)
    ours = simulate_reduce(by_value, grads, LAYERS, step=0, residuals=r_value)
    theirs = simulate_reduce(by_index, grads, LAYERS, step=0, residuals=r_index)
    if stage == 2:
        assert torch.equal(ours[0], theirs[0])
        for a, b in zip(r_value, r_index):
            assert torch.equal(a, b)
        for layer in LAYERS:
            staged = by_value[0]._pending[layer.name]["values"]  # [ranks, k], the leader (rank 0) first
            assert torch.equal(staged[0], staged[0].sort(descending=True).values), layer.name
            assert not torch.equal(staged[0], staged[0].sort(descending=True).values[torch.randperm(staged.shape[1])])
            in_index_order = by_index[0]._pending[layer.name]["values"][0]
            assert torch.equal(staged[0].sort().values, in_index_order.sort().values), "the same values"
    else:
        assert (ours[0] != 0).sum() == (theirs[0] != 0).sum(), "the same slots"
        kept = ours[0] != 0
        assert torch.equal(kept, theirs[0] != 0)
    ctx = BucketContext(index=0, step=0, rank=0, world_size=n, layers=LAYERS)
    assert by_value[0]._layout(ctx).nbytes == sum(4 * keep_count(layer.numel, 0.05) for layer in LAYERS)


@pytest.mark.parametrize("leader", ["fixed", "rotating"])
def test_own_residual_keeps_what_the_aggregate_left_of_each_rank_s_values(leader):
    """``residual="own"``, stage 3: the aggregate is the ``"average"`` accounting's, bitwise (it sets only the memory),
    and is ``f`` times the decoded average ``d`` (the same step without the projection), ``f = clamp(<mean p, d> /
    |d|^2, 0, 1)`` per layer; every rank keeps ``(1 - f) p_i`` at the leader's slots and all of ``p_i`` elsewhere
    (ScaleCom's accounting when ``f = 1``). So over the ranks the decoder's error ``f (d - mean p)`` is dropped, not
    owed, where the ``"average"`` accounting owes it."""
    n = 3
    steps = {"dense_steps": 0, "training_steps": 2, "leader": leader, "seed": 1}
    own = [_lgc("allreduce", residual="own", **steps) for _ in range(n)]
    memory = [torch.zeros(NUMEL, dtype=torch.float64) for _ in range(n)]
    _run(own, range(2), memory)
    factors = []
    for step in (2, 3):
        average = [copy.deepcopy(c) for c in own]
        for c in average:
            c.residual = "average"
        unprojected = [copy.deepcopy(c) for c in average]
        for c in unprojected:
            c.project = False
        grads = _grads(n, 60 + step)
        p = [g + m for g, m in zip(grads, memory)]
        r_average = [m.clone() for m in memory]
        decoded = simulate_reduce(unprojected, grads, LAYERS, step=step, residuals=[m.clone() for m in memory])[0]
        theirs = simulate_reduce(average, grads, LAYERS, step=step, residuals=r_average)
        ours = simulate_reduce(own, grads, LAYERS, step=step, residuals=memory)
        assert torch.equal(ours[0], theirs[0])
        mean_p, leader_rank = sum(p) / n, 0 if leader == "fixed" else step % n
        for layer in LAYERS:
            slots = torch.topk(layer.flat(p[leader_rank]).abs(), keep_count(layer.numel, 0.05)).indices
            off = torch.ones(layer.numel, dtype=torch.bool)
            off[slots] = False
            d, target = layer.flat(decoded)[slots], layer.flat(mean_p)[slots]
            f = (torch.dot(target, d) / torch.dot(d, d)).clamp(0.0, 1.0)
            factors.append(float(f))
            torch.testing.assert_close(layer.flat(ours[0])[slots], f * d, rtol=1e-6, atol=1e-9)
            assert torch.all(layer.flat(ours[0])[off] == 0)
            for rank in range(n):
                r, pr = layer.flat(memory[rank]), layer.flat(p[rank])
                torch.testing.assert_close(r[slots], (1 - f) * pr[slots], rtol=1e-6, atol=1e-9)
                assert torch.equal(r[off], pr[off]), "unsent entries are owed whole"
        assert not torch.allclose(r_average[0], memory[0]), "the average accounting owes the decoder's error"
    assert any(0.01 < f < 0.99 for f in factors), f"{factors}: a factor strictly inside (0, 1) is tested"


def test_max_factor_bounds_the_projection_s_factor_and_never_moves_further_than_no_update():
    """A decoded average half the true one fits with factor 2: ``max_factor=2`` (and ``None``) give 2, the default
    (1) gives 1; a decoded vector pointing away gives 0. Whatever the bound, the fitted update ``f d`` is never further
    from the true values ``x`` than no update (``|x - f d| <= |x|``, the least-squares factor clamped to an interval
    that holds 0)."""
    ctx = BucketContext(index=0, step=0, rank=0, world_size=1, layers=LAYERS)
    k = sum(keep_count(layer.numel, 0.05) for layer in LAYERS)
    x = torch.randn(k, generator=torch.Generator().manual_seed(0))

    def factors(max_factor, decoded):
        compressor = _lgc("allreduce", **({} if max_factor == "default" else {"max_factor": max_factor}))
        segments = compressor._segments(ctx)
        return compressor._factors(decoded, layer_dots(x, decoded, segments), ctx), segments

    for max_factor, expected in (("default", 1.0), (2.0, 2.0), (None, 2.0), (1.5, 1.5)):
        fs, _ = factors(max_factor, 0.5 * x)
        torch.testing.assert_close(torch.stack(fs), torch.full((len(LAYERS),), expected))
    fs, _ = factors(2.0, -0.5 * x)
    assert torch.equal(torch.stack(fs), torch.zeros(len(LAYERS))), "an opposed decoding is not used at all"
    g = torch.Generator().manual_seed(1)
    for max_factor in ("default", 2.0, None):
        for _ in range(5):
            decoded = 0.2 * x + torch.randn(k, generator=g)
            fs, segments = factors(max_factor, decoded)
            for f, (_, at, n) in zip(fs, segments):
                xi, di = x[at : at + n], decoded[at : at + n]
                assert torch.linalg.vector_norm(xi - f * di) <= torch.linalg.vector_norm(xi) * (1 + 1e-6)


@pytest.mark.parametrize("variant", ["ps", "allreduce"])
def test_a_layer_s_stage_3_result_does_not_depend_on_its_bucket(variant):
    """A layer reduced after another in one bucket, or alone, gets bitwise the same aggregate and residuals. After a
    resume DDP's first step puts every layer in one bucket and later steps in several, so a per-layer result that
    depended on the layer's place in the bucket broke the bitwise resume: ``torch.dot`` (BLAS on the CPU) sums in an
    order set by the pointer's alignment, and the all-reduce variant's projection took its dot products on the
    bucket's slices (here the second layer's slots start 7 floats in, and 819 of them are summed)."""
    n = 2
    pair = layers_from_shapes([(14, 10), (128, 128)], names=["a", "b"])
    alone = layers_from_shapes([(128, 128)], names=["b"])
    # seed 1: the untrained autoencoder's decoded average correlates with the true one, so the projection's factor is
    # not clamped to 0 and the layer's slots carry values (asserted below)
    options = {"dense_steps": 0, "training_steps": 0, "leader": "fixed", "seed": 1}
    if variant == "ps":
        options["innovation_ratio"] = 0.001
    g = torch.Generator().manual_seed(0)
    common = torch.randn(140 + 16384, generator=g)
    grads = [common + 0.3 * torch.randn(140 + 16384, generator=g) for _ in range(n)]
    in_pair = [VARIANTS[variant](ratio=0.05, **options) for _ in range(n)]
    by_itself = [VARIANTS[variant](ratio=0.05, **options) for _ in range(n)]
    r_pair = [torch.zeros(140 + 16384) for _ in range(n)]
    r_alone = [torch.zeros(16384) for _ in range(n)]
    ours = simulate_reduce(in_pair, grads, pair, residuals=r_pair)
    theirs = simulate_reduce(by_itself, [x[140:].clone() for x in grads], alone, residuals=r_alone)
    assert keep_count(140, 0.05) == 7
    assert (theirs[0] != 0).sum() >= keep_count(16384, 0.05)
    for rank in range(n):
        assert torch.equal(ours[rank][140:], theirs[rank])
        assert torch.equal(r_pair[rank][140:], r_alone[rank])


def test_a_ps_autoencoder_refuses_another_number_of_ranks():
    compressors = [_lgc("ps", dense_steps=0) for _ in range(2)]
    _run(compressors, range(2))
    state = compressors[0].state_dict()
    three = [_lgc("ps", dense_steps=0) for _ in range(3)]
    for c in three:
        c.load_state_dict(state)
    with pytest.raises(RuntimeError, match="one decoder per rank"):
        simulate_reduce(three, _grads(3, 0), LAYERS, step=2)


# ----------------------------------------------------------------------------------------------------------------
# Two real processes: all three stages, replicas identical, resume from stage 2 and stage 3 bitwise
# ----------------------------------------------------------------------------------------------------------------
# tests/fit_worker.py's "lgc-*" strategies and "epochs3-all" variant: 64 samples, 8 per batch, 2 ranks: 4 steps per
# epoch; stage 1 is steps 0-1, stage 2 steps 2-5, stage 3 from step 6; the checkpoints after epochs 1 and 2 (steps 4
# and 8) are in stages 2 and 3. Tiny buckets: several per step. Every variant's runs in one launch.
def _straight(variant: str) -> str:
    return f"lgc-{variant}:epochs3-all"


def _resumed(variant: str, epoch: int) -> str:
    return f"{_straight(variant)}+{_straight(variant)}@epoch={epoch}"


@pytest.fixture(scope="module")
def stage_runs(request, tmp_path_factory):
    """Each selected variant's uninterrupted run, and its resumes from the checkpoints of epochs 1 and 2."""
    variants = selected_params(request, "variant", test_two_processes_cross_every_stage_identically_and_resume_bitwise)
    runs = [run for v in variants for run in (_straight(v), _resumed(v, 0), _resumed(v, 1))]
    root = tmp_path_factory.mktemp("lgc")
    code, output, records = run_fits(root, 2, runs)
    assert code == 0, output[-3000:]
    return root, records


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["ps", "allreduce", "allreduce-linear"])
def test_two_processes_cross_every_stage_identically_and_resume_bitwise(stage_runs, variant):
    """Each variant (the all-reduce one with either encoder), checkpoints taken in stage 2 (pending data) and stage
    3; every resumed run ends with the uninterrupted run's parameters, bitwise, on both ranks."""
    root, records = stage_runs
    straight = records[_straight(variant)]
    assert torch.equal(straight[0]["params"], straight[1]["params"]), "replicas differ"
    ratios = [step["stats"].compression_ratio for step in straight[0]["steps"]]
    assert len(ratios) == 12, ratios
    assert ratios[0] < 1.1, ratios  # dense
    assert ratios[3] > 2, ratios  # top-k
    assert ratios[-1] > ratios[3], ratios  # the code
    compressor = STRATEGIES[f"lgc-{variant}"]().compressor
    for epoch, stage in ((0, 2), (1, 3)):
        path = os.path.join(root, run_name(_straight(variant)), f"epoch={epoch}.ckpt")
        saved = [load_rank_state(path, "gradcomp", rank).state for rank in range(2)]
        assert saved[0]["step"] == 4 * (epoch + 1)
        assert compressor.stage(saved[0]["step"]) == stage
        assert "autoencoder" in saved[0]["compressor"]
        resumed = records[_resumed(variant, epoch)]
        for rank in range(2):
            assert torch.equal(straight[rank]["params"], resumed[rank]["params"]), f"epoch {epoch}, rank {rank}"


class _AntiAlignedLGC(LGC):
    """LGC-PS whose decoders return each rank's values times ``gain``: with a negative gain, a poorly trained
    autoencoder's failure in the diverging run (its decoded values pointed away from the true ones, cosine -0.6 on
    the leader's own), made exact. ``truth`` holds every rank's input (gradient plus memory) at this step."""

    truth: dict = {}
    gain = -2.0

    def _ps_decoded(self, model, j, code, indices, values, own, ctx):
        return self.gain * self.truth[j].index_select(0, indices).float()


@pytest.mark.parametrize("form", ["allgather", "gather"])
def test_a_decoder_that_points_away_cannot_make_ps_diverge(form):
    """The mechanism of the PS variant's divergence, in a few steps: decoded values that point away from a rank's
    values make its contribution an ascent direction and its error-feedback memory grow, ``m <- p - gain p``, by
    ``1 - gain`` (3x) a step. With the projection (the default) each rank scales its decoded values by their
    least-squares fit to its own values, clamped to [0, 1]: here 0, so the aggregate is the innovations alone (never
    an ascent direction) and the memory never exceeds what no update would leave. ``project=False`` is the control:
    at the leader's slots the memory triples every step, as in the diverging run (175x the gradient after 8 steps,
    against at most 8x)."""
    n, steps = 2, 8
    g = torch.Generator().manual_seed(3)
    grads = [torch.randn(NUMEL, generator=g, dtype=torch.float64) for _ in range(n)]
    norms = {}
    for project in (None, False):
        compressors = [
            _AntiAlignedLGC(
                **{**_lgc("ps").hparams(), "dense_steps": 0, "training_steps": 0, "project": project, "ps_form": form}
            )
            for _ in range(n)
        ]
        residuals = [torch.zeros(NUMEL, dtype=torch.float64) for _ in range(n)]
        for step in range(steps):
            p = [gr + r for gr, r in zip(grads, residuals)]
            _AntiAlignedLGC.truth = dict(enumerate(p))
            out = simulate_reduce(compressors, grads, LAYERS, step=step, residuals=residuals)[0]
            mean = (p[0] + p[1]) / n
            if project is None:
                assert torch.dot(out, mean) >= 0, "never an ascent direction"
                assert torch.dot(out, p[0] + p[1]) >= 0
                for pi, ri in zip(p, residuals):
                    assert ri.norm() <= pi.norm() * (1 + 1e-12), "the memory never exceeds no update's"
        norms[project] = max(r.norm() for r in residuals) / max(gr.norm() for gr in grads)
    assert norms[None] <= steps + 1e-9, "at most the sum of the gradients, as with no update at all"
    assert norms[False] > 10 * steps, "without the projection the memory grows geometrically, far past no update's"
