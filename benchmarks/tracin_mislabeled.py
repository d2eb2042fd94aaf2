"""Mislabeled-data detection with TracIn self-influence (the protocol of Pruthi et al., NeurIPS 2020, section 4.1).

Flips 10 % of the labels of scikit-learn's digits (offline, 1797 8x8 images), trains a small MLP on two CPU processes
with ``CompressedDDP`` and the ``TracIn`` callback (a checkpoint with its learning rate every epoch), which scores
the self-influence of every training example after training, in parallel over both processes, and writes its
report. Then ranks the training set four ways and reports the fraction of the flipped examples found in the top
10 % and 20 % of each ranking:

* TracIn self-influence, full gradients (every parameter, ``torch.func``): what the callback computed;
* TracIn self-influence, last layer only (the outer-product fast path);
* the final model's loss on the example (a strong, cheap baseline);
* random order (expected value: the fraction inspected; also a seeded draw).

Deterministic (fixed seeds, CPU)::

    python benchmarks/tracin_mislabeled.py                           # Identity (plain DDP averaging)
    python benchmarks/tracin_mislabeled.py --compressor powersgd     # trained with PowerSGD rank 2
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile

import torch

from lightning_gradcomp import CompressedDDP
from lightning_gradcomp.callbacks import TracIn
from lightning_gradcomp.compressors import Identity, PowerSGD
from lightning_gradcomp.demo.digits import DigitsMLP, digits, fit
from lightning_gradcomp.tracin.scoring import TracInScorer, detection_curve

FRACTIONS = (0.1, 0.2)


def train_and_rank(args: argparse.Namespace, workdir: str) -> dict:
    dataset, flipped = digits(n=args.n, flip_fraction=args.flip, seed=args.seed)
    model = DigitsMLP(
        dataset, hidden=tuple(args.hidden), lr=args.lr, milestones=args.milestones, batch_size=args.batch_size
    )
    compressor = PowerSGD(rank=2) if args.compressor == "powersgd" else Identity()
    strategy = CompressedDDP(compressor, min_compress_numel=512, start_method="spawn")
    tracin = TracIn(os.path.join(workdir, "tracin"), every_n_epochs=1, top_n=args.top_n, show_progress=False)
    _, records = fit(model, strategy, os.path.join(workdir, "run"), callbacks=[tracin], max_epochs=args.epochs)
    scores, losses = records[0]["tracin_scores"], records[0]["tracin_losses"]
    assert torch.equal(scores, records[1]["tracin_scores"]), "every rank holds the gathered scores"
    checkpoints = sorted(
        (os.path.join(workdir, "tracin", f) for f in os.listdir(os.path.join(workdir, "tracin")) if f.endswith(".pt")),
        key=lambda p: int(p.rsplit("step=", 1)[1][:-3]),
    )
    last_layer = TracInScorer(model, checkpoints, method="last_layer").self_influence(dataset)
    flagged = set(flipped)
    generator = torch.Generator().manual_seed(args.seed)
    rankings = {
        "TracIn self-influence (all layers)": torch.argsort(scores, descending=True).tolist(),
        "TracIn self-influence (last layer)": torch.argsort(last_layer, descending=True).tolist(),
        "final loss": torch.argsort(losses, descending=True).tolist(),
        "random order (one seeded draw)": torch.randperm(len(dataset), generator=generator).tolist(),
    }
    found = {name: detection_curve(order, flagged, FRACTIONS) for name, order in rankings.items()}
    found["random order (expected)"] = list(FRACTIONS)
    if args.report_dir:
        os.makedirs(args.report_dir, exist_ok=True)
        shutil.copy(os.path.join(workdir, "tracin", "report", "top_self_influence.png"), args.report_dir)
    top = rankings["TracIn self-influence (all layers)"][: args.top_n]
    return {
        "examples": len(dataset),
        "flipped": len(flipped),
        "checkpoints": len(checkpoints),
        "found": found,
        "flipped_among_top_n_shown": sum(1 for i in top if i in flagged),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=None, help="training examples (default: all 1797 digits)")
    parser.add_argument("--flip", type=float, default=0.1, help="fraction of labels flipped")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--milestones", type=int, nargs="*", default=[15])
    parser.add_argument("--hidden", type=int, nargs="+", default=[64])
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--batch-size", type=int, default=32, help="per process")
    parser.add_argument("--compressor", choices=["identity", "powersgd"], default="identity")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--top-n", type=int, default=64, help="examples in the PNG grid")
    parser.add_argument("--report-dir", default=None, help="copy the PNG grid here")
    parser.add_argument("--out", default=None, help="JSON file for the results")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        result = train_and_rank(args, workdir)
    print(
        f"\n{result['flipped']} of {result['examples']} labels flipped; {result['checkpoints']} checkpoints;"
        f" trained with {args.compressor}.\n"
    )
    print("| ranking | flipped found in top 10 % | in top 20 % |")
    print("|---|---|---|")
    for name, (ten, twenty) in result["found"].items():
        print(f"| {name} | {ten:.1%} | {twenty:.1%} |")
    print(f"\nFlipped examples among the {args.top_n} shown in the PNG grid: {result['flipped_among_top_n_shown']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), **result}, f, indent=1)


if __name__ == "__main__":
    main()
