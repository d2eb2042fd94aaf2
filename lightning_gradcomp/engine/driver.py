"""The driver of :meth:`Compressor.reduce`: one reduction's rounds as futures, error feedback, the non-finite guard.

A compressor's :meth:`~lightning_gradcomp.compressors.base.Compressor.exchange` is a generator of requests and of one
declaration of what it sent (:mod:`lightning_gradcomp.engine.requests`). :func:`reduce` is the one place that
does error feedback (Seide et al., 2014; Karimireddy et al., 2019): it forms what is compressed, ``x = g + e``
(after the compressor's own :meth:`~lightning_gradcomp.compressors.base.Compressor.accumulate`), and settles the
residual from the declaration, ``e = x - sent``, with the in-place operation that fits it (:func:`settle`). It also
issues round 0 at once (in the hook, so in bucket order) and every later round through
:meth:`~lightning_gradcomp.engine.comm.Comm.after` on that round's process group, hands each result back to the
generator, and carries the non-finite flag on the first all-reduce or all-gather.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import Tensor

from lightning_gradcomp.engine import wire
from lightning_gradcomp.engine.comm import Payload
from lightning_gradcomp.engine.context import BucketContext, GradientRuns, Layer, ResidualBuffers
from lightning_gradcomp.engine.requests import (
    AllGather,
    AllGatherV,
    AllReduce,
    AllToAll,
    Broadcast,
    Exchange,
    Lossless,
    OwedAt,
    Request,
    Sent,
    SentAt,
    SentExactly,
    SentPayload,
    SentValue,
    StepUpdates,
    nonfinite_flag,
)

if TYPE_CHECKING:
    from lightning_gradcomp.engine.comm import Comm

__all__ = ["Compaction", "Delegate", "issue_all", "reduce", "settle"]

_DECLARATIONS = (Lossless, SentExactly, SentPayload, SentValue, SentAt, OwedAt)


class Reducible(Protocol):
    """What the driver uses of a :class:`~lightning_gradcomp.compressors.base.Compressor` (base.py imports this)."""

    @property
    def rounds(self) -> int: ...

    @property
    def propagates_nonfinite(self) -> bool: ...

    @property
    def has_own_accumulation(self) -> bool: ...

    @property
    def has_nonfinite_witness(self) -> bool: ...

    @property
    def keeps_input(self) -> bool: ...

    @property
    def residual_beta(self) -> float: ...

    def delegate(self, ctx: BucketContext) -> Delegate | None: ...

    def accumulate(self, tensor: Tensor, ctx: BucketContext) -> Tensor | Sequence[Tensor]: ...

    def exchange(self, tensor: Tensor, ctx: BucketContext, out: Tensor) -> Exchange: ...

    def decompress(self, payload: Payload, ctx: BucketContext, out: Tensor | None = None) -> Tensor: ...

    def nonfinite_witness(self, payload: Payload) -> Tensor | None: ...


class Splittable(Reducible, Protocol):
    """What :mod:`~lightning_gradcomp.engine.split` uses of a compressor besides the driver's part: its split."""

    def bucket_compressor(self, layers: Sequence[Layer]) -> Splittable: ...

    def compresses(self, layer: Layer, min_numel: int) -> bool: ...

    def plan_key(self) -> tuple: ...

    def resolve_error_feedback(self, enabled: bool | None) -> bool: ...

    @property
    def has_dense_update(self) -> bool: ...

    def finish_dense(self, average: Tensor, ctx: BucketContext) -> None: ...

    def reduce(
        self,
        tensor: Tensor,
        ctx: BucketContext,
        memory: ResidualBuffers | None = None,
        runs: GradientRuns | None = None,
    ) -> torch.futures.Future[Tensor]: ...

    def wire_bytes(
        self,
        layers: Sequence[Layer] | int,
        world_size: int,
        *,
        error_feedback: bool | None = None,
        tensor: Tensor | None = None,
        step: int = 0,
    ) -> wire.Wire: ...


