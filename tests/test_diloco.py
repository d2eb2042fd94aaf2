"""DiLoCo: inner steps without communication, the outer step on the averaged pseudo-gradient, exact resume.

The fits run under Lightning's default launcher through tests/fit_worker.py: one launch of two processes for most
tests (a launch costs seconds, a fit of TinyNet a fraction of one), one of three processes and one of one. The
reference DiLoCo is computed in the test process, from the same data, model and optimizers.
"""

import copy
import os
import re
import shutil
from functools import partial

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn
from torch.utils.data import DistributedSampler

from lightning_gradcomp import DiLoCo
from lightning_gradcomp.compressors import Identity
from lightning_gradcomp.diloco.defaults import auto_sync_every
from lightning_gradcomp.diloco.replicas import group_size
from lightning_gradcomp.diloco.round import split_fragments
from lightning_gradcomp.runtime.rank_state import CHECKPOINT_FILE, checkpoint_file, load_rank_state
from tests.fit_worker import assert_same_weights, run_fits, run_name, train
from tests.models import TinyNet, synthetic_classification

RESUMED = "diloco-h3:epochs4+diloco-h3:epochs2"
# the checkpoint after 8 steps holds fragment 1's exchange in flight
RESUMED_IN_FLIGHT = "diloco-h4f2t1:epochs4+diloco-h4f2t1:epochs2"
# eager updates applied one period late (in flight at every step: the checkpoint after 8 steps holds fragment 1's
# exchange, sent at step 8)
RESUMED_DELAYED = "diloco-h4f2t2:epochs4+diloco-h4f2t2:epochs2"
# Muon inside (MuonAdamW, one optimizer): resumed 2 steps into a round, with each rank's Muon and AdamW state
RESUMED_MUON = "diloco-h3:muon-epochs4+diloco-h3:muon-epochs2"
# a checkpoint with compressor residuals, saved on 2, 3 and 4 processes: rank 0's file must not grow
SIZED = "diloco-h4-sparseloco:epochs2"
LAUNCH = [
    # first: only the first fit of a launch has the launcher that starts (and may stop) the other ranks
    "diloco-h2:lr-find",
    "ddp:eager",
    "diloco-h1:eager",
    "diloco-h4:steps8",
    "diloco-h4-sigterm-every-step:steps8",
    "diloco-h2:eager",
    "diloco-h2:manual",
    "diloco-h2:accumulate2",
    "diloco-h2:lr-find-callback",
    "diloco-h4-offload:steps8",
    "diloco-h4f2:steps8",
    "diloco-h4t1:steps8",
    "diloco-h4f2t1:steps8",
    "diloco-h4f2t1:epochs4",
    "diloco-h4f2t1:epochs2",
    RESUMED_IN_FLIGHT,
    "diloco-h4t1-mix:steps8",
    "diloco-h4t1-eager:steps6",
    "diloco-h4t1-eager:steps8",
    "diloco-h4t4-eager:steps8",
    "diloco-h4-defaults:steps8",
    "diloco-h4f2t2:epochs4",
    "diloco-h4f2t2:epochs2",
    RESUMED_DELAYED,
    "diloco-h3:muon-epochs4",
    "diloco-h3:muon-epochs2",
    RESUMED_MUON,
    "diloco-h4:nan",
    "diloco-h4:mask",
    "diloco-h4:boolmask",
    "diloco-h4:val",
    # 4 steps per epoch, a round of 3: the checkpoint after 2 epochs (8 steps) is 2 steps into a round
    "diloco-h3:epochs4",
    "diloco-h3:epochs2",
    RESUMED,
    f"{RESUMED}:stateless",
    "ddp:epochs2",
    "diloco-h3:epochs4+ddp:epochs2",
    "ddp:epochs4+diloco-h3:epochs2",
    "identity:epochs4+diloco-h3:epochs2",
    "diloco-h4:epochs4+diloco-h3:epochs2",
    SIZED,
    # DenseWarmup: 3 dense steps then rounds of 2; resumed 1 step after the warm-up (7) and inside it (10)
    "diloco-h2-w3:steps8",
    "diloco-h3-w7:epochs4",
    "diloco-h3-w7:epochs2",
    "diloco-h3-w7:epochs4+diloco-h3-w7:epochs2",
    "diloco-h3-w10:epochs4",
    "diloco-h3-w10:epochs2",
    "diloco-h3-w10:epochs4+diloco-h3-w10:epochs2",
]


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    """The launch's folder, output and every run's records."""
    root = tmp_path_factory.mktemp("diloco")
    code, output, records = run_fits(root, 2, LAUNCH)
    assert code == 0, output[-3000:]
    return root, output, records


def _nesterov(theta: torch.Tensor, buf: torch.Tensor | None, g: torch.Tensor, lr: float, mu: float) -> torch.Tensor:
    """Where one step of Nesterov SGD (torch's convention: the buffer starts as the first gradient) takes ``theta``."""
    buf = g.clone() if buf is None else mu * buf + g
    return theta - lr * (g + mu * buf)


