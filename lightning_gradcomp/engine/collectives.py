"""torch.distributed process groups for the rounds of a compressed exchange: their lifetime, and a safe exit.

:class:`TorchCollectives` is :class:`~lightning_gradcomp.engine.comm.CollectiveBackend` on ``torch.distributed``, one
process group per round (why: see :mod:`lightning_gradcomp.engine.comm`). The groups of later rounds are kept in a
registry owned by the main thread and released there (:func:`release_round_groups`). The rest of this module keeps a
finished or failed run from aborting at exit: a process group's thread that still holds a Python object when the
interpreter finalises cannot take the GIL and ends the process inside a C++ destructor. :func:`gather_rows` and
:func:`gather_objects` are collectives safe as a run's last, :func:`hand_off_gil` lets torch's threads finish, and
:meth:`TorchCollectives.settle` waits for the callbacks of a failed step.
"""

from __future__ import annotations

import atexit
import collections
import datetime
import logging
import pickle
import threading
import time
import weakref
import zlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_gradcomp.engine.comm import ReduceOpName

__all__ = ["TorchCollectives", "gather_objects", "gather_rows", "hand_off_gil", "release_round_groups", "side_group"]

log = logging.getLogger(__name__)

# how long TorchCollectives.settle waits for the collectives of a failed step to end (once a peer's socket is gone they
# end within moments; a peer that hangs instead is caught by the process group's timeout)
SETTLE_S = 10.0
SETTLE_GRACE_S = 0.5  # then, after a failure, for the worker threads to run and drop the futures' callbacks
RELEASE_S = 5.0  # how long gather_rows waits for the process group's thread to let go of its tensors
HAND_OFF_S = 0.05  # how long hand_off_gil lets go of the GIL at the end of training

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


def _destroy(group: dist.ProcessGroup) -> None:
    if _is_alive(group):
        try:
            dist.destroy_process_group(group)
        except (RuntimeError, ValueError) as error:  # already torn down with its peers: nothing left to free
            log.debug("gradcomp: could not destroy a process group of ours: %s", error)


def _release(groups: list[dist.ProcessGroup]) -> None:
    for group in groups[1:]:  # round 0 is the caller's group (DDP's): never ours to destroy
        _destroy(group)
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


def _timeout_of(group: dist.ProcessGroup) -> datetime.timedelta | None:
    """The timeout ``group`` was made with, for the groups made beside it.

    ``new_group`` without a timeout takes the backend's default (30 minutes for gloo), not what
    ``init_process_group`` (a strategy's ``timeout``) was given: a rank that stops answering would hold a collective
    on such a group that long. ``None`` where torch does not say (``new_group`` then keeps its default).
    """
    device = torch.device("cuda") if dist.get_backend(group) == "nccl" else torch.device("cpu")
    try:
        return group._get_backend(device).options._timeout
    except (AttributeError, RuntimeError):
        return None


# Side groups: one per base group, created once and reused by every later fit in the process (a fit's setup must not
# leave a group behind each time), released on the main thread at exit like the round groups.
_SIDE_GROUPS: dict[int, tuple[dist.ProcessGroup, dist.ProcessGroup]] = {}
_SIDE_RELEASE_AT_EXIT = False


def side_group(base: dist.ProcessGroup | None = None) -> dist.ProcessGroup:
    """A second process group over ``base``'s ranks (default: the world), for collectives that must not share its queue.

    A backend runs one group's collectives in the order they were issued. Lightning's training loop broadcasts a
    one-element flag on the default group at the start of every step (whether a rank received SIGTERM), so an
    exchange left running on that group across inner steps (Streaming DiLoCo's overlap) would make the next step's
    broadcast wait for the whole exchange: the overlap would hide nothing. On a group of its own the exchange runs
    beside the loop's broadcasts. The first call creates the group (like every ``new_group``, a collective call:
    every rank at the same point); later calls return it while it and ``base`` live.
    """
    base = base if base is not None else _world()
    entry = _SIDE_GROUPS.get(id(base))
    if entry is not None and entry[0] is base and _is_alive(entry[1]):
        return entry[1]
    for key, (old_base, old) in list(_SIDE_GROUPS.items()):
        if not (_is_alive(old_base) and _is_alive(old)):  # destroyed with destroy_process_group(): forget here
            del _SIDE_GROUPS[key]
    group = dist.new_group(ranks=dist.get_process_group_ranks(base), timeout=_timeout_of(base))
    if not isinstance(group, dist.ProcessGroup):  # only a rank outside the ranks gets none: never here
        raise RuntimeError("torch.distributed.new_group over every rank of a group gave this rank no process group.")
    _SIDE_GROUPS[id(base)] = (base, group)
    global _SIDE_RELEASE_AT_EXIT
    if not _SIDE_RELEASE_AT_EXIT:
        # on the main thread while the interpreter lives: see release_round_groups
        atexit.register(_release_side_groups)
        _SIDE_RELEASE_AT_EXIT = True
    return group