class Compaction(Protocol):
    """How a wrapper maps its flat tensor into its inner compressor's (fewer elements) and back."""

    def gather(self, tensor: Tensor, name: str) -> Tensor:
        """``tensor``'s compact part, in a buffer kept under ``name`` (``"gradient"``, ``"residual"``)."""
        ...

    def buffer(self, name: str, like: Tensor) -> Tensor:
        """A compact-sized buffer kept under ``name``."""
        ...

    def scatter(self, compact: Tensor, out: Tensor) -> Tensor:
        """``compact`` laid back into ``out`` (zeros where nothing maps), returned."""
        ...


@dataclasses.dataclass(frozen=True)
class Delegate:
    """Who runs a wrapper compressor's reduction of one bucket (:meth:`Compressor.delegate`).

    Attributes:
        compressor: the compressor that accumulates, exchanges and declares what it sent.
        ctx: its context (the wrapper's, or one laid out for the compact tensor).
        compaction: ``None``: it reduces the wrapper's tensor itself; else the wrapper's tensor, residual and result
            pass through this map (the residual is settled in the compact coordinates, then laid back, zeros where
            nothing maps: nothing is owed there).
    """

    compressor: Reducible
    ctx: BucketContext
    compaction: Compaction | None = None


class _Done:
    """A reduction that returned before its last declared round (every rank alike): later rounds pass it on."""

    __slots__ = ("result",)

    def __init__(self, result: Tensor) -> None:
        self.result = result