def reference_diloco(
    world_size: int,
    sync_every: int,
    steps: int,
    sign: float = 1.0,
    overlap: int = 0,
    group: int = 1,
    warmup: int = 0,
    merge: str = "mix",
    alpha: float = 0.0,
    outer_lr: float = 0.7,
    outer_momentum: float = 0.9,
) -> list[torch.Tensor]:
    """DiLoCo by hand: theta_global after ``steps`` steps (a partial last round ends with an outer step).

    TinyNet's inner SGD on each rank's shard (as Lightning's DistributedSampler deals it), the mean of
    ``sign * (theta_global - theta_local)``, outer SGD (Nesterov when ``outer_momentum`` is above 0). Written from the
    paper's Algorithm 1, independently of the strategy's code. ``overlap``: the mean is applied that many inner steps
    after it was taken (one fragment), and the replicas merge then: ``merge="mix"`` (Streaming DiLoCo) sets each to
    ``alpha * local + (1 - alpha) * theta_global``; ``merge="eager"`` (eager updates) sets each, as the exchange
    starts, to the outer step of its estimate of the mean (its own pseudo-gradient over the replicas plus the others'
    of the previous exchange), and moves it by the true step minus that one when the mean arrives. ``group``:
    consecutive ranks per replica, whose inner step takes the mean of their shards' gradients (dense data
    parallelism). ``warmup``: the first steps take the mean of every rank's gradient (plain data parallelism); the
    rounds start from the weights they end with, with a fresh outer optimizer.
    """
    model = TinyNet()
    data = synthetic_classification(model.n)
    x, y = data.tensors
    # Lightning's sampler for TinyNet's loader: shuffled with seed 0, epoch 0, padded to a multiple of world_size
    shards = [list(DistributedSampler(data, num_replicas=world_size, rank=r, seed=0)) for r in range(world_size)]
    shards_of = [shards[g * group : (g + 1) * group] for g in range(world_size // group)]
    world_size //= group  # the replicas from here on
    replicas = [copy.deepcopy(model) for _ in range(world_size)]
    inner = [torch.optim.SGD(m.parameters(), lr=model.lr, momentum=0.9) for m in replicas]
    theta = [p.detach().clone() for p in model.parameters()]
    nesterov = outer_momentum > 0
    outer = torch.optim.SGD(theta, lr=outer_lr, momentum=outer_momentum, nesterov=nesterov)
    others = [[torch.zeros_like(g) for g in theta] for _ in replicas]  # eager: the others' previous shares
    own_deltas: list[list[torch.Tensor]] = []  # eager: each replica's pseudo-gradient in flight
    proxies: list[list[torch.Tensor]] = []  # eager: where each replica was placed as the exchange started

    def deltas() -> list[list[torch.Tensor]]:
        return [[sign * (g - p.detach()) for g, p in zip(theta, m.parameters())] for m in replicas]

    def exchange() -> list[torch.Tensor]:
        return [sum(d[i] for d in deltas()) / world_size for i in range(len(theta))]

    def estimate_step(r: int) -> list[torch.Tensor]:
        """Replica ``r``'s eager estimate of the mean, stepped by a copy of the outer optimizer."""
        out = []
        for i, g in enumerate(theta):
            estimate = own_deltas[r][i] / world_size + others[r][i]
            if nesterov:
                out.append(_nesterov(g, outer.state[g].get("momentum_buffer"), estimate, outer_lr, outer_momentum))
            else:
                out.append(g - outer_lr * estimate)
        return out

    def start() -> list[torch.Tensor]:
        own_deltas[:] = deltas()
        mean = [sum(d[i] for d in own_deltas) / world_size for i in range(len(theta))]
        if overlap and merge == "eager":
            proxies[:] = [estimate_step(r) for r in range(len(replicas))]
            with torch.no_grad():
                for m, proxy in zip(replicas, proxies):
                    for p, value in zip(m.parameters(), proxy):
                        p.copy_(value)
        return mean

    def apply(mean: list[torch.Tensor], in_flight: int = 0) -> bool:
        """The outer step on ``mean``, then each replica's merge; whether the replicas kept local work."""
        for g, d in zip(theta, mean):
            g.grad = d.clone()
        outer.step()
        buffers = [[b for b in m.buffers() if b.is_floating_point()] for m in replicas]
        mean_buffers = [sum(bs) / world_size for bs in zip(*buffers)]
        keep = in_flight > 0 and (merge == "eager" or alpha > 0)
        with torch.no_grad():
            for r, (m, own) in enumerate(zip(replicas, buffers)):
                for i, (p, g) in enumerate(zip(m.parameters(), theta)):
                    if merge == "eager" and overlap:
                        others[r][i] = mean[i] - own_deltas[r][i] / world_size
                    if not keep:
                        p.copy_(g)
                    elif merge == "eager":
                        p.add_(g - proxies[r][i])
                    else:
                        p.copy_(alpha * p + (1 - alpha) * g)
                for b, value in zip(own, mean_buffers):
                    b.copy_(value)
        return keep

    pending, since_applied = None, 0  # (the mean in flight, step applied, step sent); inner steps since an apply
    for step in range(steps):
        dense = step < warmup
        for m, optimizer, own in zip(replicas, inner, shards_of):
            optimizer.zero_grad()
            for shard in shards if dense else own:  # each rank's forward on its own batch (its own statistics)
                batch = shard[step * model.batch_size : (step + 1) * model.batch_size]
                (nn.functional.cross_entropy(m(x[batch]), y[batch]) / (len(shards) if dense else group)).backward()
            optimizer.step()
        if dense:
            with torch.no_grad():
                for g, p in zip(theta, replicas[0].parameters()):
                    g.copy_(p)
            continue
        since_applied += 1
        if pending is not None and step + 1 == pending[1]:
            kept = apply(pending[0], overlap)
            pending, since_applied = None, 1 if kept else 0
        if (step + 1 - warmup) % sync_every == 0:
            pending = (start(), step + 1 + overlap, step + 1)
            if not overlap:
                apply(pending[0])
                pending, since_applied = None, 0
    if pending is not None:
        kept = apply(pending[0], steps - pending[2])
        since_applied = 1 if kept else 0
    if since_applied:
        own_deltas[:] = deltas()
        apply(exchange())
    return theta


def assert_replicas_identical(ranks: list[dict], what: str = "") -> None:
    """Every rank ends with rank 0's parameters and buffers, bit for bit."""
    assert_same_weights(ranks[:1] * len(ranks), ranks, what)


def _flat(tensors):
    return torch.cat([t.flatten() for t in tensors])


def test_sync_every_1_with_outer_sgd_lr_1_is_plain_ddp(launch):
    """H = 1, inner SGD with momentum, outer SGD(lr=1): the average of the inner steps is DDP's step (linearity)."""
    _, _, records = launch
    ddp, ours = records["ddp:eager"], records["diloco-h1:eager"]
    torch.testing.assert_close(ours[0]["params"], ddp[0]["params"], rtol=1e-5, atol=1e-6)
    assert torch.equal(ours[0]["params"], ours[1]["params"])
    assert not torch.equal(ours[0]["params"], _flat(TinyNet().parameters()).detach()), "it trained"


def test_the_learning_rate_finder_returns_on_every_rank_and_leaves_no_trace(launch):
    """``Tuner.lr_find`` returns on every rank with one suggestion, and the fit after it trains exactly as one without
    the search; so does the fit of ``LearningRateFinder``, whose search and restore happen inside ``fit``, after
    setup: the restore puts back the round (theta_global, the outer optimizer, the phase) with the weights."""
    _, _, records = launch
    for run in ("diloco-h2:lr-find", "diloco-h2:lr-find-callback"):
        tuned = [rank.get("tuned") for rank in records[run]]
        assert all(t is not None for t in tuned), f"{run}: a rank did not return from the finder"
        assert tuned[0]["suggestion"] is not None, run
        assert tuned[0]["suggestion"] == tuned[1]["suggestion"], run
        assert len(tuned[0]["loss"]) == 20, run
        assert_same_weights(records["diloco-h2:eager"], records[run], run)
        assert records[run][0]["syncs"] == records["diloco-h2:eager"][0]["syncs"] == 2


def test_manual_optimization_syncs_as_automatic_does(launch):
    """Every ``optimizer.step()`` of a manual ``training_step`` is an inner step."""
    _, _, records = launch
    assert_same_weights(records["diloco-h2:eager"], records["diloco-h2:manual"])
    assert records["diloco-h2:manual"][0]["syncs"] == 2


def test_gradient_accumulation_counts_optimizer_steps(launch):
    """4 optimizer steps of 2 micro-batches each, ``sync_every=2``: the syncs follow the 4th and 8th micro-batch."""
    _, _, records = launch
    ranks = records["diloco-h2:accumulate2"]
    assert [s["collectives"] > 0 for s in ranks[0]["steps"]] == [False, False, False, True] * 2
    assert ranks[0]["syncs"] == 2
    assert_replicas_identical(ranks)


def test_offload_gives_the_same_model(launch):
    """theta_global and the outer state in CPU memory (on a CPU run the same memory: the code path, not the saving)."""
    _, _, records = launch
    assert_same_weights(records["diloco-h4:steps8"], records["diloco-h4-offload:steps8"])


def test_sync_every_4_matches_diloco_computed_by_hand(launch):
    """Two rounds of H = 4 with the default outer optimizer (Nesterov, lr 0.7): the sign of the pseudo-gradient."""
    _, _, records = launch
    expected = _flat(reference_diloco(2, 4, 8))
    ours = records["diloco-h4:steps8"]
    torch.testing.assert_close(ours[0]["params"], expected, rtol=1e-5, atol=1e-6)
    reversed_sign = _flat(reference_diloco(2, 4, 8, sign=-1.0))
    assert (ours[0]["params"] - reversed_sign).abs().max() > 1e-3, "the reference can tell the sign"
    assert ours[0]["syncs"] == 2
    numel = ours[0]["params"].numel() + _float_buffer_numel()
    assert ours[0]["bytes_sent"] == 2 * numel * 4, "one fp32 all-reduce of the model (and its buffers) per sync"


def _float_buffer_numel() -> int:
    """What a sync sends for the buffers: BatchNorm's statistics, and one float32 flag per floating-point buffer (the
    ranks agree on which buffers training changed before averaging only those)."""
    floats = [b for b in TinyNet().buffers() if b.is_floating_point()]
    return sum(b.numel() for b in floats) + len(floats)


def test_logged_bytes_are_the_bytes_of_the_all_reduced_tensors(launch):
    """``gradcomp/bytes_sent`` per step is what the outer loop handed to ``all_reduce``; amortised, the running mean."""
    _, output, records = launch
    ranks = records["diloco-h4:steps8"]
    sync_bytes = (ranks[0]["params"].numel() + _float_buffer_numel()) * 4  # fp32 parameters and BatchNorm statistics
    for rank in ranks:
        total = 0
        for i, step in enumerate(rank["steps"]):
            logged = step["logged"]
            synced = (i + 1) % 4 == 0
            assert step["all_reduced"] == (sync_bytes if synced else 0), f"step {i + 1}"
            assert logged["gradcomp/bytes_sent"] == step["all_reduced"], f"step {i + 1}"
            assert logged["gradcomp/bytes_received"] == step["all_reduced"], "2 ranks: a ring receives the buffer once"
            total += step["all_reduced"]
            assert logged["gradcomp/bytes_sent_per_step"] == pytest.approx(total / (i + 1))
            assert logged["gradcomp/syncs"] == (i + 1) // 4
            assert logged["gradcomp/skipped_syncs"] == 0
        assert rank["logged"]["gradcomp/total_bytes_sent"] == total == rank["bytes_sent"]
        assert rank["logged"]["gradcomp/total_syncs"] == 2
    assert "gradcomp summary (DiLoCo): 8 optimizer steps, 2 syncs (0 skipped)" in output
    assert re.search(r"8 optimizer steps, 2 syncs .*x less\); [\d.]+ ms per optimizer step\.$", output, flags=re.M)
    assert records["diloco-h4:nan"][0]["logged"]["gradcomp/total_skipped_syncs"] == 1


def test_no_collective_on_an_inner_step_and_replicas_identical_after_every_sync(launch):
    """The process groups' own sequence numbers (C++ callers count too) do not move on an inner step.

    The syncs run on DiLoCo's own group, never on the default one, where Lightning's loop broadcasts a flag at every
    step: an exchange overlapped with inner steps on that group would hold up each of them until it completed.
    """
    _, _, records = launch
    ranks = records["diloco-h4:steps8"]
    for name in ("diloco-h4:steps8", "diloco-h4t1:steps8", "diloco-h4f2t1:steps8"):
        assert all(s["world_collectives"] == 0 for r in records[name] for s in r["steps"]), name
    for i, (mine, theirs) in enumerate(zip(ranks[0]["steps"], ranks[1]["steps"])):
        if (i + 1) % 4:
            assert mine["collectives"] == 0, f"step {i + 1} is an inner step"
            assert not torch.equal(mine["params"], theirs["params"]), "each rank trains on its own data"
        else:
            assert mine["collectives"] > 0, f"step {i + 1} syncs"
            assert torch.equal(mine["params"], theirs["params"])
            assert torch.equal(mine["params"], mine["global"])
    assert_replicas_identical(ranks, "the ranks after fit")


def test_the_sigterm_broadcast_runs_once_a_period_when_no_exchange_is_in_flight(launch):
    """Lightning's per-step broadcast of rank 0's SIGTERM flag, the one collective of an inner step on the default
    group, runs at the step after each period's exchange has completed, and at every step with ``"step"``."""
    _, _, records = launch
    # the step (1-based) whose start takes the broadcast: phase % period == overlap_steps before it
    expected = {
        "diloco-h4:steps8": {1, 5},  # period 4, no overlap: the first step of each round
        "diloco-h4t1:steps8": {2, 6},  # period 4, the exchange applied 1 step after it started
        "diloco-h4f2t1:steps8": {2, 4, 6, 8},  # period 2 (2 fragments), overlap 1
        "diloco-h4-sigterm-every-step:steps8": set(range(1, 9)),  # Lightning's own: every step (the control)
    }
    for name, steps in expected.items():
        for rank in records[name]:
            moved = [s["world_collectives_since_last_step"] for s in rank["steps"]]
            assert moved == [1 if i + 1 in steps else 0 for i in range(8)], name


def test_fragments_sync_every_parameter_exactly_once_per_round(launch):
    """Streaming: 2 fragments of H = 4 sync at steps 2 and 4 of each round; each parameter changes globally once."""
    _, _, records = launch
    ranks = records["diloco-h4f2:steps8"]
    steps = ranks[0]["steps"]
    fragments = split_fragments([p.numel() for p in TinyNet().parameters()], 2)
    sizes = [p.numel() for p in TinyNet().parameters()]
    bounds = torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()])
    owner = torch.empty(bounds[-1], dtype=torch.long)
    for k, fragment in enumerate(fragments):
        for i in fragment:
            owner[bounds[i] : bounds[i + 1]] = k
    previous = _flat(TinyNet().parameters()).detach()
    synced_times = torch.zeros_like(owner)
    for i, step in enumerate(steps):
        changed = step["global"] != previous
        due = {1: 0, 3: 1, 5: 0, 7: 1}.get(i)  # the fragment that syncs after step i + 1, if any
        assert (step["collectives"] > 0) == (due is not None)
        if due is not None:
            assert not changed[owner != due].any(), f"step {i + 1}: only fragment {due} moves"
            mine = owner == due
            assert changed[mine].float().mean() > 0.9, f"step {i + 1}: fragment {due} moves"
            assert torch.equal(step["params"][mine], ranks[1]["steps"][i]["params"][mine])
        else:
            assert not changed.any()
        synced_times += changed
        previous = step["global"]
    assert synced_times.max() <= 2, "at most once per round"
    assert (synced_times == 2).float().mean() > 0.9, "every parameter once per round, in 2 rounds"
    assert sorted(i for f in fragments for i in f) == list(range(len(sizes))), "the fragments cover every tensor"
    assert torch.equal(ranks[0]["params"], ranks[1]["params"])


