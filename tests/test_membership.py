"""The seam between DiLoCo's round and its membership, in one process: the round against fake memberships, and the
quorum's check of its members against a fake torchft session.

The multi-process tests (tests/test_diloco.py, tests/test_fault_tolerance.py) are the bitwise guard of the real
paths; these pin what the round does with each answer a membership can give.
"""

from __future__ import annotations

import functools
import warnings
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from lightning_gradcomp.diloco.membership import DIVERGED, Membership, Participation, Place, Start
from lightning_gradcomp.diloco.round import Round
from lightning_gradcomp.ft.config import TorchFT
from lightning_gradcomp.ft.membership import Fingerprint, Member
from lightning_gradcomp.ft.quorums import MembershipError, Quorums


class Scripted(Membership):
    """A membership whose answers the test sets: who takes part, the vote, a join at the first step."""

    def __init__(self, part: Participation | None = None, verdict: str | None = None, start: Start = Start.TRAIN):
        super().__init__()
        self.part, self.verdict, self.start = part, verdict, start
        self.discards: list[str] = []

    def first_step(self, closure, optimizers) -> Start:
        start, self.start = self.start, Start.TRAIN
        if start is Start.AT_SYNC:
            closure()
            self.round.phase = self.round.period - 1  # healed at the others' place, as their step saw it
        return start

    def enter(self, place: Place) -> Participation:
        return self.part if self.part is not None else super().enter(place)

    def vote(self, part: Participation, reason: str) -> str:
        return super().vote(part, reason) if self.verdict is None else self.verdict

    def discard(self, part: Participation, why: str) -> None:
        super().discard(part, why)
        self.discards.append(why)


