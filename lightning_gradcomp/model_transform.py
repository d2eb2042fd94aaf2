"""``ModelTransform``: a callback that changes the model's structure during ``fit`` (Pufferfish's factorization).

A changed structure must exist before a checkpoint's weights are loaded into it, but Lightning restores the module's
weights before the callbacks' state (and before ``strategy.setup``). So :class:`~lightning_gradcomp.CompressedDDP`
stores every transform's :meth:`~ModelTransform.structure_state` at the top of each checkpoint (weights-only ones
included) and calls :meth:`~ModelTransform.restore_structure` just before it loads the weights.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from lightning.pytorch.callbacks import Callback
from torch import nn

#: where CompressedDDP keeps the transforms' structure in a checkpoint: ``checkpoint[KEY][callback.state_key]``
CHECKPOINT_KEY = "gradcomp_transforms"


class ModelTransform(Callback, ABC):
    """A callback that rewrites modules of the :class:`~lightning.pytorch.LightningModule` while it trains.

    After rewriting, it asks the strategy to wrap the changed model again
    (:meth:`~lightning_gradcomp.CompressedDDP.rewrap_model`).
    """

    @abstractmethod
    def structure_state(self) -> dict[str, Any] | None:
        """Plain data that rebuilds the current structure with :meth:`restore_structure` (``None``: unchanged)."""

    @abstractmethod
    def restore_structure(self, module: nn.Module, state: dict[str, Any] | None) -> None:
        """Rebuild the structure described by ``state`` in ``module`` (before a checkpoint's weights load into it)."""