def test_an_overlapped_exchange_matches_diloco_computed_by_hand(launch):
    """``overlap_steps=1``: each round's mean is applied one inner step later and replaces the local parameters."""
    _, _, records = launch
    ours = records["diloco-h4t1:steps8"]
    expected = _flat(reference_diloco(2, 4, 8, overlap=1))
    torch.testing.assert_close(ours[0]["params"], expected, rtol=1e-5, atol=1e-6)
    not_overlapped = _flat(reference_diloco(2, 4, 8))
    assert (ours[0]["params"] - not_overlapped).abs().max() > 1e-4, "the reference can tell the overlap"
    assert_replicas_identical(ours)
    # the exchange is sent at steps 4 and 8 and applied at step 5 (buffers averaged) and at the end of fit
    assert [s["collectives"] > 0 for s in ours[0]["steps"]] == [False, False, False, True, True, False, False, True]


@pytest.mark.parametrize(
    ("run", "steps", "reference"),
    [
        ("diloco-h4t1-mix:steps8", 8, {"overlap": 1, "merge": "mix", "alpha": 0.5}),
        ("diloco-h4t1-eager:steps8", 8, {"overlap": 1, "merge": "eager"}),
        ("diloco-h4t1-eager:steps6", 6, {"overlap": 1, "merge": "eager"}),  # the last round's work kept, then synced
        ("diloco-h4t4-eager:steps8", 8, {"overlap": 4, "merge": "eager"}),  # one outer step late
    ],
)
def test_the_overlap_merges_match_diloco_computed_by_hand(launch, run, steps, reference):
    """Streaming DiLoCo's mixing factor and eager updates keep the local work of the steps taken in flight."""
    _, _, records = launch
    ours = records[run]
    expected = _flat(reference_diloco(2, 4, steps, **reference))
    torch.testing.assert_close(ours[0]["params"], expected, rtol=1e-5, atol=1e-6)
    replaced = _flat(reference_diloco(2, 4, steps, overlap=reference["overlap"]))  # mixing factor 0
    assert (ours[0]["params"] - replaced).abs().max() > 1e-4, "the reference can tell the merge"
    assert_replicas_identical(ours)
    if reference["merge"] == "eager":  # in flight, each rank trains from its own estimate's outer step
        step = ours[0]["steps"][4]
        assert not torch.equal(step["params"], ours[1]["steps"][4]["params"])


