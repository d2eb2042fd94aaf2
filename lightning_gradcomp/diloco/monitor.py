"""``OuterMonitor``: log what DiLoCo's outer exchange sends, every optimizer step, through the Trainer's logger.

The counterpart of :class:`~lightning_gradcomp.CompressionMonitor` for periodic synchronization (DiLoCo, Douillard et
al. 2023, arXiv 2311.08105): the bytes of a sync, the same bytes spread over the inner steps that share it, the
syncs taken and the rounds skipped. It reads the strategy's :class:`~lightning_gradcomp.diloco.round.Round` and
sits below the strategy, which adds it when fitting.
"""

from __future__ import annotations

import time
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_gradcomp.diloco.own_summary import own_summary
from lightning_gradcomp.diloco.round import Round
from lightning_gradcomp.engine import wire
from lightning_gradcomp.validation import check_strategy_state


class OuterMonitor(Callback):
    """Log the outer exchange's counters after every optimizer step, and a summary line at the end of ``fit``.

    Logged keys (the same on every rank: every rank takes part in every sync):

    - ``gradcomp/bytes_sent``, ``gradcomp/bytes_received``: what this step's syncs put on and took off the wire
      (0 on an inner step; on a sync, the collectives of the pseudo-gradient and the buffers, counted as the package's
      telemetry counts them, :mod:`lightning_gradcomp.engine.wire`: a ring all-reduce sends and receives
      ``2 (n - 1) / n`` times its buffer);
    - ``gradcomp/bytes_sent_per_step``, ``gradcomp/bytes_received_per_step``: the bytes so far divided by the optimizer
      steps so far (amortised: what a per-step method would have to beat);
    - ``gradcomp/syncs``: outer steps taken so far; ``gradcomp/skipped_syncs``: rounds skipped because the averaged
      pseudo-gradient was not finite;
    - with a membership that reports them (fault tolerance), this replica group's ``gradcomp/participants``
      (the groups whose pseudo-gradient counted in the last sync), ``gradcomp/discarded_rounds`` (syncs discarded
      because one failed during them), ``gradcomp/heals`` and ``gradcomp/heal_seconds`` (the last heal's duration).

    At the end of ``fit`` (after the final outer step of a partial last round) the totals go into the callback
    metrics (``gradcomp/total_*``) and rank 0 logs one line with them and what plain DDP's ring all-reduce of the
    gradients would have moved (sent plus received) in the same steps at this world size, and the wall time per
    optimizer step of this fit (validation included), to check against what ``lightning-gradcomp advise`` predicted.

    Raises:
        MisconfigurationException: In ``setup``, if the strategy is not ``DiLoCo``.
    """

    def __init__(self) -> None:
        self._last_step = -1
        self._last_sent = 0
        self._last_received = 0
        self._started: tuple[float, int] | None = None  # (perf_counter, global_step) as training started
        self._own = (0, 0, 0)  # this process's optimizer steps, bytes sent and received at train start (own_summary)

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Check that the strategy has an outer state (DiLoCo)."""
        self._state(trainer)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Count from the totals as training starts (a resumed run's were restored from its checkpoint)."""
        outer = self._state(trainer)
        self._last_step = trainer.global_step
        self._last_sent, self._last_received = outer.bytes_sent, outer.bytes_received
        self._started = (time.perf_counter(), trainer.global_step)
        self._own = (0, outer.bytes_sent, outer.bytes_received)  # a heal or a resume moves global_step, not these

    def _state(self, trainer: pl.Trainer) -> Round:
        return check_strategy_state(
            trainer.strategy, "outer_state", Round, self, "DiLoCo", error=MisconfigurationException
        )

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Log the counters after an optimizer step (nothing on a gradient-accumulation micro-step)."""
        if trainer.global_step == self._last_step:
            return
        outer = self._state(trainer)
        sent, received = outer.bytes_sent - self._last_sent, outer.bytes_received - self._last_received
        self._last_step = trainer.global_step
        self._last_sent, self._last_received = outer.bytes_sent, outer.bytes_received
        self._own = (self._own[0] + 1, *self._own[1:])
        steps = max(trainer.global_step, 1)

        def log(name: str, value: float) -> None:
            pl_module.log(name, value, on_step=True, on_epoch=False, batch_size=1)

        log("gradcomp/bytes_sent", float(sent))
        log("gradcomp/bytes_received", float(received))
        log("gradcomp/bytes_sent_per_step", outer.bytes_sent / steps)
        log("gradcomp/bytes_received_per_step", outer.bytes_received / steps)
        log("gradcomp/syncs", float(outer.syncs))
        log("gradcomp/skipped_syncs", float(outer.skipped))
        for name, value in outer.membership.metrics().items():
            log(f"gradcomp/{name}", value)

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Put the totals in the callback metrics and log the summary line (after DiLoCo's final outer step)."""
        outer = self._state(trainer)
        totals = {
            "total_steps": trainer.global_step,
            "total_syncs": outer.syncs,
            "total_skipped_syncs": outer.skipped,
            "total_bytes_sent": outer.bytes_sent,
            "total_bytes_received": outer.bytes_received,
        }
        # in the callback metrics too, so that a launcher that returns only those (spawn) still reports them
        trainer.callback_metrics.update({f"gradcomp/{k}": torch.tensor(float(v)) for k, v in totals.items()})
        dense_per_step = sum(p.numel() * p.element_size() for p in outer.params)
        workers = trainer.world_size * outer.membership.groups
        rank_zero_info(own_summary(trainer.global_step, self._own, self._started, outer, dense_per_step, workers))


def format_outer_summary(
    steps: int, outer: Round, dense_per_step: int, world_size: int, step_seconds: float | None = None
) -> str:
    """One line: syncs, skipped rounds, MB moved in all and per step, against plain DDP's ring of the gradients.

    Moved is sent plus received; plain DDP's ring all-reduce of ``dense_per_step`` bytes moves ``4 (n - 1) / n``
    times them per step on each rank. ``step_seconds``: the fit's wall time per optimizer step, when known.
    """
    moved = wire.Wire(outer.bytes_sent, outer.bytes_received)
    per_step = moved.moved / max(steps, 1)
    dense = wire.all_reduce(dense_per_step, world_size)
    ratio = wire.compression_ratio(dense, moved.scaled(1 / max(steps, 1)))
    return (
        f"gradcomp summary (DiLoCo): {steps} optimizer steps, {outer.syncs} syncs ({outer.skipped} skipped"
        f"{outer.membership.summary()});"
        f" {outer.bytes_sent / 1e6:,.3f} MB sent, {outer.bytes_received / 1e6:,.3f} MB received"
        f" ({per_step / 1e6:,.4f} MB moved per step, plain DDP's ring {dense.moved / 1e6:,.4f}: {ratio:,.1f}x less)"
        + (f"; {step_seconds * 1e3:,.1f} ms per optimizer step." if step_seconds is not None else ".")
    )
