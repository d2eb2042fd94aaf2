"""Gradient compressors: every one implements the :class:`~lightning_gradcomp.Compressor` contract."""

from lightning_gradcomp.compressors.adacomp import AdaComp
from lightning_gradcomp.compressors.base import BucketContext, Compressor, Layer, Payload
from lightning_gradcomp.compressors.cast import BF16, FP16
from lightning_gradcomp.compressors.dgc import DGC
from lightning_gradcomp.compressors.identity import Identity
from lightning_gradcomp.compressors.lgc import LGC, LGCAllReduce
from lightning_gradcomp.compressors.masked import MaskedCompressor, Masks
from lightning_gradcomp.compressors.minmax import MinMax
from lightning_gradcomp.compressors.planned import Planned
from lightning_gradcomp.compressors.powersgd import PowerSGD
from lightning_gradcomp.compressors.quantize import QSGD, TernGrad
from lightning_gradcomp.compressors.scalecom import ScaleCom
from lightning_gradcomp.compressors.sign import EFSignSGD, OneBit, SignSGD
from lightning_gradcomp.compressors.sparseloco import SparseLoCo
from lightning_gradcomp.compressors.sparsify import RandomK, TopK
from lightning_gradcomp.compressors.zen import Zen

__all__ = [
    "BF16",
    "DGC",
    "FP16",
    "LGC",
    "QSGD",
    "AdaComp",
    "BucketContext",
    "Compressor",
    "EFSignSGD",
    "Identity",
    "LGCAllReduce",
    "Layer",
    "MaskedCompressor",
    "Masks",
    "MinMax",
    "OneBit",
    "Payload",
    "Planned",
    "PowerSGD",
    "RandomK",
    "ScaleCom",
    "SignSGD",
    "SparseLoCo",
    "TernGrad",
    "TopK",
    "Zen",
]
