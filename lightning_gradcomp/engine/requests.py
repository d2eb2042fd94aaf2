"""How a compressor's rounds of communication run: the requests it yields, and what it declares it sent.

A compressor describes its reduction as a generator (:meth:`Compressor.exchange`) that *yields* the collectives it
needs (:class:`AllReduce`, :class:`AllGather`, :class:`Broadcast`, and for payloads whose sizes depend on the data
:class:`AllToAll` and :class:`AllGatherV`) and receives their results, yields once what went out of the tensor it
compresses (a *declaration*: :class:`Lossless`, :class:`SentExactly`, :class:`SentPayload`, :class:`SentValue`,
:class:`SentAt`, :class:`OwedAt`), and returns the average::

    def exchange(self, tensor, ctx, out):
        summed = yield AllReduce((self.project(tensor),))   # round 0
        shared = yield AllReduce((self.second(summed),))    # round 1
        average = self.reconstruct(shared, out=out)
        yield SentValue(average)                            # what error feedback keeps: tensor - average
        return average

A declaration costs no round: the driver settles error feedback's residual from it at once (``e = x - sent``, with
the in-place operation that fits it) and resumes the generator. It is yielded where it holds, before ``tensor``'s
memory is written over (``out`` may be ``tensor`` itself); without error feedback the driver ignores it.

The driver (:func:`lightning_gradcomp.engine.driver.reduce`) turns that into futures: round 0 is issued at
once (in the hook, so in bucket order), round ``k`` through :meth:`~lightning_gradcomp.engine.comm.Comm.after` on round
``k``'s process group, so every rank issues every round's collectives in the same order (the reason torch's
``powerSGD_hook`` aborts under gloo on multi-bucket models, and ours does not). Compressors never see a future, a
process group or a residual; the driver also times encoding and decoding and runs the non-finite guard.

**The non-finite guard.** A NaN or an infinity on any rank must never enter a compressor's state (an error-feedback
residual that keeps a NaN adds it back every step, forever), and the step's aggregate must be non-finite on every
rank, so that the user's or AMP's usual skip works as with plain DDP. Each rank computes a 0/1 flag from a sum over
its input (one pass, no host synchronisation) and the flag rides along with the first all-reduce or all-gather the
compressor yields (one more element, counted as sent). Every state change of the step is *staged*
(:class:`StepUpdates`) and written only if no rank raised the flag; otherwise the state stays as it was before the
step and the aggregate gets a NaN, on every rank alike.
"""

from __future__ import annotations

import threading
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any, Union

import torch
from torch import Tensor

from lightning_gradcomp.engine.comm import Payload, ReduceOpName

__all__ = [
    "AllGather",
    "AllGatherV",
    "AllReduce",
    "AllToAll",
    "Broadcast",
    "Exchange",
    "Lossless",
    "OwedAt",
    "Request",
    "Sent",
    "SentAt",
    "SentExactly",
    "SentPayload",
    "SentValue",
    "StepUpdates",
    "nonfinite_flag",
]


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


@dataclass(frozen=True)
class AllToAll:
    """Send rows of ``payload`` to every rank: ``send_counts[d]`` consecutive rows to rank ``d`` (variable splits).

    ``payload`` holds 1-D tensors of ``sum(send_counts)`` elements (row ``i`` is element ``i`` of each);
    ``recv_counts[s]`` is the number of rows rank ``s`` sends to this rank, so the sizes must have been exchanged in
    an earlier round. The reduction receives one payload per source rank, in rank order.
    """

    payload: Payload
    send_counts: tuple[int, ...]
    recv_counts: tuple[int, ...]


@dataclass(frozen=True)
class AllGatherV:
    """Gather every rank's rows: rank ``r`` sends ``counts[r]`` rows (1-D tensors of that length).

    Every rank must know every count (exchanged in an earlier round, or fixed by the layout). The reduction receives
    one payload per rank, in rank order.
    """

    payload: Payload
    counts: tuple[int, ...]


Request = Union[AllReduce, AllGather, Broadcast, AllToAll, AllGatherV]  # noqa: UP007 (a runtime alias, also on Python 3.10)


# ----------------------------------------------------------------------------------------------------------------
# Declarations: what went out of the tensor an exchange compressed (``x``); error feedback keeps the rest
# ----------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Lossless:
    """``x`` went out whole and exactly (Identity, Zen, a dense stage): nothing is owed."""


@dataclass(frozen=True)
class SentExactly:
    """``x`` went out exactly at these flat ``indices`` and not at all elsewhere (top-k, random-k, DGC, ScaleCom)."""

    indices: Tensor


