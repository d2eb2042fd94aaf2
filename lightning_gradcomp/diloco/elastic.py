"""DiLoCo's membership across replica groups that come and go: a quorum at every sync, a vote, a heal before training.

The dynamic :class:`~lightning_gradcomp.diloco.membership.Membership`: the round's sync is plain DiLoCo's (Douillard
et al. 2023, arXiv 2311.08105), and its members are the replica groups torchft's lighthouse puts in each quorum
(:mod:`lightning_gradcomp.ft`), as torchft's own ``_StreamingDiLoCoFragment`` runs it (pytorch/torchft
``local_sgd.py``), with plain DiLoCo's guarantees:

- every sync starts with a quorum; the pseudo-gradient is averaged over the groups that take part (divided by their
  number), so a group that died between syncs costs the others nothing;
- after the exchange each group votes; a failure anywhere (a group that died during the exchange, an average that is
  not finite) discards the outer step on every group that saw it: the weights go back to theta_global and the
  compressor's staged state is dropped. A group that committed less than the others heals at the next quorum;
- a group that starts behind the others heals from a live peer inside its first optimizer step, before any inner
  step: theta_global, the outer optimizer, the phase, the exchange's shared state (its own residuals start empty),
  and the front door's loop state (Lightning's counters, inner optimizers and schedulers), then takes part in the sync
  the others are at without contributing to it, and applies the same outer step;
- when the members change, each compares its settings with the others' (:mod:`lightning_gradcomp.ft.quorums`)
  and one that does not belong is refused before it averages anything; a group that would start a new model where
  the lighthouse already formed quorums (everything trained is gone from the live groups) is refused too, instead of
  resetting the run;
- a dense step (``DenseWarmup``'s) is torchft's fault-tolerant data parallelism: a quorum, the mean gradient over
  the groups in it and a vote, a group behind the others healed first.
"""

from __future__ import annotations

import importlib.metadata
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from lightning_gradcomp.diloco import round_state
from lightning_gradcomp.diloco.membership import Job, LoopState, Membership, Participation, Place, Start
from lightning_gradcomp.diloco.replicas import (
    ReplicaGroups,
    average_in_group,
    dense_tensors,
    flatten_by_dtype,
    unflatten_into,
)
from lightning_gradcomp.diloco.weights import finite_each
from lightning_gradcomp.ft.config import TorchFT
from lightning_gradcomp.ft.membership import Fingerprint
from lightning_gradcomp.ft.quorums import MembershipError, Quorums, Sync

if TYPE_CHECKING:
    from lightning_gradcomp.ft.session import Quorum, Session

__all__ = ["MembershipError", "TorchFTMembership", "membership_for"]

_VOTED_NO = "a collective failed or another group voted so"


