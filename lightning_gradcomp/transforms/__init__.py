"""Model-side compression: change the model so that plain averaging moves fewer numbers.

Pufferfish's low-rank factorization, and PacTrain's pruning schedule and masks (its callback,
:class:`lightning_gradcomp.PacTrain`, lives in :mod:`lightning_gradcomp.callbacks`: ``transforms`` sits below the
callbacks and does not import them).
"""

from lightning_gradcomp.runtime.model_transform import ModelTransform
from lightning_gradcomp.transforms.complexity import count_macs, count_parameters
from lightning_gradcomp.transforms.lowrank import (
    FactorizedConv,
    FactorizedLinear,
    FactorizedLSTM,
    FactorizedMultiheadAttention,
    factorize,
    svd_factors,
)
from lightning_gradcomp.transforms.pufferfish import Pufferfish

__all__ = [
    "FactorizedConv",
    "FactorizedLSTM",
    "FactorizedLinear",
    "FactorizedMultiheadAttention",
    "ModelTransform",
    "Pufferfish",
    "count_macs",
    "count_parameters",
    "factorize",
    "svd_factors",
]
