"""theta_global beside the worker's own model: the outer optimizer's parameters, the buffers of the last sync.

DiLoCo (Douillard et al. 2023, arXiv 2311.08105, Algorithm 1) keeps the shared parameters theta_global apart from
each worker's replica: the pseudo-gradient is ``theta_global - theta_local``, the outer optimizer steps theta_global
with its average as ``.grad``, and the worker starts the next round from theta_global. :class:`GlobalWeights` holds
both sides and the operations between them; the round (:mod:`lightning_gradcomp.diloco.round`) decides when.

Buffers are treated as DDP treats them, or better: only the floating-point buffers that training changed since the
last sync (BatchNorm's running statistics) are averaged at a sync; a constant buffer, finite or not (a causal mask
of ``0``/``-inf``, a rotary table), is left as it is and sends nothing.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_gradcomp.compressors.base import Layer
from lightning_gradcomp.diloco.exchange import OuterExchange
from lightning_gradcomp.diloco.replicas import dtype_groups, flatten_by_dtype, views_of

__all__ = ["GlobalWeights", "OuterOptimizerCallable", "divergence_message", "finite_each", "floating_point"]

#: what ``DiLoCo(outer_optimizer=...)`` takes: parameters in, an optimizer out (LightningCLI's ``OptimizerCallable``)
OuterOptimizerCallable = Callable[[Iterable[Tensor]], Optimizer]


def floating_point(buffers: Sequence[Tensor]) -> list[Tensor]:
    """The floating-point ones of ``buffers`` (the ones a sync may average: not a step counter)."""
    return [b for b in buffers if b.is_floating_point()]


def finite_each(tensors: Sequence[Tensor]) -> list[bool]:
    """Whether each of ``tensors`` is finite everywhere (one host read for all of them)."""
    if not tensors:
        return []
    sums = torch.stack([t.detach().sum(dtype=torch.float64).cpu() for t in tensors])
    return [bool(v) for v in torch.isfinite(sums)]


def divergence_message(names: Sequence[str], rank: int, skipped: int) -> str:
    """The skipped round's warning: the tensors that became non-finite on this rank, by name, or another rank."""
    shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
    where = f"on rank {rank}, {shown} became non-finite" if names else "on another rank"
    return (
        f"DiLoCo: outer step skipped: a worker's inner steps diverged ({where}); the average is not finite, every"
        f" worker reset to theta_global ({skipped} skipped so far)."
    )