def test_every_default_but_the_round_matches_diloco_computed_by_hand(launch):
    """``DiLoCo(sync_every=4)``: the default outer optimizer, Nesterov SGD with lr 0.5 and momentum 0.5."""
    _, output, records = launch
    ours = records["diloco-h4-defaults:steps8"]
    expected = _flat(reference_diloco(2, 4, 8, outer_lr=0.5, outer_momentum=0.5))
    torch.testing.assert_close(ours[0]["params"], expected, rtol=1e-5, atol=1e-6)
    assert (ours[0]["params"] - _flat(reference_diloco(2, 4, 8))).abs().max() > 1e-4, "not the paper's"
    assert "every 4 optimizer steps (outer optimizer SGD(lr=0.5, momentum=0.5, nesterov=True))" in output


@pytest.mark.parametrize(
    ("resumed", "uninterrupted", "saved", "pending"),
    [
        (RESUMED_IN_FLIGHT, "diloco-h4f2t1:epochs4", "diloco-h4f2t1:epochs2", {"fragment": 1, "remaining": 1}),
        (RESUMED_DELAYED, "diloco-h4f2t2:epochs4", "diloco-h4f2t2:epochs2", {"fragment": 1, "remaining": 2}),
    ],
)
def test_the_overlap_merges_resume_bitwise_with_an_exchange_in_flight(launch, resumed, uninterrupted, saved, pending):
    root, _, records = launch
    assert_same_weights(records[uninterrupted], records[resumed], "resumed in flight")
    assert_replicas_identical(records[resumed])
    assert _saved(root, saved)["diloco"]["outer"]["pending"] == pending
    if "t2" in saved:  # eager: each rank's estimate of the others' shares is its own, saved in its file
        others = [rank["others"] for rank in _saved_ranks(root, saved)]
        assert sorted(others[0]) == [0, 1]
        assert not torch.equal(others[0][0][0], others[1][0][0])


def test_muon_inside_trains_and_resumes_bitwise_mid_round(launch):
    """``MuonAdamW`` as the inner optimizer: one optimizer, so DiLoCo takes it; its state is each rank's own."""
    root, _, records = launch
    assert_same_weights(records["diloco-h3:muon-epochs4"], records[RESUMED_MUON], "resumed mid-round")
    assert_replicas_identical(records[RESUMED_MUON])
    ranks = _saved_ranks(root, "diloco-h3:muon-epochs2")
    states = [rank["optimizer_states"][0]["state"] for rank in ranks]
    kinds = [set(state) for state in states[0].values()]
    assert kinds.count({"momentum_buffer"}) == 2, "Muon's state for the two linear weights"
    assert kinds.count({"step", "exp_avg", "exp_avg_sq"}) == len(kinds) - 2, "AdamW's for the rest"
    assert not torch.equal(states[0][0]["momentum_buffer"], states[1][0]["momentum_buffer"]), "each rank's own"
    trained = records["diloco-h3:muon-epochs4"][0]["params"]
    assert not torch.equal(trained, _flat(TinyNet().parameters()).detach())


