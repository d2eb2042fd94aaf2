"""Sparse gradients (``nn.Embedding(sparse=True)``): which modules produce them, and what that means for a compressor.

DDP gives a parameter with a sparse gradient a bucket of its own and the hook averages it as DDP does, uncompressed;
these checks tell the user when that changes what they asked for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.nn import Module

if TYPE_CHECKING:  # the fused optimizers use the detection and know no compressor
    from lightning_gradcomp.compressors.base import Compressor


def sparse_gradient_modules(module: Module) -> list[str]:
    """The names of ``module``'s submodules whose weight gets a sparse gradient (``sparse=True`` embeddings).

    The same test DDP makes when it gives a parameter a bucket of its own for a sparse gradient.
    """
    kinds = (torch.nn.Embedding, torch.nn.EmbeddingBag)
    return [name for name, m in module.named_modules() if isinstance(m, kinds) and m.sparse]


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