class TorchFTMembership(Membership):
    """The replica groups of a fault-tolerant run, on torchft: a quorum at every sync, a vote, a heal.

    Args:
        config: the run's :class:`~lightning_gradcomp.ft.TorchFT` settings.
        info: how the one-line reports (heals, discarded syncs, members) are logged.
        error: what a setting that cannot work raises.

    Attributes:
        quorums: the quorums this group asks for (:class:`~lightning_gradcomp.ft.quorums.Quorums`).
        loop: the front door's loop state, taken for a peer that heals and loaded when this group heals.
        heals: times this group healed; heal_seconds: how long the last heal took; contributors, members: the
            groups that counted in, and took part in, the last sync.
    """

    resumes_in_flight = False  # an exchange's quorum is gone after a restart: discarded, not sent again

    def __init__(
        self, config: TorchFT, info: Callable[[str], Any] = print, error: type[Exception] = ValueError
    ) -> None:
        super().__init__(None, error)
        self.config, self.info = config, info
        self.quorums = Quorums(config, info)
        self.loop = LoopState()
        self.joined = False
        self.heals = 0
        self.heal_seconds = 0.0
        self.contributors = 0
        self.members = 0
        self._open: Sync | None = None  # a quorum opened for the sync to come (the join's)
        self._restored_step: dict[str, int] | None = None
        self._last_line = ""
        self._named: set[int] | None = None  # the members' integer names at the last quorum whose members changed

    @property
    def session(self) -> Session | None:
        """The torchft manager of this rank (after :meth:`bind`, until :meth:`close`)."""
        return self.quorums.session

    def bind(self, round: Any, job: Job, device: Any) -> None:
        """Torchft's manager for this rank, and the round's exchange on its process groups.

        Raises:
            LighthouseUnreachableError: If no lighthouse answers within the connect timeout.
        """
        from lightning_gradcomp.ft.session import Session

        self.round, self.loop = round, job.loop
        world_size = job.world_size if job.distributed else 1
        compressor = round.exchange.compressor
        if world_size > 1 and compressor is not None:
            raise self.error(
                f"Expected `compressor=None` with `fault_tolerance` on a job of {world_size} processes: a compressed"
                " outer exchange between replica groups of several processes is not supported (one process per job"
                " is)."
            )
        self.quorums.fingerprint = _fingerprint(round)
        self.quorums.session = session = Session(
            self.config,
            rank=job.rank,
            world_size=world_size,
            store=job.store,
            rounds=compressor.rounds if compressor is not None else 1,
            state_dict=self._snapshot,
        )
        round.exchange.attach(device, replicas=self._replicas(job, world_size), backend=session.collectives)
        if self._restored_step is not None:
            session.load_step(self._restored_step)

    def _replicas(self, job: Job, world_size: int) -> ReplicaGroups | None:
        """Two levels in a job of several processes: shard j of the group's exchange with rank j of the others."""
        if world_size == 1:
            return None
        return ReplicaGroups(size=world_size, count=1, index=job.rank, group=job.group, peers=None)

    # ------------------------------------------------------------------------------------------------------------
    # The join, a sync's members, the vote
    # ------------------------------------------------------------------------------------------------------------
    def first_step(self, closure: Callable[[], Any], optimizers: Sequence[Any]) -> Start:
        """This group's first quorum, before its first inner step: how the step goes on.

        Everyone starting (a new run, or a whole-job restart): the start is committed (a peer's state, if this group
        is behind, loaded first) and the step trains. Others at a dense step: it takes part in it. Others at a sync:
        the step's closure runs (Lightning's loop needs it; its gradients are dropped), the group heals at the place
        the others are at, and takes part in their sync with no step of its own.

        Raises:
            MembershipError: If this group does not belong with the others, or would start a new model where the
                lighthouse already formed quorums.
        """
        if self.joined:
            return Start.TRAIN
        self.joined = True
        sync = self._first_quorum()
        if sync is None:
            return Start.TRAIN
        self._open = sync
        round, peer = self._round(), sync.quorum.peer_state
        if Place.of(sync.place).dense:  # the others are at a dense step: this one takes part in it, healed first
            if peer is not None:
                self._heal(sync.quorum, peer["round"]["phase"])
            return Start.DENSE
        closure()
        for optimizer in optimizers:
            optimizer.zero_grad(set_to_none=True)
        assert sync.place is not None
        if peer is not None:  # at the others' phase, as their step saw it: the round's tick redoes it
            self._heal(sync.quorum, peer["round"]["phase"] - 1)
        else:  # at their step but not at their place in the round (a checkpoint of the same step): vote to discard
            sync.failed = sync.failed or "this group joined at the others' step but not at their place in the round"
            round.phase = (sync.place + 1) * round.period - 1
        return Start.AT_SYNC

    def _first_quorum(self) -> Sync | None:
        """Quorums until the run can start; the quorum of the place the others are at, or ``None`` to train."""
        deadline = time.monotonic() + self.config.quorum_timeout
        while True:
            sync = self._quorum(None)
            if sync.place is not None:
                return sync
            if sync.quorum.peer_state is not None:
                self._heal(sync.quorum, sync.quorum.peer_state["round"]["phase"])
                break
            if sync.members >= self.config.starting_replicas and not sync.failed:
                break
            # a run starts, or every group resumes from its checkpoint, only with enough groups in its first quorum
            # and not with one that was refused: a resumed group that went on alone would average only its own
            # pseudo-gradients while the others, once up, did the same
            self.quorums.wait_for_more(sync, deadline)
        if sync.top_step == 0 and sync.new_in_a_used_lighthouse:
            raise MembershipError(
                f"TorchFT: replica group '{self.config.name}' would start a new model, but the lighthouse at"
                f" {self.config.lighthouse} formed quorums before with groups that are gone, and no live group is"
                " further along: what was trained is not on any live group. Resume from a checkpoint"
                " (`trainer.fit(model, ckpt_path=...)`), or restart the lighthouse to start a new run."
            )
        self._session().should_commit(not sync.failed, sync.failed)
        if self._restored_step is not None and sync.quorum.peer_state is None:
            self._session().load_step(self._restored_step)  # the start's commit is no sync: the checkpoint's step
        return None

    def enter(self, place: Place) -> Participation:
        """The quorum (the join's, or a new one, healing first if behind); who takes part in the sync at ``place``."""
        sync, self._open = self._open, None
        if sync is None:
            sync = self._quorum(place.code())
            if sync.quorum.peer_state is not None and sync.place is not None:  # behind: their state, their sync
                self._heal(sync.quorum, sync.quorum.peer_state["round"]["phase"])
        theirs = Place.of(sync.place)
        if sync.place is None or theirs.dense != place.dense:  # nobody at the highest step is where this group is
            sync.failed = sync.failed or f"the groups at the highest step are not at {place}"
            sync.skip = True
        self.contributors, self.members = sync.contributors, sync.members
        return Participation(theirs, sync.contributes, sync.contributors, sync.members, sync.failed, sync.skip)

    def _quorum(self, code: int | None) -> Sync:
        """A quorum, with one line when its members changed (not again for the same line)."""
        sync = self.quorums.enter(code)
        if sync.changed:
            healed = "; this one healed" if sync.quorum.peer_state is not None else ""
            moves, self._named = _moves(self._named, sync.names)
            line = (
                f"DiLoCo: replica group '{self.config.name}' in a quorum of {sync.members} groups at sync"
                f" {sync.top_step}, at {Place.of(sync.place)} ({sync.contributors} contributing{healed}"
                f"{moves})."
            )
            if line != self._last_line:
                self.info(line)
                self._last_line = line
        return sync

    def vote(self, part: Participation, reason: str) -> str:
        """Torchft's commit vote: ``""`` when every group commits; this group's own reason, or the failure's."""
        why = part.failed or reason
        if self._session().should_commit(not why, why):
            return ""
        if why and not part.failed and not self._session().errored():
            return why  # this group's own (a divergence), as plain DiLoCo reports it
        return part.failed or _VOTED_NO

    def discard(self, part: Participation, why: str) -> None:
        """Count and log a discarded sync."""
        self.discarded += 1
        self.info(
            f"DiLoCo: sync {self._session().step} discarded on replica group '{self.config.name}' ({why}): back to"
            f" theta_global, {self.discarded} discarded so far."
        )

    def dense_average(self, params: Sequence[Tensor], buffers: Sequence[Tensor], finite_only: bool) -> bool:
        """Average the gradients and floating-point buffers over the groups in this step's quorum; whether to step.

        torchft's fault-tolerant data parallelism (its ``Manager.allreduce`` and ``should_commit`` at every step):
        inside the group first, then across the groups; a group behind the others heals first and contributes
        zeros; the mean is over the contributors. A failed exchange, or with ``finite_only`` a gradient or a buffer
        that was finite and is not, votes to discard: no group steps, and the gradients and buffers stay as they were.
        """
        round = self._round()
        if round.exchange.in_group is not None:
            average_in_group(params, buffers, round.exchange.in_group)
        part = self.enter(Place(dense=True))
        return self._quorum_mean(part, dense_tensors(params, buffers), len(params), finite_only)

    def _quorum_mean(self, part: Participation, tensors: Sequence[Tensor], gradients: int, finite_only: bool) -> bool:
        """The mean of ``tensors`` (gradients, then buffers) over the dense step's contributors; whether to step.

        The first ``gradients`` tensors are gradients; a buffer that was not finite before does not fail the vote.
        """
        round = self._round()
        was_finite = [True] * gradients + finite_each(tensors[gradients:])
        with torch.no_grad():
            flats = flatten_by_dtype(tensors)
            comm = round.exchange.world
            if not part.skip and comm is not None:
                for _, flat in flats:
                    if not part.contributes:
                        flat.zero_()
                    comm.mean([flat], workers=part.members).wait()
            finite = _finite_where_it_was(tensors, flats, was_finite) if finite_only else True
            reason = "" if finite else "the averaged gradient is not finite"
            why = self.vote(part, reason or ("no group contributed" if part.contributors == 0 else ""))
            if why:
                self.discarded += 1
                self.info(
                    f"DiLoCo: dense step {self._session().step} discarded on replica group '{self.config.name}'"
                    f" ({why}): no step, {self.discarded} discarded so far."
                )
                return False
            for _, flat in flats:
                if part.scale != 1:  # the mean over the contributors, not over the members
                    flat.mul_(part.scale)
            unflatten_into(tensors, flats)
        return True

    # ------------------------------------------------------------------------------------------------------------
    # The heal
    # ------------------------------------------------------------------------------------------------------------
    def _heal(self, quorum: Quorum, phase: int) -> None:
        """Take a live peer's state (this group is behind), and go on at ``phase`` of the round.

        The peer's theta_global (the model set to it), outer optimizer, the exchange's shared state (with empty
        residuals of this group's own), and the front door's loop state.
        """
        start, state = time.perf_counter(), quorum.peer_state
        assert state is not None
        round_state.load_peer_state(self._round(), state, phase, self.loop)
        self.heals += 1
        self.heal_seconds = quorum.seconds + time.perf_counter() - start
        self.info(
            f"DiLoCo: replica group '{self.config.name}' healed from a live peer at sync {quorum.step} in"
            f" {self.heal_seconds:.2f} s (theta_global, the outer optimizer, the phase in the round"
            f" {state['round']['phase']}, the training loop's counters: global step {_global_step(state)})."
        )

    def _snapshot(self) -> dict[str, Any]:
        """What a peer that heals from this group receives (torchft calls this on its quorum thread)."""
        return round_state.peer_state(self._round(), self.loop)

    def _round(self) -> Any:
        if self.round is None:
            raise RuntimeError("TorchFTMembership.bind must be called before the first sync.")
        return self.round

    def _session(self) -> Session:
        return self.quorums.session_of()

    # ------------------------------------------------------------------------------------------------------------
    # What the front door reads, and the state
    # ------------------------------------------------------------------------------------------------------------
    @property
    def groups(self) -> int:
        """The groups in the last sync (at least 1)."""
        return max(self.members, 1)

    def workers_at_setup(self, world_size: int) -> int | None:
        """Unknown before the first quorum."""
        return None

    def workers(self, world_size: int) -> str:
        """This job's processes, as plain DiLoCo's setup line says them."""
        return super().describe(world_size)

    def describe(self, world_size: int) -> str:
        """The setup line's words: this job's processes, its group, the lighthouse."""
        return (
            f"{self.workers(world_size)} in replica group '{self.config.name}' of a fault-tolerant run"
            f" (lighthouse {self.config.lighthouse}, at least {self.config.min_replicas} groups per sync)"
        )

    def summary(self) -> str:
        """Discarded syncs and heals, for the end-of-fit summary."""
        return f", {self.discarded} discarded, {self.heals} heals"

    def metrics(self) -> dict[str, float]:
        """The ``gradcomp/*`` values the monitor logs for fault tolerance."""
        return {
            "participants": float(self.contributors),
            "discarded_rounds": float(self.discarded),
            "heals": float(self.heals),
            "heal_seconds": self.heal_seconds,
        }

    def owns_round_groups(self) -> bool:
        """The compressor's round groups are torchft's, closed with its session."""
        return True

    def state_dict(self) -> dict[str, Any]:
        """Torchft's step (the syncs committed), which a resumed group starts from."""
        return {"ft": self.session.step_state()} if self.session is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Torchft's step from a checkpoint (a checkpoint without fault tolerance has none)."""
        if "ft" in state:
            self._restored_step = dict(state["ft"])
            if self.session is not None:
                self.session.load_step(self._restored_step)

    def close(self) -> None:
        """Leave the run: the manager stops (its heartbeats end, so the others' next quorum goes on without it)."""
        if self.quorums.session is not None:
            self.quorums.session.close()
            self.quorums.session = None


