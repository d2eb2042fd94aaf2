"""When a rank fails: every rank ends, and the error names the rank that failed.

A rank that raises, exits or is killed mid-training leaves the others blocked in a collective until the peer's
connection closes (at once) or the process group's ``timeout`` passes (a rank that hangs). Their error then says only
"Connection closed by peer" or "timeout", never which rank failed, and Lightning's launcher does not stop a child
process that hangs: it is left running after the script ended. Here:

- a rank that fails records one line about its error in the process group's store (:func:`record_failure`, called
  from ``CompressedDDP.on_exception`` and ``DiLoCo.on_exception``), which the main process reads;
- the launcher of Lightning's default ``popen`` start method is replaced by :class:`ScriptLauncher`: when the main
  process (rank 0 of its node) fails, it stops its child processes (waiting a few seconds for those that are ending by
  themselves, killing the rest) and raises :class:`RankFailedError` naming the failed ranks; when a child fails while
  the main process cannot notice (it hangs), its watcher kills the whole node after a grace period, as Lightning's own
  watcher does at once.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver
from lightning.fabric.utilities.distributed import _set_num_threads_if_needed
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.utilities.exceptions import _TunerExitException
from typing_extensions import override

log = logging.getLogger(__name__)

__all__ = ["RankFailedError", "ScriptLauncher", "is_collective_failure", "record_failure"]

# how long the main process waits for ranks that are already ending (their collective failed too) before killing them
CHILD_GRACE_S = 5.0
# how long a watcher waits for the main process to raise its own error after a child failed, before killing it
MAIN_GRACE_S = 15.0
_KEY = "gradcomp/failure/{rank}"
# what gloo and NCCL say when a peer went away or did not answer: such an error is a consequence, not the fault.
# Specific on purpose: a rank's own error that merely mentions a timeout (a DataLoader's) must stay its own fault.
_COLLECTIVE_FAILURE = re.compile(
    r"Connection closed by peer|Connection reset by peer|caused pair closure|Timed out waiting \d+ ?ms"
    r"|gloo/transport/|NCCL (error|communicator)|DistBackendError",
)


class RankFailedError(RuntimeError):
    """Another rank failed (raised, exited, was killed or hung), so this rank's collectives failed."""


def is_collective_failure(error: BaseException) -> bool:
    """Whether ``error`` is a collective that failed because a peer went away or timed out (not a fault here)."""
    if isinstance(error, RankFailedError):
        return True
    if isinstance(error, getattr(dist, "DistError", ())):
        return True
    return isinstance(error, RuntimeError) and _COLLECTIVE_FAILURE.search(str(error)) is not None


def _store() -> Any | None:
    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 (a private helper: without it the error names fewer ranks, nothing more)
        return None


def record_failure(rank: int, error: BaseException) -> None:
    """Leave one line about ``error`` in the store, for the main process's report. Best effort, never raises."""
    store = _store()
    if store is None:
        return
    line = f"{type(error).__name__}: {error}".splitlines()[0][:300]
    try:
        store.set(_KEY.format(rank=rank), line)
    except Exception as failure:  # noqa: BLE001 (the store may be gone with a failed rank 0: nothing to tell)
        log.debug("gradcomp: could not record the failure of rank %d: %s", rank, failure)


def read_failures(world_size: int) -> dict[int, str]:
    """The failures recorded by :func:`record_failure`, by rank (without waiting for any)."""
    store = _store()
    found: dict[int, str] = {}
    if store is None:
        return found
    for rank in range(world_size):
        key = _KEY.format(rank=rank)
        try:
            if store.check([key]):
                found[rank] = store.get(key).decode(errors="replace")
        except Exception:  # noqa: BLE001
            continue
    return found


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class _Watcher(_ChildProcessObserver):
    """Lightning's child-process watcher, which gives the main process time to raise its own error first.

    Lightning's watcher SIGKILLs the main process as soon as a child exits with an error; the main process then ends
    without a word about which rank failed (and may be killed half-way through writing a checkpoint). A child's exit
    closes its connections, so the main process's collective fails at once and :class:`ScriptLauncher` takes over
    (and stands this watcher down); only a main process that cannot notice (it hangs) is killed, after
    :data:`MAIN_GRACE_S`.
    """

    def __init__(
        self, main_pid: int, child_processes: list[subprocess.Popen], first_rank: int, label: str = "CompressedDDP"
    ) -> None:
        super().__init__(main_pid=main_pid, child_processes=child_processes, sleep_period=1)
        self._first_rank = first_rank
        self._label = label
        self.standing_down = threading.Event()

    @override
    def _run(self) -> bool:
        return self.standing_down.is_set() or super()._run()

    @override
    def _terminate_all(self) -> None:
        if self.standing_down.wait(MAIN_GRACE_S):
            return
        failed = ", ".join(
            f"rank {self._first_rank + i} {_describe_exit(p.returncode)}"
            for i, p in enumerate(self._child_processes)
            if p.returncode
        )
        print(
            f"{self._label}: {failed}, and rank {self._first_rank - 1} (the main process,"
            f" pid {self._main_pid}) did not stop within {MAIN_GRACE_S:.0f} s (it may hang): killing it and the other"
            " ranks of this node.",
            file=sys.stderr,
            flush=True,
        )
        super()._terminate_all()


