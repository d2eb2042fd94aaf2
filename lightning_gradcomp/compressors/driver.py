"""The driver of :meth:`Compressor.reduce`: one reduction's rounds as futures, error feedback, the non-finite guard.

A compressor's :meth:`~lightning_gradcomp.compressors.base.Compressor.exchange` is a generator of requests
(:mod:`lightning_gradcomp.compressors.exchange`); :func:`reduce` forms what is compressed, issues round 0 at once (in
the hook, so in bucket order) and every later round through :meth:`~lightning_gradcomp.comm.Comm.after` on that
round's process group, hands each result back to the generator, and carries the non-finite flag on the first
all-reduce or all-gather.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import Tensor

from lightning_gradcomp.comm import Payload
from lightning_gradcomp.compressors.context import BucketContext
from lightning_gradcomp.compressors.exchange import (
    AllGather,
    AllGatherV,
    AllReduce,
    AllToAll,
    Broadcast,
    Exchange,
    Request,
    StepUpdates,
    nonfinite_flag,
)

if TYPE_CHECKING:
    from lightning_gradcomp.comm import Comm

__all__ = ["reduce"]


class Compressor(Protocol):
    """What the driver uses of a :class:`~lightning_gradcomp.compressors.base.Compressor` (base.py imports this)."""

    @property
    def rounds(self) -> int: ...

    @property
    def propagates_nonfinite(self) -> bool: ...

    @property
    def has_own_accumulation(self) -> bool: ...

    @property
    def has_nonfinite_witness(self) -> bool: ...

    def accumulate(self, tensor: Tensor, ctx: BucketContext) -> Tensor | None: ...

    def exchange(self, tensor: Tensor, ctx: BucketContext) -> Exchange: ...

    def nonfinite_witness(self, payload: Payload) -> Tensor | None: ...


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
        self.awaits_witness = False  # the flag is to be read from the first carrier's witness (nonfinite_witness)
        self.flag_at: tuple[int, type] | None = None  # (round, request type) that carried it
        self.ok: Tensor | None = None

    # ------------------------------------------------------------------------------------------------------------
    def issue(self, request: Request, round: int) -> torch.futures.Future:
        """Start ``request``'s collective on ``round``, with the flag if it is the first one that can carry it."""
        comm = self.comm
        payload = tuple(request.payload)
        if self.awaits_witness and isinstance(request, (AllReduce, AllGather)):
            witness = self.compressor.nonfinite_witness(payload)
            if witness is None:
                raise RuntimeError(
                    f"{type(self.compressor).__name__}.nonfinite_witness named no tensor of its first all-reduce or"
                    " all-gather payload; a compressor that overrides it must name one there (the non-finite guard"
                    " reads only that tensor)."
                )
            self.flag = nonfinite_flag(witness)
            self.awaits_witness = False
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
        if isinstance(request, AllToAll):
            return comm.all_to_all(payload, request.send_counts, request.recv_counts, round=round)
        if isinstance(request, AllGatherV):
            return comm.all_gather_v(payload, request.counts, round=round)
        raise TypeError(
            f"{type(self.compressor).__name__}.exchange yielded {request!r}; it must yield AllReduce, AllGather,"
            " Broadcast, AllToAll or AllGatherV requests (lightning_gradcomp.compressors.exchange)."
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
    def first(self) -> Request:
        """Form what is compressed, arm the guard and run the exchange up to its first request."""
        ctx, compressor = self.ctx, self.compressor
        runs = ctx.gradient_runs
        if runs is not None and compressor.has_own_accumulation:
            runs.into(self.tensor)  # an accumulation of its own is handed the gradient gathered
            ctx = self.ctx = dataclasses.replace(ctx, gradient_runs=None)
        accumulated = compressor.accumulate(self.tensor, ctx)
        if ctx.gradient_runs is not None:  # gathered by the default accumulation, into what it returned
            ctx = self.ctx = dataclasses.replace(ctx, gradient_runs=None)
        if _needs_guard(compressor, ctx):
            if compressor.has_nonfinite_witness:
                self.awaits_witness = True  # read from the payload when it is issued: no pass over the tensor
            else:
                self.flag = nonfinite_flag(self.tensor if accumulated is None else accumulated)
        if ctx.residual is not None and ctx.new_residual is not None:
            ctx.updates.stage(ctx.residual, ctx.new_residual, swap=True)
        self.generator = compressor.exchange(self.tensor, ctx)
        try:
            return next(self.generator)
        except StopIteration as stop:
            raise TypeError(
                f"{type(compressor).__name__}.exchange returned without a collective: every reduction must"
                " communicate (yield AllReduce, AllGather or Broadcast)."
            ) from stop

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
        if self.flag is not None or self.awaits_witness:
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


def reduce(compressor: Compressor, tensor: Tensor, ctx: BucketContext) -> torch.futures.Future[Tensor]:
    """Run ``compressor``'s reduction of ``tensor``: what :meth:`Compressor.reduce` does; ``ctx.comm`` must be set.

    Accumulates (error feedback), runs :meth:`Compressor.exchange` round by round (round ``k`` on its own process
    group, in bucket order on every rank), times encoding and decoding, and guards against non-finite input. Outside
    the hook (no ``ctx.updates``) the reduction commits its own staged state.
    """
    comm = ctx.comm
    if comm is None:
        raise RuntimeError("Compressor.reduce needs `ctx.comm` (the hook sets it); use compress/decompress directly.")
    owns_updates = ctx.updates is None
    changes: dict[str, Any] = {}
    if owns_updates:
        changes["updates"] = StepUpdates()
    if ctx.residual is not None and ctx.new_residual is None:
        changes["new_residual"] = torch.empty_like(ctx.residual)
    if changes:
        ctx = dataclasses.replace(ctx, **changes)
    run = _Run(compressor, tensor, ctx, comm)
    with comm.timed("encode"):
        request = run.first()
    fut = run.issue(request, 0)
    for round in range(1, compressor.rounds):
        fut = comm.after(fut, lambda done, round=round: run.resume(done, round), round=round)
    fut = fut.then(run.finish)
    if not owns_updates:
        return fut
    updates = ctx.updates
    assert updates is not None

    def commit(done: torch.futures.Future[Tensor]) -> Tensor:
        out = done.value()
        updates.commit()
        return out

    return fut.then(commit)
