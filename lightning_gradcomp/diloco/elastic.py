"""DiLoCo's round across replica groups that come and go: a quorum at every sync, a vote, a heal before training.

The round of :mod:`lightning_gradcomp.diloco.round`, with its outer exchange on torchft (:mod:`lightning_gradcomp.ft`),
as torchft's own ``_StreamingDiLoCoFragment`` runs it (pytorch/torchft ``local_sgd.py``) but with the guarantees of
plain DiLoCo (Douillard et al. 2023, arXiv 2311.08105):

- every sync starts with a quorum; the pseudo-gradient is averaged over the groups that take part (divided by their
  number), so a group that died between syncs costs the others nothing;
- after the exchange each group votes; a failure anywhere (a group that died during the exchange, an average that is
  not finite) discards the outer step on every group that saw it: the weights go back to theta_global and the
  compressor's staged state is dropped. A group that committed less than the others heals at the next quorum;
- a group that starts behind the others heals from a live peer inside its first optimizer step, before any inner
  step: theta_global, the outer optimizer, the phase, the exchange's shared state (its own residuals start empty),
  and Lightning's counters, inner optimizers and schedulers (:mod:`lightning_gradcomp.ft.loops`), then takes part in
  the sync the others are at without contributing to it, and applies the same outer step;
- when the members change, each compares its settings with the others' (:mod:`lightning_gradcomp.ft.membership`)
  and one that does not belong is refused before it averages anything; a group that would start a new model where
  the lighthouse already formed quorums (everything trained is gone from the live groups) is refused too, instead of
  resetting the run (the small-quorum trap of frontier-2026's chaos study);
- a dense step (``DenseWarmup``'s) is torchft's fault-tolerant data parallelism: a quorum, the mean gradient over
  the groups in it and a vote, a group behind the others healed first.
"""

from __future__ import annotations

import importlib.metadata
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.optim import Optimizer
from torch.utils._pytree import tree_map

from lightning_gradcomp.diloco.exchange import InFlight, all_finite
from lightning_gradcomp.diloco.replicas import ReplicaGroups, dtype_groups
from lightning_gradcomp.diloco.round import Pending, Round, _floats
from lightning_gradcomp.ft.config import TorchFT
from lightning_gradcomp.ft.membership import DENSE, STARTING, Fingerprint, Member

if TYPE_CHECKING:
    from lightning_gradcomp.ft.session import Quorum, Session

__all__ = ["ElasticRound", "Job", "MembershipError"]

log = logging.getLogger(__name__)

_START_POLL_S = 0.2  # how often a group asks again for a first quorum with more groups in it


class MembershipError(RuntimeError):
    """This replica group does not belong in the run it joined (its settings differ), or would reset it."""


@dataclass(frozen=True)
class Job:
    """This rank's place in its replica group (one Lightning job).

    Attributes:
        rank: its global rank in the job; world_size: the job's ranks.
        store: ``(host, port)`` of the job's rendezvous store (``MASTER_ADDR``, ``MASTER_PORT``).
        group: the job's process group for the gather of the two levels (``None`` with one rank).
    """

    rank: int
    world_size: int
    store: tuple[str, int]
    group: Any = None


@dataclass
class _Sync:
    """The quorum of one sync, as this group acts on it.

    Attributes:
        quorum: torchft's answer.
        fragment: the fragment exchanged (``None``: no exchange in this quorum: everyone is starting).
        contributes: whether this group's pseudo-gradient counts in the average.
        contributors: how many count (the mean's divisor); members: the quorum's groups (the collectives' size).
        top_step: the highest torchft step in the quorum.
        new_in_a_used_lighthouse: the lighthouse formed quorums before this one, and no member was in them.
        failed: why this sync cannot commit here (``""``: it can).
        skip: no member runs the exchange (every member saw the same reason not to): nothing waits for a peer.
    """

    quorum: Quorum
    fragment: int | None
    contributes: bool
    contributors: int
    members: int
    top_step: int = 0
    new_in_a_used_lighthouse: bool = False
    failed: str = ""
    skip: bool = False