class _Run:
    """One reduction in flight: who runs it, where ``x`` is, the generator, the guard's flag."""

    def __init__(
        self,
        compressor: Reducible,
        tensor: Tensor,
        ctx: BucketContext,
        comm: Comm,
        memory: ResidualBuffers | None,
        runs: GradientRuns | None,
    ) -> None:
        self.compressor = compressor  # the guard's facts are the compressor's own, wrapper or not
        delegate = _resolve(compressor, ctx)
        self.runner, self.ctx, self.compaction = delegate.compressor, delegate.ctx, delegate.compaction
        self.tensor = self.outer_tensor = tensor
        self.memory = memory
        self.outer_twin = None if memory is None else memory.twin
        self.runs = runs
        self.comm = comm
        self.x = tensor
        self.declared = False
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
            comm.telemetry.add_guard(_flag_sent(payload, flag, isinstance(request, AllGather), comm.world_size))
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
            " Broadcast, AllToAll or AllGatherV requests (lightning_gradcomp.engine.requests)."
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
        """Form what is compressed (error feedback's ``x``), arm the guard and run the exchange to its first request."""
        runner, ctx, tensor, memory = self.runner, self.ctx, self.tensor, self.memory
        runs = self.runs
        if runs is not None and (self.compaction is not None or runner.has_own_accumulation or memory is None):
            runs.into(tensor)  # an accumulation of its own, or a compaction, is handed the gradient gathered
            runs = None
        if self.compaction is not None:
            # the guard reads the wrapper's whole gradient, as it would without the compaction
            if _needs_guard(self.compressor, memory):
                self.flag = nonfinite_flag(tensor)
            tensor = self.tensor = self.compaction.gather(tensor, "gradient")
            if memory is not None:
                memory = self.memory = ResidualBuffers(
                    self.compaction.gather(memory.residual, "residual"),
                    self.compaction.buffer("new_residual", tensor),
                )
        accumulated = runner.accumulate(tensor, ctx)
        x = self.x = _form_input(runner, tensor, accumulated, memory, runs, ctx)
        if self.compaction is None and _needs_guard(self.compressor, memory):
            if self.compressor.has_nonfinite_witness:
                self.awaits_witness = True  # read from the payload when it is issued: no pass over the tensor
            else:
                self.flag = nonfinite_flag(x)
        self.generator = runner.exchange(x, ctx, tensor)
        request = self.advance(None)
        if isinstance(request, _Done):
            raise TypeError(
                f"{type(runner).__name__}.exchange returned without a collective: every reduction must"
                " communicate (yield AllReduce, AllGather or Broadcast)."
            )
        return request

    def advance(self, value: Any) -> Request | _Done:
        """Send ``value`` to the generator; settle what it declares; its next request, or its average when done."""
        assert self.generator is not None
        try:
            item = self.generator.send(value)
            while isinstance(item, _DECLARATIONS):
                self.declare(item)
                item = self.generator.send(None)
        except StopIteration as stop:
            if self.memory is not None and not self.declared:
                raise RuntimeError(
                    f"{type(self.runner).__name__}.exchange declared nothing of what it sent; with error feedback"
                    " it must yield one declaration (Lossless, SentExactly, SentPayload, SentValue, SentAt or"
                    " OwedAt, lightning_gradcomp.engine.requests) before it writes over its input."
                ) from None
            return _Done(stop.value)
        return item

    def declare(self, sent: Sent) -> None:
        """Error feedback's residual from what the exchange sent (nothing to do without error feedback)."""
        if self.declared:
            raise RuntimeError(f"{type(self.runner).__name__}.exchange declared what it sent twice; declare it once.")
        self.declared = True
        if self.memory is not None:
            assert self.memory.twin is not None
            settle(sent, self.x, self.memory, self.runner, self.ctx)

    def resume(self, done: torch.futures.Future, round: int) -> torch.futures.Future:
        """Hand round ``round - 1``'s result to the generator and issue what it yields on round ``round``."""
        value = done.value()
        if isinstance(value, _Done):
            return _completed(self.comm, value)
        value = self.received(value, round - 1)
        with self.comm.timed("encode"):
            request = self.advance(value)
        if isinstance(request, _Done):
            return _completed(self.comm, request)
        return self.issue(request, round)

    def finish(self, done: torch.futures.Future) -> Tensor:
        value = done.value()
        if isinstance(value, _Done):
            out = value.result
        else:
            value = self.received(value, self.runner.rounds - 1)
            with self.comm.timed("decode"):
                last = self.advance(value)
            if not isinstance(last, _Done):
                raise RuntimeError(
                    f"{type(self.runner).__name__}.exchange yielded more collectives than its declared"
                    f" `rounds = {self.runner.rounds}`; declare every round (process groups are created"
                    " for them before training)."
                )
            out = last.result
        if self.flag is not None or self.awaits_witness:
            raise RuntimeError(
                f"{type(self.runner).__name__}.exchange yielded no AllReduce or AllGather to carry the non-finite"
                " flag; every reduction needs one (a Broadcast alone cannot tell every rank that one rank failed)."
            )
        if self.compaction is not None:
            with self.comm.timed("decode"):
                if self.memory is not None:
                    assert self.outer_twin is not None
                    assert self.memory.twin is not None
                    self.compaction.scatter(self.memory.twin, self.outer_twin)  # zeros where nothing maps
                out = self.compaction.scatter(out, self.outer_tensor)
        if self.ok is not None:
            with self.comm.timed("decode"):
                # one NaN is enough for "the gradient is not finite" on every rank (the user's or AMP's check)
                nan = torch.full((), float("nan"), dtype=out.dtype, device=out.device)
                out[:1].add_(torch.where(self.ok, torch.zeros_like(nan), nan))
            assert self.ctx.updates is not None
            self.ctx.updates.observe(self.ok)
        return out


