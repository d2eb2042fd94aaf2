"""DiLoCo on a small-batch CNN with BatchNorm, with and without a dense warm-up (``DenseWarmup``).

Local-SGD methods have lost accuracy on CNNs with BatchNorm and small batches (pytorch/pytorch#74157: -7 points of
ImageNet top-1 with post-local SGD). This measures what DiLoCo does on the package's offline analogue: scikit-learn's
digits (1437 training images, 360 held out), the ``"cnn"`` classifier (two 3x3 convolutions with BatchNorm, 8x8
inputs), ``batch`` samples per worker and step, two gloo worker processes on the CPU, SGD (lr 0.1, momentum 0.9,
weight decay 1e-4, the ``ImageClassifier`` defaults) as the inner optimizer, for ``--epochs`` epochs. Configurations:

- ``ddp``: plain ``DDPStrategy`` (the reference);
- ``diloco``: ``DiLoCo(sync_every=H)`` from the first step, outer SGD with ``--outer-lr`` and ``--outer-momentum``
  (Nesterov when above 0; the defaults, 0.7 and 0.9, are the paper's);
- ``diloco-warmup``: the same with ``DenseWarmup(epochs=W)``: plain data parallelism for the first ``W`` epochs,
  then DiLoCo's rounds from the synchronized weights.

Each seed fixes the initial weights and the split and order of the data, the same for every configuration. The
table gives the held-out accuracy of the final model (theta_global for DiLoCo) and its loss, per seed and the mean.
Runs under Lightning's default launcher (the script runs again for the second process), so run it as a script::

    python benchmarks/diloco_warmup.py
    python benchmarks/diloco_warmup.py --seeds 0 1 2 --epochs 4 --batch 8 --sync-every 20 --warmup-epochs 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings
from functools import partial

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy

from lightning_gradcomp import DiLoCo
from lightning_gradcomp.callbacks import DenseWarmup
from lightning_gradcomp.tasks.classification import ImageClassifier
from lightning_gradcomp.tasks.data import DigitsDataModule

CONFIGS = ("diloco", "diloco-warmup", "ddp")


def _fit(config: str, seed: int, args: argparse.Namespace) -> dict[str, float]:
    """Train one configuration from seed ``seed``; the final model's held-out accuracy and loss."""
    pl.seed_everything(seed, verbose=False)
    model = ImageClassifier(arch="cnn")
    data = DigitsDataModule(batch_size=args.batch, seed=seed)
    outer = partial(torch.optim.SGD, lr=args.outer_lr, momentum=args.outer_momentum, nesterov=args.outer_momentum > 0)
    strategy = (
        DDPStrategy() if config == "ddp" else DiLoCo(sync_every=args.sync_every, outer_optimizer=outer, monitor=False)
    )
    callbacks = [DenseWarmup(epochs=args.warmup_epochs)] if config == "diloco-warmup" else []
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.workers,
        strategy=strategy,
        max_epochs=args.epochs,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        check_val_every_n_epoch=args.epochs,
    )
    start = time.perf_counter()
    trainer.fit(model, datamodule=data)
    seconds = time.perf_counter() - start
    (metrics,) = trainer.validate(model, datamodule=data, verbose=False)  # the final model (DiLoCo: theta_global)
    return {
        "val_acc": float(metrics["val_acc"]),
        "val_loss": float(metrics["val_loss"]),
        "seconds": seconds,
        "steps": trainer.global_step,
    }


def _table(results: dict[str, dict[int, dict[str, float]]], seeds: list[int]) -> str:
    lines = [
        "| configuration | " + " | ".join(f"seed {s}" for s in seeds) + " | mean accuracy | mean loss |",
        "|---|" + "---|" * (len(seeds) + 2),
    ]
    for config, by_seed in results.items():
        accs = [by_seed[s]["val_acc"] for s in seeds]
        losses = [by_seed[s]["val_loss"] for s in seeds]
        cells = " | ".join(f"{100 * a:.1f} %" for a in accs)
        lines.append(f"| {config} | {cells} | {100 * statistics.mean(accs):.1f} % | {statistics.mean(losses):.3f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8, help="samples per worker and step")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--sync-every", type=int, default=20, help="DiLoCo's H")
    parser.add_argument("--warmup-epochs", type=int, default=1, help="DenseWarmup's dense epochs")
    parser.add_argument("--outer-lr", type=float, default=0.7, help="DiLoCo's outer SGD learning rate")
    parser.add_argument(
        "--outer-momentum",
        type=float,
        default=0.9,
        help="DiLoCo's outer SGD momentum (Nesterov when above 0; 0 with lr 1.0 averages the replicas)",
    )
    parser.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    parser.add_argument("--json", help="write the results here as JSON")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    torch.set_num_threads(1)
    results: dict[str, dict[int, dict[str, float]]] = {config: {} for config in args.configs}
    main_process = int(os.environ.get("LOCAL_RANK", "0")) == 0
    for seed in args.seeds:  # seed by seed: every configuration of a seed is done before the next seed starts
        for config in args.configs:
            results[config][seed] = _fit(config, seed, args)
            if main_process:
                print(f"RESULT {json.dumps({'config': config, 'seed': seed, **results[config][seed]})}", flush=True)
    if not main_process:
        return
    print(
        f"digits, 'cnn' with BatchNorm, {args.workers} workers x batch {args.batch}, {args.epochs} epochs"
        f" ({results[args.configs[0]][args.seeds[0]]['steps']} steps), DiLoCo H = {args.sync_every},"
        f" warm-up {args.warmup_epochs} epoch(s), outer SGD lr {args.outer_lr} momentum {args.outer_momentum};"
        f" `{' '.join(sys.argv)}`"
    )
    print(_table(results, args.seeds))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