class ElasticRound(Round):
    """DiLoCo's round on torchft: the same state and schedule as :class:`Round`, the exchange across replica groups.

    Args:
        *args: :class:`Round`'s.
        fault_tolerance: the run's :class:`~lightning_gradcomp.ft.TorchFT` settings.
        info: how the one-line reports (heals, discarded rounds, members) are logged.
        **kwargs: :class:`Round`'s.

    Attributes:
        job: this rank's replica group (set before :meth:`attach`).
        training_state, load_training_state: Lightning's training state of the group, taken for a peer that heals
            and loaded when this group heals (the strategy sets them).
        discarded: syncs this group discarded (a failure during them); heals: times it healed; heal_seconds: how
            long the last heal took; contributors, members: the groups that counted in, and took part in, the last
            sync.
    """

    def __init__(
        self, *args: Any, fault_tolerance: TorchFT, info: Callable[[str], Any] = log.info, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.config = fault_tolerance
        self.info = info
        self.job = Job(0, 1, ("127.0.0.1", 0))
        self.session: Session | None = None
        self.fingerprint = Fingerprint(())
        self.training_state: Callable[[], dict[str, Any]] = dict
        self.load_training_state: Callable[[dict[str, Any]], None] = lambda state: None
        self.joined = False
        self.discarded = 0
        self.heals = 0
        self.heal_seconds = 0.0
        self.contributors = 0
        self.members = 0
        self._open: _Sync | None = None  # a quorum opened for the sync to come (the join's)
        self._inflight: _Sync | None = None  # the quorum of the exchange in flight
        self._restored_step: dict[str, int] | None = None
        self._first_quorum: int | None = None  # the id of the first quorum this group was in
        self._waiting_logged = False
        self._last_line = ""

    # ------------------------------------------------------------------------------------------------------------
    # Setup
    # ------------------------------------------------------------------------------------------------------------
    def attach(
        self,
        params: Sequence[Tensor],
        buffers: Sequence[Tensor],
        names: Sequence[str] | None = None,
        distributed: bool = True,
    ) -> None:
        """:meth:`Round.attach`, then torchft's manager for this rank and the exchange on its process groups.

        Raises:
            LighthouseUnreachableError: If no lighthouse answers within the connect timeout.
        """
        from lightning_gradcomp.ft.session import Session

        super().attach(params, buffers, names, distributed=False)
        compressor = self.exchange.compressor
        self.fingerprint = Fingerprint(
            (
                ("model (parameter names, shapes and dtypes)", repr(_layout(self.names, params))),
                ("sync_every", self.sync_every),
                ("fragments", self.fragments),
                ("overlap_steps", self.overlap_steps),
                ("merge", f"{self.merge} {self.mixing_factor:g}" if self.overlap_steps else "none"),
                ("compressor", repr(compressor)),
                ("lightning-gradcomp version", _version()),
            )
        )
        job = self.job
        self.session = Session(
            self.config,
            rank=job.rank,
            world_size=job.world_size,
            store=job.store,
            rounds=compressor.rounds if compressor is not None else 1,
            state_dict=self._snapshot,
        )
        device = params[0].device if params else torch.device("cpu")
        replicas = None
        if job.world_size > 1:  # two levels: shard j of every group's exchange with rank j of the other groups
            replicas = ReplicaGroups(size=job.world_size, count=1, index=job.rank, group=job.group, peers=None)
        self.exchange.attach(device, replicas=replicas, backend=self.session.collectives)
        if self._restored_step is not None:
            self.session.load_step(self._restored_step)

    def close_session(self) -> None:
        """Leave the run: the manager stops (its heartbeats end, so the others' next quorum goes on without it)."""
        if self.session is not None:
            self.session.close()
            self.session = None

    # ------------------------------------------------------------------------------------------------------------
    # The join: this group's first optimizer step
    # ------------------------------------------------------------------------------------------------------------
    def join(self) -> bool:
        """This group's first quorum, before its first inner step; whether it heals at the sync the others are at.

        Everyone starting (a new run, or a whole-job restart): the start is committed (a peer's state, if this group
        is behind, loaded first) and the step goes on as usual. Others at a sync: ``True``; the caller runs the
        step's closure (Lightning's loop needs it; its gradients are not used) and :meth:`finish_join`.

        Raises:
            MembershipError: If this group does not belong with the others, or would start a new model where the
                lighthouse already formed quorums.
        """
        self.joined = True
        deadline = time.monotonic() + self.config.quorum_timeout
        while True:
            sync = self._enter(STARTING)
            if sync.fragment == DENSE:  # the others are at a dense step: this one takes part in it, healed first
                self._open = sync
                return False
            if sync.fragment is not None:
                self._open = sync
                return True
            if sync.quorum.peer_state is not None:
                self._heal(sync.quorum, sync.quorum.peer_state["round"]["phase"])
                break
            if sync.members >= self.config.starting_replicas and not sync.failed:
                break
            # a run starts, or every group resumes from its checkpoint, only with enough groups in its first quorum
            # and not with one that was refused: a resumed group that went on alone would average only its own
            # pseudo-gradients while the others, once up, did the same
            self._wait_for_more(sync, deadline)
        if sync.top_step == 0 and sync.new_in_a_used_lighthouse:
            raise MembershipError(
                f"TorchFT: replica group '{self.config.name}' would start a new model, but the lighthouse at"
                f" {self.config.lighthouse} formed quorums before with groups that are gone, and no live group is"
                " further along: what was trained is not on any live group. Resume from a checkpoint"
                " (`trainer.fit(model, ckpt_path=...)`), or restart the lighthouse to start a new run."
            )
        self.session_of().should_commit(not sync.failed, sync.failed)
        return False

    def _wait_for_more(self, sync: _Sync, deadline: float) -> None:
        """Before asking again for a first quorum with more groups: at most ``quorum_timeout`` in all.

        Raises:
            NoQuorumError: If the deadline passed.
        """
        from lightning_gradcomp.ft.session import NoQuorumError

        wanted = self.config.starting_replicas
        if time.monotonic() > deadline:
            raise NoQuorumError(
                f"TorchFT: replica group '{self.config.name}' found {sync.members} of the {wanted} groups a run starts"
                f" or resumes with (`start_replicas`) within {self.config.quorum_timeout:g} s at"
                f" {self.config.lighthouse}."
            )
        if not self._waiting_logged:
            self.info(f"DiLoCo: replica group '{self.config.name}' waits for {wanted} groups to start the run.")
            self._waiting_logged = True
        time.sleep(_START_POLL_S)

    def finish_join(self, optimizers: Sequence[Optimizer]) -> None:
        """Take part in the others' sync as the step they are in: healed first, this group's own step void."""
        sync = self._open
        assert sync is not None
        assert sync.fragment is not None
        peer = sync.quorum.peer_state
        if peer is not None:  # at the others' phase, as their after_inner_step saw it: redo that step from there
            self._heal(sync.quorum, peer["round"]["phase"] - 1)
        else:  # at their step but not at their phase (a checkpoint of the same step): take part, vote to discard
            sync.failed = sync.failed or "this group joined at the others' step but not at their place in the round"
            self.phase = (sync.fragment + 1) * self.period - 1
        self.after_inner_step(optimizers)

    # ------------------------------------------------------------------------------------------------------------
    # The sync
    # ------------------------------------------------------------------------------------------------------------
    def send(self, fragment: int, remaining: int) -> Pending:
        """The quorum (the join's, or a new one), then the exchange of this fragment over the groups in it."""
        sync, self._open = self._open, None
        if sync is None:
            sync = self._enter(fragment)
            peer = sync.quorum.peer_state
            if peer is not None and sync.fragment is not None:  # behind the others: their state, then their sync
                self._heal(sync.quorum, peer["round"]["phase"])
        self._inflight = sync
        target = sync.fragment  # the others' (this group's own unless it joined them)
        if target is None or target == DENSE:  # nobody at the highest step is at a sync: no exchange to take part in
            sync.failed = sync.failed or f"the groups at the highest step are not at the sync of fragment {fragment}"
            sync.skip = True
        if sync.skip or target is None or target == DENSE:
            return Pending(fragment, remaining, InFlight([], [], lambda kept: None))
        fragment = target
        flats, layouts = self.pseudo_gradients(fragment)
        if not sync.contributes:
            for flat in flats:
                flat.zero_()
        if self.exchange.replicas is not None:
            self.exchange.replicas.count = sync.members
        contribution = [f.clone() for f in flats] if remaining else None
        return Pending(fragment, remaining, self.exchange.start(flats, layouts), contribution)

    def finish(self, optimizers: Sequence[Optimizer]) -> None:
        """The vote on the exchange in flight, then the outer step on every group that commits, or the discard.

        The mean was taken over the quorum's groups; with groups in it that do not contribute (healing ones) it is
        rescaled to the mean over the contributors. A discard leaves theta_global, sets the fragment back to it and
        drops the compressor's staged state, as a skipped (non-finite) round does.
        """
        pending, sync = self.pending, self._inflight
        assert pending is not None
        assert pending.exchange is not None
        assert sync is not None
        self.pending, self._inflight = None, None
        indices = self.fragment_params[pending.fragment]
        floats = _floats(self._local_buffers)
        kept: dict[str, Any] = {}

        def decide(finite: bool) -> bool:
            mine = floats if sync.contributes else [torch.zeros_like(b) for b in floats]
            kept["buffers"] = mine if sync.skip else self.exchange.average(mine)
            kept["finite"] = finite and all_finite(kept["buffers"])
            reason = sync.failed or ("" if kept["finite"] else "the average is not finite")
            if not reason and sync.contributors == 0:
                reason = "no group contributed"
            return self.session_of().should_commit(not reason, reason)

        averaged, committed = pending.exchange.wait(decide)
        self.contributors, self.members = sync.contributors, sync.members
        if committed:
            scale = sync.members / sync.contributors
            for tensor in (*averaged, *kept["buffers"]):
                if scale != 1:
                    tensor.mul_(scale)
            self.outer_step(averaged, indices)
            self.set_buffers(kept["buffers"])
            self.syncs += 1
            if sync.contributes:  # the local work done during an overlapped exchange, merged as plain DiLoCo does
                self.dirty[pending.fragment] = self._merge(pending, None, None)
                return
        elif not kept["finite"] and not sync.failed and not self.session_of().errored():
            self.skipped += 1  # the group's own divergence, as plain DiLoCo reports it
            self.restore_buffers()
            self._forget_nonfinite_state(optimizers)
            self.warn(
                "DiLoCo: the averaged pseudo-gradient is not finite (a rank's inner steps diverged): outer step"
                f" skipped, every worker reset to theta_global ({self.skipped} skipped so far)."
            )
        else:
            self.discarded += 1
            self.restore_buffers()
            self._forget_nonfinite_state(optimizers)
            self.info(
                f"DiLoCo: sync {self.session_of().step} discarded on replica group '{self.config.name}' ("
                f"{sync.failed or 'a collective failed or another group voted so'}): back to theta_global,"
                f" {self.discarded} discarded so far."
            )
        self.copy_to(indices)
        self.dirty[pending.fragment] = False

    # ------------------------------------------------------------------------------------------------------------
    # A dense step (DenseWarmup's): plain data parallelism across the groups, with a quorum and a vote
    # ------------------------------------------------------------------------------------------------------------
    @property
    def at_dense_step(self) -> bool:
        """Whether this group joined the others at a dense step (its first step must take part in it)."""
        return self._open is not None and self._open.fragment == DENSE

    def dense_step(self, params: Sequence[Tensor], buffers: Sequence[Tensor], finite_only: bool = True) -> bool:
        """Average the gradients and floating-point buffers over the groups in this step's quorum; whether to step.

        torchft's fault-tolerant data parallelism (its ``Manager.allreduce`` and ``should_commit`` at every step): a
        group behind the others heals first (their weights, optimizer state and counters, taken before their step)
        and contributes zeros; the mean is over the contributors. A failed exchange, or with ``finite_only`` an
        average that is not finite, votes to discard: no group steps, the gradients and buffers are left as they
        were, and training goes on. (``finite_only=False`` under a gradient scaler, which skips such a step itself
        and must see it to lower its scale.)
        """
        sync, self._open = self._open, None
        if sync is None:
            sync = self._enter(DENSE)
        if sync.quorum.peer_state is not None:
            self._heal(sync.quorum, sync.quorum.peer_state["round"]["phase"])
        if sync.fragment != DENSE:  # the groups at the highest step are at a sync of DiLoCo's rounds
            sync.failed = sync.failed or "the groups at the highest step are not at a dense step"
            sync.skip = True
        grads = []
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        tensors = [*grads, *_floats(buffers)]
        groups = dtype_groups(tensors)
        with torch.no_grad():
            flats = [torch.cat([tensors[i].flatten() for i in indices]) for indices in groups]
            comm = self.exchange.world
            if not sync.skip and comm is not None:
                for flat in flats:
                    if not sync.contributes:
                        flat.zero_()
                    comm.telemetry.add_bucket(flat.numel() * flat.element_size())
                    comm.all_reduce((flat.div_(sync.members),)).wait()
            finite = all_finite(flats) if finite_only else True
            reason = sync.failed or ("" if finite else "the averaged gradient is not finite")
            if not reason and sync.contributors == 0:
                reason = "no group contributed"
            self.contributors, self.members = sync.contributors, sync.members
            if not self.session_of().should_commit(not reason, reason):
                self.discarded += 1
                self.info(
                    f"DiLoCo: dense step {self.session_of().step} discarded on replica group '{self.config.name}' ("
                    f"{reason or 'a collective failed or another group voted so'}): no step, {self.discarded}"
                    " discarded so far."
                )
                return False
            scale = sync.members / sync.contributors
            for indices, flat in zip(groups, flats, strict=True):
                if scale != 1:
                    flat.mul_(scale)
                for i, piece in zip(indices, flat.split([tensors[i].numel() for i in indices]), strict=True):
                    tensors[i].copy_(piece.view_as(tensors[i]))
        return True

    def _enter(self, mode: int) -> _Sync:
        """Ask for the quorum; when its members changed, compare settings and places with every member.

        Raises:
            MembershipError: If this group's settings differ from those of the members at the highest step.
        """
        session = self.session_of()
        before = session.step
        quorum = session.quorum()
        quorum_id = session.groups.quorum_id or 0
        if self._first_quorum is None:
            self._first_quorum = quorum_id
        healed = quorum.peer_state is not None
        contributes = mode != STARTING and not healed and not quorum.errored
        sync = _Sync(quorum, None if mode == STARTING else mode, contributes, quorum.members, quorum.members)
        sync.top_step = quorum.step
        if quorum.errored:
            sync.failed = "the quorum's process group or heal failed here"
        if not quorum.reconfigured:
            return sync  # the same members as at the last sync: all at this place, none healing
        veteran = self._first_quorum < quorum_id
        rows = session.all_gather(Member(mode, contributes, before, veteran).row(self.fingerprint))
        if rows is None:
            sync.failed, sync.skip = "the members' check failed (a group left during it)", True
            return sync
        members = [Member.of(row) for row in rows]
        top = sync.top_step = max(member.step for member, _ in members)
        sync.new_in_a_used_lighthouse = quorum_id > 1 and not any(member.veteran for member, _ in members)
        leaders = [(member, codes) for member, codes in members if member.step == top]
        reference = leaders[0][1]  # the first group at the highest step (by name): the run's settings
        difference = self.fingerprint.difference(reference)
        if difference is not None:
            raise MembershipError(
                f"TorchFT: replica group '{self.config.name}' does not belong in the run at {self.config.lighthouse}:"
                f" {difference}. It is refused before averaging into theta_global."
            )
        if any(codes != reference for _, codes in members):
            sync.failed, sync.skip = "a group that does not belong was refused", True
        places = {member.mode for member, _ in leaders if member.mode != STARTING}
        if len(places) > 1:
            sync.failed = sync.failed or f"the groups at the highest step are at different syncs {sorted(places)}"
            sync.skip = True
        sync.fragment = min(places) if places else None
        sync.contributors = sum(member.contributes for member, _ in members)
        if sync.fragment is None:
            sync.contributes = False
        place = "all starting" if sync.fragment is None else "at a sync"
        if sync.fragment == DENSE:
            place = "at a dense step"
        elif sync.fragment is not None and self.fragments > 1:
            place = f"at the sync of fragment {sync.fragment}"
        line = (
            f"DiLoCo: replica group '{self.config.name}' in a quorum of {quorum.members} groups at step {top}, {place}"
            f" ({sync.contributors} contributing{'; this one healed' if healed else ''})."
        )
        if line != self._last_line:  # a new run's first quorums repeat while it waits for its groups
            self.info(line)
            self._last_line = line
        return sync

    def _heal(self, quorum: Quorum, phase: int) -> None:
        """Take a live peer's state (this group is behind), and go on at ``phase`` of the round.

        The peer's theta_global (the model set to it), outer optimizer, the exchange's shared state (with empty
        residuals of this group's own), and Lightning's counters, inner optimizers and schedulers.
        """
        start = time.perf_counter()
        state = quorum.peer_state
        assert state is not None
        own = self.exchange.bytes_sent, self.exchange.bytes_received
        Round.load_state_dict(self, {**state["round"], "pending": None})
        self.exchange.bytes_sent, self.exchange.bytes_received = own
        self.exchange.load_state_dict(state["exchange"])
        self.phase = phase
        self.copy_to()
        self.restore_buffers()
        self.load_training_state(state["lightning"])
        self.heals += 1
        self.heal_seconds = quorum.seconds + time.perf_counter() - start
        self.info(
            f"DiLoCo: replica group '{self.config.name}' healed from a live peer at step {quorum.step} in"
            f" {self.heal_seconds:.2f} s (theta_global, the outer optimizer, the phase in the round"
            f" {state['round']['phase']}, Lightning's counters: global step {self.training_step_of(state)})."
        )

    @staticmethod
    def training_step_of(state: dict[str, Any]) -> int | str:
        """The global step a peer's state holds (its optimizer steps), or ``"?"``."""
        loops = state.get("lightning", {}).get("loops", {})
        progress = loops.get("epoch_loop.automatic_optimization.optim_progress")
        try:
            return int(progress["optimizer"]["step"]["total"]["completed"]) + 1  # the step it is inside
        except (KeyError, TypeError):
            return "?"

    def _snapshot(self) -> dict[str, Any]:
        """What a peer that heals from this group receives (torchft calls this on its quorum thread)."""
        exchange = {**self.exchange.state_dict(), "residuals": {}}
        state = {"round": Round.state_dict(self), "exchange": exchange, "lightning": self.training_state()}
        state["round"]["pending"] = None
        return tree_map(lambda t: t.detach().clone() if isinstance(t, Tensor) else t, state)

    def session_of(self) -> Session:
        """The session (after :meth:`attach`)."""
        if self.session is None:
            raise RuntimeError("ElasticRound.attach must be called before the first sync.")
        return self.session

    # ------------------------------------------------------------------------------------------------------------
    # State
    # ------------------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """:meth:`Round.state_dict`, with torchft's step (the syncs committed), which a resumed group starts from."""
        state = super().state_dict()
        if self.session is not None:
            state["ft"] = self.session.step_state()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """:meth:`Round.load_state_dict`, and torchft's step (a checkpoint without fault tolerance has none)."""
        super().load_state_dict(state)
        if "ft" in state:
            self._restored_step = dict(state["ft"])
            if self.session is not None:
                self.session.load_step(self._restored_step)

    def load_own_state(self, own: dict[str, Any], device: torch.device) -> None:
        """Restore this rank's own state; an exchange that was in flight is discarded (its quorum is gone)."""
        pending = self.pending
        self.pending = None
        super().load_own_state(own, device)
        if pending is not None:
            self.copy_to(self.fragment_params[pending.fragment])
            self.dirty[pending.fragment] = False
            self.discarded += 1

    def metrics(self) -> dict[str, float]:
        """The ``gradcomp/*`` values the monitor logs for fault tolerance."""
        return {
            "participants": float(self.contributors),
            "discarded_rounds": float(self.discarded),
            "heals": float(self.heals),
            "heal_seconds": self.heal_seconds,
        }


def _version() -> str:
    try:
        return importlib.metadata.version("lightning-gradcomp")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _layout(names: Sequence[str], params: Sequence[Tensor]) -> list[tuple[str, tuple[int, ...], str]]:
    return [(name, tuple(p.shape), str(p.dtype)) for name, p in zip(names, params)]
