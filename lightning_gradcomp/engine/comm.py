"""Collectives for compressed payloads: packing, byte accounting and rank-consistent ordering of rounds.

Every payload goes through a real ``torch.distributed`` collective, asynchronously, and the future chains keep the
backward pass overlapping with communication.

Why rounds get their own process groups: gloo (and NCCL) match collectives by the order in which each rank issues
them on a process group. A method with two dependent rounds (PowerSGD's P then Q) issues its second round from a
future callback, whose timing differs between ranks; if that callback issued on the same group as the next bucket's
first round, the order would differ between ranks. This is exactly how torch's own ``powerSGD_hook`` aborts under
gloo on multi-bucket models ("Received data size doesn't match expected size"). Here round ``k`` of every bucket is
issued on group ``k``, and :meth:`Comm.after` issues round ``k`` of bucket ``i`` only after round ``k`` of bucket
``i - 1`` was issued, so on every group every rank issues the same sequence. The process groups themselves, their
lifetime and a safe exit are :mod:`lightning_gradcomp.engine.collectives`'s.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, Literal, Protocol

import torch
from torch import Tensor

from lightning_gradcomp.engine import wire
from lightning_gradcomp.engine.telemetry import Telemetry

__all__ = ["CollectiveBackend", "Comm", "when_all"]

Payload = tuple[Tensor, ...]
ReduceOpName = Literal["sum", "max"]
_ALIGN = 8  # bytes; keeps every packed tensor aligned for any dtype up to 8 bytes wide


class CollectiveBackend(Protocol):
    """The asynchronous collectives :class:`Comm` builds on (torch.distributed in training, simulated in tests)."""

    rank: int
    world_size: int

    def all_reduce(self, tensor: Tensor, round: int, op: ReduceOpName) -> torch.futures.Future[Tensor]:
        """Reduce ``tensor`` in place across ranks; the future resolves to ``tensor``."""

    def all_gather(self, tensor: Tensor, round: int) -> torch.futures.Future[Tensor]:
        """Gather ``tensor`` from every rank; the future resolves to a ``(world_size, *tensor.shape)`` tensor."""

    def broadcast(self, tensor: Tensor, src: int, round: int) -> torch.futures.Future[Tensor]:
        """Broadcast ``tensor`` from rank ``src`` in place; the future resolves to ``tensor``."""

    def all_to_all(
        self, tensor: Tensor, send_splits: Sequence[int], recv_splits: Sequence[int], round: int
    ) -> torch.futures.Future[Tensor]:
        """Send ``tensor``'s consecutive chunks of ``send_splits[d]`` elements to rank ``d`` (1-D tensors).

        The future resolves to a 1-D tensor of ``sum(recv_splits)`` elements: the chunk every rank sent here, in rank
        order. ``send_splits[d]`` on rank ``r`` must equal ``recv_splits[r]`` on rank ``d``.
        """


class Comm:
    """The collectives a compressor uses: packed payloads, bytes counted, later rounds ordered.

    Each collective counts what this rank moves on the wire by its standard algorithm
    (:mod:`lightning_gradcomp.engine.wire`), from the buffer it hands the backend, so what the telemetry logs is what a
    compressor's declared byte model predicts (:meth:`Compressor.wire_bytes
    <lightning_gradcomp.compressors.Compressor.wire_bytes>`).

    Args:
        backend: where the collectives run.
        telemetry: where bytes and encode/decode times are counted.
        device: the gradients' device (futures made here carry it, as CUDA futures must).
    """

    def __init__(self, backend: CollectiveBackend, telemetry: Telemetry, device: torch.device) -> None:
        self.backend = backend
        self.telemetry = telemetry
        telemetry.world_size = backend.world_size  # plain DDP's ring, the comparison, at this size
        self.device = device
        self._last_issue: dict[int, torch.futures.Future[None]] = {}

    @property
    def rank(self) -> int:
        """This process's rank."""
        return self.backend.rank

    @property
    def world_size(self) -> int:
        """The number of ranks."""
        return self.backend.world_size

    def new_future(self) -> torch.futures.Future:
        """An empty future that carries this device's streams (plain CPU future on CPU)."""
        if self.device.type == "cuda":
            return torch.futures.Future(devices=[self.device])
        return torch.futures.Future()

    def timed(self, phase: Literal["encode", "decode"]):  # noqa: ANN201 (context manager)
        """Context manager that adds the time spent inside it to ``phase``."""
        return self.telemetry.timed(phase, self.device)

    # ------------------------------------------------------------------------------------------------------------
    # Collectives
    # ------------------------------------------------------------------------------------------------------------
    def all_reduce(
        self, payload: Sequence[Tensor], round: int = 0, op: ReduceOpName = "sum"
    ) -> torch.futures.Future[Payload]:
        """Reduce every tensor of ``payload`` across ranks; one collective per dtype.

        A single tensor is reduced in place (no copy); several tensors of one dtype are packed into one buffer so
        the whole payload costs one collective (counted as a ring all-reduce of it). The future resolves to the
        reduced tensors, shaped as given.
        """
        payload = tuple(payload)
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, t in enumerate(payload):
            by_dtype.setdefault(t.dtype, []).append(i)
        futures: list[torch.futures.Future] = []
        unpackers: list[Callable[[Tensor], list[tuple[int, Tensor]]]] = []
        for positions in by_dtype.values():
            nbytes = sum(payload[i].numel() * payload[i].element_size() for i in positions)
            self.telemetry.add_collective(nbytes, wire.all_reduce(nbytes, self.world_size))
            if len(positions) == 1:
                i = positions[0]
                futures.append(self.backend.all_reduce(payload[i], round, op))
                unpackers.append(functools.partial(_alone, i))
                continue
            parts = [payload[i] for i in positions]
            buffer = torch.cat([p.reshape(-1) for p in parts])
            futures.append(self.backend.all_reduce(buffer, round, op))
            unpackers.append(functools.partial(_split_like, positions=positions, parts=parts))
        if len(futures) == 1:
            return futures[0].then(lambda fut: _ordered(unpackers[0](fut.value()), len(payload)))

        def unpack_all(fut: torch.futures.Future[list[Tensor]]) -> Payload:
            pieces: list[tuple[int, Tensor]] = []
            for unpack, value in zip(unpackers, fut.value()):
                pieces.extend(unpack(value))
            return _ordered(pieces, len(payload))

        return when_all(futures, self.device).then(unpack_all)

    def mean(self, flats: Sequence[Tensor], workers: int | None = None) -> torch.futures.Future[Payload]:
        """The mean over ``workers`` (default: every rank) of each of ``flats``, in place: the one mean all-reduce.

        Each tensor is divided by ``workers``, then summed in one all-reduce per dtype (:meth:`all_reduce`); the
        telemetry counts the tensors as one bucket plain DDP would have all-reduced, so the ratio against DDP holds.
        """
        flats = tuple(flats)
        divisor = self.world_size if workers is None else workers
        self.telemetry.add_bucket(sum(flat.numel() * flat.element_size() for flat in flats))
        return self.all_reduce([flat.div_(divisor) for flat in flats])

    def all_reduce_sparse(self, tensor: Tensor, round: int = 0) -> torch.futures.Future[Tensor]:
        """Sum the sparse COO ``tensor`` (coalesced) across ranks with the backend's sparse all-reduce, in place.

        What DDP does with a sparse gradient (``nn.Embedding(sparse=True)``); gloo implements it as an all-gather of
        every rank's rows, summed on every rank (NCCL has no sparse all-reduce, under plain DDP either). Counted as an
        all-gather of the tensor's indices and values (gloo adds a few bytes of sizes), as if every rank sent as many
        rows (the other ranks' counts are not exchanged here).
        """
        nbytes = tensor._indices().nbytes + tensor._values().nbytes
        self.telemetry.add_collective(nbytes, wire.sparse_all_reduce(nbytes, self.world_size))
        return self.backend.all_reduce(tensor, round, "sum")

    def all_gather(self, payload: Sequence[Tensor], round: int = 0) -> torch.futures.Future[list[Payload]]:
        """Gather every rank's ``payload`` in one collective (tensors packed byte-wise, 8-byte aligned).

        The future resolves to one payload per rank, in rank order. Payload shapes must agree across ranks.
        """
        payload = tuple(payload)
        if len(payload) == 1:
            (single,) = payload
            nbytes = single.numel() * single.element_size()
            self.telemetry.add_collective(nbytes, wire.all_gather(nbytes, self.world_size))
            return self.backend.all_gather(single, round).then(lambda fut: [(row,) for row in fut.value()])
        buffer, layout = _pack_bytes(payload)
        self.telemetry.add_collective(buffer.numel(), wire.all_gather(buffer.numel(), self.world_size))
        return self.backend.all_gather(buffer, round).then(
            lambda fut: [_unpack_bytes(row, layout) for row in fut.value()]
        )

    def broadcast(self, payload: Sequence[Tensor], src: int, round: int = 0) -> torch.futures.Future[Payload]:
        """Broadcast ``payload`` from rank ``src`` in one collective, counted as this rank's part of a binomial tree."""
        payload = tuple(payload)
        buffer, layout = _pack_bytes(payload)
        self.telemetry.add_collective(
            buffer.numel() if self.rank == src else 0, wire.broadcast(buffer.numel(), self.world_size, self.rank, src)
        )
        return self.backend.broadcast(buffer, src, round).then(lambda fut: _unpack_bytes(fut.value(), layout))

    def all_to_all(
        self, payload: Sequence[Tensor], send_counts: Sequence[int], recv_counts: Sequence[int], round: int = 0
    ) -> torch.futures.Future[list[Payload]]:
        """Send rows ``[sum(send_counts[:d]), sum(send_counts[:d + 1]))`` of every tensor of ``payload`` to rank ``d``.

        ``payload`` holds 1-D tensors of ``sum(send_counts)`` elements each (an index and a value per row, say); every
        row travels as its bytes, the tensors' bytes side by side, in one ``all_to_all_single``. ``recv_counts[s]`` is
        the number of rows rank ``s`` sends here; the future resolves to one payload per source rank, in rank order.
        The bytes counted as sent (received) are those of the rows sent to (received from) the other ranks.
        """
        payload = tuple(payload)
        rows, row_bytes = _pack_rows(payload)
        if rows.shape[0] != sum(send_counts):
            raise ValueError(f"all_to_all: the payload has {rows.shape[0]} rows, the send counts {sum(send_counts)}.")
        moved = wire.all_to_all([c * row_bytes for c in send_counts], [c * row_bytes for c in recv_counts], self.rank)
        self.telemetry.add_collective(sum(send_counts) * row_bytes, moved)
        recv_counts = list(recv_counts)
        future = self.backend.all_to_all(
            rows.reshape(-1), [c * row_bytes for c in send_counts], [c * row_bytes for c in recv_counts], round
        )
        return future.then(lambda fut: _unpack_rows_per_rank(fut.value(), recv_counts, row_bytes, payload))

    def all_gather_v(
        self, payload: Sequence[Tensor], counts: Sequence[int], round: int = 0
    ) -> torch.futures.Future[list[Payload]]:
        """Gather every rank's rows; rank ``r`` holds ``counts[r]`` of them, and every rank knows every count.

        Rows are 1-D tensors of one length, as in :meth:`all_to_all`. One all-gather of the rows' bytes padded to the
        largest count (the padding moves, so it is counted as sent), trimmed on arrival. The future resolves to one
        payload per rank, in rank order.
        """
        payload = tuple(payload)
        rows, row_bytes = _pack_rows(payload)
        counts = list(counts)
        if rows.shape[0] != counts[self.rank]:
            raise ValueError(f"all_gather_v: this rank has {rows.shape[0]} rows, its count says {counts[self.rank]}.")
        width = max(counts) * row_bytes if counts else 0
        buffer = torch.zeros(width, dtype=torch.uint8, device=rows.device)
        buffer[: rows.numel()].copy_(rows.reshape(-1))
        self.telemetry.add_collective(width, wire.all_gather(width, self.world_size))

        def unpack(fut: torch.futures.Future[Tensor]) -> list[Payload]:
            gathered = fut.value()
            return [_unpack_rows(gathered[r, : c * row_bytes], c, row_bytes, payload) for r, c in enumerate(counts)]

        return self.backend.all_gather(buffer, round).then(unpack)

    # ------------------------------------------------------------------------------------------------------------
    # Ordered multi-round chains
    # ------------------------------------------------------------------------------------------------------------
    def after(
        self,
        fut: torch.futures.Future,
        issue: Callable[[torch.futures.Future], torch.futures.Future],
        round: int,
    ) -> torch.futures.Future:
        """Run ``issue(fut)`` once ``fut`` is done, issuing round ``round`` in bucket order; return its result.

        ``issue`` computes the next round's payload and returns the future of the collective it started. It runs
        only after the ``issue`` of the previous bucket for the same round has returned, so the collectives of
        round ``round`` reach its process group in the same order on every rank. Call this from the hook (in bucket
        order), never from a callback. Errors in ``fut`` or ``issue`` fail the returned future, so DDP raises
        instead of waiting forever.
        """
        result = self.new_future()
        issued: torch.futures.Future[None] = torch.futures.Future()
        previous = self._last_issue.get(round)
        self._last_issue[round] = issued
        gate = torch.futures.collect_all([fut] if previous is None else [fut, previous])

        def start(_: torch.futures.Future) -> None:
            try:
                fut.wait()  # in this callback's stream, wait for what wrote ``fut``'s tensors (no host sync)
                inner = issue(fut)
            except BaseException as error:  # noqa: BLE001 (forwarded to the waiting DDP reducer)
                issued.set_result(None)
                result.set_exception(error)
                return
            issued.set_result(None)
            inner.then(lambda done: _forward(done, result))

        gate.then(start)
        return result


def when_all(futures: list[torch.futures.Future], device: torch.device) -> torch.futures.Future[list[Any]]:
    """The values of ``futures`` once all are done, ordered for the device like each of them.

    ``torch.futures.collect_all`` returns a future without devices: a callback chained on it reads its children's
    CUDA tensors without waiting for the streams that wrote them (the children's ``.then`` callbacks run on side
    streams). Here each child is ``wait()``-ed inside the callback, which makes the current stream wait for its
    events (no host synchronisation), and the result is set on a future that carries the device, so whatever is
    chained next waits too. Found by two ranks sharing a GPU over gloo, whose replicas drifted apart without it.
    """
    if device.type != "cuda":
        return torch.futures.collect_all(futures).then(lambda fut: [done.value() for done in fut.value()])
    result: torch.futures.Future = torch.futures.Future(devices=[device])

    def finish(fut: torch.futures.Future) -> None:
        try:
            values = [done.wait() for done in fut.value()]
        except BaseException as error:  # noqa: BLE001 (forwarded to the waiting DDP reducer)
            result.set_exception(error)
            return
        result.set_result(values)

    torch.futures.collect_all(futures).then(finish)
    return result


def _forward(done: torch.futures.Future, result: torch.futures.Future) -> None:
    try:
        value = done.value()
    except BaseException as error:  # noqa: BLE001
        result.set_exception(error)
        return
    result.set_result(value)


def _ordered(pieces: list[tuple[int, Tensor]], n: int) -> Payload:
    out: list[Tensor | None] = [None] * n
    for i, t in pieces:
        out[i] = t
    return tuple(out)  # type: ignore[arg-type]


def _alone(i: int, buffer: Tensor) -> list[tuple[int, Tensor]]:
    return [(i, buffer)]


def _split_like(buffer: Tensor, positions: list[int], parts: list[Tensor]) -> list[tuple[int, Tensor]]:
    pieces, offset = [], 0
    for i, part in zip(positions, parts):
        n = part.numel()
        pieces.append((i, buffer[offset : offset + n].view(part.shape)))
        offset += n
    return pieces


def _pack_rows(payload: Payload) -> tuple[Tensor, int]:
    """The rows of 1-D tensors of one length as a ``(rows, row_bytes)`` uint8 matrix: each row's bytes side by side."""
    if not payload or any(t.dim() != 1 or t.numel() != payload[0].numel() for t in payload):
        raise ValueError("Row payloads are non-empty tuples of 1-D tensors of one length.")
    n = payload[0].numel()
    columns = [t.contiguous().view(torch.uint8).view(n, t.element_size()) for t in payload]
    rows = columns[0] if len(columns) == 1 else torch.cat(columns, dim=1)
    return rows, rows.shape[1]


def _unpack_rows(buffer: Tensor, count: int, row_bytes: int, like: Payload) -> Payload:
    """The tensors of ``count`` rows packed by :func:`_pack_rows` (shaped and typed like ``like``'s tensors)."""
    rows = buffer.view(count, row_bytes)
    out, at = [], 0
    for t in like:
        width = t.element_size()
        out.append(rows[:, at : at + width].contiguous().view(t.dtype).view(count))
        at += width
    return tuple(out)


def _unpack_rows_per_rank(buffer: Tensor, counts: list[int], row_bytes: int, like: Payload) -> list[Payload]:
    out, at = [], 0
    for count in counts:
        out.append(_unpack_rows(buffer[at : at + count * row_bytes], count, row_bytes, like))
        at += count * row_bytes
    return out


_Layout = list[tuple[int, int, torch.dtype, torch.Size]]


def _pack_bytes(payload: Payload) -> tuple[Tensor, _Layout]:
    """Pack tensors of any dtypes into one uint8 buffer, each at an 8-byte aligned offset."""
    layout: _Layout = []
    total = 0
    for t in payload:
        nbytes = t.numel() * t.element_size()
        layout.append((total, nbytes, t.dtype, t.shape))
        total += -(-nbytes // _ALIGN) * _ALIGN
    device = payload[0].device if payload else torch.device("cpu")
    buffer = torch.zeros(total, dtype=torch.uint8, device=device) if total else torch.empty(0, dtype=torch.uint8)
    for (offset, nbytes, _, _), t in zip(layout, payload):
        if nbytes:
            buffer[offset : offset + nbytes].copy_(t.contiguous().reshape(-1).view(torch.uint8))
    return buffer, layout


def _unpack_bytes(buffer: Tensor, layout: _Layout) -> Payload:
    """Views of the tensors packed by :func:`_pack_bytes` (no copy)."""
    return tuple(buffer[offset : offset + nbytes].view(dtype).view(shape) for offset, nbytes, dtype, shape in layout)
