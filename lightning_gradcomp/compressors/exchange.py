"""How a compressor's rounds of communication run: the requests it yields, and the driver that issues them.

A compressor describes its reduction as a generator (:meth:`Compressor.exchange`) that *yields* the collectives it
needs (:class:`AllReduce`, :class:`AllGather`, :class:`Broadcast`) and receives their results::

    def exchange(self, tensor, ctx):
        summed = yield AllReduce((self.project(tensor),))   # round 0
        shared = yield AllReduce((self.second(summed),))    # round 1
        return self.reconstruct(shared, out=tensor)

The driver here turns that into futures: round 0 is issued at once (in the hook, so in bucket order), round ``k``
through :meth:`~lightning_gradcomp.comm.Comm.after` on round ``k``'s process group, so every rank issues every
round's collectives in the same order (the reason torch's ``powerSGD_hook`` aborts under gloo on multi-bucket
models, and ours does not). Compressors never see a future or a process group; the driver also times encoding and
decoding and runs the non-finite guard.

**The non-finite guard.** A NaN or an infinity on any rank must never enter a compressor's state (an error-feedback
residual that keeps a NaN adds it back every step, forever), and the step's aggregate must be non-finite on every
rank, so that the user's or AMP's usual skip works as with plain DDP. Each rank computes a 0/1 flag from a sum over
its input (one pass, no host synchronisation) and the flag rides along with the first all-reduce or all-gather the
compressor yields (one more element, counted as sent). Every state change of the step is *staged*
(:class:`StepUpdates`) and written only if no rank raised the flag; otherwise the state stays as it was before the
step and the aggregate gets a NaN, on every rank alike.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Generator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Union

import torch
from torch import Tensor

from lightning_gradcomp.comm import Payload, ReduceOpName

if TYPE_CHECKING:
    from lightning_gradcomp.comm import Comm
    from lightning_gradcomp.compressors.base import BucketContext, Compressor

__all__ = ["AllGather", "AllReduce", "Broadcast", "Exchange", "Request", "StepUpdates", "run_exchange"]


@dataclass(frozen=True)
class AllReduce:
    """Reduce every tensor of ``payload`` over the ranks (``"sum"`` or ``"max"``).

    The reduction receives the reduced payload, shaped as sent.
    """

    payload: Payload
    op: ReduceOpName = "sum"


@dataclass(frozen=True)
class AllGather:
    """Gather every rank's ``payload`` (same shapes on every rank).

    The reduction receives one payload per rank, in rank order.
    """

    payload: Payload


@dataclass(frozen=True)
class Broadcast:
    """Send rank ``src``'s ``payload`` to every rank (every rank passes tensors of the same shapes).

    The reduction receives it.
    """

    payload: Payload
    src: int


Request = Union[AllReduce, AllGather, Broadcast]  # noqa: UP007 (a runtime alias, also on Python 3.10)
#: What :meth:`Compressor.exchange` returns: yields requests, receives their results, returns the flat average.
Exchange = Generator[Request, Any, Tensor]


class StepUpdates:
    """State changes of one step, written once the step is known to be finite on every rank.

    A compressor stages a change with :meth:`stage` (``target`` receives ``value`` at commit); the error-feedback
    residual is staged the same way by the driver. The communication hook shares one instance between all buckets
    of a step and commits after the last bucket, so a non-finite step leaves *all* state as it was; outside the
    hook every reduction commits its own.

    The decision needs no host synchronisation: on CUDA the commit is ``torch.where(ok, value, target)``; on the
    CPU, where reading a flag costs nothing, it is a plain copy when the step is finite.
    """

    def __init__(self) -> None:
        self._staged: list[tuple[Tensor, Tensor]] = []
        self._ok: Tensor | None = None
        self._lock = threading.Lock()  # buckets finish on the collectives' threads

    def stage(self, target: Tensor, value: Tensor) -> None:
        """Write ``value`` into ``target`` at commit if the step is finite on every rank.

        ``value`` must not change afterwards: stage a buffer of its own, not a view of the gradient.
        """
        with self._lock:
            self._staged.append((target, value))

    def observe(self, ok: Tensor) -> None:
        """Record one reduction's verdict (a 0-dim bool tensor, identical on every rank)."""
        with self._lock:
            self._ok = ok if self._ok is None else self._ok & ok

    @property
    def ok(self) -> Tensor | None:
        """Whether every reduction of the step so far was finite on every rank (``None``: nothing was checked)."""
        return self._ok

    def commit(self) -> Tensor | None:
        """Write every staged change (where the step is finite) and start afresh; returns the step's verdict."""
        with self._lock:
            staged, ok = self._staged, self._ok
            self._staged, self._ok = [], None
        if ok is None:
            for target, value in staged:
                target.copy_(value)
        elif ok.device.type == "cpu":
            if bool(ok):  # a CPU tensor: no device to wait for
                for target, value in staged:
                    target.copy_(value)
        else:
            for target, value in staged:
                torch.where(ok, value, target, out=target)
        return ok