def _form_input(
    compressor: Reducible,
    tensor: Tensor,
    accumulated: Tensor | Sequence[Tensor],
    memory: ResidualBuffers | None,
    runs: GradientRuns | None,
    ctx: BucketContext,
) -> Tensor:
    """Error feedback's ``x = accumulated + e``, the one place it is formed; returns where ``x`` is.

    A compressor that keeps its input (:attr:`Compressor.keeps_input`) gets ``x`` straight in the updated residual's
    buffer, where :func:`settle` then takes off what was sent in place (no copy of ``x``: one memory pass per step),
    and ``tensor`` becomes its output buffer. Otherwise ``x`` is formed in ``tensor``. ``accumulated`` is
    :meth:`Compressor.accumulate`'s answer: ``tensor`` (or a flat tensor of its own), or one tensor per layer.
    """
    into_twin = memory is not None and compressor.keeps_input and compressor.residual_beta == 1.0
    if memory is None:
        if isinstance(accumulated, Tensor):
            return accumulated
        return torch.cat(list(accumulated), out=tensor)
    residual = memory.residual
    target = memory.twin if into_twin else tensor
    assert target is not None
    if runs is not None:
        return runs.into(target, plus=residual)
    if not isinstance(accumulated, Tensor):
        for layer, piece in zip(ctx.layers, accumulated):
            torch.add(piece, layer.flat(residual), out=layer.flat(target))
        return target
    if into_twin:
        return torch.add(accumulated, residual, out=target)
    if accumulated is not tensor:
        tensor.copy_(accumulated)
    return tensor.add_(residual)


def settle(sent: Sent, x: Tensor, memory: ResidualBuffers, compressor: Reducible, ctx: BucketContext) -> None:
    """Write the updated residual, ``x - sent``, into ``memory.twin`` from what an exchange declared it sent.

    Each declaration has its in-place form (the one each compressor used when it wrote its residual itself, so the
    bits are the same); where ``x`` is the twin buffer itself it is changed in place, else copied in first. Then
    ScaleCom's low-pass filter when the compressor's :attr:`Compressor.residual_beta` is below 1:
    ``m <- (1 - beta) m + beta (x - sent)``, where ``m`` is the residual of the last finite step.
    """
    twin, residual = memory.twin, memory.residual
    assert twin is not None
    in_place = x is twin
    beta = compressor.residual_beta
    if isinstance(sent, Lossless):
        twin.zero_()  # everything went out: nothing is owed, nothing to filter
        return
    if isinstance(sent, SentExactly) and beta != 1.0:
        # (1 - beta) m + beta x, then the sent entries: (1 - beta) m + 0.0 (the bits of adding beta times a copy of x
        # with zeros there, without that gradient-sized copy)
        decayed = torch.mul(residual, 1.0 - beta, out=twin)
        kept = decayed.index_select(0, sent.indices).add_(0.0)
        decayed.add_(x, alpha=beta).index_copy_(0, sent.indices, kept)
        return
    if isinstance(sent, SentPayload):
        if in_place:
            raise RuntimeError(f"{type(compressor).__name__} keeps its input: declare SentValue, not SentPayload.")
        # decoded straight into the residual's buffer (no gradient-sized temporary), then subtracted in place
        torch.sub(x, compressor.decompress(sent.payload, ctx, out=twin), out=twin)
    elif isinstance(sent, SentValue):
        if in_place:
            twin.sub_(sent.value)
        else:
            torch.sub(x, sent.value, out=twin)
    else:
        lost = twin if in_place else twin.copy_(x)
        if isinstance(sent, SentExactly):
            lost.index_fill_(0, sent.indices, 0)
        elif isinstance(sent, SentAt):
            lost.index_add_(0, sent.indices, sent.values, alpha=-1)
            if sent.exactly is not None:
                lost.index_fill_(0, sent.exactly, 0)
        else:
            lost.index_copy_(0, sent.indices, sent.owed)
    if beta != 1.0:
        twin.mul_(beta).add_(residual, alpha=1.0 - beta)


