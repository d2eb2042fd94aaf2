"""Train a small CNN on two CPU processes with gradient compression: the one-line change, end to end.

    python examples/train.py --compressor powersgd
    python examples/train.py --compressor topk --steps 200

Runs offline: the data is synthetic (8x8 images labelled by a fixed random teacher network), so it needs no download.
At the end, lightning-gradcomp prints how many bytes each rank sent compared with plain DDP.
"""

import argparse

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_gradcomp import CompressedDDP
from lightning_gradcomp.compressors import BF16, FP16, Identity, PowerSGD, RandomK, TopK

COMPRESSORS = {
    "identity": Identity,
    "fp16": FP16,
    "bf16": BF16,
    "topk": lambda: TopK(ratio=0.01),
    "randomk": lambda: RandomK(ratio=0.01),
    "powersgd": lambda: PowerSGD(rank=2),
}


def dataset(n: int = 4096, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 1, 8, 8, generator=g)
    y = (x.flatten(1) @ torch.randn(64, 10, generator=g)).argmax(1)
    return TensorDataset(x, y)


class SmallCNN(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(1, 32, 3), nn.ReLU(), nn.Conv2d(32, 64, 3), nn.ReLU(), nn.Flatten(),
            nn.Linear(64 * 4 * 4, 128), nn.ReLU(), nn.Linear(128, 10),
        )  # fmt: skip

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        loss = nn.functional.cross_entropy(logits, y)
        self.log("loss", loss, prog_bar=True)
        self.log("acc", (logits.argmax(1) == y).float().mean(), prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def train_dataloader(self):
        return DataLoader(dataset(), batch_size=64, shuffle=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compressor", choices=list(COMPRESSORS), default="powersgd")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args()
    torch.set_num_threads(1)
    pl.seed_everything(0)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=CompressedDDP(compressor=COMPRESSORS[args.compressor]()),  # the one-line change
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    trainer.fit(SmallCNN())


if __name__ == "__main__":
    main()
