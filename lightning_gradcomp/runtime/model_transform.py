"""``ModelTransform``: a callback that changes the model's structure during ``fit`` (Pufferfish's factorization).

A changed structure must exist before a checkpoint's weights are loaded into it, but Lightning restores the module's
weights before the callbacks' state (and before ``strategy.setup``). So :class:`~lightning_gradcomp.CompressedDDP`
stores every transform's :meth:`~ModelTransform.structure_state` at the top of each checkpoint (weights-only ones
included) and calls :meth:`~ModelTransform.restore_structure` just before it loads the weights.
A transform that rebuilds the optimizers mid-training keeps their schedule with :func:`carry_schedule`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
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


def carry_schedule(
    old_optimizers: list[Any], new_optimizers: list[Any], old_configs: list[Any], new_configs: list[Any]
) -> None:
    """Continue the LR schedule of ``old_*`` in the rebuilt ``new_*`` (learning rates and scheduler positions).

    For ``CompressedDDP.rewrap_model(keep_lr_schedule=True)``, after a transform rebuilt the optimizers: each parameter
    group's hyper-parameters and each scheduler's position carry over when the shapes match; otherwise a warning says
    the rebuilt ones start afresh.
    """
    shapes_match = len(old_optimizers) == len(new_optimizers) and all(
        len(a.param_groups) == len(b.param_groups) for a, b in zip(old_optimizers, new_optimizers)
    )
    if not shapes_match or len(old_configs) != len(new_configs):
        rank_zero_warn(
            "rewrap_model(keep_lr_schedule=True): configure_optimizers returned a different number of optimizers,"
            " parameter groups or schedulers than before; the rebuilt ones start from their initial state."
        )
        return
    for old, new in zip(old_optimizers, new_optimizers):
        for old_group, new_group in zip(old.param_groups, new.param_groups):
            new_group.update({k: v for k, v in old_group.items() if k != "params"})
    for old, new in zip(old_configs, new_configs):
        if type(old.scheduler) is type(new.scheduler):
            new.scheduler.load_state_dict(old.scheduler.state_dict())
        else:
            rank_zero_warn(
                f"rewrap_model(keep_lr_schedule=True): the rebuilt scheduler {type(new.scheduler).__name__} is not"
                f" a {type(old.scheduler).__name__}; it starts from its initial state."
            )
