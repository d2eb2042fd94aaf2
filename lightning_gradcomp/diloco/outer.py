"""DiLoCo's outer step: theta_global, the averaged pseudo-gradient, the outer optimizer and the round's phase.

DiLoCo (Douillard et al. 2023, arXiv 2311.08105, Algorithm 1): every worker starts a round from the shared parameters
theta_global, takes ``H`` inner optimizer steps on its own data, then the workers average the pseudo-gradient
``theta_global - theta_local`` and an outer optimizer steps theta_global with that average as its gradient. This
module holds that state and those operations; :class:`~lightning_gradcomp.diloco.DiLoCo` decides when they run.

:meth:`OuterState.average` is the one place where the pseudo-gradient crosses the wire, and it counts the bytes it sends
and receives; with a compressor it goes through :class:`~lightning_gradcomp.diloco.exchange.OuterExchange`.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.optim import Optimizer

from lightning_gradcomp.compressors.base import Compressor, Layer
from lightning_gradcomp.diloco.exchange import OuterExchange
from lightning_gradcomp.diloco.replicas import ReplicaGroups, average_across_groups
from lightning_gradcomp.engine import wire

#: what ``DiLoCo(outer_optimizer=...)`` takes: parameters in, an optimizer out (LightningCLI's ``OptimizerCallable``)
OuterOptimizerCallable = Callable[[Iterable[Tensor]], Optimizer]


def default_outer_optimizer(params: Iterable[Tensor]) -> Optimizer:
    """Nesterov SGD, learning rate 0.7, momentum 0.9: DiLoCo's outer optimizer (arXiv 2311.08105, section 3)."""
    return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)


def _groups(tensors: Sequence[Tensor]) -> dict[tuple[torch.dtype, torch.device], list[int]]:
    """Indices of ``tensors`` grouped by dtype and device: one flat buffer per group."""
    groups: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.dtype, t.device), []).append(i)
    return groups


def _flat_float_buffers(buffers: Sequence[Tensor]) -> list[Tensor]:
    return [b for b in buffers if b.is_floating_point()]


class Averaging:
    """An average of flat tensors, possibly still in flight; :meth:`wait` returns it."""

    def __init__(self, flats: list[Tensor], works: list[Any], on_done: Callable[[], None]) -> None:
        self._flats, self._works, self._on_done = flats, works, on_done

    def wait(self) -> list[Tensor]:
        """Wait for the collectives (if any are in flight) and return the averaged tensors."""
        for work in self._works:
            work.wait()
        self._on_done()
        return self._flats


