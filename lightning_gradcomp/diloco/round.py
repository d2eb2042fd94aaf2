"""DiLoCo's round: the schedule, the exchange in flight, and the sync, written once whoever the members are.

DiLoCo (Douillard et al. 2023, arXiv 2311.08105, Algorithm 1): every worker starts a round from the shared parameters
theta_global, takes ``H`` inner optimizer steps on its own data, then the workers average the pseudo-gradient
``theta_global - theta_local`` and an outer optimizer steps theta_global with that average as its gradient. Streaming
DiLoCo (Douillard et al. 2025, arXiv 2501.18512) cuts the model into fragments of consecutive parameters, synced in
turn every ``H / fragments`` steps, and lets a fragment's exchange run during ``overlap_steps`` inner steps; the
fragment's local work in those steps is kept by one of :mod:`~lightning_gradcomp.diloco.merge`'s merges.

:class:`Round` owns that state and the steps that change it, as torchft's ``_StreamingDiLoCoFragment`` does, and asks
its :class:`~lightning_gradcomp.diloco.membership.Membership` who takes part in each sync and whether it commits. A
front door (the Lightning strategy) calls :meth:`Round.inner_step` at each optimizer step and :meth:`Round.send` when
a sync is due, and nothing else; the round imports nothing from Lightning.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_gradcomp.compressors.base import Compressor
from lightning_gradcomp.diloco import round_state
from lightning_gradcomp.diloco.defaults import default_outer_optimizer
from lightning_gradcomp.diloco.exchange import InFlight, OuterExchange
from lightning_gradcomp.diloco.membership import DIVERGED, Job, Membership, Place, Start
from lightning_gradcomp.diloco.merge import eager_estimate, mix_into, others_share, tentative_step
from lightning_gradcomp.diloco.preflight import same_data
from lightning_gradcomp.diloco.replicas import ReplicaGroups, averaging_in
from lightning_gradcomp.diloco.round_state import Pending
from lightning_gradcomp.diloco.weights import (
    GlobalWeights,
    OuterOptimizerCallable,
    divergence_message,
    floating_point,
)

__all__ = ["OuterOptimizerCallable", "Pending", "Round", "default_outer_optimizer", "floating_point", "split_fragments"]


def split_fragments(numels: list[int], fragments: int) -> list[list[int]]:
    """Parameter indices cut into ``fragments`` consecutive runs of about equal size (in elements).

    Consecutive, as Streaming DiLoCo's fragments are consecutive transformer blocks.
    """
    total = sum(numels)
    cuts, seen, out, current = 1, 0, [], []
    for i, n in enumerate(numels):
        current.append(i)
        seen += n
        left_tensors, left_fragments = len(numels) - i - 1, fragments - cuts
        if cuts < fragments and (seen >= cuts * total / fragments or left_tensors == left_fragments):
            out.append(current)
            current, cuts = [], cuts + 1
    out.append(current)
    return out


class Round:
    """DiLoCo's outer loop on one rank: the phase in the round, the exchange, and the sync.

    Built empty; :meth:`attach` takes the model's parameters and buffers when training starts.

    Args:
        sync_every: inner steps per round (``H``).
        fragments: Streaming DiLoCo's fragments, synced in turn every ``sync_every / fragments`` steps.
        overlap_steps: inner steps a fragment's exchange runs for before its outer step is applied.
        outer_optimizer: builds the outer optimizer from theta_global's tensors.
        offload: keep theta_global and the outer optimizer's state in CPU memory.
        compressor: average the pseudo-gradient through this compressor (``None``: a plain mean).
        warn: how a skipped outer step is reported (the strategy passes its rank-zero warning).
        merge: how an overlapped exchange's fragment keeps its local work, ``"mix"`` or ``"eager"``.
        mixing_factor: the share of the local work ``"mix"`` keeps (0: replaced by theta_global).
        membership: who takes part in each sync (default: every worker, plain DiLoCo).

    Attributes:
        weights: theta_global, the outer optimizer and the model's tensors (after :meth:`attach`).
        phase: inner steps taken since the last fragment's sync.
        dirty: per fragment, whether it trained since its last sync.
        pending: the exchange in flight, if any.
        others, others_workers: per fragment, the other workers' shares of its last average (the eager merge's
            estimate), and over how many contributors they were taken.
        syncs: outer steps taken; skipped: outer steps skipped because a rank's inner steps diverged.
    """

    def __init__(
        self,
        sync_every: int,
        fragments: int,
        overlap_steps: int,
        outer_optimizer: OuterOptimizerCallable,
        *,
        offload: bool = False,
        compressor: Compressor | None = None,
        warn: Callable[[str], Any] = warnings.warn,
        merge: str = "mix",
        mixing_factor: float = 0.0,
        membership: Membership | None = None,
    ) -> None:
        self.sync_every, self.fragments, self.overlap_steps = sync_every, fragments, overlap_steps
        self.merge, self.mixing_factor = merge, mixing_factor
        self.outer_optimizer, self.offload, self.warn = outer_optimizer, offload, warn
        self.exchange = OuterExchange(compressor)
        self.membership = membership if membership is not None else Membership()
        self.process_group: Any = None
        self.replicas: ReplicaGroups | None = None
        self.fragment_params: list[list[int]] = []
        self.weights: GlobalWeights | None = None
        self.phase = 0
        self.dirty: list[bool] = [False] * fragments
        self.pending: Pending | None = None
        self.others: dict[int, list[Tensor]] = {}
        self.others_workers: dict[int, int] = {}
        self.syncs = 0
        self.skipped = 0
        self.rank = 0

    @property
    def period(self) -> int:
        """Inner steps between two fragments' syncs (``sync_every / fragments``)."""
        return self.sync_every // self.fragments

    @property
    def bytes_sent(self) -> int:
        """What this rank has put on the wire for the outer loop, in all (the exchange's collectives count it)."""
        return self.exchange.bytes_sent

    @property
    def bytes_received(self) -> int:
        """What this rank has taken off the wire for the outer loop, in all."""
        return self.exchange.bytes_received

    @property
    def params(self) -> list[Tensor]:
        """theta_global, one tensor per trained parameter (empty before :meth:`attach`)."""
        return self.weights.params if self.weights is not None else []

    @property
    def optimizer(self) -> Optimizer | None:
        """The outer optimizer over theta_global (after :meth:`attach`)."""
        return self.weights.optimizer if self.weights is not None else None

    def attach(
        self,
        params: Sequence[Tensor],
        buffers: Sequence[Tensor],
        names: Sequence[str] | None = None,
        buffer_names: Sequence[str] | None = None,
        job: Job | None = None,
    ) -> None:
        """Take the model's parameters (and floating-point buffers) as theta_global; bind the membership.

        ``names``: the parameters' names (the layers a compressor sees; default ``param0``, ...); ``buffer_names``
        the floating-point buffers' (for messages). ``job``: this rank's launch (default: one process).
        """
        job = job if job is not None else Job()
        names = list(names) if names is not None else [f"param{i}" for i in range(len(params))]
        floats = floating_point(buffers)
        buffer_names = list(buffer_names) if buffer_names is not None else [f"buffer{i}" for i in range(len(floats))]
        self.weights = GlobalWeights(params, buffers, names, buffer_names, self.outer_optimizer, self.offload)
        self.fragment_params = split_fragments([p.numel() for p in params], self.fragments)
        self.rank = job.rank
        self.membership.bind(self, job, params[0].device if params else torch.device("cpu"))

    def weights_of(self) -> GlobalWeights:
        """:attr:`weights` (after :meth:`attach`)."""
        if self.weights is None:
            raise RuntimeError("Round.attach must be called before training.")
        return self.weights

    # ------------------------------------------------------------------------------------------------------------
    # The step and the schedule
    # ------------------------------------------------------------------------------------------------------------
    def inner_step(
        self,
        closure: Callable[[], Any],
        step: Callable[[Callable[[], Any]], Any],
        optimizers: Sequence[Optimizer],
        dense: bool = False,
        finite_only: bool = True,
    ) -> tuple[Any, int | None]:
        """One optimizer step: ``step(closure)`` on this worker's gradients; the step's output and a due sync.

        The fragment whose sync starts now is returned for the caller's :meth:`send`. ``dense``: plain data
        parallelism over every worker (DenseWarmup's phase, :meth:`dense_step`). On a group's first step its
        membership may join the run instead: healed at the others' sync, with no step of its own.
        ``finite_only``: a dense step discarded across groups when its average is not finite (no gradient scaler).
        """
        start = self.membership.first_step(closure, optimizers)
        if start is Start.AT_SYNC:  # it ran the closure and healed at the others' place: their sync is this one's
            return None, self.tick(optimizers)
        if dense or start is Start.DENSE:
            return self.dense_step(closure, step, optimizers, finite_only), None
        if self.exchange.in_group is not None:  # two levels: the group's gradients averaged first
            weights = self.weights_of()
            closure = averaging_in(closure, weights.local, weights.local_buffers, self.exchange.in_group)
        output = step(closure)
        return output, self.tick(optimizers)

    def tick(self, optimizers: Sequence[Optimizer]) -> int | None:
        """One inner step was taken: apply the exchange that is due; the fragment whose sync starts now, if any."""
        self.phase += 1
        self.dirty = [True] * self.fragments
        if self.pending is not None:
            self.pending.remaining -= 1
            if self.pending.remaining == 0:
                self.finish(optimizers)
        due = self.phase // self.period - 1 if self.phase % self.period == 0 else None
        if self.phase == self.sync_every:
            self.phase = 0
        return due

    def send(self, fragment: int, optimizers: Sequence[Optimizer], overlap: int | None = None) -> None:
        """Start the sync of ``fragment``: who takes part, the pseudo-gradient, the exchange.

        Its outer step is applied ``overlap`` inner steps later (default ``overlap_steps``; at once without). With
        the eager merge the fragment trains meanwhile from the outer step of its estimate of the average.
        """
        remaining = self.overlap_steps if overlap is None else overlap
        part = self.membership.enter(Place(fragment))
        if part.skip or part.place.fragment is None:
            self.pending = Pending(fragment, remaining, InFlight([], [], lambda kept: None), part=part)
        else:
            fragment = part.place.fragment  # the others' (this group's own unless it joined them)
            flats, layouts = self.weights_of().pseudo_gradients(self.fragment_params[fragment])
            if not part.contributes:  # it takes part with zeros (a group that healed at this sync)
                for flat in flats:
                    flat.zero_()
            if self.exchange.replicas is not None and self.exchange.replicas.peers is None:
                self.exchange.replicas.count = part.members  # two levels across jobs: the groups in the quorum
            first = not self.syncs and self.exchange.compressor is None  # kept for same_data's check too
            contribution = [f.clone() for f in flats] if remaining or first else None
            self.pending = Pending(fragment, remaining, self.exchange.start(flats, layouts), contribution, part)
        if not remaining:
            self.finish(optimizers)
        elif self.merge == "eager" and self.pending.contribution is not None and part.contributes:
            weights = self.weights_of()
            with torch.no_grad():  # train in flight from the outer step of the estimated average
                for i, value in zip(self.fragment_params[fragment], self._eager_step(self.pending)):
                    weights.local[i].copy_(value.to(weights.local[i].device))

    def finish(self, optimizers: Sequence[Optimizer]) -> None:
        """The vote on the exchange in flight; the outer step and the merge where it commits, else the reset.

        The mean was taken over the members; with some that do not contribute (healing) it is rescaled to the mean
        over the contributors. A sync that does not commit (a rank diverged, or a failure anywhere) leaves
        theta_global, sets every worker's fragment back to it and forgets non-finite inner optimizer state.
        """
        pending, self.pending = self.pending, None
        assert pending is not None
        assert pending.exchange is not None
        part, weights, indices = pending.part, self.weights_of(), self.fragment_params[pending.fragment]
        averaged, finite = pending.exchange.result()
        changed, buffers, buffers_finite = weights.average_changed_buffers(self.exchange, part.contributes, part.skip)
        reason = "" if finite and buffers_finite else DIVERGED
        if not reason and part.contributors == 0:
            reason = "no group contributed"
        verdict = self.membership.vote(part, reason)
        pending.exchange.complete(not verdict)
        if not verdict:
            before = others = None
            for tensor in (*averaged, *buffers):
                if part.scale != 1:
                    tensor.mul_(part.scale)
            if not self.syncs and pending.contribution is not None and (note := same_data(averaged, pending, part)):
                self.warn(note)
            if part.contributes and pending.contribution is not None and self.merge == "eager":
                before = self._eager_step(pending)  # before the outer step, which may change the average in place
                others = others_share(averaged, pending.contribution, part.contributors)
            weights.outer_step(averaged, indices)
            weights.set_buffers(changed, buffers)
            self.syncs += 1
            if part.contributes:
                self.dirty[pending.fragment] = self._merge(pending, before, others)
                return
        elif verdict == DIVERGED:
            self.skipped += 1
            names = weights.nonfinite_names()  # this rank's, by name: it warns whatever its rank
            (warnings.warn if names else self.warn)(divergence_message(names, self.rank, self.skipped))
        else:
            self.membership.discard(part, verdict)
        weights.restore_buffers()
        weights.forget_nonfinite_state(optimizers)
        weights.copy_to(indices)
        self.dirty[pending.fragment] = False

    def in_flight_workers(self) -> int:
        """How many workers' pseudo-gradients the exchange in flight averages (the eager estimate's divisor)."""
        return max(self.pending.part.contributors, 1) if self.pending is not None else self.exchange.workers

    def _eager_step(self, pending: Pending) -> list[Tensor]:
        """theta_global's fragment after an outer step on the eager estimate of the average.

        The others' shares of the fragment's last average count only if they were taken over as many contributors
        (after a membership change the estimate is this worker's own share). Nothing is changed: the outer
        optimizer's step is taken on copies (:func:`tentative_step`).
        """
        assert pending.contribution is not None
        weights, indices = self.weights_of(), self.fragment_params[pending.fragment]
        workers = max(pending.part.contributors, 1)
        others = self.others.get(pending.fragment) if self.others_workers.get(pending.fragment) == workers else None
        estimate = eager_estimate(pending.contribution, others, workers)
        return tentative_step(weights.optimizer, [weights.params[i] for i in indices], weights.grads(estimate, indices))

    def _merge(self, pending: Pending, before: list[Tensor] | None, others: list[Tensor] | None) -> bool:
        """Set the fragment from the new theta_global, keeping local work as :attr:`merge` says; whether it kept any.

        A blocking exchange, or one completed early with no inner step taken in flight (the end of ``fit``), sets it
        to theta_global. ``"eager"`` moves it by the new theta_global minus ``before`` (the estimate's outer step it
        trained from), and keeps ``others`` for the fragment's next estimate; ``"mix"`` blends it with theta_global.
        """
        weights, indices = self.weights_of(), self.fragment_params[pending.fragment]
        if others is not None:
            self.others[pending.fragment] = others
            self.others_workers[pending.fragment] = max(pending.part.contributors, 1)
        if pending.contribution is None or pending.remaining == self.overlap_steps:
            weights.copy_to(indices)
            return False
        if self.merge == "eager":
            assert before is not None
            with torch.no_grad():
                for i, value in zip(indices, before, strict=True):
                    weights.local[i].add_((weights.params[i] - value).to(weights.local[i].device))
            return True
        mix_into([weights.local[i] for i in indices], [weights.params[i] for i in indices], self.mixing_factor)
        return self.mixing_factor > 0

    def close(self, optimizers: Sequence[Optimizer]) -> None:
        """Apply the exchange in flight, if any, and sync every fragment trained since its last sync."""
        if self.pending is not None:
            self.finish(optimizers)
        for fragment in range(self.fragments):
            if self.dirty[fragment]:
                self.send(fragment, optimizers, overlap=0)

    def dense_step(
        self,
        closure: Callable[[], Any],
        step: Callable[[Callable[[], Any]], Any],
        optimizers: Sequence[Optimizer],
        finite_only: bool = True,
    ) -> Any:
        """A dense step (DenseWarmup's): the mean gradient over every worker, then the step; theta_global follows.

        A round in progress is closed first. The membership averages (and, across groups that come and go, votes:
        a discarded step leaves the weights as they were). ``finite_only=False`` under a gradient scaler, which skips
        a non-finite step itself and must see it.
        """
        self.close(optimizers)
        weights = self.weights_of()
        output = closure()
        if not self.membership.dense_average(weights.local, weights.local_buffers, finite_only):
            for optimizer in optimizers:
                optimizer.zero_grad(set_to_none=True)
            return None
        output = step(lambda: output)
        weights.follow()
        self.exchange.count()  # the step's all-reduce counted as an outer exchange's
        return output

    def checks_sigterm_now(self) -> bool:
        """Whether the coming step is the one after a period's exchange completed (no exchange on the link).

        With ``overlap_steps`` equal to the period an exchange is always in flight: the step after one starts.
        """
        return self.phase % self.period == self.overlap_steps % self.period

    # ------------------------------------------------------------------------------------------------------------
    # State (:mod:`lightning_gradcomp.diloco.round_state`)
    # ------------------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """What is the same on every worker, with the membership's own state."""
        return {**round_state.shared_state(self), **self.membership.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` into an attached round."""
        round_state.load_shared_state(self, state)
        self.membership.load_state_dict(state)

    def own_state(self) -> dict[str, Any]:
        """This worker's own state, on the CPU."""
        return round_state.own_state(self)

    def load_own_state(self, own: dict[str, Any], device: torch.device) -> None:
        """Restore :meth:`own_state`; an exchange that was in flight is sent again (or discarded)."""
        round_state.load_own_state(self, own, device)