def _flag_sent(payload: Payload, flag: Tensor, gathered: bool, world_size: int) -> int:
    """What the flag adds to the bytes this rank sends (the byte-packed all-gather pads to 8 bytes)."""
    if not gathered:  # it joins the all-reduce of its dtype's tensors
        nbytes = sum(t.numel() * t.element_size() for t in payload if t.dtype == flag.dtype)
        with_flag = wire.all_reduce(nbytes + flag.element_size(), world_size).sent
        return int(with_flag - wire.all_reduce(nbytes, world_size).sent)
    added = 8
    if len(payload) == 1:  # a lone tensor is sent unpacked; with the flag it is packed, so padded too
        nbytes = payload[0].numel() * payload[0].element_size()
        added = -(-nbytes // 8) * 8 - nbytes + 8
    return int(wire.all_gather(added, world_size).sent)


def _completed(comm: Comm, value: Any) -> torch.futures.Future:
    fut = comm.new_future()
    fut.set_result(value)
    return fut


def _needs_guard(compressor: Reducible, memory: ResidualBuffers | None) -> bool:
    # a plain sum (Identity, the casts) carries a NaN to every rank by itself; with no state to protect there is
    # nothing to do, and Identity stays bitwise plain DDP
    return not (compressor.propagates_nonfinite and memory is None)


def _resolve(compressor: Reducible, ctx: BucketContext) -> Delegate:
    """Follow wrapper compressors (:meth:`Compressor.delegate`) to the one that runs the bucket's reduction."""
    delegate = Delegate(compressor, ctx)
    while delegate.compaction is None:
        inner = delegate.compressor.delegate(delegate.ctx)
        if inner is None:
            break
        delegate = inner
    return delegate


def reduce(
    compressor: Reducible,
    tensor: Tensor,
    ctx: BucketContext,
    memory: ResidualBuffers | None = None,
    runs: GradientRuns | None = None,
) -> torch.futures.Future[Tensor]:
    """Run ``compressor``'s reduction of ``tensor``: what :meth:`Compressor.reduce` does; ``ctx.comm`` must be set.

    Forms ``x = g + e`` with ``memory`` (error feedback; ``None``: off), runs :meth:`Compressor.exchange` round by
    round (round ``k`` on its own process group, in bucket order on every rank), settles the residual from what it
    declares it sent, times encoding and decoding, and guards against non-finite input. ``runs``: the compressed
    layers are still in DDP's bucket (error feedback only), and ``tensor`` is where they go. Outside the hook (no
    ``ctx.updates``) the reduction commits its own staged state.
    """
    comm = ctx.comm
    if comm is None:
        raise RuntimeError("Compressor.reduce needs `ctx.comm` (the hook sets it); use compress/decompress directly.")
    owns_updates = ctx.updates is None
    updates = StepUpdates() if owns_updates else ctx.updates
    assert updates is not None
    ctx = dataclasses.replace(ctx, updates=updates, error_feedback=memory is not None)
    if memory is not None:
        if memory.twin is None:
            memory = ResidualBuffers(memory.residual, torch.empty_like(memory.residual))
        assert memory.twin is not None
        updates.stage(memory.residual, memory.twin, swap=True)
    run = _Run(compressor, tensor, ctx, comm, memory, runs)
    with comm.timed("encode"):
        request = run.first()
    fut = run.issue(request, 0)
    for round in range(1, run.runner.rounds):
        fut = comm.after(fut, functools.partial(run.resume, round=round), round=round)
    fut = fut.then(run.finish)
    if not owns_updates:
        return fut

    def commit(done: torch.futures.Future[Tensor]) -> Tensor:
        out = done.value()
        updates.commit()
        return out

    return fut.then(commit)


def issue_all(compressor: Reducible, tensor: Tensor, ctx: BucketContext, memory: ResidualBuffers | None = None) -> None:
    """Issue every collective of ``compressor``'s reduction of ``tensor`` as :func:`reduce` would, without the result.

    For a byte model (:mod:`lightning_gradcomp.engine.wire_model`): ``ctx.comm``'s backend must complete each
    collective at once. Every round's request is issued (with the non-finite flag where it rides) and every result
    but the last is handed back to the exchange, whose final decoding is skipped. Staged state is never committed.
    """
    comm = ctx.comm
    assert comm is not None
    ctx = dataclasses.replace(ctx, updates=StepUpdates(), error_feedback=memory is not None)
    if memory is not None and memory.twin is None:
        memory = ResidualBuffers(memory.residual, torch.empty_like(memory.residual))
    run = _Run(compressor, tensor, ctx, comm, memory, None)
    fut = run.issue(run.first(), 0)
    for round in range(1, run.runner.rounds):
        fut = run.resume(fut, round)