class OuterState:
    """theta_global, the outer optimizer over it, the phase in the round and the outer exchange's counters.

    Identical on every rank (it changes only from averaged values). Built empty; :meth:`attach` takes the model's
    parameters and buffers when training starts.

    Args:
        outer_optimizer: builds the outer optimizer from theta_global's tensors.
        offload: keep theta_global and the outer optimizer's state in CPU memory (the pseudo-gradient is still
            formed and averaged on the parameters' device).
        process_group: the group the pseudo-gradient is averaged over (``None``: the default group).
        compressor: average the pseudo-gradient through this compressor, with its error feedback kept per rank
            across outer steps (:class:`~lightning_gradcomp.diloco.exchange.OuterExchange`); ``None``: a plain
            all-reduce.

    Attributes:
        replicas: with two levels (``DiLoCo(replica_group=...)``), the replica groups: the exchange averages over the
            groups hierarchically (:func:`~lightning_gradcomp.diloco.replicas.average_across_groups`).
    """

    def __init__(
        self,
        outer_optimizer: OuterOptimizerCallable,
        offload: bool = False,
        process_group: Any = None,
        compressor: Compressor | None = None,
    ):
        self.outer_optimizer = outer_optimizer
        self.offload = offload
        self.process_group = process_group
        self.replicas: ReplicaGroups | None = None
        self.exchange = OuterExchange(compressor) if compressor is not None else None
        self.names: list[str] = []  # the parameters' names: the layers a compressor sees
        self.params: list[Tensor] = []  # theta_global, one tensor per model parameter
        self.buffers: list[Tensor] = []  # the floating-point buffers as of the last sync (BatchNorm's statistics)
        self.optimizer: Optimizer | None = None
        self.phase = 0  # inner steps taken since the last sync of the last fragment
        self.dirty: list[bool] = []  # per fragment: trained since its last sync
        # an exchange in flight (Streaming DiLoCo's overlap): {"fragment": k, "remaining": inner steps until applied}
        self.pending: dict[str, int] | None = None
        self.in_flight: Averaging | None = None
        self.contribution: list[Tensor] | None = None  # this rank's pseudo-gradient in flight (to re-send on resume)
        self.syncs = 0  # outer steps taken
        self.skipped = 0  # outer steps skipped because the average was not finite
        self.bytes_sent = 0
        self.bytes_received = 0

    # ------------------------------------------------------------------------------------------------------------
    # Setup and state
    # ------------------------------------------------------------------------------------------------------------
    def attach(
        self,
        params: Sequence[Tensor],
        buffers: Sequence[Tensor],
        fragments: int = 1,
        names: Sequence[str] | None = None,
    ) -> None:
        """Take the model's current parameters (and floating-point buffers) as theta_global; a fresh outer optimizer.

        ``names``: the parameters' names (the layers a compressor sees; default ``param0``, ``param1``, ...). With a
        compressor this binds its exchange to the collectives: call it on every rank at the same point.
        """
        self.names = list(names) if names is not None else [f"param{i}" for i in range(len(params))]
        if self.exchange is not None and params and dist.is_available() and dist.is_initialized():
            self.exchange.attach(params[0].device, self.process_group)
        self.dirty = [False] * fragments
        device = torch.device("cpu") if self.offload else None
        self.params = [p.detach().clone().to(device or p.device) for p in params]
        self.buffers = [b.detach().clone() for b in _flat_float_buffers(buffers)]
        self.optimizer = self.outer_optimizer(self.params)
        if not isinstance(self.optimizer, Optimizer):
            raise TypeError(
                f"Expected `outer_optimizer` to return a torch.optim.Optimizer, got {type(self.optimizer).__name__}."
            )

    def state_dict(self) -> dict[str, Any]:
        """Everything the outer loop needs to resume exactly (the same on every rank)."""
        assert self.optimizer is not None
        return {
            "params": [p.clone() for p in self.params],
            "buffers": [b.clone() for b in self.buffers],
            "optimizer": self.optimizer.state_dict(),
            "phase": self.phase,
            "dirty": list(self.dirty),
            "pending": dict(self.pending) if self.pending is not None else None,
            "syncs": self.syncs,
            "skipped": self.skipped,
            "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` into an attached state (theta_global copied in place)."""
        assert self.optimizer is not None
        for mine, saved in zip(self.params, state["params"], strict=True):
            mine.copy_(saved)
        for mine, saved in zip(self.buffers, state["buffers"], strict=True):
            mine.copy_(saved)
        self.optimizer.load_state_dict(state["optimizer"])
        self.phase, self.syncs, self.skipped = state["phase"], state["syncs"], state["skipped"]
        self.dirty = list(state["dirty"])
        self.pending = dict(state["pending"]) if state["pending"] is not None else None
        self.bytes_sent, self.bytes_received = state["bytes_sent"], state["bytes_received"]

    # ------------------------------------------------------------------------------------------------------------
    # The round
    # ------------------------------------------------------------------------------------------------------------
    def pseudo_gradients(self, params: Sequence[Tensor], indices: Sequence[int]) -> list[Tensor]:
        """``theta_global - theta_local`` of the parameters at ``indices``, flat, one tensor per dtype and device.

        This sign makes the outer step a descent step: the inner steps moved theta_local along minus the gradient, so
        ``theta_global - theta_local`` points along the gradient, as ``.grad`` must.
        """
        local = [params[i].detach() for i in indices]
        flats = []
        for group in _groups(local).values():
            flats.append(torch.cat([(self.params[indices[i]].to(local[i].device) - local[i]).flatten() for i in group]))
        return flats

    def layouts(self, params: Sequence[Tensor], indices: Sequence[int]) -> list[tuple[Layer, ...]]:
        """The :class:`Layer` entries of each flat tensor :meth:`pseudo_gradients` makes of ``indices``."""
        local = [params[i] for i in indices]
        out = []
        for group in _groups(local).values():
            shapes = [local[i].shape for i in group]
            offsets = [0, *itertools.accumulate(s.numel() for s in shapes)]
            out.append(tuple(Layer(self.names[indices[i]], indices[i], shape, offset)
                             for i, shape, offset in zip(group, shapes, offsets)))  # fmt: skip
        return out

    def average(
        self,
        flats: list[Tensor],
        async_op: bool = False,
        layouts: Sequence[tuple[Layer, ...]] | None = None,
    ) -> Averaging:
        """The mean over the workers of each flat pseudo-gradient: one all-reduce each, its bytes counted.

        The seam of the outer exchange: whatever travels on the wire is decided here. Each rank divides by the world
        size before the sum, as DDP's reducer does. ``async_op``: return at once, the all-reduces running in the
        background until :meth:`Averaging.wait` (Streaming DiLoCo's overlap). Bytes as the package's telemetry counts
        an all-reduce (:mod:`lightning_gradcomp.engine.wire`), added when the exchange completes: a ring sends and
        receives ``2 (n - 1) / n`` times the buffer.

        With a compressor (``layouts``, from :meth:`layouts`, required) the flats go through its exchange, with this
        rank's error feedback; bytes are what its collectives count, and the residual and the compressor's state
        change only if the whole average is finite on every rank, when :meth:`Averaging.wait` returns.
        """
        if not (dist.is_available() and dist.is_initialized()):
            return Averaging(flats, [], lambda: None)
        if self.exchange is not None and self.exchange.attached:
            if layouts is None:
                raise ValueError("OuterState.average needs `layouts` when a compressor averages the pseudo-gradient.")
            exchange = self.exchange
            pending = exchange.average(flats, layouts)

            def count_compressed() -> None:
                pending.wait()
                self.bytes_sent += exchange.last_bytes[0]
                self.bytes_received += exchange.last_bytes[1]

            return Averaging(flats, [], count_compressed)
        if self.replicas is not None:
            return Averaging(flats, *average_across_groups(flats, self.replicas, self._count, async_op=async_op))
        world = dist.get_world_size(self.process_group)
        works = []
        for flat in flats:
            flat.div_(world)
            works.append(dist.all_reduce(flat, group=self.process_group, async_op=async_op))
        size = sum(flat.numel() * flat.element_size() for flat in flats)
        return Averaging(flats, [w for w in works if w is not None], lambda: self._count("all_reduce", size, world))

    def _count(self, kind: str, size: int, world: int) -> None:
        """Count one collective of a ``size``-byte buffer over ``world`` ranks as the telemetry does (:mod:`wire`).

        A ring all-reduce sends and receives ``2 (n - 1) / n`` times the buffer, an all-gather ``n - 1`` times it.
        """
        moved = (wire.all_reduce if kind == "all_reduce" else wire.all_gather)(size, world)
        self.bytes_sent += int(moved.sent)
        self.bytes_received += int(moved.received)

    def follow(self, params: Sequence[Tensor], buffers: Sequence[Tensor], world_size: int) -> None:
        """After a synchronous step: theta_global and the kept buffers set to the model's, the outer state cleared.

        The step's dense all-reduce of the gradients and floating-point buffers is counted as :meth:`average`'s.
        """
        with torch.no_grad():
            for mine, p in zip(self.params, params, strict=True):
                mine.copy_(p)
            for mine, b in zip(self.buffers, _flat_float_buffers(buffers), strict=True):
                mine.copy_(b)
        if self.optimizer is not None and self.optimizer.state:
            self.optimizer.state.clear()
        if world_size > 1:
            floats = [*params, *_flat_float_buffers(buffers)]
            self._count("all_reduce", sum(t.numel() * t.element_size() for t in floats), world_size)

    def average_buffers(self, buffers: Sequence[Tensor]) -> list[Tensor]:
        """The mean over the workers of the model's floating-point buffers, its bytes counted as :meth:`average`'s."""
        floats = _flat_float_buffers(buffers)
        if not floats or not (dist.is_available() and dist.is_initialized()):
            return [b.detach().clone() for b in floats]
        world = dist.get_world_size(self.process_group)
        flats = [(ix, torch.cat([floats[i].detach().flatten() for i in ix])) for ix in _groups(floats).values()]
        if self.replicas is not None:
            average_across_groups([flat for _, flat in flats], self.replicas, self._count)[1]()
        else:
            for _, flat in flats:
                dist.all_reduce(flat.div_(world), group=self.process_group)
            self._count("all_reduce", sum(flat.numel() * flat.element_size() for _, flat in flats), world)
        averaged: list[Tensor] = [torch.empty(0)] * len(floats)
        for group, flat in flats:
            for i, piece in zip(group, flat.split([floats[i].numel() for i in group])):
                averaged[i] = piece.view_as(floats[i])
        return averaged

    def step(self, averaged: list[Tensor], params: Sequence[Tensor], indices: Sequence[int]) -> None:
        """The outer optimizer's step on theta_global at ``indices``, with ``.grad`` the averaged pseudo-gradient.

        ``averaged`` is laid out as :meth:`pseudo_gradients` made it from the model's ``params``. Parameters outside
        ``indices`` keep no gradient, so the optimizer leaves them and their state as they are.
        """
        assert self.optimizer is not None
        chosen = [self.params[i] for i in indices]
        groups = _groups([params[i] for i in indices]).values()
        for group, flat in zip(groups, averaged, strict=True):
            for i, piece in zip(group, flat.split([chosen[i].numel() for i in group])):
                chosen[i].grad = piece.view_as(chosen[i]).to(chosen[i].device)
        self.optimizer.step()
        for p in chosen:
            p.grad = None

    def copy_to(self, params: Sequence[Tensor], indices: Sequence[int]) -> None:
        """Set the model's parameters at ``indices`` to theta_global."""
        with torch.no_grad():
            for i in indices:
                params[i].copy_(self.params[i])

    def set_buffers(self, buffers: Sequence[Tensor], values: Sequence[Tensor]) -> None:
        """Set the model's floating-point buffers, and the ones kept here, to ``values``."""
        with torch.no_grad():
            for mine, theirs, value in zip(self.buffers, _flat_float_buffers(buffers), values, strict=True):
                mine.copy_(value)
                theirs.copy_(value)

    def restore_buffers(self, buffers: Sequence[Tensor]) -> None:
        """Set the model's floating-point buffers to the ones of the last sync."""
        with torch.no_grad():
            for mine, theirs in zip(self.buffers, _flat_float_buffers(buffers), strict=True):
                theirs.copy_(mine)


def all_finite(tensors: Iterable[Tensor]) -> bool:
    """Whether every element of ``tensors`` is finite (one host read: DiLoCo calls it once per round)."""
    checks = [t.isfinite().all() for t in tensors]
    return bool(torch.stack([c.cpu() for c in checks]).all()) if checks else True


def forget_nonfinite_state(outer: OuterState, params: Sequence[Tensor], optimizers: Iterable[Optimizer]) -> None:
    """After a skipped round, leave no non-finite value in this rank's own state.

    Its non-finite parameters go back to theta_global, and the inner optimizers forget the state (momenta) of
    parameters whose state is not finite (host reads: only on a skipped round).
    """
    outer.copy_to(params, [i for i, p in enumerate(params) if not bool(p.isfinite().all())])
    for optimizer in optimizers:
        for p in list(optimizer.state):
            values = [v for v in optimizer.state[p].values() if isinstance(v, Tensor) and v.is_floating_point()]
            if not all_finite(values):
                del optimizer.state[p]