def _release_side_groups() -> None:
    for key, (_, group) in list(_SIDE_GROUPS.items()):
        del _SIDE_GROUPS[key]
        release_round_groups(group)
        _destroy(group)


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
        group = process_group if process_group is not None else _world()
        self._groups = _round_groups(group)
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self._running: collections.deque[torch.futures.Future] = collections.deque()  # see settle()
        self._running_lock = threading.Lock()  # later rounds are issued from the collectives' worker threads

    def ensure_rounds(self, rounds: int) -> None:
        """Create process groups until ``rounds`` rounds have one (a collective call on every rank)."""
        ranks = dist.get_process_group_ranks(self._groups[0])
        while len(self._groups) < rounds:
            group = dist.new_group(ranks=ranks, timeout=_timeout_of(self._groups[0]))
            if not isinstance(group, dist.ProcessGroup):  # only a rank outside ``ranks`` gets none: never here
                raise RuntimeError(f"torch.distributed.new_group({ranks}) gave this rank no process group.")
            self._groups.append(group)

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
        return self._track(_future(work).then(lambda fut: _value_then(fut, tensor)))

    def all_gather(self, tensor: Tensor, round: int) -> torch.futures.Future[Tensor]:
        """Start an all-gather of ``tensor`` on round ``round``'s group."""
        # the output is the concatenation along dim 0 (what gloo and NCCL both expect), viewed per rank afterwards
        out = torch.empty(self.world_size * tensor.numel(), dtype=tensor.dtype, device=tensor.device)
        work = _all_gather_single(out, tensor.reshape(-1), group=self._group(round), async_op=True)
        result = out.view(self.world_size, *tensor.shape)
        return self._track(_future(work).then(lambda fut: _value_then(fut, result)))

    def broadcast(self, tensor: Tensor, src: int, round: int) -> torch.futures.Future[Tensor]:
        """Start an in-place broadcast of ``tensor`` from group rank ``src`` on round ``round``'s group."""
        group = self._group(round)
        global_src = dist.get_global_rank(group, src) if group is not dist.group.WORLD else src
        work = dist.broadcast(tensor, src=global_src, group=group, async_op=True)
        return self._track(_future(work).then(lambda fut: _value_then(fut, tensor)))

    def all_to_all(
        self, tensor: Tensor, send_splits: Sequence[int], recv_splits: Sequence[int], round: int
    ) -> torch.futures.Future[Tensor]:
        """Start an all-to-all with variable splits (``all_to_all_single``: gloo and NCCL) on round ``round``."""
        out = torch.empty(sum(recv_splits), dtype=tensor.dtype, device=tensor.device)
        work = dist.all_to_all_single(
            out,
            tensor,
            output_split_sizes=list(recv_splits),
            input_split_sizes=list(send_splits),
            group=self._group(round),
            async_op=True,
        )
        return self._track(_future(work).then(lambda fut: _value_then(fut, out)))

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


def _world() -> dist.ProcessGroup:
    world = dist.group.WORLD
    if world is None:
        raise RuntimeError("torch.distributed is not initialised: call `init_process_group` first.")
    return world


def _future(work: dist.Work | None) -> torch.futures.Future:
    if work is None:  # what a collective returns without ``async_op``: never here
        raise RuntimeError("An asynchronous collective returned no work handle.")
    return work.get_future()


def _failed(future: torch.futures.Future) -> bool:
    try:
        future.value()
    except Exception:  # noqa: BLE001 (any error of the collective or of its callback)
        return True
    return False


def _value_then(fut: torch.futures.Future, result: Tensor) -> Tensor:
    fut.value()  # re-raises a failed collective instead of handing on stale memory
    return result


def identical_on_all_ranks(tensors: Sequence[Tensor], device: torch.device) -> bool:
    """Whether ``tensors`` are bitwise equal on every rank (call on every rank: a collective).

    Each rank reduces every tensor to a CRC32 of its bytes and the checksums are all-gathered (one small collective,
    whatever the tensors' size, safe as a run's last: :func:`gather_rows`).
    """
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return True
    crcs = [zlib.crc32(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()) for t in tensors]
    gathered = gather_rows(torch.tensor([len(crcs), *crcs], dtype=torch.int64, device=device))
    return bool((gathered == gathered[0]).all())
