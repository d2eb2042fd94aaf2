"""Callbacks that work with :class:`~lightning_gradcomp.CompressedDDP`."""

from lightning_gradcomp.callbacks.monitor import CompressionMonitor

__all__ = ["CompressionMonitor"]
