"""Accordion on a real small training run: which layers it compresses how hard, epoch by epoch, and what it saves.

Trains a three-layer MLP on scikit-learn's digits (offline) with two CPU processes, SGD with momentum and a step
learning-rate decay, three ways: PowerSGD (or top-k) at the low-compression level throughout ("static low"), at the
high-compression level throughout ("static high"), and with Accordion switching every layer between the two.
Reports, per epoch, the level of every layer under Accordion, and per run the bytes each rank sent (telemetry:
what was handed to the collectives), the compression ratio and the final accuracy on held-out digits.

Everything is deterministic (fixed seeds, CPU): the numbers are results, not timings::

    python benchmarks/accordion_digits.py                      # PowerSGD rank 4 / rank 1
    python benchmarks/accordion_digits.py --compressor topk    # top-k keep 99 % / 10 %
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch
from torch.utils.data import TensorDataset

from lightning_gradcomp import CompressedDDP
from lightning_gradcomp.callbacks import Accordion
from lightning_gradcomp.compressors import PowerSGD, TopK
from lightning_gradcomp.demo.digits import DigitsMLP, accuracy, digits, fit

LEVELS = {"powersgd": (4, 1), "topk": (0.99, 0.1)}


def make_compressor(name: str, level: float):
    return PowerSGD(rank=int(level)) if name == "powersgd" else TopK(ratio=level)


def run(args: argparse.Namespace, label: str, level: float, accordion: Accordion | None, workdir: str) -> dict:
    train, _ = digits(n=args.n)
    full, _ = digits()
    test = TensorDataset(full.tensors[0][args.n :], full.tensors[1][args.n :])
    model = DigitsMLP(train, lr=args.lr, milestones=[args.milestone], batch_size=args.batch_size)
    strategy = CompressedDDP(
        make_compressor(args.compressor, level), min_compress_numel=args.min_compress_numel, start_method="spawn"
    )
    callbacks = [accordion] if accordion is not None else []
    _, records = fit(model, strategy, os.path.join(workdir, label), callbacks=callbacks, max_epochs=args.epochs)
    result = {
        "run": label,
        "bytes_sent_per_rank": records[0]["total_bytes_sent"],
        "bytes_dense_per_rank": records[0]["total_bytes_dense"],
        "compression_ratio": records[0]["total_bytes_dense"] / records[0]["total_bytes_sent"],
        "test_accuracy": accuracy(model, test),
        "train_accuracy": accuracy(model, train),
        "replicas_identical": all(
            torch.equal(records[0]["final"][k], records[1]["final"][k]) for k in records[0]["final"]
        ),
    }
    if accordion is not None:
        histories = [r["callbacks"]["Accordion"]["history"] for r in records]
        result["ranks_agree"] = histories[0] == histories[1]
        result["epochs"] = [
            {
                "epoch": h["epoch"],
                "lr_decay": h["lr_decay"],
                "levels": h["levels"],
                "changes": {k: (None if v == float("inf") else round(v, 3)) for k, v in (h["changes"] or {}).items()},
            }
            for h in histories[0]
        ]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--compressor", choices=sorted(LEVELS), default="powersgd")
    parser.add_argument("--epochs", type=int, default=16)
    parser.add_argument("--milestone", type=int, default=8, help="epoch at which the learning rate drops 10x")
    parser.add_argument("--interval", type=int, default=2)
    parser.add_argument("--eta", type=float, default=0.5)
    parser.add_argument("--n", type=int, default=1024, help="training examples (the other digits are held out)")
    parser.add_argument("--batch-size", type=int, default=16, help="per process")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--min-compress-numel", type=int, default=512)
    parser.add_argument("--out", default=None, help="JSON file for the results")
    args = parser.parse_args()
    low, high = LEVELS[args.compressor]
    with tempfile.TemporaryDirectory() as workdir:
        results = [
            run(args, "static-low", low, None, workdir),
            run(args, "static-high", high, None, workdir),
            run(
                args,
                "accordion",
                high,
                Accordion(interval=args.interval, eta=args.eta, low_compression_level=low, high_compression_level=high),
                workdir,
            ),
        ]
    accordion = results[-1]
    layers = list(accordion["epochs"][0]["levels"])
    print(
        f"\nAccordion ({args.compressor}, low={low}, high={high}, interval={args.interval}, eta={args.eta},"
        f" lr x0.1 at epoch {args.milestone}): level per layer and epoch\n"
    )
    print("| epoch | lr decay | " + " | ".join(layers) + " | relative change at the check |")
    print("|---|---|" + "---|" * len(layers) + "---|")
    for e in accordion["epochs"]:
        changes = ", ".join(f"{v}" for v in e["changes"].values()) if e["changes"] else ""
        row = " | ".join(str(e["levels"][name]) for name in layers)
        print(f"| {e['epoch']} | {'yes' if e['lr_decay'] else ''} | {row} | {changes} |")
    print("\n| run | MB sent per rank | compression ratio | held-out accuracy | train accuracy |")
    print("|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['run']} | {r['bytes_sent_per_rank'] / 1e6:.3f} | {r['compression_ratio']:.1f}x |"
            f" {r['test_accuracy']:.4f} | {r['train_accuracy']:.4f} |"
        )
    saved = 1 - accordion["bytes_sent_per_rank"] / results[0]["bytes_sent_per_rank"]
    print(
        f"\nAccordion sent {saved:.1%} fewer bytes than static low compression; ranks agree on every decision:"
        f" {accordion['ranks_agree']}; replicas identical: {all(r['replicas_identical'] for r in results)}."
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
