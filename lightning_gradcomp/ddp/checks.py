"""Checks of a compressor against the optimizer and the model it trains with, read from what the compressor declares.

**Momentum.** A compressor that applies momentum itself (Deep Gradient Compression's momentum correction) declares
``optimizer_momentum_conflicts = True`` (a ``ClassVar`` of the compressor contract); an optimizer with momentum would
then apply it a second time. The strategy runs this check when fitting starts and when the compressor is switched,
without knowing any compressor by name.

**Sparse gradients** (``nn.Embedding(sparse=True)``). DDP gives a parameter with a sparse gradient a bucket of its own
and the hook averages it as DDP does, uncompressed; :func:`sparse_gradient_warning` tells the user when that changes
what they asked for.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch.nn import Module

from lightning_gradcomp.compressors.base import Compressor
from lightning_gradcomp.optim.fused import sparse_gradient_modules

__all__ = ["error_feedback_growth_warning", "optimizer_momentum_warning", "sparse_gradient_warning"]


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


def sparse_gradient_warning(compressor: Compressor, module: Module) -> str | None:
    """A warning when ``compressor`` changes densely averaged layers and ``module`` has sparse gradients; else ``None``.

    The hook averages sparse gradients as plain DDP does (:meth:`CompressionState.reduce`), without the compressor's
    update of densely averaged layers (:meth:`Compressor.finish_dense`: DGC's momentum correction, signSGD's sign
    step), which would make the embedding's rows dense.
    """
    if not compressor.has_dense_update:
        return None
    sparse = sparse_gradient_modules(module)
    if not sparse:
        return None
    return (
        f"{compressor!r} also changes the average of the layers it does not compress (its `finish_dense`), but the"
        f" sparse gradients of {', '.join(sparse[:5])}{' ...' if len(sparse) > 5 else ''} are averaged as plain DDP"
        " averages them, without it (it would make them dense). Build the embeddings with `sparse=False` to give"
        " them the compressor's treatment."
    )


def error_feedback_growth_warning(compressor: Compressor, enabled: bool | None) -> str | None:
    """A warning when error feedback is on for ``compressor`` and its residual can grow without bound; else ``None``.

    ``enabled`` is the strategy's ``error_feedback``; the reason is :meth:`Compressor.error_feedback_growth`'s. The
    strategy shows it when fitting starts and when its compressor is replaced. A warning, not an error: the
    configuration runs as asked, and the growth depends on the gradients (``python benchmarks/error_feedback.py``).
    """
    reason = compressor.error_feedback_growth(enabled)
    if reason is None:
        return None
    return (
        f"{compressor!r} with error feedback on: {reason}. Error feedback keeps a bounded residual only when the"
        " compressor's squared error is below its input's squared norm; here the residual, and the noise it adds to"
        " every average, can grow with every step (plain DDP adds none). Leave `error_feedback` unset (off for this"
        " compressor) or set it to False."
    )
