"""Accuracy of PacTrain-style pruning against dense training on a small real task (a benchmark, not a test).

scikit-learn's bundled digits (1,797 8x8 images, 10 classes; offline): a fixed stratified split of 1,437 training
and 360 test images, a small CNN (two 3x3 convolutions, two linear layers; 150k parameters), two CPU processes under
``CompressedDDP``, SGD with momentum, a cosine learning-rate schedule. Each configuration reports the test accuracy
of the final weights (rank 0's, which equal rank 1's), the pruned fraction of the prunable weights and the bytes each
rank sent in the last step. Everything is deterministic on the CPU: the numbers repeat exactly.

Examples::

    python benchmarks/pactrain_accuracy.py                      # the table in docs/pactrain.md
    python benchmarks/pactrain_accuracy.py --configs dense element-90 --epochs 10
"""

from __future__ import annotations

import argparse
import os
import tempfile

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn

from lightning_gradcomp import CompressedDDP, PacTrain
from lightning_gradcomp.compressors import TopK
from lightning_gradcomp.demo.digits import BATCH_SIZE, DigitsNet, digits_split


def accuracy(model: nn.Module) -> float:
    """Test accuracy in percent."""
    x, y = digits_split(train=False).tensors
    model.eval()
    with torch.no_grad():
        return 100.0 * (model(x).argmax(1) == y).float().mean().item()


def pactrain(sparsity: float, steps_per_epoch: int, epochs: int, **kwargs) -> PacTrain:
    """Prune from 10% to 60% of training, every half epoch, to ``sparsity`` (cubic schedule)."""
    start, end = int(0.1 * epochs * steps_per_epoch), int(0.6 * epochs * steps_per_epoch)
    return PacTrain(sparsity=sparsity, start_step=start, end_step=end, frequency=max(1, steps_per_epoch // 2), **kwargs)


CONFIGS = {
    "dense": {},
    "element-50": {"sparsity": 0.5},
    "element-90": {"sparsity": 0.9},
    "element-95": {"sparsity": 0.95},
    "channel-50": {"sparsity": 0.5, "granularity": "channel", "exclude": ["fc2.*"]},
    "global-90": {"sparsity": 0.9, "scope": "global"},
    "element-90+topk": {"sparsity": 0.9, "compressor": "topk"},
}


class _LastStep(Callback):
    """Keep rank 0's telemetry of the last step (bytes sent and dense) for the report."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_end(self, trainer, pl_module) -> None:
        telemetry = trainer.strategy.compression_state.telemetry
        if trainer.global_rank == 0 and telemetry.last is not None:
            torch.save({"bytes_sent": telemetry.last.bytes_sent, "bytes_dense": telemetry.last.bytes_dense}, self.path)


def run(config: str, epochs: int, workdir: str) -> dict:
    """Train one configuration on two processes; return its accuracy, sparsity and last-step bytes."""
    options = dict(CONFIGS[config])
    compressor = TopK(ratio=0.25) if options.pop("compressor", None) == "topk" else None
    steps_per_epoch = -(-len(digits_split(train=True)) // (2 * BATCH_SIZE))
    callbacks: list[Callback] = [_LastStep(os.path.join(workdir, "last.pt"))]
    pruning = pactrain(epochs=epochs, steps_per_epoch=steps_per_epoch, **options) if options else None
    if pruning is not None:
        callbacks.append(pruning)
    model = DigitsNet(epochs=epochs)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        max_epochs=epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        strategy=CompressedDDP(compressor, start_method="spawn"),
    )
    trainer.fit(model)
    last = torch.load(os.path.join(workdir, "last.pt"))
    weights = {n: p for n, p in model.named_parameters() if p.dim() >= 2}
    pruned = sum(int((p == 0).sum()) for p in weights.values()) / sum(p.numel() for p in weights.values())
    return {"config": config, "accuracy": accuracy(model), "sparsity": pruned, **last}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--epochs", type=int, default=30)
    args = parser.parse_args()
    rows = []
    for config in args.configs:
        with tempfile.TemporaryDirectory() as workdir:
            rows.append(run(config, args.epochs, workdir))
    dense = next((r["accuracy"] for r in rows if r["config"] == "dense"), None)
    print(f"\ndigits, 2 processes, {args.epochs} epochs\n")
    print(
        "| configuration | test accuracy (%) | vs dense (points) | pruned weights | bytes sent per step (rank 0) |"
        " vs dense bytes |"
    )
    print("|---|---|---|---|---|---|")
    for r in rows:
        delta = f"{r['accuracy'] - dense:+.2f}" if dense is not None else ""
        print(
            f"| {r['config']} | {r['accuracy']:.2f} | {delta} | {r['sparsity']:.4f} | {r['bytes_sent']:,} |"
            f" {r['bytes_sent'] / r['bytes_dense']:.4f} |"
        )


if __name__ == "__main__":
    main()