def nonfinite_flag(tensor: Tensor) -> Tensor:
    """``1`` if ``tensor`` holds a NaN or an infinity, else ``0`` (a 0-dim float32 tensor; one pass, no sync).

    A sum is non-finite exactly when an element is (or when finite elements overflow it, which no trainable gradient
    does in fp32 accumulation); it reads the tensor once, where ``isfinite(t).all()`` writes a mask first.
    """
    total = torch.sum(tensor, dtype=torch.promote_types(tensor.dtype, torch.float32))
    return (~torch.isfinite(total)).to(torch.float32)


class _Done:
    """A reduction that returned before its last declared round (every rank alike): later rounds pass it on."""

    __slots__ = ("result",)

    def __init__(self, result: Tensor) -> None:
        self.result = result


class _Run:
    """One reduction in flight: the generator, the guard's flag, the staged updates."""

    def __init__(self, compressor: Compressor, tensor: Tensor, ctx: BucketContext, comm: Comm) -> None:
        self.compressor = compressor
        self.tensor = tensor
        self.ctx = ctx
        self.comm = comm
        self.generator: Exchange | None = None
        self.flag: Tensor | None = None  # this rank's 0/1, until it has been sent
        self.flag_at: tuple[int, type] | None = None  # (round, request type) that carried it
        self.ok: Tensor | None = None

    # ------------------------------------------------------------------------------------------------------------
    def issue(self, request: Request, round: int) -> torch.futures.Future:
        """Start ``request``'s collective on ``round``, with the flag if it is the first one that can carry it."""
        comm = self.comm
        payload = tuple(request.payload)
        carries = self.flag is not None and isinstance(request, (AllReduce, AllGather))
        if carries:
            flag = self._flag_like(payload, request)
            comm.telemetry.add_guard(_flag_nbytes(payload, flag, isinstance(request, AllGather)))
            payload = (*payload, flag)
            self.flag_at = (round, type(request))
            self.flag = None
        if isinstance(request, AllReduce):
            return comm.all_reduce(payload, round=round, op=request.op)
        if isinstance(request, AllGather):
            return comm.all_gather(payload, round=round)
        if isinstance(request, Broadcast):
            return comm.broadcast(payload, src=request.src, round=round)
        raise TypeError(
            f"{type(self.compressor).__name__}.exchange yielded {request!r}; it must yield AllReduce, AllGather or"
            " Broadcast requests (lightning_gradcomp.compressors.exchange)."
        )

    def _flag_like(self, payload: Payload, request: Request) -> Tensor:
        assert self.flag is not None
        # an all-reduce groups its tensors by dtype: in the payload's own dtype the flag costs no extra collective
        # (0 and 1 are exact in every dtype, summed or maxed); an all-gather packs bytes, any dtype will do
        dtype = payload[0].dtype if isinstance(request, AllReduce) and payload else torch.float32
        if dtype == torch.bool:
            dtype = torch.uint8
        return self.flag.to(dtype).reshape(1)

    def received(self, value: Any, round: int) -> Any:
        """The collective's result as the compressor sent it: the flag is taken off (and read) if it rode here."""
        if self.flag_at is None or self.flag_at[0] != round:
            return value
        if self.flag_at[1] is AllReduce:
            *payload, flag = value
            bad = flag.reshape(())
            value = tuple(payload)
        else:
            bad = torch.stack([rank_payload[-1].reshape(()) for rank_payload in value]).sum()
            value = [tuple(rank_payload[:-1]) for rank_payload in value]
        self.ok = bad == 0
        return value

    # ------------------------------------------------------------------------------------------------------------
    def start(self) -> torch.futures.Future:
        ctx, comm = self.ctx, self.comm
        with comm.timed("encode"):
            self.compressor.accumulate(self.tensor, ctx)
            if _needs_guard(self.compressor, ctx):
                self.flag = nonfinite_flag(self.tensor)
            if ctx.residual is not None and ctx.new_residual is not None:
                ctx.updates.stage(ctx.residual, ctx.new_residual)
            self.generator = self.compressor.exchange(self.tensor, ctx)
            try:
                request = next(self.generator)
            except StopIteration as stop:
                raise TypeError(
                    f"{type(self.compressor).__name__}.exchange returned without a collective: every reduction must"
                    " communicate (yield AllReduce, AllGather or Broadcast)."
                ) from stop
        fut = self.issue(request, 0)
        for round in range(1, self.compressor.rounds):
            fut = comm.after(fut, lambda done, round=round: self.resume(done, round), round=round)
        return fut.then(self.finish)

    def resume(self, done: torch.futures.Future, round: int) -> torch.futures.Future:
        """Hand round ``round - 1``'s result to the generator and issue what it yields on round ``round``."""
        value = done.value()
        if isinstance(value, _Done):
            return _completed(self.comm, value)
        value = self.received(value, round - 1)
        assert self.generator is not None
        with self.comm.timed("encode"):
            try:
                request = self.generator.send(value)
            except StopIteration as stop:
                return _completed(self.comm, _Done(stop.value))
        return self.issue(request, round)

    def finish(self, done: torch.futures.Future) -> Tensor:
        value = done.value()
        if isinstance(value, _Done):
            out = value.result
        else:
            value = self.received(value, self.compressor.rounds - 1)
            assert self.generator is not None
            with self.comm.timed("decode"):
                try:
                    self.generator.send(value)
                except StopIteration as stop:
                    out = stop.value
                else:
                    raise RuntimeError(
                        f"{type(self.compressor).__name__}.exchange yielded more collectives than its declared"
                        f" `rounds = {self.compressor.rounds}`; declare every round (process groups are created"
                        " for them before training)."
                    )
        if self.flag is not None:
            raise RuntimeError(
                f"{type(self.compressor).__name__}.exchange yielded no AllReduce or AllGather to carry the non-finite"
                " flag; every reduction needs one (a Broadcast alone cannot tell every rank that one rank failed)."
            )
        if self.ok is not None:
            with self.comm.timed("decode"):
                # one NaN is enough for "the gradient is not finite" on every rank (the user's or AMP's check)
                nan = torch.full((), float("nan"), dtype=out.dtype, device=out.device)
                out[:1].add_(torch.where(self.ok, torch.zeros_like(nan), nan))
            self.ctx.updates.observe(self.ok)
        return out


