"""How many consecutive steps were non-finite on every rank: when to start the compressor's state afresh.

The non-finite guard (``StepUpdates``) keeps a step that is not finite on every rank from changing any state. That
covers a NaN or an infinity in the input. It cannot cover state that was finite when committed and makes every later
step non-finite: a residual that no payload can hold (QSGD's squared norm overflows), or a decoded value above fp16's
range that reached a residual before the guard could see it (``benchmarks/spikes.py`` lists the cases). Each such
step is skipped, and so is every step after it: training stalls where plain DDP, which keeps no state, would go on.

:class:`NonfiniteRun` counts the run of consecutive non-finite verdicts so that ``CompressionState`` can reset the
residuals and the compressor's state after ``reset_state_after`` of them. The count never synchronises with the
device: a verdict on the CPU is read at once; one on CUDA is copied to pinned host memory behind an event and
counted ``lag`` steps later, so that every rank counts the same verdicts at the same step (and resets at the same
step) without waiting for the device, unless it is more than ``lag`` steps behind the host.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any

import torch
from torch import Tensor

#: How many steps late a verdict on CUDA is counted (its copy to the host has long completed by then).
CUDA_LAG = 2


class NonfiniteRun:
    """The number of consecutive non-finite steps, counted from each step's verdict (identical on every rank).

    Verdicts arrive from the collectives' threads (:meth:`add`); the hook reads the run at the start of a step
    (:meth:`length_before`).
    """

    def __init__(self) -> None:
        self._length = 0  # the run as of the last verdict counted
        # (step, verdict, event): a bool, or a pinned host tensor whose copy completes at the CUDA event
        self._pending: deque[tuple[int, Any, torch.cuda.Event | None]] = deque()
        self._lock = threading.Lock()

    def add(self, step: int, ok: Tensor | None) -> None:
        """Record step ``step``'s verdict (``None``: the step was not checked, and does not count either way)."""
        if ok is None:
            return
        if ok.device.type == "cpu":
            entry: tuple[int, Any, torch.cuda.Event | None] = (step, bool(ok), None)
        else:  # no synchronisation: the copy and the event are queued behind the verdict
            host = torch.empty((), dtype=torch.bool, pin_memory=True)
            host.copy_(ok, non_blocking=True)  # on the current stream of ok's device, like the event
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(ok.device))
            entry = (step, host, event)
        with self._lock:
            self._pending.append(entry)

    def length_before(self, step: int, lag: int = 0) -> int:
        """The run of non-finite steps counted through step ``step - lag`` (steps are numbered from 1).

        Verdicts on CUDA are waited for if their event has not completed (only when the device is behind).
        """
        with self._lock:
            while self._pending and self._pending[0][0] <= step - lag:
                _, verdict, event = self._pending.popleft()
                if event is not None:
                    event.synchronize()
                    verdict = bool(verdict)
                self._length = 0 if verdict else self._length + 1
            return self._length

    def clear(self) -> None:
        """Start counting afresh (after a reset: the verdicts still pending were made with the old state)."""
        with self._lock:
            self._length = 0
            self._pending.clear()

    def state_dict(self) -> dict[str, Any]:
        """The run so far and the verdicts not counted yet (read now: a checkpoint may wait for the device)."""
        with self._lock:
            for _, _, event in self._pending:
                if event is not None:
                    event.synchronize()
            pending = [(number, bool(verdict)) for number, verdict, _ in self._pending]
            return {"length": self._length, "pending": pending}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`: the same resets happen at the same steps as without the interruption."""
        with self._lock:
            self._length = int(state_dict.get("length", 0))
            self._pending = deque((int(number), bool(ok), None) for number, ok in state_dict.get("pending", []))


def to_cpu(obj: Any) -> Any:
    """A copy of ``obj`` (tensors, dicts, lists, tuples of them) with every tensor detached and on the CPU.

    For checkpoints of a compressor's state, which may hand out its live buffers.
    """
    if isinstance(obj, Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return obj
