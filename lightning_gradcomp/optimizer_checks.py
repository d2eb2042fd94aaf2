"""Checks of a compressor against the optimizer it trains with, read from what the compressor declares.

A compressor that applies momentum itself (Deep Gradient Compression's momentum correction) declares
``optimizer_momentum_conflicts = True`` (a ``ClassVar`` of the compressor contract); an optimizer with momentum would
then apply it a second time. The strategy runs this check when fitting starts and when the compressor is switched,
without knowing any compressor by name.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from lightning_gradcomp.compressors.base import Compressor

__all__ = ["optimizer_momentum_warning"]


def optimizer_momentum_warning(compressor: Compressor, optimizers: Iterable[Any] | None) -> str | None:
    """A warning if ``compressor`` applies momentum itself (DGC) and an optimizer does too, else ``None``.

    Args:
        compressor: the compressor in use; read for its ``optimizer_momentum_conflicts`` declaration.
        optimizers: the optimizers training with it (their parameter groups' ``momentum``).

    Returns:
        The warning to show, or ``None`` when there is no conflict.
    """
    if not compressor.optimizer_momentum_conflicts:
        return None
    for optimizer in optimizers or ():
        # lightning_gradcomp.optim.DGCSGD applies its momentum to the weight decay alone: no conflict
        if not getattr(optimizer, "applies_momentum_to_gradient", True):
            continue
        for group in getattr(optimizer, "param_groups", ()):
            momentum = group.get("momentum", 0)
            if isinstance(momentum, (int, float)) and momentum > 0:
                return (
                    f"{type(compressor).__name__} applies momentum itself (momentum correction), but the optimizer"
                    f" {type(optimizer).__name__} has momentum={momentum}: momentum is applied twice. Use"
                    " `lightning_gradcomp.optim.DGCSGD(params, lr, momentum=0.9, weight_decay=...)`, the reference"
                    " optimizer (its momentum applies to the weight decay alone)."
                )
    return None
