"""``CompressionMonitor``: log what compression saves, every step, through the Trainer's logger."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override


def _require_compressed_ddp(trainer: pl.Trainer, callback: Callback) -> Any:
    from lightning_gradcomp.strategy import CompressedDDP

    if not isinstance(trainer.strategy, CompressedDDP):
        raise MisconfigurationException(
            f"`{type(callback).__name__}` requires `Trainer(strategy=CompressedDDP(...))`,"
            f" got `{type(trainer.strategy).__name__}`."
        )
    return trainer.strategy


class CompressionMonitor(Callback):
    """Log what compression sends and saves after every optimizer step.

    Logged keys: ``gradcomp/bytes_sent``, ``gradcomp/bytes_dense``, ``gradcomp/compression_ratio``,
    ``gradcomp/encode_ms`` and ``gradcomp/decode_ms``.

    The numbers are the logging rank's own: the bytes of the payloads it handed to collectives (with two ranks, the
    bytes it put on the wire) and the bytes plain DDP would have all-reduced. ``CompressedDDP`` adds this callback
    unless the trainer already has one (or ``CompressedDDP(monitor=False)``).

    Args:
        prog_bar: show the compression ratio in the progress bar.

    Raises:
        MisconfigurationException: In ``setup``, if the strategy is not ``CompressedDDP``.
    """

    def __init__(self, prog_bar: bool = True) -> None:
        self.prog_bar = prog_bar

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        _require_compressed_ddp(trainer, self)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        stats = trainer.strategy.compression_state.telemetry.pop_step()
        if stats is None:  # a gradient-accumulation micro-step: nothing was communicated
            return
        log = {"on_step": True, "on_epoch": False, "batch_size": 1}
        pl_module.log("gradcomp/bytes_sent", float(stats.bytes_sent), **log)
        pl_module.log("gradcomp/bytes_dense", float(stats.bytes_dense), **log)
        pl_module.log("gradcomp/compression_ratio", stats.compression_ratio, prog_bar=self.prog_bar, **log)
        pl_module.log("gradcomp/encode_ms", stats.encode_ms, **log)
        pl_module.log("gradcomp/decode_ms", stats.decode_ms, **log)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        telemetry = trainer.strategy.compression_state.telemetry
        if telemetry.total_steps:
            ratio = telemetry.total_bytes_dense / max(1, telemetry.total_bytes_sent)
            rank_zero_info(
                f"gradcomp: {telemetry.total_steps} steps sent {telemetry.total_bytes_sent / 1e6:,.2f} MB per rank"
                f" instead of {telemetry.total_bytes_dense / 1e6:,.2f} MB (compression ratio {ratio:,.1f}x)."
            )
