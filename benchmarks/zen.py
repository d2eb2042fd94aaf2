"""Zen against the all-gather of pairs and against dense all-reduce: bytes per rank, and step time on a shaped link.

Two parts (a benchmark, not a test):

* ``bytes``: simulated ranks (no processes) reduce one 1M-element bucket through ``TopK(0.01)`` over the all-gather
  and over Zen, with the ranks' top-k supports overlapping fully, half or not at all, at 2, 4 and 8 ranks; the
  telemetry's bytes received by the busiest rank, next to the formula of docs/zen.md.
* ``step``: gloo workers train an embedding model (``nn.Embedding(20000, 64)``, token ids drawn from a Zipf law as
  words are, a 2-layer head) inside a network namespace whose loopback is shaped with ``tc tbf`` (needs root), with
  plain DDP, Zen on the embedding, ``TopK(0.01)`` over the all-gather and over Zen. Median step time over a few
  steps; every worker's traffic crosses the one shaped link.

Examples::

    python benchmarks/zen.py bytes --out benchmarks/results/zen_bytes.json
    python benchmarks/zen.py step --workers 2 4 --rates 100mbit 1gbit --out benchmarks/results/zen_step.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _netns import shaped_namespace
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from lightning_gradcomp import CompressionState, compression_hook
from lightning_gradcomp.compressors import TopK, Zen
from lightning_gradcomp.compressors.base import layers_from_shapes
from lightning_gradcomp.engine.telemetry import Telemetry
from lightning_gradcomp.testing import simulate_reduce

CONFIGS = {
    "compute": None,  # DDP with torch's noop_hook: no communication, the compute floor
    "ddp": None,
    "zen-embedding": lambda: Zen(layers=["embedding.weight"]),
    "topk-allgather": lambda: TopK(ratio=0.01),
    "topk-zen": lambda: TopK(ratio=0.01, transport="zen"),
    "topk-auto": lambda: TopK(ratio=0.01, transport="zen-auto"),
}
VOCAB, DIM, SEQ, CLASSES = 20_000, 64, 35, 1000


# --------------------------------------------------------------------------------------------------------------------
# Bytes (simulated ranks)
# --------------------------------------------------------------------------------------------------------------------
def _supports(n: int, numel: int, k: int, overlap: float, seed: int = 0) -> list[torch.Tensor]:
    """Per rank, gradients whose top-k is a shared set of ``overlap * k`` indices plus ``(1 - overlap) k`` own ones."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(numel, generator=g)
    shared = int(overlap * k)
    out = []
    for r in range(n):
        own = perm[shared + r * (k - shared) : shared + (r + 1) * (k - shared)]
        x = 0.01 * torch.randn(numel, generator=g)
        x[torch.cat([perm[:shared], own])] = 100.0
        out.append(x)
    return out


def bytes_part(args: argparse.Namespace) -> list[dict]:
    numel, ratio = 1_000_000, 0.01
    k = int(numel * ratio)
    rows = []
    for n in (2, 4, 8):
        for overlap in (1.0, 0.5, 0.0):
            xs = _supports(n, numel, k, overlap)
            union = int(overlap * k) + n * (k - int(overlap * k))
            for transport in ("allgather", "zen"):
                telemetry = [Telemetry() for _ in range(n)]
                for t in telemetry:
                    t.add_bucket(numel * 4)
                compressors = [TopK(ratio=ratio, transport=transport) for _ in range(n)]
                simulate_reduce(compressors, xs, layers_from_shapes([(1000, 1000)]), telemetry=telemetry)
                stats = [t.pop_step() for t in telemetry]
                formula = (n - 1) * k * 8
                if transport == "zen":  # push: (n - 1) / n of k pairs; pull: n - 1 owners' shares of the union
                    share = union / n
                    formula = (n - 1) / n * k * 8 + (n - 1) * (min(4 * share, numel / n / 8) + 4 * share)
                rows.append(
                    {
                        "ranks": n,
                        "overlap": overlap,
                        "transport": transport,
                        "union": union,
                        "received_max": max(s.bytes_received for s in stats),
                        "sent_max": max(s.bytes_sent for s in stats),
                        "formula_received": round(formula),
                    }
                )
                print(rows[-1], file=sys.stderr, flush=True)
    return rows


