"""Kept for imports written before :class:`CompressionMonitor` moved below the strategy.

The class lives in :mod:`lightning_gradcomp.monitor`: ``CompressedDDP`` adds one, and the strategy must not import
from ``callbacks/``, whose modules import the strategy.
"""

from lightning_gradcomp.monitor import CompressionMonitor, format_summary

__all__ = ["CompressionMonitor", "format_summary"]
