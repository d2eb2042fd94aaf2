"""Gradient compressors: every one implements the :class:`~lightning_gradcomp.Compressor` contract."""

from lightning_gradcomp.compressors.base import BucketContext, Compressor, Layer, Payload
from lightning_gradcomp.compressors.cast import BF16, FP16
from lightning_gradcomp.compressors.identity import Identity
from lightning_gradcomp.compressors.masked import MaskedCompressor, Masks
from lightning_gradcomp.compressors.powersgd import PowerSGD
from lightning_gradcomp.compressors.sparsify import RandomK, TopK

__all__ = [
    "BF16",
    "FP16",
    "BucketContext",
    "Compressor",
    "Identity",
    "Layer",
    "MaskedCompressor",
    "Masks",
    "Payload",
    "PowerSGD",
    "RandomK",
    "TopK",
]