def bytes_table(rows: list[dict]) -> str:
    lines = [
        "TopK(0.01) of a 1M-element bucket (k = 10,000 pairs of 8 bytes per rank); bytes received by the busiest rank"
        " per step (telemetry), next to the formula (docs/zen.md; the counts round and padding not included)",
        "",
        "| ranks | overlap of supports | union M | all-gather: received | formula | Zen: received | formula |"
        " all-gather / Zen |",
        "|---|---|---|---|---|---|---|---|",
    ]
    by = {(r["ranks"], r["overlap"], r["transport"]): r for r in rows}
    for n in (2, 4, 8):
        for overlap in (1.0, 0.5, 0.0):
            ag, zen = by[n, overlap, "allgather"], by[n, overlap, "zen"]
            lines.append(
                f"| {n} | {overlap:.0%} | {ag['union']:,} | {ag['received_max']:,} | {ag['formula_received']:,} |"
                f" {zen['received_max']:,} | {zen['formula_received']:,} |"
                f" {ag['received_max'] / zen['received_max']:.2f}x |"
            )
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------------------------
# Step time (processes on a shaped loopback)
# --------------------------------------------------------------------------------------------------------------------
class EmbeddingModel(nn.Module):
    """Mean of the embedded tokens, then a 2-layer head: the embedding's gradient has a row per distinct token."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embedding = nn.Embedding(VOCAB, DIM)
        self.head = nn.Sequential(nn.Linear(DIM, 256), nn.ReLU(), nn.Linear(256, CLASSES))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embedding(tokens).mean(1))


def _batch(rank: int, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    zipf = 1.0 / torch.arange(1, VOCAB + 1, dtype=torch.float64) ** 1.1  # word frequencies
    tokens = torch.multinomial(zipf, batch_size * SEQ, replacement=True, generator=g).view(batch_size, SEQ)
    return tokens, torch.randint(0, CLASSES, (batch_size,), generator=g)


def worker(rank: int, world_size: int, port: int, config: str, args: argparse.Namespace, out: str) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    model = EmbeddingModel()
    ddp = DDP(model)
    state = None
    if config == "compute":
        ddp.register_comm_hook(None, noop_hook)
    elif CONFIGS[config] is not None:
        state = CompressionState(CONFIGS[config]())
        state.attach(ddp)
        ddp.register_comm_hook(state, compression_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    times, sent, received = [], [], []
    for step in range(args.warmup + args.steps):
        tokens, y = _batch(rank, step, args.batch_size)
        dist.barrier()
        begin = time.perf_counter()
        nn.functional.cross_entropy(ddp(tokens), y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        elapsed = time.perf_counter() - begin
        stats = state.telemetry.pop_step() if state is not None else None
        if step >= args.warmup:
            times.append(elapsed)
            if stats is not None:
                sent.append(stats.bytes_sent)
                received.append(stats.bytes_received)
    dense = 0 if config == "compute" else sum(p.numel() for p in model.parameters()) * 4
    result = {
        "config": config,
        "workers": world_size,
        "step_s": statistics.median(times),
        "step_s_all": times,
        "bytes_sent": statistics.mean(sent) if sent else dense,
        "bytes_received": statistics.mean(received) if received else 2 * (world_size - 1) * dense / world_size,
        "bytes_measured": bool(sent),
    }
    torch.save(result, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


def run_config(config: str, workers: int, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as out:
        port = 29500 + (os.getpid() + hash(config) + workers) % 2000
        mp.spawn(worker, args=(workers, port, config, args, out), nprocs=workers)
        results = [torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=False) for r in range(workers)]
    merged = dict(results[0])
    merged["step_s"] = max(r["step_s"] for r in results)  # the slowest rank sets the pace
    merged["bytes_received"] = max(r["bytes_received"] for r in results)
    return merged


def step_part(args: argparse.Namespace) -> list[dict]:
    if not args.inside_namespace:
        rows = []
        for rate in args.rates:
            with tempfile.TemporaryDirectory() as tmp, shaped_namespace(rate) as name:
                out = os.path.join(tmp, "rows.json")
                command = [
                    "ip",
                    "netns",
                    "exec",
                    name,
                    sys.executable,
                    os.path.abspath(__file__),
                    "step",
                    "--inside-namespace",
                    "--rate",
                    rate,
                    "--out",
                    out,
                    "--workers",
                    *map(str, args.workers),
                    "--steps",
                    str(args.steps),
                    "--warmup",
                    str(args.warmup),
                    "--batch-size",
                    str(args.batch_size),
                    "--configs",
                    *args.configs,
                ]
                subprocess.run(command, check=True)
                with open(out) as f:
                    rows.extend(json.load(f))
        return rows
    rows = []
    for workers in args.workers:
        for config in args.configs:
            begin = time.time()
            row = {"rate": args.rate, **run_config(config, workers, args)}
            rows.append(row)
            print(
                f"# {args.rate} {workers} workers {config}: {row['step_s']:.3f} s/step ({time.time() - begin:.0f} s)",
                file=sys.stderr,
                flush=True,
            )
    return rows


def step_table(rows: list[dict], args: argparse.Namespace) -> str:
    lines = [
        f"Embedding model (nn.Embedding({VOCAB}, {DIM}), Zipf tokens, {SEQ} per sample, batch {args.batch_size} per"
        f" worker; {VOCAB * DIM + DIM * 256 + 256 + 256 * CLASSES + CLASSES:,} parameters), gloo workers with 1 thread"
        f" on a shared 2-core machine, median of {args.steps} steps after {args.warmup} warm-up steps (slowest rank)",
        "",
        "| link | workers | configuration | step time (s) | vs plain DDP | vs TopK all-gather |"
        " communication (s) | communication vs plain DDP | bytes sent per rank | bytes received (busiest rank) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    by = {(r["rate"], r["workers"], r["config"]): r for r in rows}
    for r in rows:
        ddp = by.get((r["rate"], r["workers"], "ddp"))
        ag = by.get((r["rate"], r["workers"], "topk-allgather"))
        vs_ddp = f"{ddp['step_s'] / r['step_s']:.2f}x" if ddp else ""
        vs_ag = f"{ag['step_s'] / r['step_s']:.2f}x" if ag and r["config"].startswith("topk") else ""
        measured = "" if r["bytes_measured"] else " (analytical)"
        compute = by.get((r["rate"], r["workers"], "compute"))
        comm = comm_vs = ""
        if compute and r["config"] != "compute":
            comm_s = max(r["step_s"] - compute["step_s"], 1e-6)
            comm = f"{comm_s:.3f}"
            if ddp:
                comm_vs = f"{max(ddp['step_s'] - compute['step_s'], 1e-6) / comm_s:.2f}x"
        lines.append(
            f"| {r['rate']} | {r['workers']} | {r['config']} | {r['step_s']:.3f} | {vs_ddp} | {vs_ag} | {comm} |"
            f" {comm_vs} | {r['bytes_sent']:,.0f}{measured} | {r['bytes_received']:,.0f}{measured} |"
        )
    lines.append("")
    lines.append("Speed-ups are step-time ratios (higher: faster than the reference). Communication is the step time")
    lines.append("minus the `compute` configuration's (DDP with torch's noop_hook), i.e. what communication adds to a")
    lines.append("step. Plain DDP's bytes are the ring all-reduce's analytical ones (it has no byte counter).")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("part", choices=["bytes", "step"])
    parser.add_argument("--out", default=None, help="write the rows (JSON) here")
    parser.add_argument("--merge", nargs="*", default=[], help="earlier step rows (JSON) to tabulate with these")
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rates", nargs="+", default=["100mbit", "1gbit"])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--rate", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--inside-namespace", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.part == "bytes":
        rows = bytes_part(args)
        print(bytes_table(rows))
    else:
        rows = step_part(args)
        for path in args.merge:
            with open(path) as f:
                rows = json.load(f) + rows
        if not args.inside_namespace:
            print(step_table(rows, args))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
