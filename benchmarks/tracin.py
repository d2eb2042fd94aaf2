"""TracIn scoring time: lightning-gradcomp's ``TracInScorer`` against Captum's ``TracInCP`` on the same checkpoints.

Trains an MLP on scikit-learn's digits (one process, SGD, a checkpoint with its learning rate every epoch), then
times, on the same checkpoints and the same layers:

* self-influence of every training example: ours (``torch.func`` per-example gradients; last-layer fast path;
  sharded over ``--processes`` gloo processes) against Captum's ``TracInCP`` (``sample_wise_grads_per_batch``) and
  ``TracInCPFast`` (which leaves out the last layer's bias, so its scores differ by that term);
* influence of ``--test`` held-out examples on every training example (the proponent/opponent score matrix): ours
  (full, last layer, and last layer with a random projection) against Captum's ``TracInCP``, ``TracInCPFast`` and
  ``TracInCPFastRandProj``.

Each configuration's time is the median of ``--repeats`` runs; the largest relative deviation from Captum's scores
is printed next to it (exact pairs agree to ~1e-7; projections are estimates). Timings depend on the machine: take
them on a quiet one::

    python benchmarks/tracin.py --repeats 5 --out benchmarks/results/tracin_scoring.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable

import torch
import torch.multiprocessing as mp
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_gradcomp.demo.digits import DigitsMLP, digits
from lightning_gradcomp.tracin.scoring import TracInScorer, load_tracin_checkpoint, save_tracin_checkpoint


def train(args: argparse.Namespace, workdir: str) -> tuple[DigitsMLP, TensorDataset, tuple, list[str]]:
    full, _ = digits()
    train_set = TensorDataset(full.tensors[0][: args.n], full.tensors[1][: args.n])
    test = (full.tensors[0][args.n : args.n + args.test], full.tensors[1][args.n : args.n + args.test])
    model = DigitsMLP(train_set, hidden=tuple(args.hidden))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    paths = []
    for epoch in range(args.epochs):
        for x, y in DataLoader(train_set, batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(epoch)):
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
        paths.append(os.path.join(workdir, f"epoch{epoch}.pt"))
        save_tracin_checkpoint(model, paths[-1], optimizer.param_groups[0]["lr"])
    return model.eval(), train_set, test, paths


def timed(fn: Callable[[], torch.Tensor], repeats: int) -> tuple[float, torch.Tensor]:
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def _sharded_worker(
    rank: int, world_size: int, port: int, args: argparse.Namespace, paths: list[str], out: str
) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    full, _ = digits()
    train_set = TensorDataset(full.tensors[0][: args.n], full.tensors[1][: args.n])
    model = DigitsMLP(train_set, hidden=tuple(args.hidden)).eval()
    scorer = TracInScorer(model, paths, batch_size=args.batch_size)
    times = []
    for _ in range(args.repeats):
        dist.barrier()
        start = time.perf_counter()
        scores = scorer.self_influence(train_set)
        dist.barrier()
        times.append(time.perf_counter() - start)
    if rank == 0:
        torch.save({"time": statistics.median(times), "scores": scores}, out)
    dist.destroy_process_group()


def sharded(args: argparse.Namespace, paths: list[str], workdir: str) -> tuple[float, torch.Tensor]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = os.path.join(workdir, "sharded.pt")
    mp.spawn(_sharded_worker, args=(args.processes, port, args, paths, out), nprocs=args.processes)
    result = torch.load(out, weights_only=True)
    return result["time"], result["scores"]


def deviation(ours: torch.Tensor, reference: torch.Tensor) -> float:
    reference = reference.double()
    return ((ours.double() - reference).abs().max() / reference.abs().max()).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=1500, help="training examples")
    parser.add_argument("--test", type=int, default=32, help="test examples for the influence matrix")
    parser.add_argument("--epochs", type=int, default=5, help="checkpoints")
    parser.add_argument("--hidden", type=int, nargs="+", default=[256, 128])
    parser.add_argument("--batch-size", type=int, default=250)
    parser.add_argument("--projection-dim", type=int, default=64)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads in the main process")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from captum.influence import TracInCP, TracInCPFast, TracInCPFastRandProj

    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        model, train_set, test, paths = train(args, workdir)
        last = "net.4" if len(args.hidden) == 2 else f"net.{2 * len(args.hidden)}"
        loader = DataLoader(train_set, batch_size=args.batch_size)
        loss = nn.CrossEntropyLoss(reduction="sum")
        common = {"checkpoints_load_func": load_tracin_checkpoint, "loss_fn": loss, "batch_size": args.batch_size}
        captum_full = TracInCP(model, train_set, paths, sample_wise_grads_per_batch=True, **common)
        captum_last = TracInCP(model, train_set, paths, layers=[last], sample_wise_grads_per_batch=True, **common)
        captum_fast = TracInCPFast(model, last, train_set, paths, **common)
        ours = {
            "full": TracInScorer(model, paths, batch_size=args.batch_size),
            "last_layer": TracInScorer(model, paths, method="last_layer", batch_size=args.batch_size),
            "projected": TracInScorer(
                model, paths, method="last_layer", projection_dim=args.projection_dim, batch_size=args.batch_size
            ),
        }

        def row(task, name, fn, reference=None):
            seconds, scores = timed(fn, args.repeats)
            rows.append(
                {
                    "task": task,
                    "implementation": name,
                    "seconds": seconds,
                    "deviation": deviation(scores, reference) if reference is not None else None,
                }
            )
            print(f"{task:15s} {name:55s} {seconds:8.3f} s", flush=True)
            return scores

        ref = row("self-influence", "captum TracInCP (all layers)", lambda: captum_full.self_influence(loader))
        row("self-influence", "ours, all layers (torch.func)", lambda: ours["full"].self_influence(train_set), ref)
        seconds, scores = sharded(args, paths, workdir)
        rows.append(
            {
                "task": "self-influence",
                "implementation": f"ours, all layers, {args.processes} processes",
                "seconds": seconds,
                "deviation": deviation(scores, ref),
            }
        )
        print(f"{'self-influence':15s} {rows[-1]['implementation']:55s} {seconds:8.3f} s", flush=True)
        ref = row("self-influence", f"captum TracInCP (layers=[{last!r}])", lambda: captum_last.self_influence(loader))
        row(
            "self-influence",
            "ours, last layer (outer product)",
            lambda: ours["last_layer"].self_influence(train_set),
            ref,
        )
        row("self-influence", "captum TracInCPFast (last layer, no bias)", lambda: captum_fast.self_influence(loader))

        ref = row("influence", "captum TracInCP (all layers)", lambda: captum_full.influence(test))
        row("influence", "ours, all layers (torch.func)", lambda: ours["full"].influence(train_set, test), ref)
        ref = row("influence", f"captum TracInCP (layers=[{last!r}])", lambda: captum_last.influence(test))
        row("influence", "ours, last layer (outer product)", lambda: ours["last_layer"].influence(train_set, test), ref)
        row(
            "influence",
            f"ours, last layer, projection_dim={args.projection_dim}",
            lambda: ours["projected"].influence(train_set, test),
            ref,
        )
        row("influence", "captum TracInCPFast (last layer, no bias)", lambda: captum_fast.influence(test))
        try:  # builds a nearest-neighbour index with the optional `annoy` package
            rand_proj = TracInCPFastRandProj(
                model, last, train_set, paths, projection_dim=args.projection_dim, **common
            )
        except (ImportError, ValueError) as err:
            print(f"captum TracInCPFastRandProj skipped: {err}")
        else:
            row(
                "influence",
                f"captum TracInCPFastRandProj (projection_dim={args.projection_dim})",
                lambda: rand_proj.influence(test),
            )

    print("\n| task | implementation | seconds (median) | max deviation from Captum's exact scores |")
    print("|---|---|---|---|")
    for r in rows:
        dev = "" if r["deviation"] is None else f"{r['deviation']:.1e}"
        print(f"| {r['task']} | {r['implementation']} | {r['seconds']:.3f} | {dev} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