class ScriptLauncher(_SubprocessScriptLauncher):
    """Lightning's ``popen`` launcher (the default: the script runs again for each child rank) that stops every rank.

    When the main process fails it stops its children: at once if the fault is its own, after up to
    :data:`CHILD_GRACE_S` for children that are ending by themselves if its collective failed (another rank's fault);
    then it raises an error that names the failed rank(s). Nothing is left running when ``fit`` returns or raises.
    Lightning's tuner ending ``fit`` (its ``_TunerExitException``, raised on every rank) is no failure: it passes
    through, and the children end their ``fit`` by themselves.

    Args:
        *args: Lightning's ``_SubprocessScriptLauncher``'s (the cluster environment, processes, nodes).
        label: the strategy's name, which starts every message.
    """

    def __init__(self, *args: Any, label: str = "CompressedDDP") -> None:
        super().__init__(*args)
        self.label = label

    @override
    def launch(self, function: Callable, *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        """Start the child ranks (unless the cluster does), then run ``function``; stop every rank if it fails."""
        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        if self.cluster_environment.creates_processes_externally:
            _set_num_threads_if_needed(num_processes=self.num_processes)
            return function(*args, **kwargs)
        self._call_children_scripts()
        first_rank = self.cluster_environment.node_rank() * self.num_processes + 1
        watcher = _Watcher(os.getpid(), self.procs, first_rank, self.label)
        watcher.start()
        _set_num_threads_if_needed(num_processes=self.num_processes)
        try:
            return function(*args, **kwargs)
        except _TunerExitException:
            # not a failure: Lightning's tuner (LearningRateFinder, BatchSizeFinder) ends `fit` with it on every rank
            # once it is done, and the trainer finishes normally; the other ranks are still finishing theirs
            raise
        except BaseException as error:
            watcher.standing_down.set()
            report = self._stop_children(error, first_rank)
            if report is None:
                raise
            raise RankFailedError(report) from error

    def _stop_children(self, error: BaseException, first_rank: int) -> str | None:
        """Stop every child; return the message of a :class:`RankFailedError`, or ``None`` if the fault is ours."""
        own_fault = not is_collective_failure(error)
        deadline = time.monotonic() + (0.0 if own_fault else CHILD_GRACE_S)
        killed: list[int] = []
        for i, proc in enumerate(self.procs):
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                killed.append(first_rank + i)
                proc.kill()  # blocked in a collective or hung: SIGTERM would wait for it (Lightning kills too)
                proc.wait()
        main_rank = first_rank - 1
        if own_fault:
            if isinstance(error, Exception) and hasattr(error, "add_note"):  # not for Ctrl+C (Python >= 3.11)
                error.add_note(
                    f"{self.label}: rank {main_rank} failed (this error); the other ranks of this node were stopped."
                )
            return None
        notes = read_failures(dist.get_world_size() if dist.is_initialized() else len(self.procs) + 1)
        failed: list[str] = []
        for i, proc in enumerate(self.procs):
            rank = first_rank + i
            if rank in killed or proc.returncode == 0:
                continue
            note = f" ({notes.pop(rank)})" if rank in notes else ""
            failed.append(f"rank {rank}{note} {_describe_exit(proc.returncode)}")
        failed.extend(f"rank {rank} failed ({note})" for rank, note in sorted(notes.items()) if rank != main_rank)
        if not failed:  # nobody else reported an error: the ranks we had to kill are the ones that stopped answering
            failed = [f"rank {rank} did not answer within the timeout (it hung) and was killed" for rank in killed]
        elif killed:
            failed.append("rank(s) " + ", ".join(map(str, killed)) + " did not stop by themselves and were killed")
        if not failed:
            failed = ["a rank on another node failed or did not answer within the timeout"]
        return (
            f"{self.label}: " + "; ".join(failed) + f". Rank {main_rank}'s collective failed as a consequence (the"
            f" cause above: {str(error).splitlines()[0][:200]}). Every rank of this node has stopped; resume from the"
            " last checkpoint with `trainer.fit(model, ckpt_path=...)`."
        )