def _moves(before: set[int] | None, names: Sequence[int]) -> tuple[str, set[int]]:
    """Which groups joined or left since the last quorum whose members changed (by their integer names); the names."""
    now = {name for name in names if name >= 0}
    if before is None or len(now) < len(names):
        return "", now
    joined, left = sorted(now - before), sorted(before - now)
    words = [f"{verb}: {', '.join(map(str, which))}" for verb, which in (("joined", joined), ("left", left)) if which]
    return ("; " + "; ".join(words) if words else ""), now


def _finite_where_it_was(tensors: Sequence[Tensor], flats: Sequence[tuple[list[int], Tensor]], was: list[bool]) -> bool:
    """Whether every averaged tensor (in ``flats``, as :func:`flatten_by_dtype` made them) that was finite still is.

    A constant buffer of ``-inf`` (a causal mask) does not make a step non-finite.
    """
    pieces: list[Tensor] = []
    for indices, flat in flats:
        views = flat.split([tensors[i].numel() for i in indices])
        pieces.extend(view for i, view in zip(indices, views) if was[i])
    return all(finite_each(pieces))


def _global_step(state: dict[str, Any]) -> int | str:
    """The global step a peer's state holds (its optimizer steps), or ``"?"``."""
    loops = state.get("lightning", {}).get("loops", {})
    progress = loops.get("epoch_loop.automatic_optimization.optim_progress")
    try:
        return int(progress["optimizer"]["step"]["total"]["completed"]) + 1  # the step it is inside
    except (KeyError, TypeError):
        return "?"


