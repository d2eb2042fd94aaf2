"""Fits of TinyNet and its variants on CPU processes, several in one launch (launched by tests/test_strategy.py).

Lightning's spawn launcher pickles the model for its workers, and a compiled model does not pickle (under plain
``DDPStrategy`` too), so this script runs under Lightning's default launcher, which starts the script again for every
further rank, as a user's training script runs. One launch runs several fits, one after another (a launch costs
seconds, a fit of TinyNet a fraction of one), each recorded in ``DIRPATH/STRATEGY-VARIANT``::

    python -m tests.fit_worker DIRPATH DEVICES STRATEGY:VARIANT ... [--optimize-ddp MODE]

``STRATEGY`` is one of :data:`STRATEGIES`, ``VARIANT`` one of :data:`VARIANTS` (the Trainer features a user of
``DDPStrategy`` may turn on). ``--optimize-ddp``, if given, is set as ``torch._dynamo.config.optimize_ddp`` before
any model is wrapped.
"""

import os
import sys
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
import torch._dynamo
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_gradcomp import CompressedDDP
from lightning_gradcomp.callbacks import CompressionMonitor
from lightning_gradcomp.compressors import Identity, TopK
from tests.models import RecordRanks, TinyNet

STRATEGIES: dict[str, Callable[..., DDPStrategy]] = {
    "ddp": DDPStrategy,
    "identity": lambda **kwargs: CompressedDDP(Identity(), **kwargs),
    "topk": lambda **kwargs: CompressedDDP(TopK(ratio=0.05), min_compress_numel=64, **kwargs),
}


class ManualNet(TinyNet):
    """TinyNet with manual optimization: ``manual_backward`` and the optimizer's step in ``training_step``."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        optimizer = self.optimizers()
        optimizer.zero_grad()
        loss = super().training_step(batch, batch_idx)
        self.manual_backward(loss)
        optimizer.step()
        return loss


class FrozenNet(TinyNet):
    """TinyNet with its first convolution frozen (DDP leaves it out of its buckets)."""

    def __init__(self) -> None:
        super().__init__()
        self.net[0].requires_grad_(False)


class UnusedNet(TinyNet):
    """TinyNet with a head used on even steps only (``find_unused_parameters=True``)."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(10, 10)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        out = self(x)
        if batch_idx % 2 == 0:
            out = out + self.head(out)
        return nn.functional.cross_entropy(out, y)


class CheckpointedNet(TinyNet):
    """TinyNet whose convolutions are recomputed in the backward pass (activation checkpointing)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net[3:](checkpoint(self.net[:3], x, use_reentrant=False))


# variant -> (model, Trainer arguments, strategy arguments, compiled)
VARIANTS: dict[str, tuple[Callable[[], TinyNet], dict, dict, bool]] = {
    "eager": (TinyNet, {}, {}, False),
    "compiled": (TinyNet, {}, {}, True),
    "clip": (TinyNet, {"gradient_clip_val": 0.05}, {}, False),
    "fp64": (TinyNet, {"precision": "64-true"}, {}, False),
    "manual": (ManualNet, {}, {}, False),
    "frozen": (FrozenNet, {}, {}, False),
    "unused": (UnusedNet, {}, {"find_unused_parameters": True}, False),
    "checkpointed": (CheckpointedNet, {}, {}, False),
}


def train(name: str, variant: str, dirpath: str, devices: int) -> None:
    """One fit of a fresh model of ``variant`` under strategy ``name``, recorded in ``dirpath``."""
    make_model, trainer_kwargs, strategy_kwargs, compiled = VARIANTS[variant]
    os.makedirs(dirpath, exist_ok=True)
    strategy = STRATEGIES[name](**strategy_kwargs)
    monitor = [CompressionMonitor()] if isinstance(strategy, CompressedDDP) else []
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=4,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[*monitor, RecordRanks(dirpath)],
        **trainer_kwargs,
    )
    model = make_model()
    trainer.fit(torch.compile(model) if compiled else model)


if __name__ == "__main__":
    args = sys.argv[1:]
    if "--optimize-ddp" in args:
        at = args.index("--optimize-ddp")
        torch._dynamo.config.optimize_ddp = args[at + 1]
        del args[at : at + 2]
    root, devices, *runs = args
    torch.set_num_threads(1)
    for run in runs:
        name, variant = run.split(":")
        train(name, variant, os.path.join(root, f"{name}-{variant}"), int(devices))
