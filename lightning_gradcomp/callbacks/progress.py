"""``ProgressLines``: a plain line of training progress every so often, for output that goes to a file.

A progress bar redraws one terminal line; in a SLURM log or behind ``> run.log`` its redraws are noise, so the CLI
turns it off when stdout is not a terminal, and then nothing would be printed between the model summary and the first
validation (hours apart on a slow machine). This callback prints, on global rank 0, a line such as::

    progress: step 120/2000 (6%), loss 4.213, 0.52 steps/s, 1h00m left

the first ``first`` seconds into training, then every ``every`` seconds, and once at the end of training.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_gradcomp.validation import check_number

__all__ = ["ProgressLines", "format_duration"]


def format_duration(seconds: float) -> str:
    """``"1h05m"``, ``"4m10s"`` or ``"12s"``: a duration for a progress line (``"?"`` when unknown)."""
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    seconds = round(seconds)
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    if seconds >= 60:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds}s"


def _print(line: str) -> None:
    print(line, flush=True)  # flushed: a log file shows the line at once


class ProgressLines(Callback):
    """Print a line of progress (step, loss, steps per second, time left) every so often, on global rank 0.

    Args:
        every: seconds between two lines.
        first: seconds into training before the first line (at most ``every``), so that a short look at the log
            shows the run is moving.
        clock: the time in seconds (``time.monotonic``; a test passes its own).
        out: where each line goes (``print``, flushed).

    Raises:
        ValueError: If ``every`` or ``first`` is not a number > 0.
    """

    def __init__(
        self,
        every: float = 60.0,
        first: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        out: Callable[[str], None] | None = None,
    ) -> None:
        self.every = check_number(every, "every", low=0.0, low_open=True)
        self.first = min(check_number(first, "first", low=0.0, low_open=True), self.every)
        self._clock = clock
        self._out = out or _print  # a module function, not a lambda: the callback may be pickled to spawned ranks
        self._start = self._next = 0.0
        self._start_step = 0
        self._loss: Any = None

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Start the clock, from the step training starts at (a resumed run counts its own steps' speed)."""
        self._start = self._clock()
        self._next = self._start + self.first
        self._start_step = trainer.global_step

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Keep the batch's loss; print a line when one is due."""
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        self._loss = loss if isinstance(loss, torch.Tensor) else self._loss
        now = self._clock()
        if now >= self._next and trainer.is_global_zero:
            self._out(self.line(trainer, now))
            self._next = now + self.every

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """A last line, where training stopped."""
        if trainer.is_global_zero:
            self._out(self.line(trainer, self._clock()))

    def line(self, trainer: pl.Trainer, now: float) -> str:
        """The progress line at ``now``: step of the total, the last batch's loss, speed and time left."""
        step = trainer.global_step
        total = trainer.estimated_stepping_batches
        known = isinstance(total, (int, float)) and math.isfinite(total) and total > 0
        of = f"/{int(total)} ({100 * step / total:.0f}%)" if known else ""
        rate = (step - self._start_step) / (now - self._start) if now > self._start else 0.0
        left = format_duration((total - step) / rate) if known and rate > 0 else "?"
        loss = f", loss {float(self._loss.detach()):.4g}" if self._loss is not None else ""
        return f"progress: step {step}{of}{loss}, {rate:.3g} steps/s, {left} left"