def _flag_nbytes(payload: Payload, flag: Tensor, gathered: bool) -> int:
    """What the flag adds to the bytes handed to the collective (the byte-packed all-gather pads to 8 bytes)."""
    if not gathered:
        return flag.element_size()
    if len(payload) == 1:  # a lone tensor is sent unpacked; with the flag it is packed, so padded too
        nbytes = payload[0].numel() * payload[0].element_size()
        return -(-nbytes // 8) * 8 - nbytes + 8
    return 8


def _completed(comm: Comm, value: Any) -> torch.futures.Future:
    fut = comm.new_future()
    fut.set_result(value)
    return fut


def _needs_guard(compressor: Compressor, ctx: BucketContext) -> bool:
    # a plain sum (Identity, the casts) carries a NaN to every rank by itself; with no state to protect there is
    # nothing to do, and Identity stays bitwise plain DDP
    return not (compressor.propagates_nonfinite and ctx.residual is None)


def run_exchange(compressor: Compressor, tensor: Tensor, ctx: BucketContext) -> torch.futures.Future[Tensor]:
    """Run ``compressor``'s reduction of ``tensor`` (see :meth:`Compressor.reduce`); ``ctx.comm`` must be set."""
    if ctx.comm is None:
        raise RuntimeError("Compressor.reduce needs `ctx.comm` (the hook sets it); use compress/decompress directly.")
    owns_updates = ctx.updates is None
    changes: dict[str, Any] = {}
    if owns_updates:
        changes["updates"] = StepUpdates()
    if ctx.residual is not None and ctx.new_residual is None:
        changes["new_residual"] = torch.empty_like(ctx.residual)
    if changes:
        ctx = dataclasses.replace(ctx, **changes)
    fut = _Run(compressor, tensor, ctx, ctx.comm).start()
    if not owns_updates:
        return fut
    updates = ctx.updates

    def commit(done: torch.futures.Future[Tensor]) -> Tensor:
        out = done.value()
        updates.commit()
        return out

    return fut.then(commit)