@dataclass(frozen=True)
class SentPayload:
    """``x`` went out as ``decompress(payload)``: this rank's own payload, as compressed (the single-round default).

    The driver decodes it straight into the residual's buffer, so the declaration costs no gradient-sized temporary.
    """

    payload: Payload


@dataclass(frozen=True)
class SentValue:
    """``x`` went out as this flat local ``value`` (PowerSGD's ``P Q^T``, TernGrad's ``s t``)."""

    value: Tensor


@dataclass(frozen=True)
class SentAt:
    """``x`` went out as ``values`` at ``indices`` (distinct), exactly at ``exactly``, and not at all elsewhere.

    AdaComp's signed scales; LGC's decoded values at the leader's indices and its innovation at its own.
    """

    indices: Tensor
    values: Tensor
    exactly: Tensor | None = None


@dataclass(frozen=True)
class OwedAt:
    """At ``indices`` (distinct) what is still owed is ``owed``; elsewhere nothing went out (LGC's own accounting)."""

    indices: Tensor
    owed: Tensor


Sent = Union[Lossless, SentExactly, SentPayload, SentValue, SentAt, OwedAt]  # noqa: UP007 (a runtime alias)
#: What :meth:`Compressor.exchange` is: yields requests (receiving their results) and one declaration of what it sent
#: (receiving ``None``), returns the flat average.
Exchange = Generator[Union[Request, Sent], Any, Tensor]  # noqa: UP007


class StepUpdates:
    """State changes of one step, written once the step is known to be finite on every rank.

    A compressor stages a change with :meth:`stage` (``target`` receives ``value`` at commit); the error-feedback
    residual is staged the same way by the driver. The communication hook shares one instance between all buckets
    of a step and commits after the last bucket, so a non-finite step leaves *all* state as it was; outside the
    hook every reduction commits its own.

    The decision needs no host synchronisation: on CUDA the commit is ``torch.where(ok, value, target)``; on the
    CPU, where reading a flag costs nothing, it is a plain copy when the step is finite, or no copy at all for
    values staged with ``swap=True`` (the two tensors exchange their storage).
    """

    def __init__(self) -> None:
        self._staged: list[tuple[Tensor, Tensor, bool]] = []
        self._ok: Tensor | None = None
        self._lock = threading.Lock()  # buckets finish on the collectives' threads

    def stage(self, target: Tensor, value: Tensor, *, swap: bool = False) -> None:
        """Write ``value`` into ``target`` at commit if the step is finite on every rank.

        ``value`` must not change afterwards: stage a buffer of its own, not a view of the gradient.

        Args:
            target: the state to update.
            value: its new value.
            swap: ``value`` is scratch the caller keeps for the next step's write and may get back holding anything
                (the error-feedback twin, a momentum's next buffer). Where the commit needs no condition (the CPU,
                or no check) the two tensors then exchange their storage instead of copying: a pass over the data
                saved per step. Views, and tensors that differ in shape, dtype, layout or device, are copied.
        """
        with self._lock:
            self._staged.append((target, value, swap))

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
        if ok is None or (ok.device.type == "cpu" and bool(ok)):  # a CPU flag: no device to wait for
            for target, value, swap in staged:
                if swap and _swappable(target, value):
                    _swap_storage(target, value)
                else:
                    target.copy_(value)
        elif ok.device.type != "cpu":
            for target, value, _ in staged:
                torch.where(ok, value, target, out=target)
        return ok


def _swappable(a: Tensor, b: Tensor) -> bool:
    """Whether ``a`` and ``b`` can exchange storage: whole, dense, alike, and not sharing memory."""
    return bool(
        a._base is None
        and b._base is None
        and a.shape == b.shape
        and a.dtype == b.dtype
        and a.device == b.device
        and a.is_contiguous()
        and b.is_contiguous()
        and a.storage_offset() == 0
        and b.storage_offset() == 0
        and a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
    )


def _swap_storage(a: Tensor, b: Tensor) -> None:
    """Exchange the storage of two tensors in place: every reference to ``a`` now reads what ``b`` held."""
    storage = a.untyped_storage()
    a.set_(b.untyped_storage(), 0, b.shape, b.stride())
    b.set_(storage, 0, a.shape, a.stride())


def nonfinite_flag(tensor: Tensor) -> Tensor:
    """``1`` if ``tensor`` holds a NaN or an infinity, else ``0`` (a 0-dim float32 tensor; one pass, no sync).

    A sum is non-finite exactly when an element is (or when finite elements overflow it, which no trainable gradient
    does in fp32 accumulation); it reads the tensor once, where ``isfinite(t).all()`` writes a mask first.
    """
    total = torch.sum(tensor, dtype=torch.promote_types(tensor.dtype, torch.float32))
    return (~torch.isfinite(total)).to(torch.float32)
