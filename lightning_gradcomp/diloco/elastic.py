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
- when the members change, each compares its settings with the others' (:mod:`lightning_gradcomp.ft.quorums`)
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
from lightning_gradcomp.diloco.merge import others_share
from lightning_gradcomp.diloco.replicas import ReplicaGroups, dense_tensors, flatten_by_dtype, unflatten_into
from lightning_gradcomp.diloco.round import Pending, Round, floating_point
from lightning_gradcomp.ft.config import TorchFT
from lightning_gradcomp.ft.membership import DENSE, STARTING, Fingerprint
from lightning_gradcomp.ft.quorums import MembershipError, Quorums, Sync

if TYPE_CHECKING:
    from lightning_gradcomp.ft.session import Quorum, Session

__all__ = ["ElasticRound", "Job", "MembershipError"]

log = logging.getLogger(__name__)

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
        quorums: the quorums this group asks for (:class:`~lightning_gradcomp.ft.quorums.Quorums`).
        discarded: syncs this group discarded (a failure during them); heals: times it healed; heal_seconds: how
            long the last heal took; contributors, members: the groups that counted in, and took part in, the last
            sync.
        others_workers: per fragment, the contributors over which :attr:`others` was taken (the eager merge).
    """

    def __init__(
        self, *args: Any, fault_tolerance: TorchFT, info: Callable[[str], Any] = log.info, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.config = fault_tolerance
        self.info = info
        self.job = Job(0, 1, ("127.0.0.1", 0))
        self.quorums = Quorums(fault_tolerance, self.fragments, info)
        self.training_state: Callable[[], dict[str, Any]] = dict
        self.load_training_state: Callable[[dict[str, Any]], None] = lambda state: None
        self.joined = False
        self.discarded = 0
        self.heals = 0
        self.heal_seconds = 0.0
        self.contributors = 0
        self.members = 0
        self.others_workers: dict[int, int] = {}  # per fragment: the contributors its others' shares were taken over
        self._open: Sync | None = None  # a quorum opened for the sync to come (the join's)
        self._inflight: Sync | None = None  # the quorum of the exchange in flight
        self._restored_step: dict[str, int] | None = None

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
        self.quorums.fingerprint = _fingerprint(self, params)
        job = self.job
        self.quorums.session = session = Session(
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
        self.exchange.attach(device, replicas=replicas, backend=session.collectives)
        if self._restored_step is not None:
            session.load_step(self._restored_step)

    def close_session(self) -> None:
        """Leave the run: the manager stops (its heartbeats end, so the others' next quorum goes on without it)."""
        if self.quorums.session is not None:
            self.quorums.session.close()
            self.quorums.session = None

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
            sync = self.quorums.enter(STARTING)
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
            self.quorums.wait_for_more(sync, deadline)
        if sync.top_step == 0 and sync.new_in_a_used_lighthouse:
            raise MembershipError(
                f"TorchFT: replica group '{self.config.name}' would start a new model, but the lighthouse at"
                f" {self.config.lighthouse} formed quorums before with groups that are gone, and no live group is"
                " further along: what was trained is not on any live group. Resume from a checkpoint"
                " (`trainer.fit(model, ckpt_path=...)`), or restart the lighthouse to start a new run."
            )
        self.session_of().should_commit(not sync.failed, sync.failed)
        return False

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
            sync = self.quorums.enter(fragment)
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
        floats = floating_point(self._local_buffers)
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
            before = others = None
            if sync.contributes and pending.contribution is not None and self.merge == "eager":
                before = self._eager_step(pending, sync.contributors)  # before the outer step changes the average
                others = others_share(averaged, pending.contribution, sync.contributors)
                self.others_workers[pending.fragment] = sync.contributors
            self.outer_step(averaged, indices)
            self.set_buffers(kept["buffers"])
            self.syncs += 1
            if sync.contributes:  # the local work done during an overlapped exchange, merged as plain DiLoCo does
                self.dirty[pending.fragment] = self._merge(pending, before, others)
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

    def in_flight_workers(self) -> int:
        """The groups that contribute to the exchange in flight (the eager estimate's divisor; at least 1)."""
        return max(self._inflight.contributors, 1) if self._inflight is not None else self.exchange.workers

    def others_for(self, fragment: int, workers: int) -> list[Tensor] | None:
        """The others' shares of the fragment's last average if it was taken over ``workers`` contributors.

        When the members changed, none: the eager estimate is this group's own share, as at a fragment's first exchange.
        """
        return self.others.get(fragment) if self.others_workers.get(fragment) == workers else None

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
            sync = self.quorums.enter(DENSE)
        if sync.quorum.peer_state is not None:
            self._heal(sync.quorum, sync.quorum.peer_state["round"]["phase"])
        if sync.fragment != DENSE:  # the groups at the highest step are at a sync of DiLoCo's rounds
            sync.failed = sync.failed or "the groups at the highest step are not at a dense step"
            sync.skip = True
        tensors = dense_tensors(params, buffers)
        with torch.no_grad():
            flats = flatten_by_dtype(tensors)
            comm = self.exchange.world
            if not sync.skip and comm is not None:
                for _, flat in flats:
                    if not sync.contributes:
                        flat.zero_()
                    comm.telemetry.add_bucket(flat.numel() * flat.element_size())
                    comm.all_reduce((flat.div_(sync.members),)).wait()
            finite = all_finite([flat for _, flat in flats]) if finite_only else True
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
            if scale != 1:  # the mean over the contributors, not over the members
                for _, flat in flats:
                    flat.mul_(scale)
            unflatten_into(tensors, flats)
        return True

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

    @property
    def session(self) -> Session | None:
        """The torchft manager of this rank (after :meth:`attach`, until :meth:`close_session`)."""
        return self.quorums.session

    def session_of(self) -> Session:
        """The session (after :meth:`attach`)."""
        return self.quorums.session_of()

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

    def own_state(self) -> dict[str, Any]:
        """:meth:`Round.own_state`, and the contributors the eager merge's shares of the others were taken over."""
        return {**super().own_state(), "others_workers": dict(self.others_workers)}

    def load_own_state(self, own: dict[str, Any], device: torch.device) -> None:
        """Restore this rank's own state; an exchange that was in flight is discarded (its quorum is gone)."""
        pending = self.pending
        self.pending = None
        super().load_own_state(own, device)
        self.others_workers = {int(k): int(v) for k, v in own.get("others_workers", {}).items()}
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


def _fingerprint(round: Round, params: Sequence[Tensor]) -> Fingerprint:
    """What every group of the run must share: the model, the schedule, the merge, the compressor, the version."""
    return Fingerprint(
        (
            ("model (parameter names, shapes and dtypes)", repr(_layout(round.names, params))),
            ("sync_every", round.sync_every),
            ("fragments", round.fragments),
            ("overlap_steps", round.overlap_steps),
            ("merge", f"{round.merge} {round.mixing_factor:g}" if round.overlap_steps else "none"),
            ("compressor", repr(round.exchange.compressor)),
            ("lightning-gradcomp version", _version()),
        )
    )


def _layout(names: Sequence[str], params: Sequence[Tensor]) -> list[tuple[str, tuple[int, ...], str]]:
    return [(name, tuple(p.shape), str(p.dtype)) for name, p in zip(names, params)]