def _version() -> str:
    try:
        return importlib.metadata.version("lightning-gradcomp")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _fingerprint(round: Any) -> Fingerprint:
    """What every group of the run must share: the model, the schedule, the merge, the compressor, the version."""
    weights = round.weights_of()
    layout = [(name, tuple(p.shape), str(p.dtype)) for name, p in zip(weights.names, weights.local)]
    return Fingerprint(
        (
            ("model (parameter names, shapes and dtypes)", repr(layout)),
            ("sync_every", round.sync_every),
            ("fragments", round.fragments),
            ("overlap_steps", round.overlap_steps),
            ("merge", f"{round.merge} {round.mixing_factor:g}" if round.overlap_steps else "none"),
            ("compressor", repr(round.exchange.compressor)),
            ("lightning-gradcomp version", _version()),
        )
    )


def membership_for(
    fault_tolerance: Any, replica_group: int | str | None, info: Callable[[str], Any], error: type[Exception]
) -> Membership:
    """The policy ``DiLoCo(fault_tolerance=..., replica_group=...)`` asks for.

    Raises:
        error: If ``fault_tolerance`` is not a ``TorchFT``, or comes with ``replica_group`` (the job is the group).
    """
    if fault_tolerance is None:
        return Membership(replica_group, error)
    if not isinstance(fault_tolerance, TorchFT):
        raise error(
            "Expected `fault_tolerance` to be lightning_gradcomp.TorchFT(lighthouse=..., replica_group_id=...) or"
            f" None, got {fault_tolerance!r}."
        )
    if replica_group is not None:
        raise error(
            f"Expected `replica_group=None` with `fault_tolerance`: each Lightning job is one replica group (its"
            f" processes train with dense data parallelism inside it), got replica_group={replica_group!r}."
        )
    return TorchFTMembership(fault_tolerance, info=info)
