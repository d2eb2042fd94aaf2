"""Kept for imports written before :class:`ModelTransform` moved below the strategy.

The class lives in :mod:`lightning_gradcomp.model_transform`: the strategy needs it (to save and rebuild a changed
structure) and must not import from ``transforms/``, whose modules import the strategy.
"""

from lightning_gradcomp.model_transform import CHECKPOINT_KEY, ModelTransform

__all__ = ["CHECKPOINT_KEY", "ModelTransform"]
