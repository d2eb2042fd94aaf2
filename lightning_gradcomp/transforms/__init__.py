"""Model-side compression: change the model so that plain averaging moves fewer numbers (Pufferfish, PacTrain)."""

from lightning_gradcomp.model_transform import ModelTransform
from lightning_gradcomp.transforms.complexity import count_macs, count_parameters
from lightning_gradcomp.transforms.lowrank import (
    FactorizedConv,
    FactorizedLinear,
    FactorizedLSTM,
    FactorizedMultiheadAttention,
    factorize,
    svd_factors,
)
from lightning_gradcomp.transforms.pactrain import PacTrain
from lightning_gradcomp.transforms.pufferfish import Pufferfish

__all__ = [
    "FactorizedConv",
    "FactorizedLSTM",
    "FactorizedLinear",
    "FactorizedMultiheadAttention",
    "ModelTransform",
    "PacTrain",
    "Pufferfish",
    "count_macs",
    "count_parameters",
    "factorize",
    "svd_factors",
]