def test_streaming_with_overlap_trains_and_resumes_with_an_exchange_in_flight(launch):
    """2 fragments, each exchange overlapped with one inner step; the checkpoint after 8 steps holds one in flight."""
    root, _, records = launch
    ranks = records["diloco-h4f2t1:steps8"]
    assert_replicas_identical(ranks)
    sent = [s["collectives"] > 0 for s in ranks[0]["steps"]]
    assert sent == [False, True, True, True, True, True, True, True], "sent at 2, 4, 6, 8; applied at 3, 5, 7"
    assert_same_weights(records["diloco-h4f2t1:epochs4"], records[RESUMED_IN_FLIGHT], "resumed in flight")
    section = _saved(root, "diloco-h4f2t1:epochs2")["diloco"]
    assert section["outer"]["pending"] == {"fragment": 1, "remaining": 1}
    contributions = [rank["contribution"] for rank in _saved_ranks(root, "diloco-h4f2t1:epochs2")]
    assert not torch.equal(contributions[0][0], contributions[1][0]), "each rank's own pseudo-gradient"


def _assert_mask_twins_train_alike(records, strategy: str) -> None:
    """A float ``-inf`` mask buffer trains as its bool twin: no round skipped, the same losses and weights; the
    running statistics BatchNorm changes are still averaged (identical on every rank, moved from their start)."""
    floats, bools = records[f"{strategy}:mask"], records[f"{strategy}:boolmask"]
    assert floats[0]["skipped"] == 0
    assert floats[0]["syncs"] == bools[0]["syncs"] > 0
    for rank_f, rank_b in zip(floats, bools, strict=True):
        assert [s["loss"] for s in rank_f["steps"]] == [s["loss"] for s in rank_b["steps"]]
        assert torch.equal(rank_f["params"], rank_b["params"])
    stats = [rank["state_dict"]["net.1.running_mean"] for rank in floats]
    assert all(torch.equal(s, stats[0]) for s in stats), "BatchNorm's statistics averaged at the syncs"
    assert stats[0].abs().sum() > 0


def test_a_float_mask_buffer_trains_as_its_bool_twin(launch):
    _assert_mask_twins_train_alike(launch[2], "diloco-h4")


def test_a_float_mask_buffer_trains_as_its_bool_twin_on_two_levels(launch4):
    _assert_mask_twins_train_alike(launch4[2], "diloco-h2-g2")


def test_a_nan_on_one_rank_costs_one_round(launch):
    """Rank 1's loss is NaN in round 2: that outer step is skipped, theta_global and the outer state stay finite."""
    _, output, records = launch
    ranks = records["diloco-h4:nan"]
    steps = ranks[0]["steps"]
    assert ranks[0]["skipped"] == 1
    assert ranks[0]["syncs"] == 2
    assert "not finite" in output
    assert torch.equal(steps[7]["global"], steps[3]["global"]), "the skipped round leaves theta_global"
    assert torch.equal(steps[7]["params"], steps[3]["global"]), "every worker reset to theta_global"
    assert not torch.equal(steps[11]["global"], steps[7]["global"]), "round 3 trains again"
    assert torch.isfinite(steps[11]["global"]).all()
    for state in ranks[0]["outer_state"]["state"].values():
        assert torch.isfinite(state["momentum_buffer"]).all()
    assert_replicas_identical(ranks)
    assert all(torch.isfinite(v).all() for v in ranks[1]["state_dict"].values() if v.is_floating_point())


def test_validation_runs_on_theta_global_and_leaves_the_local_training_alone(launch):
    _, _, records = launch
    ranks = records["diloco-h4:val"]
    assert len(ranks[0]["validated"]) == 2  # one batch per rank after steps 3 and 6, mid-round
    for seen in ranks[0]["validated"]:
        assert torch.equal(seen["params"], seen["global"])
    assert not torch.equal(ranks[0]["validated"][0]["params"], ranks[0]["steps"][2]["params"])
    assert_same_weights(records["diloco-h4:steps8"], ranks, "validation changed training")


def _saved(root, run):
    """Lightning's checkpoint of the run's ``last.ckpt`` (the file, or the one in its directory)."""
    return torch.load(checkpoint_file(os.path.join(root, run_name(run), "last.ckpt")), weights_only=False)


def _saved_ranks(root, run, world_size=2):
    """What each rank saved in the run's last checkpoint (its own DiLoCo state)."""
    path = os.path.join(root, run_name(run), "last.ckpt")
    return [load_rank_state(path, "diloco", rank).state for rank in range(world_size)]


def test_resume_in_the_middle_of_a_round_is_bitwise(launch):
    root, _, records = launch
    assert_same_weights(records["diloco-h3:epochs4"], records[RESUMED], "resumed mid-round")
    assert len(records[RESUMED][0]["steps"]) == 8
    saved = _saved(root, "diloco-h3:epochs2")
    section = saved["diloco"]
    assert section["world_size"] == 2
    assert section["outer"]["phase"] == 2, "saved 2 steps into a round"
    assert "ranks" not in section, "no rank's own state in rank 0's checkpoint"
    ranks = _saved_ranks(root, "diloco-h3:epochs2")
    assert [rank["global_step"] for rank in ranks] == [8, 8]
    local = [rank["tensors"] for rank in ranks]
    assert not all(torch.equal(a, b) for a, b in zip(*local)), "each rank's own parameters are saved"
    momenta = [rank["optimizer_states"][0]["state"][0]["momentum_buffer"] for rank in ranks]
    assert not torch.equal(*momenta), "each rank's own inner optimizer state is saved"
    model = TinyNet()
    params = dict(model.named_parameters())
    for name, g in zip(params, section["outer"]["params"]):
        assert torch.equal(saved["state_dict"][name], g), "the checkpoint's state_dict is theta_global"
    # the state matters: without it the resumed run differs
    stateless = records[f"{RESUMED}:stateless"]
    assert not torch.equal(stateless[0]["params"], records[RESUMED][0]["params"])


