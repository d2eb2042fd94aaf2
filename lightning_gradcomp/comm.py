"""Collectives for compressed payloads: packing, byte accounting and rank-consistent ordering of rounds.

Every payload goes through a real ``torch.distributed`` collective, asynchronously, and the future chains keep the
backward pass overlapping with communication.

Why rounds get their own process groups: gloo (and NCCL) match collectives by the order in which each rank issues
them on a process group. A method with two dependent rounds (PowerSGD's P then Q) issues its second round from a
future callback, whose timing differs between ranks; if that callback issued on the same group as the next bucket's
first round, the order would differ between ranks. This is exactly how torch's own ``powerSGD_hook`` aborts under
gloo on multi-bucket models ("Received data size doesn't match expected size"). Here round ``k`` of every bucket is
issued on group ``k``, and :meth:`Comm.after` issues round ``k`` of bucket ``i`` only after round ``k`` of bucket
``i - 1`` was issued, so on every group every rank issues the same sequence.
"""

from __future__ import annotations

import atexit
import collections
import logging
import pickle
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Literal, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_gradcomp.telemetry import Telemetry

__all__ = ["CollectiveBackend", "Comm", "TorchCollectives", "gather_objects", "gather_rows", "release_round_groups"]

log = logging.getLogger(__name__)

Payload = tuple[Tensor, ...]
ReduceOpName = Literal["sum", "max"]
_ALIGN = 8  # bytes; keeps every packed tensor aligned for any dtype up to 8 bytes wide
# how long TorchCollectives.settle waits for the collectives of a failed step to end (once a peer's socket is gone they
# end within moments; a peer that hangs instead is caught by the process group's timeout)
SETTLE_S = 10.0
SETTLE_GRACE_S = 0.5  # then, after a failure, for the worker threads to run and drop the futures' callbacks
RELEASE_S = 5.0  # how long gather_rows waits for the process group's thread to let go of its tensors
HAND_OFF_S = 0.05  # how long hand_off_gil lets go of the GIL at the end of training


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


# torch 2.14 renamed all_gather_into_tensor to all_gather_single (the same collective; the old name warns there)
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

# Round groups live here, owned by the main thread, for as long as their base group lives. Collective callbacks run on
# gloo's worker threads and hold references to the compressor's context; if one of them dropped the last reference to
# a process group, the group's destructor would join its own worker thread and abort the process ("Resource deadlock
# avoided"). The registry also lets a re-wrapped DDP model reuse the groups instead of creating new ones.
_ROUND_GROUPS: dict[int, tuple[dist.ProcessGroup, list[dist.ProcessGroup]]] = {}
_RELEASE_AT_EXIT = False


def _is_alive(group: dist.ProcessGroup) -> bool:
    try:
        dist.get_process_group_ranks(group)
    except (KeyError, RuntimeError, ValueError):
        return False
    return True


def _round_groups(base: dist.ProcessGroup) -> list[dist.ProcessGroup]:
    entry = _ROUND_GROUPS.get(id(base))
    if entry is not None and entry[0] is base:
        return entry[1]
    for key, (old_base, _) in list(_ROUND_GROUPS.items()):
        if not _is_alive(old_base):  # destroyed with destroy_process_group(): release here, on the main thread
            _release(_ROUND_GROUPS.pop(key)[1])
    global _RELEASE_AT_EXIT
    if not _RELEASE_AT_EXIT:
        # Whatever is still registered at exit is released before the interpreter finalises (atexit handlers run
        # while it is fully alive), never by finalisation itself: see release_round_groups.
        atexit.register(release_round_groups)
        _RELEASE_AT_EXIT = True
    groups = [base]
    _ROUND_GROUPS[id(base)] = (base, groups)
    return groups


def _release(groups: list[dist.ProcessGroup]) -> None:
    for group in groups[1:]:  # round 0 is the caller's group (DDP's): never ours to destroy
        if _is_alive(group):
            try:
                dist.destroy_process_group(group)
            except (RuntimeError, ValueError) as error:  # already torn down with its peers: nothing left to free
                log.debug("gradcomp: could not destroy a round group: %s", error)
    # the list is shared by every TorchCollectives over this base group: emptying it drops all their references
    groups.clear()


