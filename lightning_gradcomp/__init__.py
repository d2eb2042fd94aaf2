"""lightning-gradcomp: communication-efficient data-parallel training for PyTorch Lightning.

Change one line: ``Trainer(strategy=CompressedDDP(compressor=PowerSGD(rank=2)))``.
"""

from lightning.pytorch.strategies import StrategyRegistry as _StrategyRegistry

from lightning_gradcomp import callbacks, compressors, tasks, transforms
from lightning_gradcomp.callbacks import AutoCompression as _AutoCompression
from lightning_gradcomp.callbacks import PacTrain
from lightning_gradcomp.compressors.base import BucketContext, Compressor, Layer
from lightning_gradcomp.ddp import CompressedDDP, CompressionState, compression_hook
from lightning_gradcomp.diloco import DiLoCo
from lightning_gradcomp.diloco.sharded import ShardedDiLoCo
from lightning_gradcomp.ft import TorchFT
from lightning_gradcomp.transforms import Pufferfish

__version__ = "0.1.0.dev0"

# Trainer(strategy="compressed_ddp"), its presets and Trainer(strategy="diloco") (Lightning discovers no
# third-party strategy itself); a name already taken (a user's own entry) is kept
CompressedDDP.register_strategies(_StrategyRegistry)
DiLoCo.register_strategies(_StrategyRegistry)
ShardedDiLoCo.register_strategies(_StrategyRegistry)
# CompressedDDP(compressor="auto") adds this callback when fitting; wired here, where both layers are known
CompressedDDP.auto_callback = _AutoCompression

__all__ = [
    "BucketContext",
    "CompressedDDP",
    "CompressionState",
    "Compressor",
    "DiLoCo",
    "Layer",
    "PacTrain",
    "Pufferfish",
    "ShardedDiLoCo",
    "TorchFT",
    "callbacks",
    "compression_hook",
    "compressors",
    "tasks",
    "transforms",
]
