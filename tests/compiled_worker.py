"""TinyNet trained on CPU processes, compiled with ``torch.compile`` or not (launched by tests/test_strategy.py).

Lightning's spawn launcher pickles the model for its workers, and a compiled model does not pickle (under plain
``DDPStrategy`` too), so this script runs under Lightning's default launcher, which starts the script again for every
further rank, as a user's training script runs. One launch runs several fits, one after another, each recorded in
``DIRPATH/STRATEGY-MODE``::

    python -m tests.compiled_worker DIRPATH DEVICES STRATEGY:compiled|eager ... [--optimize-ddp MODE]

``--optimize-ddp``, if given, is set as ``torch._dynamo.config.optimize_ddp`` before any model is wrapped.
"""

import os
import sys

import lightning.pytorch as pl
import torch
import torch._dynamo
from lightning.pytorch.strategies import DDPStrategy

from lightning_gradcomp import CompressedDDP
from lightning_gradcomp.callbacks import CompressionMonitor
from lightning_gradcomp.compressors import Identity, TopK
from tests.models import RecordRanks, TinyNet

STRATEGIES = {
    "ddp": DDPStrategy,
    "identity": lambda: CompressedDDP(Identity()),
    "topk": lambda: CompressedDDP(TopK(ratio=0.05), min_compress_numel=64),
}

def train(name: str, mode: str, dirpath: str, devices: int) -> None:
    """One fit of a fresh TinyNet under strategy ``name``, compiled or ``eager``, recorded in ``dirpath``."""
    os.makedirs(dirpath, exist_ok=True)
    strategy = STRATEGIES[name]()
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
    )
    model = TinyNet()
    trainer.fit(torch.compile(model) if mode == "compiled" else model)


if __name__ == "__main__":
    args = sys.argv[1:]
    if "--optimize-ddp" in args:
        at = args.index("--optimize-ddp")
        torch._dynamo.config.optimize_ddp = args[at + 1]
        del args[at : at + 2]
    root, devices, *runs = args
    torch.set_num_threads(1)
    for run in runs:
        name, mode = run.split(":")
        train(name, mode, os.path.join(root, f"{name}-{mode}"), int(devices))