class GlobalWeights:
    """theta_global, the outer optimizer over it and the buffers of the last sync, beside the model's own tensors.

    Args:
        params: the model's trained parameters (theta_local, changed in place).
        buffers: the model's buffers.
        names: the parameters' names; buffer_names: the floating-point buffers' names (for messages).
        outer_optimizer: builds the outer optimizer from theta_global's tensors.
        offload: keep theta_global and the outer optimizer's state in CPU memory.

    Raises:
        TypeError: If ``outer_optimizer`` does not return a ``torch.optim.Optimizer``.
    """

    def __init__(
        self,
        params: Sequence[Tensor],
        buffers: Sequence[Tensor],
        names: Sequence[str],
        buffer_names: Sequence[str],
        outer_optimizer: OuterOptimizerCallable,
        offload: bool = False,
    ) -> None:
        self.local = list(params)
        self.local_buffers = floating_point(buffers)
        self.names, self.buffer_names = list(names), list(buffer_names)
        device = torch.device("cpu") if offload else None
        self.params = [p.detach().clone().to(device or p.device) for p in params]
        if offload and any(p.device.type == "cuda" for p in params):  # page-locked: faster copies at a sync
            self.params = [p.pin_memory() for p in self.params]
        self.buffers = [b.detach().clone() for b in self.local_buffers]
        self.optimizer = outer_optimizer(self.params)
        if not isinstance(self.optimizer, Optimizer):
            raise TypeError(
                f"Expected `outer_optimizer` to return a torch.optim.Optimizer, got {type(self.optimizer).__name__}."
            )

    # ------------------------------------------------------------------------------------------------------------
    # The pseudo-gradient and the outer step
    # ------------------------------------------------------------------------------------------------------------
    def pseudo_gradients(self, indices: Sequence[int]) -> tuple[list[Tensor], list[tuple[Layer, ...]]]:
        """``theta_global - theta_local`` of the parameters at ``indices``, flat per dtype and device, and layouts.

        This sign makes the outer step a descent step: the inner steps moved theta_local along minus the gradient, so
        ``theta_global - theta_local`` points along the gradient, as ``.grad`` must.
        """
        local = [self.local[i].detach() for i in indices]
        grouped = flatten_by_dtype([self.params[i].to(mine.device) - mine for i, mine in zip(indices, local)])
        layouts = []
        for group, _ in grouped:
            shapes = [local[i].shape for i in group]
            offsets = itertools.accumulate((s.numel() for s in shapes), initial=0)
            layouts.append(
                tuple(
                    Layer(self.names[indices[i]], indices[i], shape, offset)
                    for i, shape, offset in zip(group, shapes, offsets)
                )
            )
        return [flat for _, flat in grouped], layouts

    def outer_step(self, averaged: list[Tensor], indices: Sequence[int]) -> None:
        """The outer optimizer's step on theta_global at ``indices``, with ``.grad`` the averaged pseudo-gradient.

        ``averaged`` is laid out as :meth:`pseudo_gradients` made it. Parameters outside ``indices`` keep no gradient,
        so the optimizer leaves them and their state as they are.
        """
        chosen = [self.params[i] for i in indices]
        for p, grad in zip(chosen, self.grads(averaged, indices), strict=True):
            p.grad = grad
        self.optimizer.step()
        for p in chosen:
            p.grad = None

    def grads(self, flats: list[Tensor], indices: Sequence[int]) -> list[Tensor]:
        """Flat tensors laid out as :meth:`pseudo_gradients` made them, as one tensor per parameter at ``indices``."""
        chosen = [self.params[i] for i in indices]
        groups = dtype_groups([self.local[i] for i in indices])
        views = views_of(chosen, list(zip(groups, flats, strict=True)))
        return [view.to(p.device) for view, p in zip(views, chosen)]

    # ------------------------------------------------------------------------------------------------------------
    # The model and theta_global
    # ------------------------------------------------------------------------------------------------------------
    def copy_to(self, indices: Iterable[int] | None = None) -> None:
        """Set the model's parameters at ``indices`` (default: all) to theta_global."""
        with torch.no_grad():
            for i in range(len(self.local)) if indices is None else indices:
                self.local[i].copy_(self.params[i])

    def follow(self) -> None:
        """theta_global and the kept buffers set to the model's (after a dense step); the outer state cleared."""
        with torch.no_grad():
            for mine, p in zip(self.params, self.local, strict=True):
                mine.copy_(p)
            for mine, b in zip(self.buffers, self.local_buffers, strict=True):
                mine.copy_(b)
        self.optimizer.state.clear()

    def evaluate_global(self, tensors: Sequence[Tensor]) -> list[Tensor]:
        """Copies of the worker's ``tensors``, then the model set to theta_global and the last sync's buffers.

        What validation during ``fit`` evaluates (the model a checkpoint holds); :meth:`restore` undoes it.
        """
        saved = [t.detach().clone() for t in tensors]
        self.copy_to()
        self.restore_buffers()
        return saved

    @staticmethod
    def restore(tensors: Sequence[Tensor], saved: Sequence[Tensor]) -> None:
        """Give the worker its own ``tensors`` back from :meth:`evaluate_global`'s copies."""
        with torch.no_grad():
            for mine, value in zip(tensors, saved, strict=True):
                mine.copy_(value)

    def changed_buffers(self) -> Tensor:
        """Per floating-point buffer, 1.0 where training changed it since the last sync (NaN kept as NaN: unchanged)."""
        flags = [((b != kept) & ~(b.isnan() & kept.isnan())).any() for b, kept in zip(self.local_buffers, self.buffers)]
        return torch.stack(flags).float() if flags else torch.zeros(0)

    def average_changed_buffers(
        self, exchange: OuterExchange, contributes: bool = True, skip: bool = False
    ) -> tuple[list[int], list[Tensor], bool]:
        """The floating-point buffers some worker's training changed, their means, and whether those stayed finite.

        A constant buffer (a causal mask of ``-inf``, a rotary table) is not sent, as DDP would not change it. The
        workers first agree on which changed (a mean of 0/1 flags through ``exchange``), so every rank sends the same
        layout; a worker that does not contribute sends zeros, and nothing is sent when ``skip``.
        """
        if not self.local_buffers or skip:
            return [], [], True
        flags = self.changed_buffers() if contributes else self.local_buffers[0].new_zeros(len(self.local_buffers))
        changed = [i for i, flag in enumerate(exchange.average([flags])[0].tolist()) if flag > 0]
        if not changed:
            return [], [], True
        mine = [self.local_buffers[i] for i in changed]
        averaged = exchange.average(mine if contributes else [torch.zeros_like(b) for b in mine])
        was_finite = finite_each([self.buffers[i] for i in changed])  # only what was finite must stay so
        stayed = [ok for ok, was in zip(finite_each(averaged), was_finite) if was]
        return changed, averaged, all(stayed)

    def set_buffers(self, indices: Sequence[int], values: Sequence[Tensor]) -> None:
        """Set the model's floating-point buffers at ``indices``, and the ones kept here, to ``values``."""
        with torch.no_grad():
            for i, value in zip(indices, values, strict=True):
                self.buffers[i].copy_(value)
                self.local_buffers[i].copy_(value)

    def restore_buffers(self) -> None:
        """Set the model's floating-point buffers to the ones of the last sync."""
        with torch.no_grad():
            for mine, theirs in zip(self.buffers, self.local_buffers, strict=True):
                theirs.copy_(mine)

    def nonfinite_names(self) -> list[str]:
        """The names of this worker's parameters and buffers that are not finite where theta_global's are."""
        tensors = [*self.local, *self.local_buffers]
        before = finite_each([*self.params, *self.buffers])
        names = [*self.names, *self.buffer_names]
        return [name for name, now, then in zip(names, finite_each(tensors), before) if then and not now]

    def forget_nonfinite_state(self, optimizers: Sequence[Optimizer]) -> None:
        """After a skipped round, leave no non-finite value in this worker's own state.

        Its non-finite parameters go back to theta_global, and the inner optimizers forget the state (momenta) of
        parameters whose state is not finite (host reads: only on a skipped round).
        """
        self.copy_to([i for i, p in enumerate(self.local) if not bool(p.isfinite().all())])
        for optimizer in optimizers:
            for p in list(optimizer.state):
                values = [v for v in optimizer.state[p].values() if isinstance(v, Tensor) and v.is_floating_point()]
                if not all(bool(v.isfinite().all()) for v in values):
                    del optimizer.state[p]