def release_round_groups(base: dist.ProcessGroup | None = None) -> None:
    """Destroy the extra process groups made for later rounds (of ``base``, or of every group) and forget them.

    Call it on the main thread while the interpreter is alive: ``CompressedDDP.teardown`` does, and so does an
    ``atexit`` handler for whatever is left (raw-DDP users may call it before ``destroy_process_group``). Otherwise
    the registry keeps the groups alive into interpreter finalisation, where a gloo worker thread that still has to
    touch a Python object (a collective's tensor, a future's callback) tries to take the GIL and is ended by the
    interpreter inside a C++ destructor: ``terminate called without an active exception`` and SIGABRT at exit.
    Collectives issued later on ``base`` fail until a new :class:`TorchCollectives` is made (``attach`` again).
    """
    for key, (old_base, groups) in list(_ROUND_GROUPS.items()):
        if base is None or old_base is base:
            del _ROUND_GROUPS[key]
            _release(groups)


def gather_rows(tensor: Tensor, group: dist.ProcessGroup | None = None) -> Tensor:
    """All-gather ``tensor`` into a ``(world_size, *tensor.shape)`` tensor, and return once torch has let go of it.

    For the collectives a run issues last (the end-of-training summary, the replica checks). A process group's thread
    (gloo's worker, NCCL's watchdog) keeps its own reference to a collective's tensors until a moment after the
    collective completed, and dropping the reference to a tensor that Python has seen takes the GIL. If the main
    thread has reached interpreter finalisation by then, the thread cannot take the GIL, is ended inside a C++
    destructor and the process aborts after a successful run (``terminate called without an active exception``: a
    core dump shows ``~AsyncAllgatherWork`` on gloo's ``runLoop`` thread, stopped in ``take_gil``; about one run in
    ten on a loaded 2-core machine, after the summary's gather). Here the collective works on private tensors and
    this function waits, with the GIL released, until their Python objects are gone: the thread has released them.
    A plain ``all_gather`` cannot do that, since its caller holds the tensors.

    Args:
        tensor: this rank's part (any device the group's backend accepts); the same shape on every rank.
        group: the process group (default: the world). Without an initialised process group, ``tensor[None]``.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return tensor.detach().clone().unsqueeze(0)
    group = group if group is not None else dist.group.WORLD
    world_size = dist.get_world_size(group)
    mine = tensor.detach().reshape(-1).clone()
    out = torch.empty(world_size * mine.numel(), dtype=mine.dtype, device=mine.device)
    _all_gather_single(out, mine, group=group)
    rows = out.view(world_size, *tensor.shape).clone()
    held = [weakref.ref(mine), weakref.ref(out)]
    del mine, out  # from now on only the collective's own references keep them
    _wait_released(held)
    return rows


def gather_objects(obj: Any, device: torch.device | None = None) -> list[Any] | None:
    """``torch.distributed.gather_object`` to rank 0, safe as a run's last collective as :func:`gather_rows` is.

    Returns every rank's ``obj`` on rank 0 and ``None`` elsewhere. For the compressor state a checkpoint gathers from
    every rank, which may be the last thing a run does when no summary follows (``CompressedDDP(monitor=False)``).
    Pickled like ``gather_object``; only rank 0 receives the states. ``device``: where the bytes travel (the
    strategy's device: NCCL gathers no CPU tensor).
    """
    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    device = device if device is not None else torch.device("cpu")
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    sizes = gather_rows(torch.tensor([data.numel()], dtype=torch.int64, device=device))[:, 0].tolist()
    mine = torch.zeros(max(sizes), dtype=torch.uint8, device=device)
    mine[: data.numel()].copy_(data)
    rows = [torch.empty_like(mine) for _ in sizes] if dist.get_rank() == 0 else None
    dist.gather(mine, rows, dst=0)
    held = [weakref.ref(t) for t in [mine, *(rows or [])]]
    found = None if rows is None else [pickle.loads(row[:n].cpu().numpy().tobytes()) for row, n in zip(rows, sizes)]
    del mine, rows
    _wait_released(held)
    return found


def hand_off_gil(seconds: float = HAND_OFF_S) -> None:
    """Let go of the GIL for ``seconds``, so that torch's threads waiting for it can finish while the interpreter lives.

    Every collective issued during a backward pass keeps, in its thread-local state, the context that autograd stashes
    there (a ``contextvars.Context``, a Python object), and the process group's thread that ran it drops it when it is
    done, which takes the GIL. If that thread gets the GIL only once the main thread has reached interpreter
    finalisation, it is ended inside the C++ destructor and the process aborts after a successful run (``terminate
    called without an active exception``; a core dump shows ``~AsyncAllreduceWork``, ``~ThreadLocalState`` and a
    ``SafePyObject`` decref of that context in ``take_gil`` on gloo's ``runLoop`` thread, with the main thread in
    ``Py_FinalizeEx``'s garbage collection). Seen about once in 40 runs of Lightning's plain ``DDPStrategy`` with a
    static graph on torch 2.15, where no collective was issued after training; why the thread had not had the GIL
    earlier is not established. Sleeping releases the GIL and wakes the threads waiting for it.
    ``CompressedDDP.teardown`` calls it after the last collective of a run.
    """
    time.sleep(seconds)


def _wait_released(held: list[weakref.ref]) -> None:
    deadline = time.monotonic() + RELEASE_S
    while any(ref() is not None for ref in held) and time.monotonic() < deadline:
        time.sleep(0.001)  # releases the GIL, which the thread needs to drop its references


class TorchCollectives:
    """:class:`CollectiveBackend` on ``torch.distributed`` process groups, one group per round.

    Round 0 uses ``process_group`` (DDP's own). Later rounds use groups made with :func:`torch.distributed.new_group`
    over the same ranks; :meth:`ensure_rounds` creates them and, like every ``new_group`` call, must be called by all
    ranks at the same point of the program.
    """

    def __init__(self, process_group: dist.ProcessGroup | None = None) -> None:
        group = process_group if process_group is not None else dist.group.WORLD
        self._groups = _round_groups(group)
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self._running: collections.deque[torch.futures.Future] = collections.deque()  # see settle()
        self._running_lock = threading.Lock()  # later rounds are issued from the collectives' worker threads

    @property
    def num_rounds(self) -> int:
        """How many rounds have a process group."""
        return len(self._groups)

    def ensure_rounds(self, rounds: int) -> None:
        """Create process groups until ``rounds`` rounds have one (a collective call on every rank)."""
        ranks = dist.get_process_group_ranks(self._groups[0])
        while len(self._groups) < rounds:
            self._groups.append(dist.new_group(ranks=ranks))

    def _group(self, round: int) -> dist.ProcessGroup:
        if round >= len(self._groups):
            raise RuntimeError(
                f"A compressor issued a collective for round {round} but only {len(self._groups)} round(s) have a"
                " process group; CompressedDDP creates them between steps (call `ensure_rounds` on every rank when"
                " using the hook without the strategy)."
            )
        return self._groups[round]

    def all_reduce(self, tensor: Tensor, round: int, op: ReduceOpName) -> torch.futures.Future[Tensor]:
        """Start an in-place all-reduce of ``tensor`` on round ``round``'s group."""
        reduce_op = dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX
        work = dist.all_reduce(tensor, op=reduce_op, group=self._group(round), async_op=True)
        return self._track(work.get_future().then(lambda fut: _value_then(fut, tensor)))

    def all_gather(self, tensor: Tensor, round: int) -> torch.futures.Future[Tensor]:
        """Start an all-gather of ``tensor`` on round ``round``'s group."""
        # the output is the concatenation along dim 0 (what gloo and NCCL both expect), viewed per rank afterwards
        out = torch.empty(self.world_size * tensor.numel(), dtype=tensor.dtype, device=tensor.device)
        work = _all_gather_single(out, tensor.reshape(-1), group=self._group(round), async_op=True)
        result = out.view(self.world_size, *tensor.shape)
        return self._track(work.get_future().then(lambda fut: _value_then(fut, result)))

    def broadcast(self, tensor: Tensor, src: int, round: int) -> torch.futures.Future[Tensor]:
        """Start an in-place broadcast of ``tensor`` from group rank ``src`` on round ``round``'s group."""
        group = self._group(round)
        global_src = dist.get_global_rank(group, src) if group is not dist.group.WORLD else src
        work = dist.broadcast(tensor, src=global_src, group=group, async_op=True)
        return self._track(work.get_future().then(lambda fut: _value_then(fut, tensor)))

    def all_to_all(
        self, tensor: Tensor, send_splits: Sequence[int], recv_splits: Sequence[int], round: int
    ) -> torch.futures.Future[Tensor]:
        """Start an all-to-all with variable splits (``all_to_all_single``: gloo and NCCL) on round ``round``."""
        out = torch.empty(sum(recv_splits), dtype=tensor.dtype, device=tensor.device)
        work = dist.all_to_all_single(out, tensor, output_split_sizes=list(recv_splits),
                                      input_split_sizes=list(send_splits), group=self._group(round),
                                      async_op=True)  # fmt: skip
        return self._track(work.get_future().then(lambda fut: _value_then(fut, out)))

    def _track(self, future: torch.futures.Future) -> torch.futures.Future:
        # the collectives that have not ended yet, oldest first (ended ones are dropped as new ones start: no host
        # synchronisation, the deque stays as long as one step's collectives)
        with self._running_lock:
            while self._running and self._running[0].done():
                self._running.popleft()
            self._running.append(future)
        return future

    def settle(self, failed: bool = False, timeout_s: float = SETTLE_S) -> None:
        """After a failed collective: wait until the collectives' worker threads are done with this module's callbacks.

        A step that failed because a rank died reaches DDP through its first failed collective while others may still
        be queued on gloo's worker threads. Each ends with an error moments later and runs its chain of callbacks (this
        package's Python functions) on the worker thread, which also drops its last references to them; a collective
        marks its future done *before* that chain runs. If the chain runs during interpreter finalisation, the thread
        cannot take the GIL, is ended inside C++ and the process aborts at exit (``terminate called after throwing an
        instance of 'gloo::IoException'`` or ``... without an active exception``; about one run in ten with a rank
        SIGKILLed on torch 2.15). Plain DDP's C++ hook has no Python callbacks, so this is ours to prevent.

        ``CompressedDDP.teardown`` calls this on the main thread while the interpreter lives: it waits (GIL released,
        at most ``timeout_s``) for every collective issued here to end, then, if training ``failed`` or one of them
        did, for :data:`SETTLE_GRACE_S` more, in which the worker threads finish their chains. After successful
        training every collective has ended without error and it returns at once.
        """
        with self._running_lock:
            issued, self._running = list(self._running), collections.deque()
        running = [f for f in issued if not f.done()]
        deadline = time.monotonic() + timeout_s
        while running and time.monotonic() < deadline:
            time.sleep(0.01)
            running = [f for f in running if not f.done()]
        if running:
            log.warning(
                "gradcomp: %d collectives were still running %.0f s after training stopped; if they end during"
                " interpreter shutdown the process may abort at exit",
                len(running),
                timeout_s,
            )
        elif failed or any(_failed(f) for f in issued):
            time.sleep(SETTLE_GRACE_S)


def _failed(future: torch.futures.Future) -> bool:
    try:
        future.value()
    except Exception:  # noqa: BLE001 (any error of the collective or of its callback)
        return True
    return False


def _value_then(fut: torch.futures.Future, result: Tensor) -> Tensor:
    fut.value()  # re-raises a failed collective instead of handing on stale memory
    return result


class Comm:
    """The collectives a compressor uses: packed payloads, bytes counted, later rounds ordered.

    Args:
        backend: where the collectives run.
        telemetry: where bytes and encode/decode times are counted.
        device: the gradients' device (futures made here carry it, as CUDA futures must).
    """

    def __init__(self, backend: CollectiveBackend, telemetry: Telemetry, device: torch.device) -> None:
        self.backend = backend
        self.telemetry = telemetry
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
        the whole payload costs one collective. The future resolves to the reduced tensors, shaped as given.
        """
        payload = tuple(payload)
        nbytes = sum(t.numel() * t.element_size() for t in payload)
        self.telemetry.add_sent(nbytes)
        self.telemetry.add_received(2 * (self.world_size - 1) * nbytes // self.world_size)
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, t in enumerate(payload):
            by_dtype.setdefault(t.dtype, []).append(i)
        futures: list[torch.futures.Future] = []
        unpackers: list[Callable[[Tensor], list[tuple[int, Tensor]]]] = []
        for positions in by_dtype.values():
            if len(positions) == 1:
                i = positions[0]
                futures.append(self.backend.all_reduce(payload[i], round, op))
                unpackers.append(lambda buf, i=i: [(i, buf)])
                continue
            parts = [payload[i] for i in positions]
            buffer = torch.cat([p.reshape(-1) for p in parts])
            futures.append(self.backend.all_reduce(buffer, round, op))
            unpackers.append(lambda buf, positions=positions, parts=parts: _split_like(buf, positions, parts))
        if len(futures) == 1:
            return futures[0].then(lambda fut: _ordered(unpackers[0](fut.value()), len(payload)))

        def unpack_all(fut: torch.futures.Future[list[Tensor]]) -> Payload:
            pieces: list[tuple[int, Tensor]] = []
            for unpack, value in zip(unpackers, fut.value()):
                pieces.extend(unpack(value))
            return _ordered(pieces, len(payload))

        return when_all(futures, self.device).then(unpack_all)

    def all_reduce_sparse(self, tensor: Tensor, round: int = 0) -> torch.futures.Future[Tensor]:
        """Sum the sparse COO ``tensor`` (coalesced) across ranks with the backend's sparse all-reduce, in place.

        What DDP does with a sparse gradient (``nn.Embedding(sparse=True)``); gloo implements it as an all-gather of
        every rank's rows, summed on every rank (NCCL has no sparse all-reduce, under plain DDP either). Counted as
        sent: the tensor's indices and values (gloo adds a few bytes of sizes); as received, ``n - 1`` times that, as
        if every rank sent as many rows (the other ranks' counts are not exchanged here).
        """
        nbytes = tensor._indices().nbytes + tensor._values().nbytes
        self.telemetry.add_sent(nbytes)
        self.telemetry.add_received((self.world_size - 1) * nbytes)
        return self.backend.all_reduce(tensor, round, "sum")

    def all_gather(self, payload: Sequence[Tensor], round: int = 0) -> torch.futures.Future[list[Payload]]:
        """Gather every rank's ``payload`` in one collective (tensors packed byte-wise, 8-byte aligned).

        The future resolves to one payload per rank, in rank order. Payload shapes must agree across ranks.
        """
        payload = tuple(payload)
        if len(payload) == 1:
            (single,) = payload
            self.telemetry.add_sent(single.numel() * single.element_size())
            self.telemetry.add_received((self.world_size - 1) * single.numel() * single.element_size())
            return self.backend.all_gather(single, round).then(lambda fut: [(row,) for row in fut.value()])
        buffer, layout = _pack_bytes(payload)
        self.telemetry.add_sent(buffer.numel())
        self.telemetry.add_received((self.world_size - 1) * buffer.numel())
        return self.backend.all_gather(buffer, round).then(
            lambda fut: [_unpack_bytes(row, layout) for row in fut.value()]
        )

    def broadcast(self, payload: Sequence[Tensor], src: int, round: int = 0) -> torch.futures.Future[Payload]:
        """Broadcast ``payload`` from rank ``src`` in one collective; only ``src`` counts the bytes as sent."""
        payload = tuple(payload)
        buffer, layout = _pack_bytes(payload)
        if self.rank == src:
            self.telemetry.add_sent(buffer.numel())
        else:
            self.telemetry.add_received(buffer.numel())
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
        me = self.rank
        self.telemetry.add_sent((sum(send_counts) - send_counts[me]) * row_bytes)
        self.telemetry.add_received((sum(recv_counts) - recv_counts[me]) * row_bytes)
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
        self.telemetry.add_sent(width)
        self.telemetry.add_received((self.world_size - 1) * width)

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
