"""One "node" of a two-node run (launched by tests/test_multinode.py with NODE_RANK set, as on a real cluster)."""

import sys

import lightning.pytorch as pl
import torch

from lightning_gradcomp import CompressedDDP
from lightning_gradcomp.callbacks import CompressionMonitor
from lightning_gradcomp.compressors import PowerSGD
from tests.models import RecordRanks, TinyNet

if __name__ == "__main__":
    torch.set_num_threads(1)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        num_nodes=2,
        strategy=CompressedDDP(PowerSGD(rank=2), min_compress_numel=64),
        max_steps=6,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[CompressionMonitor(), RecordRanks(sys.argv[1])],
    )
    trainer.fit(TinyNet())