def test_only_rank_zero_writes_the_checkpoint_each_rank_writes_its_own_file(launch):
    root, _, records = launch
    ranks = records["diloco-h3:epochs2"]
    own, main = "last.ckpt/diloco.rank0.pt", f"last.ckpt/{CHECKPOINT_FILE}"
    assert ranks[0]["checkpoints_written"] == [own, main, own, main], "rank 0: its own and Lightning's, every epoch"
    assert ranks[1]["checkpoints_written"] == ["last.ckpt/diloco.rank1.pt"] * 2, "rank 1: its own file only"
    folder = os.path.join(root, run_name("diloco-h3:epochs2"), "last.ckpt")
    assert sorted(os.listdir(folder)) == [CHECKPOINT_FILE, "diloco.rank0.pt", "diloco.rank1.pt"]


def test_checkpoints_pass_between_plain_ddp_and_diloco(launch):
    _, output, records = launch
    assert "not written by DiLoCo" in output
    resumed = records["diloco-h3:epochs4+ddp:epochs2"]
    assert_replicas_identical(resumed)
    assert len(resumed[0]["steps"]) == 8
    assert resumed[0]["syncs"] == 3, "rounds start afresh at the resume: steps 3, 6 and the partial last one"
    # plain DDP keeps each rank's BatchNorm statistics apart (it broadcasts them before each forward): parameters only
    for run in ("ddp:epochs4+diloco-h3:epochs2", "identity:epochs4+diloco-h3:epochs2"):
        ranks = records[run]
        assert torch.equal(ranks[0]["params"], ranks[1]["params"]), run
        assert len(ranks[0]["steps"]) == 8
    assert "holds no CompressedDDP state" in output


def test_a_checkpoint_of_another_schedule_starts_a_new_round_from_theta_global(launch):
    _, output, records = launch
    assert "synced every 3 steps in 1 fragments, this run every 4 in 1: a new round starts" in output
    ranks = records["diloco-h4:epochs4+diloco-h3:epochs2"]
    assert [s["phase"] for s in ranks[0]["steps"]] == [1, 2, 3, 0] * 2
    assert_replicas_identical(ranks)


def test_dense_warmup_steps_are_ddp_steps_then_rounds_start_from_the_synchronized_weights(launch):
    """``DenseWarmup(steps=3)``, ``sync_every=2``: steps 1-3 equal DDPStrategy's step by step, every rank identical;
    then rounds of 2 (syncs after steps 5 and 7, and the partial last round), matching DiLoCo by hand from there."""
    _, output, records = launch
    assert "DenseWarmup: plain data parallelism for the first 3 steps, then DiLoCo's rounds." in output
    ddp, ranks = records["ddp:eager"], records["diloco-h2-w3:steps8"]
    for i in range(3):
        for rank in range(2):
            mine = ranks[rank]["steps"][i]
            assert torch.equal(mine["params"], ddp[rank]["steps"][i]["params"]), f"step {i + 1}, rank {rank}"
            assert torch.equal(mine["params"], mine["global"]), "theta_global follows the synchronized model"
        assert ranks[0]["steps"][i]["collectives"] > 0
    sent = [s["collectives"] > 0 for s in ranks[0]["steps"][3:]]
    assert sent == [False, True, False, True, False], "steps 4-8: rounds of 2 from the end of the warm-up"
    assert not torch.equal(ranks[0]["steps"][3]["params"], ranks[1]["steps"][3]["params"]), "local steps after"
    assert ranks[0]["syncs"] == 3
    expected = _flat(reference_diloco(2, 2, 8, warmup=3))
    torch.testing.assert_close(ranks[0]["params"], expected, rtol=1e-5, atol=1e-6)
    assert (ranks[0]["params"] - _flat(reference_diloco(2, 2, 8))).abs().max() > 1e-4, "the reference tells warm-up"
    assert_replicas_identical(ranks)


@pytest.mark.parametrize("warmup", [7, 10])
def test_resume_just_after_and_inside_the_dense_warmup_is_bitwise(launch, warmup):
    """The checkpoint after 8 steps: 1 step into the first round (warm-up of 7) or inside the warm-up (10)."""
    root, _, records = launch
    name = f"diloco-h3-w{warmup}"
    assert_same_weights(records[f"{name}:epochs4"], records[f"{name}:epochs4+{name}:epochs2"], f"warm-up {warmup}")
    saved = _saved(root, f"{name}:epochs2")
    assert saved["diloco"]["outer"]["phase"] == (1 if warmup == 7 else 0)
    assert saved["diloco"]["outer"]["syncs"] == 0
    steps = records[f"{name}:epochs4"][0]["steps"]
    assert [s["collectives"] > 0 for s in steps[: warmup + 4]] == [True] * warmup + [False, False, True, False]


def _assert_matches_reference(ranks: list[dict], world_size: int) -> None:
    expected = _flat(reference_diloco(world_size, 2, 6))
    for rank in ranks:
        torch.testing.assert_close(rank["params"], expected, rtol=1e-5, atol=1e-6)
    assert_replicas_identical(ranks)


GROUPED = ["ddp:eager", "diloco-h1-g2:eager", "diloco-h2-g2:eager", SIZED, "diloco-h2-g2:mask", "diloco-h2-g2:boolmask"]
# the 2-process checkpoint of RESUMED resumed on 3 processes
RESIZED = "diloco-h3:epochs4+diloco-h3:epochs2"


@pytest.fixture(scope="module")
def launch3(launch, tmp_path_factory):
    """Three processes: the reference, a checkpoint, and a resume of the 2-process launch's checkpoint."""
    root = tmp_path_factory.mktemp("diloco")  # a name as long as the 2-process launch's: checkpoints comparable
    shutil.copytree(launch[0] / run_name("diloco-h3:epochs2"), root / run_name("diloco-h3:epochs2"))
    code, output, records = run_fits(root, 3, ["diloco-h2:steps6", SIZED, RESIZED])
    assert code == 0, output[-3000:]
    return root, output, records


@pytest.fixture(scope="module")
def launch4(tmp_path_factory):
    root = tmp_path_factory.mktemp("diloco")
    code, output, records = run_fits(root, 4, GROUPED)
    assert code == 0, output[-3000:]
    return root, output, records


