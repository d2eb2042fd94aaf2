"""Callbacks for :class:`~lightning_gradcomp.CompressedDDP` (``OuterMonitor``: DiLoCo; ``TracIn``: any DDP strategy)."""

from lightning_gradcomp.callbacks.accordion import Accordion
from lightning_gradcomp.callbacks.auto import AutoCompression
from lightning_gradcomp.callbacks.pactrain import PacTrain
from lightning_gradcomp.callbacks.progress import ProgressLines
from lightning_gradcomp.callbacks.tracin import TracIn
from lightning_gradcomp.callbacks.warmup import DGC_RAMP, DenseWarmup
from lightning_gradcomp.ddp.monitor import CompressionMonitor
from lightning_gradcomp.diloco.monitor import OuterMonitor

__all__ = [
    "DGC_RAMP",
    "Accordion",
    "AutoCompression",
    "CompressionMonitor",
    "DenseWarmup",
    "OuterMonitor",
    "PacTrain",
    "ProgressLines",
    "TracIn",
]