def _round(membership: Membership, sync_every: int = 2) -> tuple[Round, nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    model.register_buffer("mask", torch.zeros(4).masked_fill(torch.arange(4) > 1, float("-inf")))
    outer = functools.partial(torch.optim.SGD, lr=1.0)
    round = Round(sync_every, 1, 0, outer, membership=membership, warn=warnings.warn)
    names = [n for n, _ in model.named_parameters()]
    buffer_names = [n for n, b in model.named_buffers() if b.is_floating_point()]
    round.attach(list(model.parameters()), list(model.buffers()), names, buffer_names)
    return round, model, torch.optim.SGD(model.parameters(), lr=0.1)


def _train(round: Round, model: nn.Module, optimizer: torch.optim.Optimizer, steps: int, bad: bool = False) -> None:
    """``steps`` optimizer steps through the round, a sync sent where one is due."""
    for _ in range(steps):

        def closure():
            optimizer.zero_grad()
            out = model(torch.randn(8, 4))
            loss = out.sum() * (float("nan") if bad else 1.0)
            loss.backward()
            return loss

        def step(closure):
            loss = closure()
            optimizer.step()
            return loss

        _, due = round.inner_step(closure, step, [optimizer])
        if due is not None:
            round.send(due, [optimizer])


def test_the_static_membership_steps_theta_global_to_the_model_and_leaves_a_constant_mask():
    """One worker, outer SGD(lr=1): the outer step moves theta_global onto the model; BatchNorm's statistics (changed)
    are kept, the ``-inf`` mask (constant) neither blocks the sync nor changes."""
    round, model, optimizer = _round(Membership())
    _train(round, model, optimizer, 2)
    assert round.syncs == 1
    assert round.skipped == 0
    for p, g in zip(model.parameters(), round.params):
        torch.testing.assert_close(p.detach(), g, rtol=0, atol=1e-6)
    kept = round.weights.buffers[round.weights.buffer_names.index("1.running_mean")]
    assert torch.equal(kept, model[1].running_mean)
    assert torch.isinf(model.mask).sum() == 2


def test_a_vote_that_says_no_discards_the_sync_everywhere():
    membership = Scripted(verdict="another group voted so")
    round, model, optimizer = _round(membership)
    start = [g.clone() for g in round.params]
    _train(round, model, optimizer, 2)
    assert round.syncs == 0
    assert round.skipped == 0
    assert membership.discards == ["another group voted so"]
    assert membership.discarded == 1
    for p, g, s in zip(model.parameters(), round.params, start):
        assert torch.equal(g, s), "theta_global untouched"
        assert torch.equal(p.detach(), g), "the worker back at theta_global"


def test_a_member_that_does_not_contribute_sends_zeros_and_applies_the_others_step():
    """A group that healed at this sync takes part with zeros: with one worker, the mean over the contributors is
    rescaled from the members (2) to the contributors (1), so zeros everywhere give no step, and no merge."""
    part = Participation(Place(0), contributes=False, contributors=1, members=2)
    round, model, optimizer = _round(Scripted(part=part))
    start = [g.clone() for g in round.params]
    _train(round, model, optimizer, 2)
    assert round.syncs == 1
    for p, g, s in zip(model.parameters(), round.params, start):
        assert torch.equal(g, s), "zeros from this group: no change here"
        assert torch.equal(p.detach(), g), "the fragment set to theta_global (no local work merged)"


def test_identical_first_pseudo_gradients_are_warned_about():
    """Two contributors whose average equals this worker's own pseudo-gradient trained on the same batches (one
    process stands for both here: its average is its own); one contributor, or a later sync, says nothing."""
    twins = Participation(Place(0), contributors=2, members=2)
    round, model, optimizer = _round(Scripted(part=twins))
    with pytest.warns(UserWarning, match="the 2 workers' first pseudo-gradients are identical"):
        _train(round, model, optimizer, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _train(round, model, optimizer, 2)  # the second sync: not checked again
        alone, model, optimizer = _round(Membership())
        _train(alone, model, optimizer, 2)
    assert round.syncs == 2
    assert alone.syncs == 1


def test_no_contributor_discards_the_sync():
    part = Participation(Place(0), contributes=False, contributors=0, members=1)
    membership = Scripted(part=part)
    round, model, optimizer = _round(membership)
    _train(round, model, optimizer, 2)
    assert round.syncs == 0
    assert membership.discards == ["no group contributed"]


def test_a_join_at_the_others_sync_takes_no_step_and_takes_part_in_it():
    membership = Scripted(start=Start.AT_SYNC)
    round, model, optimizer = _round(membership)
    before = [p.detach().clone() for p in model.parameters()]
    output, due = round.inner_step(lambda: None, lambda c: pytest.fail("no step"), [optimizer])
    assert output is None
    assert due == 0, "healed one step before the others' sync, the tick makes it due"
    assert all(torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before))


def test_a_diverged_worker_skips_the_round_and_names_its_tensors():
    round, model, optimizer = _round(Membership())
    with pytest.warns(UserWarning, match=r"on rank 0, 0.weight, 0.bias, .*1.running_mean.* became non-finite") as seen:
        _train(round, model, optimizer, 2, bad=True)
    assert "mask" not in str(seen[0].message), "a buffer that was never finite is not named"
    assert round.skipped == 1
    assert round.syncs == 0
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert not optimizer.state, "no non-finite momentum kept"
    assert Membership().vote(Participation(Place(0)), DIVERGED) == DIVERGED


# ---------------------------------------------------------------------------------------------------------------
# Quorums against a fake torchft session
# ---------------------------------------------------------------------------------------------------------------
class FakeSession:
    """What :class:`Quorums` asks of torchft's session: a quorum, and the members' rows."""

    def __init__(self, members: list[tuple[Member, Fingerprint]], reconfigured: bool = True, quorum_id: int = 1):
        self.rows = torch.stack([member.row(fingerprint) for member, fingerprint in members])
        self.reconfigured, self.step = reconfigured, 0
        self.groups = SimpleNamespace(quorum_id=quorum_id)

    def quorum(self):
        return SimpleNamespace(
            members=len(self.rows),
            peer_state=None,
            reconfigured=self.reconfigured,
            errored=False,
            seconds=0.0,
            step=self.step,
        )

    def all_gather(self, row):
        return self.rows


_OURS = Fingerprint((("sync_every", 4), ("model", "a")))


def _quorums(members, **kwargs) -> Quorums:
    quorums = Quorums(TorchFT(lighthouse="http://127.0.0.1:1", replica_group_id="a"), info=lambda line: None)
    quorums.fingerprint = _OURS
    quorums.session = FakeSession(members, **kwargs)
    return quorums


def test_a_quorum_counts_its_contributors_and_finds_the_leaders_place():
    members = [
        (Member(2, True, 5, name=0), _OURS),
        (Member(2, False, 3, name=4), _OURS),
        (Member(None, False, 5), _OURS),
    ]
    sync = _quorums(members).enter(2)
    assert (sync.place, sync.contributors, sync.members, sync.top_step) == (2, 1, 3, 5)
    assert sync.names == (0, 4, -1)
    assert sync.changed
    assert not sync.failed
    assert not sync.skip


def test_a_member_with_other_settings_is_refused_in_one_line():
    theirs = Fingerprint((("sync_every", 8), ("model", "a")))
    members = [(Member(0, True, 5), theirs), (Member(0, True, 5), _OURS)]
    with pytest.raises(MembershipError, match=r"another sync_every \(4 here, 8 there\)"):
        _quorums(members).enter(0)


def test_leaders_at_different_places_skip_the_sync():
    members = [(Member(0, True, 5), _OURS), (Member(1, True, 5), _OURS)]
    sync = _quorums(members).enter(0)
    assert sync.skip
    assert "different places [0, 1]" in sync.failed


def test_an_unchanged_quorum_asks_nothing_of_the_members():
    sync = _quorums([(Member(0, True, 5), _OURS)], reconfigured=False).enter(0)
    assert not sync.changed
    assert sync.place == 0
    assert sync.contributes


def test_the_quorum_line_names_the_groups_that_joined_or_left():
    from lightning_gradcomp.diloco.elastic import TorchFTMembership
    from lightning_gradcomp.ft.quorums import Sync

    lines: list[str] = []
    membership = TorchFTMembership(TorchFT(lighthouse="http://127.0.0.1:1", replica_group_id="0"), info=lines.append)
    quorum = SimpleNamespace(peer_state=None)
    for names in [(0, 1, 2), (0, 2), (0, 2, 3)]:
        membership.quorums.enter = lambda code, names=names: Sync(
            quorum, 0, True, len(names), len(names), changed=True, names=names
        )
        membership._quorum(0)
    assert lines[0].endswith("(3 contributing).")
    assert lines[1].endswith("(2 contributing; left: 1).")
    assert lines[2].endswith("(3 contributing; joined: 3).")