def test_two_levels_dense_inside_a_group_diloco_across(launch4):
    """4 processes as 2 groups of 2: identical inside a group at every step, everywhere after a sync; H = 1 with outer
    SGD(lr=1) is plain DDP over the 4 ranks; H = 2 (4 steps, one epoch) matches DiLoCo by hand with each group's mean
    gradient."""
    _, output, records = launch4
    assert "2 replicas of 2 ranks" in output
    torch.testing.assert_close(
        records["diloco-h1-g2:eager"][0]["params"], records["ddp:eager"][0]["params"], rtol=1e-5, atol=1e-6
    )
    ranks = records["diloco-h2-g2:eager"]
    for i, steps in enumerate(zip(*(rank["steps"] for rank in ranks))):
        params = [step["params"] for step in steps]
        assert torch.equal(params[0], params[1]), f"step {i + 1}: inside group 0"
        assert torch.equal(params[2], params[3]), f"step {i + 1}: inside group 1"
        if (i + 1) % 2:
            assert not torch.equal(params[0], params[2]), f"step {i + 1}: each group trains on its own data"
        else:
            assert all(torch.equal(p, steps[0]["global"]) for p in params), f"step {i + 1}: synced"
    assert_replicas_identical(ranks)
    expected = _flat(reference_diloco(4, 2, 4, group=2))
    torch.testing.assert_close(ranks[0]["params"], expected, rtol=1e-5, atol=1e-6)
    ungrouped = _flat(reference_diloco(4, 2, 4))
    assert (ranks[0]["params"] - ungrouped).abs().max() > 1e-4, "the reference can tell the groups"
    # each sync: every rank all-reduces half of the model with its peer and all-gathers the other half in its group
    half = (ranks[0]["params"].numel() + _float_buffer_numel()) // 2 * 4
    assert ranks[0]["bytes_sent"] == 2 * 2 * half


def test_three_processes_match_the_reference(launch3):
    _assert_matches_reference(launch3[2]["diloco-h2:steps6"], 3)


def test_rank_zeros_checkpoint_does_not_grow_with_the_ranks(launch, launch3, launch4):
    """Each rank's parameters, inner optimizer state and residuals go into its own file, not rank 0's checkpoint."""
    sizes, rank_files = [], []
    for world_size, (root, _, records) in zip((2, 3, 4), (launch, launch3, launch4)):
        path = os.path.join(root, run_name(SIZED), "last.ckpt")
        sizes.append(os.path.getsize(os.path.join(path, CHECKPOINT_FILE)))
        rank_files.append(sorted(os.listdir(path)))
        assert rank_files[-1] == [CHECKPOINT_FILE, *(f"diloco.rank{r}.pt" for r in range(world_size))]
        assert not any(CHECKPOINT_FILE in f for rank in records[SIZED][1:] for f in rank["checkpoints_written"])
        own = load_rank_state(path, "diloco", world_size - 1).state
        assert own["exchange"]["residuals"], "the residuals are in the rank's file"
    one_rank = os.path.getsize(os.path.join(path, "diloco.rank0.pt"))
    assert max(sizes) - min(sizes) < one_rank / 100, f"rank 0's checkpoint: {sizes} bytes on 2, 3, 4 processes"


def test_a_checkpoint_of_two_ranks_resumes_on_three_from_theta_global_in_the_same_round(launch3):
    """theta_global, the outer state and the phase carry over; each rank's own state is reset, with a warning."""
    _, output, records = launch3
    assert "saved by 2 processes, this run has 3" in output
    ranks = records[RESIZED]
    assert [s["phase"] for s in ranks[0]["steps"]] == [0, 1, 2, 0, 1, 2], "saved 2 steps into a round of 3"
    assert ranks[0]["syncs"] == 2 + 3, "2 saved, 2 rounds resumed, the partial last one"
    assert_replicas_identical(ranks)


def test_one_process_matches_the_reference(in_process_ddp, tmp_path):
    """One process (in this one: no launch): the pseudo-gradient's average is itself."""
    train("diloco-h2:steps6", str(tmp_path), 1)
    _assert_matches_reference([torch.load(tmp_path / "diloco-h2-steps6" / "rank0.pt", weights_only=False)], 1)


def _trainer(tmp_path, strategy, **kwargs) -> Trainer:
    return Trainer(
        **{
            "strategy": strategy,
            "accelerator": "cpu",
            "devices": 1,
            "max_steps": 1,
            "logger": False,
            "enable_checkpointing": False,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "default_root_dir": tmp_path,
            **kwargs,
        }
    )


def test_registered_by_name_with_sync_every_auto_from_the_run(in_process_ddp, tmp_path, caplog):
    """``strategy="diloco"``: H is chosen when fitting starts, about 60 outer steps over the run (120 steps: H = 2);
    one process is warned about (nothing to average), and the setup line says what was chosen."""
    import logging

    trainer = Trainer(strategy="diloco", accelerator="cpu", devices=2, logger=False)
    assert isinstance(trainer.strategy, DiLoCo)
    assert trainer.strategy.sync_every == "auto"
    trainer = _trainer(tmp_path, "diloco", max_steps=120, max_epochs=-1)
    with caplog.at_level(logging.INFO), pytest.warns(UserWarning, match="DiLoCo: 1 replica .* nothing is averaged"):
        trainer.fit(TinyNet())
    assert trainer.strategy.sync_every == 2
    assert trainer.strategy.outer_state.syncs == 60
    assert "synced every 2 ('auto') optimizer steps (outer optimizer SGD(lr=0.5, momentum=0.5, nesterov=True))" in (
        caplog.text
    )


@pytest.mark.parametrize(("total", "expected"), [(60, 1), (600, 10), (6000, 100), (10**6, 500), (float("inf"), 500)])
def test_auto_gives_about_60_outer_steps_and_at_most_the_papers_round(total, expected):
    assert auto_sync_every(total) == expected
    assert auto_sync_every(total, fragments=4) % 4 == 0
    assert auto_sync_every(600, fragments=3, overlap_steps=7) == 21, "a period of at least the overlap"


def test_a_run_with_few_outer_steps_is_warned_before_it_starts(in_process_ddp, tmp_path):
    """``sync_every=500`` in a 4-step run: no outer step before the end; the warning names the fix."""
    trainer = _trainer(tmp_path, DiLoCo(sync_every=500), max_steps=4, max_epochs=-1)
    message = r"sync_every=500 gives 0 outer steps and a partial one at the end in this run's 4 optimizer steps"
    message += r" \(fewer than 20\): validation and checkpoints hold the starting weights until the end"
    with pytest.warns(UserWarning, match=message + r".*use sync_every='auto' \(H=1 here\)"):
        trainer.fit(TinyNet())


def test_a_bare_sgd_class_is_taken_with_diloco_outer_settings_and_said(in_process_ddp, tmp_path):
    strategy = DiLoCo(sync_every=1, outer_optimizer=torch.optim.SGD)
    built = r"built as SGD\(lr=0.5, momentum=0.5, nesterov=True\) \(DiLoCo's default outer settings"
    with pytest.warns(UserWarning, match=r"outer_optimizer=SGD is a bare class: " + built):
        _trainer(tmp_path, strategy).fit(TinyNet())
    group = strategy.outer_state.optimizer.param_groups[0]
    assert (group["lr"], group["momentum"], group["nesterov"]) == (0.5, 0.5, True)


