"""DiLoCo's round: theta_global, the outer optimizer, the phase, the exchange in flight, and the steps that change them.

DiLoCo (Douillard et al. 2023, arXiv 2311.08105, Algorithm 1): every worker starts a round from the shared parameters
theta_global, takes ``H`` inner optimizer steps on its own data, then the workers average the pseudo-gradient
``theta_global - theta_local`` and an outer optimizer steps theta_global with that average as its gradient. Streaming
DiLoCo (Douillard et al. 2025, arXiv 2501.18512) cuts the model into fragments of consecutive parameters, synced in
turn every ``H / fragments`` steps, and lets a fragment's exchange run during ``overlap_steps`` inner steps; the
fragment's local work in those steps is kept by one of :mod:`~lightning_gradcomp.diloco.merge`'s merges.

:class:`Round` owns all of that state and the methods that change it, as torchft's ``_StreamingDiLoCoFragment``
does; :class:`~lightning_gradcomp.diloco.DiLoCo` only tells it when an inner step was taken, when the round must close
and when a step is synchronous. Its state is identical on every rank (it changes only from averaged values), except
the exchange's error-feedback residuals, the contribution in flight and the eager merge's estimate of the other
workers' shares, which are each rank's own.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_gradcomp.compressors.base import Compressor, Layer
from lightning_gradcomp.diloco.defaults import default_outer_optimizer
from lightning_gradcomp.diloco.exchange import InFlight, OuterExchange, all_finite
from lightning_gradcomp.diloco.merge import eager_estimate, mix_into, others_share, tentative_step
from lightning_gradcomp.diloco.replicas import ReplicaGroups, dtype_groups

__all__ = ["OuterOptimizerCallable", "Pending", "Round", "default_outer_optimizer", "floating_point", "split_fragments"]

#: what ``DiLoCo(outer_optimizer=...)`` takes: parameters in, an optimizer out (LightningCLI's ``OptimizerCallable``)
OuterOptimizerCallable = Callable[[Iterable[Tensor]], Optimizer]


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


def floating_point(buffers: Sequence[Tensor]) -> list[Tensor]:
    """The floating-point ones of ``buffers`` (the ones averaged: BatchNorm's statistics, not its step counter)."""
    return [b for b in buffers if b.is_floating_point()]


@dataclass
class Pending:
    """A fragment's exchange in flight (Streaming DiLoCo's overlap).

    Attributes:
        fragment: the fragment whose pseudo-gradient is on the wire.
        remaining: inner steps until its outer step is applied.
        exchange: the collectives in flight (``None`` after a resume, until they are sent again).
        contribution: this rank's pseudo-gradient, kept to send it again when a run resumes mid-exchange.
    """

    fragment: int
    remaining: int
    exchange: InFlight | None = None
    contribution: list[Tensor] | None = None


class Round:
    """DiLoCo's outer loop on one rank: theta_global, the outer optimizer, the phase in the round, the exchange.

    Built empty; :meth:`attach` takes the model's parameters and buffers when training starts.

    Args:
        sync_every: inner steps per round (``H``).
        fragments: Streaming DiLoCo's fragments, synced in turn every ``sync_every / fragments`` steps.
        overlap_steps: inner steps a fragment's exchange runs for before its outer step is applied.
        outer_optimizer: builds the outer optimizer from theta_global's tensors.
        offload: keep theta_global and the outer optimizer's state in CPU memory.
        compressor: average the pseudo-gradient through this compressor (``None``: a plain mean).
        warn: how a skipped outer step is reported (the strategy passes its rank-zero warning).
        merge: how an overlapped exchange's fragment keeps its local work, ``"mix"`` or ``"eager"``
            (:mod:`~lightning_gradcomp.diloco.merge`).
        mixing_factor: the share of the local work ``"mix"`` keeps (0: replaced by theta_global).

    Attributes:
        params: theta_global, one tensor per trained parameter.
        buffers: the floating-point buffers as of the last sync (BatchNorm's statistics).
        optimizer: the outer optimizer over :attr:`params`.
        phase: inner steps taken since the last fragment's sync.
        dirty: per fragment, whether it trained since its last sync.
        pending: the exchange in flight, if any.
        others: per fragment, the other workers' shares of its last average (the eager merge's estimate).
        syncs: outer steps taken; skipped: outer steps skipped because the average was not finite.
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
    ) -> None:
        self.sync_every, self.fragments, self.overlap_steps = sync_every, fragments, overlap_steps
        self.merge, self.mixing_factor = merge, mixing_factor
        self.outer_optimizer = outer_optimizer
        self.offload = offload
        self.exchange = OuterExchange(compressor)
        self.warn = warn
        self.process_group: Any = None
        self.replicas: ReplicaGroups | None = None
        self.names: list[str] = []
        self.fragment_params: list[list[int]] = []
        self.params: list[Tensor] = []
        self.buffers: list[Tensor] = []
        self.optimizer: Optimizer | None = None
        self.phase = 0
        self.dirty: list[bool] = [False] * fragments
        self.pending: Pending | None = None
        self.others: dict[int, list[Tensor]] = {}
        self.syncs = 0
        self.skipped = 0
        self._local: list[Tensor] = []  # the model's trained parameters
        self._local_buffers: list[Tensor] = []  # and its buffers

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
        """Take the model's parameters (and floating-point buffers) as theta_global; a fresh outer optimizer.

        ``names``: the parameters' names (the layers a compressor sees; default ``param0``, ``param1``, ...).
        ``distributed``: bind the exchange to the collectives (on every rank at the same point).

        Raises:
            TypeError: If ``outer_optimizer`` does not return a ``torch.optim.Optimizer``.
        """
        self._local, self._local_buffers = list(params), list(buffers)
        self.names = list(names) if names is not None else [f"param{i}" for i in range(len(params))]
        self.fragment_params = split_fragments([p.numel() for p in params], self.fragments)
        if distributed and params:
            self.exchange.attach(params[0].device, self.process_group, self.replicas)
        device = torch.device("cpu") if self.offload else None
        self.params = [p.detach().clone().to(device or p.device) for p in params]
        self.buffers = [b.detach().clone() for b in floating_point(buffers)]
        self.optimizer = self.outer_optimizer(self.params)
        if not isinstance(self.optimizer, Optimizer):
            raise TypeError(
                f"Expected `outer_optimizer` to return a torch.optim.Optimizer, got {type(self.optimizer).__name__}."
            )

    # ------------------------------------------------------------------------------------------------------------
    # The schedule
    # ------------------------------------------------------------------------------------------------------------
    def after_inner_step(self, optimizers: Sequence[Optimizer]) -> None:
        """One inner step was taken: apply the exchange that is due, and start the one that begins now."""
        self.phase += 1
        self.dirty = [True] * self.fragments
        if self.pending is not None:
            self.pending.remaining -= 1
            if self.pending.remaining == 0:
                self.finish(optimizers)
        if self.phase % self.period == 0:
            self.pending = self.send(self.phase // self.period - 1, self.overlap_steps)
            if not self.overlap_steps:
                self.finish(optimizers)
            elif self.merge == "eager" and self.pending.contribution is not None:
                # train in flight from the outer step of the estimated average
                with torch.no_grad():
                    indices = self.fragment_params[self.pending.fragment]
                    for i, value in zip(indices, self._eager_step(self.pending, self.in_flight_workers())):
                        self._local[i].copy_(value.to(self._local[i].device))
        if self.phase == self.sync_every:
            self.phase = 0

    def start(self, fragment: int) -> None:
        """Send fragment ``fragment``'s pseudo-gradient now; its outer step is applied by :meth:`finish`."""
        self.pending = self.send(fragment, 0)

    def send(self, fragment: int, remaining: int) -> Pending:
        """Start averaging ``fragment``'s pseudo-gradient; its outer step is due ``remaining`` inner steps later.

        With ``remaining`` this rank's contribution is kept, to send it again if a run resumes mid-exchange. The one
        place an exchange starts (the fault-tolerant round asks for its quorum here).
        """
        flats, layouts = self.pseudo_gradients(fragment)
        contribution = [f.clone() for f in flats] if remaining else None
        return Pending(fragment, remaining, self.exchange.start(flats, layouts), contribution)

    def finish(self, optimizers: Sequence[Optimizer]) -> None:
        """Step theta_global with the exchange's average and set every worker's fragment to it.

        With ``overlap_steps`` the fragment's local progress since the exchange started is merged with the new
        theta_global as :attr:`merge` says (:meth:`_merge`). An average that is not finite on some rank skips the
        outer step: every worker goes back to theta_global, and non-finite inner optimizer state is forgotten.
        """
        pending = self.pending
        assert pending is not None
        assert pending.exchange is not None
        self.pending = None
        indices = self.fragment_params[pending.fragment]
        averaged, finite = pending.exchange.wait()
        buffers = self.exchange.average(floating_point(self._local_buffers))
        if finite and all_finite(buffers):
            before = others = None
            if pending.contribution is not None and self.merge == "eager":
                # before the outer step, which may change the averages in place (torch's Nesterov SGD does)
                before = self._eager_step(pending, self.exchange.workers)
                others = others_share(averaged, pending.contribution, self.exchange.workers)
            self.outer_step(averaged, indices)
            self.set_buffers(buffers)
            self.syncs += 1
            self.dirty[pending.fragment] = self._merge(pending, before, others)
            return
        self.skipped += 1
        self.restore_buffers()
        self._forget_nonfinite_state(optimizers)
        self.warn(
            "DiLoCo: the averaged pseudo-gradient is not finite (a rank's inner steps diverged): outer step"
            f" skipped, every worker reset to theta_global ({self.skipped} skipped so far)."
        )
        self.copy_to(indices)
        self.dirty[pending.fragment] = False

    def in_flight_workers(self) -> int:
        """How many workers' pseudo-gradients the exchange in flight averages (all of them in plain DiLoCo)."""
        return self.exchange.workers

    def others_for(self, fragment: int, workers: int) -> list[Tensor] | None:
        """The other workers' shares of ``fragment``'s last average, for an estimate of a mean over ``workers``."""
        return self.others.get(fragment)

    def _eager_step(self, pending: Pending, workers: int) -> list[Tensor]:
        """theta_global's fragment after an outer step on the eager estimate of the average over ``workers``.

        Nothing is changed: the outer optimizer's step is taken on copies (:func:`tentative_step`).
        """
        assert self.optimizer is not None
        assert pending.contribution is not None
        indices = self.fragment_params[pending.fragment]
        estimate = eager_estimate(pending.contribution, self.others_for(pending.fragment, workers), workers)
        return tentative_step(self.optimizer, [self.params[i] for i in indices], self._grads(estimate, indices))

    def _merge(self, pending: Pending, before: list[Tensor] | None, others: list[Tensor] | None) -> bool:
        """Set the fragment from the new theta_global, keeping local work as :attr:`merge` says; whether it kept any.

        A blocking exchange (no contribution kept), or one completed early with no inner step taken in flight (the
        end of ``fit``), sets it to theta_global. ``"eager"`` moves it by the new theta_global minus ``before`` (the
        estimate's outer step it trained from), and keeps ``others`` for the fragment's next estimate; ``"mix"``
        blends it with theta_global.
        """
        indices = self.fragment_params[pending.fragment]
        if others is not None:
            self.others[pending.fragment] = others
        if pending.contribution is None or pending.remaining == self.overlap_steps:
            self.copy_to(indices)
            return False
        if self.merge == "eager":
            assert before is not None
            assert others is not None
            with torch.no_grad():
                for i, value in zip(indices, before, strict=True):
                    self._local[i].add_((self.params[i] - value).to(self._local[i].device))
            return True
        mix_into([self._local[i] for i in indices], [self.params[i] for i in indices], self.mixing_factor)
        return self.mixing_factor > 0

    def close(self, optimizers: Sequence[Optimizer]) -> None:
        """Apply the exchange in flight, if any, and sync every fragment trained since its last sync."""
        if self.pending is not None:
            self.finish(optimizers)
        for fragment in range(self.fragments):
            if self.dirty[fragment]:
                self.start(fragment)
                self.finish(optimizers)

    def follow(self) -> None:
        """After a synchronous step: theta_global and the kept buffers set to the model's, the outer state cleared.

        The step's dense all-reduce (through :attr:`exchange`'s collectives) is counted as an outer exchange's.
        """
        with torch.no_grad():
            for mine, p in zip(self.params, self._local, strict=True):
                mine.copy_(p)
            for mine, b in zip(self.buffers, floating_point(self._local_buffers), strict=True):
                mine.copy_(b)
        if self.optimizer is not None and self.optimizer.state:
            self.optimizer.state.clear()
        self.exchange.count()

    def checks_sigterm_now(self) -> bool:
        """Whether the coming step is the one after a period's exchange completed (no exchange on the link).

        With ``overlap_steps`` equal to the period an exchange is always in flight: the step after one starts.
        """
        return self.phase % self.period == self.overlap_steps % self.period

    # ------------------------------------------------------------------------------------------------------------
    # theta_global and the model
    # ------------------------------------------------------------------------------------------------------------
    def pseudo_gradients(self, fragment: int) -> tuple[list[Tensor], list[tuple[Layer, ...]]]:
        """``theta_global - theta_local`` of ``fragment``, flat, one tensor per dtype and device, and their layouts.

        This sign makes the outer step a descent step: the inner steps moved theta_local along minus the gradient, so
        ``theta_global - theta_local`` points along the gradient, as ``.grad`` must.
        """
        indices = self.fragment_params[fragment]
        local = [self._local[i].detach() for i in indices]
        flats, layouts = [], []
        for group in dtype_groups(local):
            flats.append(torch.cat([(self.params[indices[i]].to(local[i].device) - local[i]).flatten() for i in group]))
            shapes = [local[i].shape for i in group]
            offsets = itertools.accumulate((s.numel() for s in shapes), initial=0)
            layouts.append(
                tuple(
                    Layer(self.names[indices[i]], indices[i], shape, offset)
                    for i, shape, offset in zip(group, shapes, offsets)
                )
            )
        return flats, layouts

    def outer_step(self, averaged: list[Tensor], indices: Sequence[int]) -> None:
        """The outer optimizer's step on theta_global at ``indices``, with ``.grad`` the averaged pseudo-gradient.

        ``averaged`` is laid out as :meth:`pseudo_gradients` made it. Parameters outside ``indices`` keep no gradient,
        so the optimizer leaves them and their state as they are.
        """
        assert self.optimizer is not None
        chosen = [self.params[i] for i in indices]
        for p, grad in zip(chosen, self._grads(averaged, indices), strict=True):
            p.grad = grad
        self.optimizer.step()
        for p in chosen:
            p.grad = None

    def _grads(self, flats: list[Tensor], indices: Sequence[int]) -> list[Tensor]:
        """Flat tensors laid out as :meth:`pseudo_gradients` made them, as one tensor per parameter at ``indices``."""
        chosen = [self.params[i] for i in indices]
        grads: list[Tensor] = list(chosen)  # every entry replaced below
        for group, flat in zip(dtype_groups([self._local[i] for i in indices]), flats, strict=True):
            for i, piece in zip(group, flat.split([chosen[i].numel() for i in group])):
                grads[i] = piece.view_as(chosen[i]).to(chosen[i].device)
        return grads

    def copy_to(self, indices: Iterable[int] | None = None) -> None:
        """Set the model's parameters at ``indices`` (default: all) to theta_global."""
        with torch.no_grad():
            for i in range(len(self._local)) if indices is None else indices:
                self._local[i].copy_(self.params[i])

    def set_buffers(self, values: Sequence[Tensor]) -> None:
        """Set the model's floating-point buffers, and the ones kept here, to ``values``."""
        with torch.no_grad():
            for mine, theirs, value in zip(self.buffers, floating_point(self._local_buffers), values, strict=True):
                mine.copy_(value)
                theirs.copy_(value)

    def restore_buffers(self) -> None:
        """Set the model's floating-point buffers to the ones of the last sync."""
        with torch.no_grad():
            for mine, theirs in zip(self.buffers, floating_point(self._local_buffers), strict=True):
                theirs.copy_(mine)

    def _forget_nonfinite_state(self, optimizers: Sequence[Optimizer]) -> None:
        """After a skipped round, leave no non-finite value in this rank's own state.

        Its non-finite parameters go back to theta_global, and the inner optimizers forget the state (momenta) of
        parameters whose state is not finite (host reads: only on a skipped round).
        """
        self.copy_to([i for i, p in enumerate(self._local) if not bool(p.isfinite().all())])
        for optimizer in optimizers:
            for p in list(optimizer.state):
                values = [v for v in optimizer.state[p].values() if isinstance(v, Tensor) and v.is_floating_point()]
                if not all(bool(v.isfinite().all()) for v in values):
                    del optimizer.state[p]

    # ------------------------------------------------------------------------------------------------------------
    # State
    # ------------------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything the outer loop needs to resume exactly that is the same on every rank."""
        assert self.optimizer is not None
        pending = self.pending
        return {
            "params": [p.clone() for p in self.params],
            "buffers": [b.clone() for b in self.buffers],
            "optimizer": self.optimizer.state_dict(),
            "phase": self.phase,
            "dirty": list(self.dirty),
            "pending": None if pending is None else {"fragment": pending.fragment, "remaining": pending.remaining},
            "syncs": self.syncs,
            "skipped": self.skipped,
            "bytes_sent": self.exchange.bytes_sent,
            "bytes_received": self.exchange.bytes_received,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` into an attached round (theta_global copied in place).

        An exchange that was in flight is pending again, without its collectives: :meth:`resend` sends this rank's
        contribution again.
        """
        assert self.optimizer is not None
        for mine, saved in zip(self.params, state["params"], strict=True):
            mine.copy_(saved)
        for mine, saved in zip(self.buffers, state["buffers"], strict=True):
            mine.copy_(saved)
        self.optimizer.load_state_dict(state["optimizer"])
        self.phase, self.syncs, self.skipped = state["phase"], state["syncs"], state["skipped"]
        self.dirty = list(state["dirty"])
        self.exchange.bytes_sent, self.exchange.bytes_received = state["bytes_sent"], state["bytes_received"]
        pending = state["pending"]
        self.pending = None if pending is None else Pending(pending["fragment"], pending["remaining"])
        self.others = {}  # each rank's own: restored by load_own_state, or empty on a new world size

    def own_state(self) -> dict[str, Any]:
        """This rank's own state, on the CPU: its contribution in flight, its exchange's residuals and counter."""
        contribution = self.pending.contribution if self.pending is not None else None
        return {
            "contribution": [t.to("cpu", copy=True) for t in contribution] if contribution is not None else None,
            "exchange": self.exchange.state_dict(),
            "others": {k: [t.to("cpu", copy=True) for t in v] for k, v in self.others.items()},
        }

    def load_own_state(self, own: dict[str, Any], device: torch.device) -> None:
        """Restore :meth:`own_state`, and send the exchange that was in flight again, with the same values."""
        self.exchange.load_state_dict(own["exchange"])
        self.others = {int(k): [t.to(device) for t in v] for k, v in own.get("others", {}).items()}
        if self.pending is not None:
            contribution = [t.to(device) for t in own["contribution"]]
            self.pending.contribution = [t.clone() for t in contribution]
            layouts = self.pseudo_gradients(self.pending.fragment)[1]
            self.pending.exchange = self.exchange.start(contribution, layouts)
