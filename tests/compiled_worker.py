"""TinyNet trained on CPU processes, compiled with ``torch.compile`` or not (launched by tests/test_strategy.py).

Lightning's spawn launcher pickles the model for its workers, and a compiled model does not pickle (under plain
``DDPStrategy`` too), so this script runs under Lightning's default launcher, which starts the script again for every
further rank, as a user's training script runs::

    python -m tests.compiled_worker STRATEGY DIRPATH DEVICES compiled|eager [OPTIMIZE_DDP]

``OPTIMIZE_DDP``, if given, is set as ``torch._dynamo.config.optimize_ddp`` before the model is wrapped.
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

if __name__ == "__main__":
    name, dirpath, devices, mode, *optimize_ddp = sys.argv[1:]
    if optimize_ddp:
        torch._dynamo.config.optimize_ddp = optimize_ddp[0]
    torch.set_num_threads(1)
    os.makedirs(dirpath, exist_ok=True)
    strategy = STRATEGIES[name]()
    monitor = [CompressionMonitor()] if isinstance(strategy, CompressedDDP) else []
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=int(devices),
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
