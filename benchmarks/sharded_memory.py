"""Training state resident per rank: ``ShardedDiLoCo`` with ``S`` = 1, 2, 4 shards per group against ``DiLoCo``.

DiLoCo (Douillard et al. 2023, arXiv 2311.08105) keeps, on every rank, the model, its gradients and the inner
optimizer's state (AdamW: two moments) plus theta_global and the outer optimizer's state (Nesterov SGD: one momentum
buffer): about 24 bytes per fp32 parameter. ``ShardedDiLoCo`` shards all of it over the ``S`` ranks of a replica group
(FSDP2 inside, the outer state on each rank's shards, as INTELLECT-1, arXiv 2412.01152), so it should hold about
``24 / S`` bytes per parameter.

This fits a GPT of about 46M parameters (8 blocks, width 688, 256 byte tokens, 16 positions) for 4 AdamW steps with
``sync_every=1`` (so that the outer momentum exists) on 4 CPU processes, and at the end of ``fit`` reads, on every
rank, the bytes of each part of the training state from the real objects: the parameters' local shards, their
gradients, the inner optimizer's state, theta_global and the outer optimizer's state. Activations, buffers of the
collectives and the allocator's caches are not counted; each rank's peak resident set size (``ru_maxrss``) is shown
beside, for scale. Two more columns: the sync's buffers (the flat pseudo-gradient each rank builds at a sync, the
largest seen) and the sync's wall time per round (from the round's ``send`` to its return, the median over the syncs
after the first, the slowest rank).

Run::

    python benchmarks/sharded_memory.py                    # every configuration; the table to results/
    python benchmarks/sharded_memory.py --only sharded-s2  # one configuration
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import ModelParallelStrategy, Strategy
from torch import Tensor, nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from lightning_gradcomp import DiLoCo, ShardedDiLoCo
from lightning_gradcomp.models.gpt import GPT

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULT = os.path.join(ROOT, "benchmarks", "results", "sharded_memory.txt")
WIDTH, LAYERS, HEADS, VOCAB, POSITIONS = 688, 8, 8, 256, 16
PARTS = ("parameters", "gradients", "inner_state", "theta_global", "outer_state")  # the training state
#: name -> (processes, strategy, shards per group)
CONFIGS: dict[str, tuple[int, str, int]] = {
    "diloco-g2": (4, "DiLoCo(replica_group=2)", 1),
    "sharded-s1": (4, "ShardedDiLoCo(replica_group=1)", 1),
    "sharded-s2": (4, "ShardedDiLoCo(replica_group=2)", 2),
    "sharded-s4": (4, "ShardedDiLoCo(replica_group=4)", 4),  # one group: the memory per rank, no outer average
}


class _GPTModule(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = GPT(VOCAB, POSITIONS, LAYERS, HEADS, WIDTH)

    def configure_model(self) -> None:
        if isinstance(self.trainer.strategy, ModelParallelStrategy):
            assert self.device_mesh is not None
            mesh = self.device_mesh["data_parallel"]
            for block in self.model.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(self.model, mesh=mesh)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.model(x).flatten(0, 1), y.flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(1)
        tokens = torch.randint(0, VOCAB, (64, POSITIONS + 1), generator=g)
        return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=1)


def _bytes(tensors: Any) -> int:
    total = 0
    for t in tensors:
        if isinstance(t, Tensor):
            local = t.to_local() if isinstance(t, DTensor) else t
            total += local.numel() * local.element_size()
    return total


class _Measure(pl.Callback):
    """At the end of ``fit`` (before the strategy lets go of anything): the bytes of each part, per rank."""

    def __init__(self) -> None:
        self.parts: dict[str, int] = {}
        self.sync_bytes = 0
        self.sync_seconds: list[float] = []

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Time each sync (``Round.send``) and weigh the pseudo-gradient it builds (``pseudo_gradients``)."""
        round = getattr(trainer.strategy, "outer_state")
        weights, send, pseudo = round.weights_of(), round.send, round.weights_of().pseudo_gradients

        def timed_send(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            out = send(*args, **kwargs)
            self.sync_seconds.append(time.perf_counter() - start)
            return out

        def weighed(*args: Any, **kwargs: Any) -> Any:
            flats, layouts = pseudo(*args, **kwargs)
            self.sync_bytes = max(self.sync_bytes, _bytes(flats))
            return flats, layouts

        round.send, weights.pseudo_gradients = timed_send, weighed

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        params = list(pl_module.parameters())
        optimizer = trainer.optimizers[0]
        round = getattr(trainer.strategy, "outer_state")
        assert round.optimizer is not None
        self.parts = {
            "parameters": _bytes(params),
            "gradients": _bytes(p.grad for p in params),
            "inner_state": _bytes(v for state in optimizer.state.values() for v in state.values()),
            "theta_global": _bytes(round.params) + _bytes(round.weights_of().buffers),
            "outer_state": _bytes(v for state in round.optimizer.state.values() for v in state.values()),
            "maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "sync_bytes": self.sync_bytes,
            "sync_us": int(statistics.median(self.sync_seconds[1:] or self.sync_seconds) * 1e6),
        }
        self.parts["numel"] = sum(p.numel() for p in params)


def _strategy(name: str) -> Strategy:
    outer = {"outer_optimizer": lambda ps: torch.optim.SGD(ps, lr=0.7, momentum=0.9, nesterov=True)}
    if name == "diloco-g2":
        return DiLoCo(sync_every=1, replica_group=2, monitor=False, **outer)
    return ShardedDiLoCo(sync_every=1, replica_group=CONFIGS[name][2], monitor=False, **outer)


def run_one(name: str, out: str) -> None:
    """Fit ``name`` (under Lightning's launcher: the script runs again for every rank); rank 0 writes ``out``."""
    torch.set_num_threads(1)
    measure = _Measure()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=CONFIGS[name][0],
        strategy=_strategy(name),
        max_steps=4,
        callbacks=[measure],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(_GPTModule())
    gathered: list[Any] = [None] * trainer.world_size
    dist.all_gather_object(gathered, measure.parts)
    if trainer.global_rank == 0:
        with open(out, "w") as f:
            json.dump(gathered, f)


def _table(results: dict[str, list[dict[str, int]]]) -> str:
    numel = results["diloco-g2"][0]["numel"]
    dense = max(sum(v for k, v in r.items() if k in PARTS) for r in results["diloco-g2"])
    lines = [
        f"GPT of {numel / 1e6:.1f}M parameters ({LAYERS} blocks, width {WIDTH}), fp32, AdamW inside, outer Nesterov"
        " SGD, 4 CPU processes (gloo), sync_every=1, 4 steps; bytes per rank at the end of fit (largest rank);"
        " the sync's buffers and wall time per round (slowest rank).",
        "",
        "| configuration | S | parameters | gradients | inner AdamW | theta_global | outer momentum | total"
        " | bytes / parameter | x (24 / S) | x DiLoCo | peak RSS | sync buffers | sync per round |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, ranks in results.items():
        size = CONFIGS[name][2]
        worst = max(ranks, key=lambda r: sum(r[k] for k in PARTS))
        parts = [worst[k] for k in PARTS]
        total = sum(parts)
        mb = " | ".join(f"{p / 2**20:,.1f} MiB" for p in parts)
        per = total / numel
        lines.append(
            f"| {CONFIGS[name][1]} | {size} | {mb} | {total / 2**20:,.1f} MiB | {per:.2f} | {per / (24 / size):.3f}"
            f" | {total / dense:.3f} | {max(r['maxrss'] for r in ranks) / 2**20:,.0f} MiB"
            f" | {max(r['sync_bytes'] for r in ranks) / 2**20:,.1f} MiB"
            f" | {max(r['sync_us'] for r in ranks) / 1e3:,.0f} ms |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=sorted(CONFIGS), help="one configuration (default: all)")
    parser.add_argument("--run", choices=sorted(CONFIGS), help=argparse.SUPPRESS)  # a launch's own fit
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        run_one(args.run, args.out)
        return
    results = {}
    for name in [args.only] if args.only else list(CONFIGS):
        with tempfile.TemporaryDirectory() as folder:
            out = os.path.join(folder, "parts.json")
            env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
            command = [sys.executable, os.path.abspath(__file__), "--run", name, "--out", out]
            subprocess.run(command, cwd=folder, env=env, check=True, capture_output=True)
            with open(out) as f:
                results[name] = json.load(f)
    text = _table(results) if "diloco-g2" in results else json.dumps(results, indent=1)
    print(text)
    if not args.only:
        with open(RESULT, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
