"""Callbacks that work with :class:`~lightning_gradcomp.CompressedDDP` (and, for ``TracIn``, any DDP strategy)."""

from lightning_gradcomp.callbacks.accordion import Accordion
from lightning_gradcomp.callbacks.auto import AutoCompression
from lightning_gradcomp.callbacks.pactrain import PacTrain
from lightning_gradcomp.callbacks.tracin import TracIn
from lightning_gradcomp.callbacks.warmup import DGC_RAMP, DenseWarmup
from lightning_gradcomp.monitor import CompressionMonitor

__all__ = ["DGC_RAMP", "Accordion", "AutoCompression", "CompressionMonitor", "DenseWarmup", "PacTrain", "TracIn"]