def test_an_outer_lr_too_small_to_train_is_warned_about(in_process_ddp, tmp_path):
    """What LightningCLI builds from ``class_path: torch.optim.SGD`` without ``init_args``: torch's lr 0.001."""
    strategy = DiLoCo(sync_every=1, outer_optimizer=partial(torch.optim.SGD))
    with pytest.warns(UserWarning, match="the outer optimizer's lr is 0.001: .* barely trains"):
        _trainer(tmp_path, strategy).fit(TinyNet())


def test_validating_a_mid_round_checkpoint_says_its_weights_are_the_last_syncs(in_process_ddp, tmp_path, caplog):
    """A checkpoint 2 steps into a round of 4: ``validate`` evaluates theta_global of the last sync, and says so; so
    does the validation during ``fit`` that runs mid-round (after steps 3 and 6), once."""
    import logging

    from lightning.pytorch.callbacks import ModelCheckpoint

    from tests.fit_worker import ValNet

    saving = ModelCheckpoint(dirpath=tmp_path, filename="last")
    kwargs = {"max_steps": 6, "max_epochs": -1, "val_check_interval": 3, "callbacks": [saving]}
    trainer = _trainer(tmp_path, DiLoCo(sync_every=4), enable_checkpointing=True, **kwargs)
    with caplog.at_level(logging.INFO):
        trainer.fit(ValNet())
        assert caplog.text.count("validation runs on theta_global of the last sync") == 1, "once per fit"
        assert "validation runs on theta_global of the last sync (3 inner steps ago)" in caplog.text
        caplog.clear()
        _trainer(tmp_path, DiLoCo(sync_every=4)).validate(ValNet(), ckpt_path=str(tmp_path / "last.ckpt"))
    assert "this checkpoint was saved 2 inner steps into a round: its weights are theta_global" in caplog.text


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"sync_every": 0}, "Expected `sync_every` to be an integer >= 1, got 0."),
        ({"sync_every": 4, "fragments": 3}, "divides `sync_every` (4), got 3."),
        ({"sync_every": 4, "fragments": 2, "overlap_steps": 3}, "`overlap_steps` to be an integer in [0, 2], got 3"),
        ({"sync_every": "often"}, "Expected `sync_every` to be an integer >= 1 or 'auto', got 'often'."),
        ({"outer_optimizer": 0.7}, "Expected `outer_optimizer` to be a callable"),
        ({"outer_optimizer": torch.optim.Adam}, "got the bare class Adam: its default lr is not an outer step's."),
        (
            {"outer_optimizer": torch.optim.SGD([torch.zeros(1)], lr=0.7)},
            "got an optimizer instance, SGD, built over other tensors.",
        ),
        ({"merge": "eager"}, "Expected `overlap_steps` >= 1 with `merge`"),
        ({"mixing_factor": 0.5}, "Expected `overlap_steps` >= 1 with `mixing_factor`"),
        ({"overlap_steps": 1, "merge": "eager", "mixing_factor": 0.5}, "Expected `merge='mix'` with `mixing_factor`"),
        ({"overlap_steps": 1, "merge": "average"}, "Expected `merge` to be one of 'mix', 'eager', got 'average'."),
        (
            {"overlap_steps": 1, "merge": "mix", "mixing_factor": 1.0},
            "Expected `mixing_factor` to be a finite number in [0, 1), got 1.0.",
        ),
        ({"offload": 1}, "Expected `offload` to be True or False, got 1."),
        ({"sigterm_check": "never"}, "Expected `sigterm_check` to be one of 'sync', 'step', got 'never'."),
        ({"bucket_cap_mb": 25}, "DiLoCo does not accept `bucket_cap_mb`=25"),
        ({"sync_evry": 5}, "Did you mean `sync_every`?"),
        ({"ddp_comm_hook": print}, "DiLoCo does not accept `ddp_comm_hook`"),
        ({"replica_group": "nodes"}, 'Expected `replica_group` to be None (every rank its own replica), "node"'),
        ({"replica_group": 0}, "or an integer >= 1 (ranks per group), got 0."),
        ({"replica_group": True}, "or an integer >= 1 (ranks per group), got True."),
        ({"replica_group": 2, "compressor": Identity()}, "Expected `compressor=None` with `replica_group=2`"),
    ],
)
def test_bad_arguments_are_refused_at_construction(kwargs, message):
    with pytest.raises(MisconfigurationException) as error:
        DiLoCo(**kwargs)
    assert message in str(error.value)
    assert "\n" not in str(error.value)


class TwoOptimizers(TinyNet):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def configure_optimizers(self):
        return torch.optim.SGD(self.net[:3].parameters(), lr=0.1), torch.optim.SGD(self.net[3:].parameters(), lr=0.1)


def test_more_than_one_optimizer_is_refused_when_fitting_starts(in_process_ddp, tmp_path):
    trainer = Trainer(
        strategy=DiLoCo(sync_every=2),
        accelerator="cpu",
        devices=1,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        default_root_dir=tmp_path,
    )
    with pytest.raises(MisconfigurationException, match="returned 2: return one optimizer with a parameter group"):
        trainer.fit(TwoOptimizers())


def test_a_replica_group_that_does_not_divide_the_processes_is_refused(in_process_ddp, tmp_path):
    trainer = Trainer(
        strategy=DiLoCo(sync_every=2, replica_group=2),
        accelerator="cpu",
        devices=1,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        default_root_dir=tmp_path,
    )
    with pytest.raises(MisconfigurationException, match="`replica_group` to divide the 1 processes .* got 2 ranks"):
        trainer.fit(TinyNet())


def test_a_node_is_the_processes_over_the_nodes():
    assert group_size("node", 16, 2, ValueError) == 8
    assert group_size("node", 4, 1, ValueError) == 4
    assert group_size(2, 4, 1, ValueError) == 2
    with pytest.raises(ValueError, match="divide the 6 processes into equal groups, got 4 ranks per group"):
        group_size(4, 6, 1, ValueError)


def test_outer_optimizer_is_a_callable_of_the_parameters():
    strategy = DiLoCo(outer_optimizer=partial(torch.optim.Adam, lr=1e-3))
    assert strategy.outer_state.outer_optimizer.func is torch.optim.Adam


def test_fragments_are_consecutive_and_cover_every_parameter():
    numels = [100, 10, 100, 10, 100, 10]
    fragments = split_fragments(numels, 3)
    assert fragments == [[0, 1], [2, 3], [4, 5]]
    assert split_fragments([5, 5], 2) == [[0], [1]]
    assert split_fragments([1000, 1, 1], 3) == [[0], [1], [2]]
