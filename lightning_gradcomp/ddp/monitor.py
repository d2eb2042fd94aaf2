"""``CompressionMonitor``: log what compression saves, every step, through the Trainer's logger.

It sits below the strategy (``CompressedDDP`` adds one when fitting), so it checks for what it reads, the strategy's
:class:`~lightning_gradcomp.CompressionState`, instead of importing the strategy class.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_gradcomp.ddp.hook import CompressionState
from lightning_gradcomp.engine import wire
from lightning_gradcomp.engine.collectives import gather_rows
from lightning_gradcomp.validation import check_bool, check_strategy_state


class CompressionMonitor(Callback):
    """Log what compression sends and saves after every optimizer step.

    Logged keys: ``gradcomp/bytes_sent`` and ``gradcomp/bytes_received`` (what this rank put on and took off the
    wire, by each collective's standard algorithm: :mod:`lightning_gradcomp.engine.wire`), ``gradcomp/bytes_dense`` (the
    buckets' bytes, as plain DDP all-reduces them), ``gradcomp/bytes_dense_moved`` (what plain DDP's ring all-reduce
    would send plus receive on this rank at this world size, ``4 (n - 1) / n`` times ``bytes_dense``),
    ``gradcomp/compression_ratio`` (``bytes_dense_moved / (bytes_sent + bytes_received)``: below 1 when compression
    moves more than plain DDP, as an all-gather does at many ranks), ``gradcomp/encode_ms``, ``gradcomp/decode_ms``
    and ``gradcomp/nonfinite_steps`` (how many steps so far had a non-finite gradient on some rank; the first one
    also gets a warning).

    The numbers are the logging rank's own. ``CompressedDDP`` adds this callback unless the trainer already has one
    (or ``CompressedDDP(monitor=False)``).

    Args:
        prog_bar: show the compression ratio in the progress bar.

    Raises:
        MisconfigurationException: In ``setup``, if the strategy is not ``CompressedDDP``.
    """

    def __init__(self, prog_bar: bool = True) -> None:
        self.prog_bar = check_bool(prog_bar, "prog_bar", error=MisconfigurationException)

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Check that the strategy is CompressedDDP (has the compression state this callback reads)."""
        self._state(trainer)

    def _state(self, trainer: pl.Trainer) -> CompressionState:
        return check_strategy_state(
            trainer.strategy,
            "compression_state",
            CompressionState,
            self,
            "CompressedDDP",
            error=MisconfigurationException,
        )

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Log the finished step's telemetry (nothing on micro-steps that did not communicate)."""
        telemetry = self._state(trainer).telemetry
        stats = telemetry.pop_step()
        if stats is None:  # a gradient-accumulation micro-step: nothing was communicated
            return

        def log(name: str, value: float, prog_bar: bool = False) -> None:
            pl_module.log(name, value, prog_bar=prog_bar, on_step=True, on_epoch=False, batch_size=1)

        log("gradcomp/bytes_sent", float(stats.bytes_sent))
        log("gradcomp/bytes_received", float(stats.bytes_received))
        log("gradcomp/bytes_dense", float(stats.bytes_dense))
        log("gradcomp/bytes_dense_moved", float(stats.bytes_dense_moved))
        log("gradcomp/compression_ratio", stats.compression_ratio, prog_bar=self.prog_bar)
        log("gradcomp/encode_ms", stats.encode_ms)
        log("gradcomp/decode_ms", stats.decode_ms)
        log("gradcomp/nonfinite_steps", float(telemetry.total_nonfinite_steps))
        log("gradcomp/state_resets", float(telemetry.total_state_resets))
        if not stats.finite and telemetry.total_nonfinite_steps == 1:
            rank_zero_warn(
                f"gradcomp: step {trainer.global_step} had a non-finite gradient on some rank. Its aggregate is"
                " non-finite on every rank (skip it as with plain DDP) and every compressor state was kept as it was"
                " before the step; `gradcomp/nonfinite_steps` counts such steps."
            )

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Print the per-rank summary table and put the totals in the callback metrics."""
        state = self._state(trainer)
        telemetry = state.telemetry
        totals = torch.tensor(
            [
                telemetry.total_steps,
                telemetry.total_bytes_sent,
                telemetry.total_bytes_received,
                telemetry.total_bytes_dense,
                telemetry.total_bytes_dense_moved,
                telemetry.total_encode_ms,
                telemetry.total_decode_ms,
            ],
            dtype=torch.float64,
        )
        # every rank's own numbers, for the table (a collective: every rank reaches on_train_end; on the strategy's
        # device, since NCCL gathers no CPU tensor). Often the run's last collective: gather_rows returns only once
        # torch's threads let go of it, so that the process cannot abort at exit (see its docstring)
        gathered = gather_rows(totals.to(trainer.strategy.root_device))
        per_rank = gathered.cpu().reshape(-1, totals.numel())
        # in the callback metrics too, so that a launcher that returns only those (spawn) still reports them
        names = (
            "total_steps",
            "total_bytes_sent",
            "total_bytes_received",
            "total_bytes_dense",
            "total_bytes_dense_moved",
            "total_encode_ms",
            "total_decode_ms",
        )
        trainer.callback_metrics.update({f"gradcomp/{n}": v for n, v in zip(names, totals)})
        if telemetry.total_steps:
            rank_zero_info(format_summary(per_rank.tolist(), repr(state.compressor)))


def format_summary(per_rank: list[list[float]], compressor: str) -> str:
    """The end-of-training table: what each rank moved against plain DDP's ring at this world size, encode/decode time.

    ``per_rank``: each rank's steps, bytes sent, received, dense (the buckets'), dense moved (plain DDP's ring, sent
    plus received), encode and decode milliseconds, in all.
    """
    lines = [
        f"gradcomp summary ({compressor}):",
        "| rank | steps | MB sent | MB received | MB plain DDP (ring, sent + received) | compression ratio"
        " | encode ms/step | decode ms/step |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for rank, (steps, sent, received, _, dense_moved, encode, decode) in enumerate(per_rank):
        ratio = wire.compression_ratio(wire.Wire(dense_moved, 0), wire.Wire(sent, received))
        per_step = max(steps, 1)
        lines.append(
            f"| {rank} | {steps:.0f} | {sent / 1e6:,.3f} | {received / 1e6:,.3f} | {dense_moved / 1e6:,.3f} |"
            f" {ratio:,.2f}x | {encode / per_step:.2f} | {decode / per_step:.2f} |"
        )
    return "\n".join(lines)
