"""Checkpoint bytes on rank 0 and on every other rank, and the save's time, against the number of ranks.

``CompressedDDP`` keeps state that differs between ranks (error-feedback residuals, a stateful compressor's memory).
Each rank writes its own in a file of the checkpoint directory (:mod:`lightning_gradcomp.runtime.rank_state`), so rank
0 writes the checkpoint plain ``DDPStrategy`` writes plus a header of a few bytes, at any number of ranks. This
benchmark shows it for ``DDPStrategy``, ``CompressedDDP(PowerSGD(rank=4))`` and ``CompressedDDP(TopK(ratio=0.01))``
(error feedback), on an MLP of ``--layers`` square layers of ``--width`` trained a few steps with SGD and momentum:

- ``--ranks`` (2 and 4): real processes (gloo on the CPU, Lightning's spawn launcher); every rank times
  ``trainer.save_checkpoint`` and measures what it wrote.
- ``--simulate`` (8 to 64): no processes. Every rank's compressor state comes from the real communication hook on
  simulated ranks (:class:`~lightning_gradcomp.ddp.simulation.SimulatedHook`) after the same steps, serialized as the
  rank would write it; rank 0's checkpoint is the 2-rank run's with its header for that many ranks. The column "gathered
  into rank 0" is what rank 0 would write if every rank's state were gathered into its one file::

    python benchmarks/checkpoint_bytes.py --width 256 --layers 4 --ranks 2 4 --simulate 8 16 32 64
"""

from __future__ import annotations

import argparse
import io
import json
import os
import tempfile
import time
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_gradcomp import CompressedDDP
from lightning_gradcomp.compressors import PowerSGD, TopK
from lightning_gradcomp.compressors.base import layers_from_shapes
from lightning_gradcomp.ddp.hook import CompressionState
from lightning_gradcomp.ddp.simulation import SimulatedHook
from lightning_gradcomp.runtime.rank_state import checkpoint_file, rank_state_path

STEPS = 3
MIN_COMPRESS_NUMEL = 1024
COMPRESSORS: dict[str, Callable[[], Any]] = {
    "CompressedDDP(PowerSGD(rank=4))": lambda: PowerSGD(rank=4),
    "CompressedDDP(TopK(ratio=0.01))": lambda: TopK(ratio=0.01),
}
DDP = "DDPStrategy"


class SquareMLP(pl.LightningModule):
    """``layers`` linear layers of ``width`` (weights and biases), SGD with momentum (an optimizer state per weight)."""

    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.width = width
        self.net = nn.Sequential(*(nn.Linear(width, width) for _ in range(layers)))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(256, self.width, generator=g), torch.randn(256, self.width, generator=g))
        return DataLoader(data, batch_size=8)


class _SaveAndMeasure(Callback):
    """After training, every rank times ``trainer.save_checkpoint`` and records the bytes of what it wrote."""

    def __init__(self, path: str, out: str) -> None:
        self.path, self.out = path, out

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        trainer.strategy.barrier("measure")  # every rank starts the save together
        start = time.perf_counter()
        trainer.save_checkpoint(self.path)
        seconds = time.perf_counter() - start
        rank = trainer.global_rank
        own = rank_state_path(self.path, "gradcomp", rank)
        record = {
            "seconds": seconds,
            "checkpoint": os.path.getsize(checkpoint_file(self.path)) if rank == 0 else 0,
            "own": os.path.getsize(own) if os.path.exists(own) else 0,
        }
        with open(os.path.join(self.out, f"rank{rank}.json"), "w") as f:
            json.dump(record, f)


def _strategy(name: str) -> DDPStrategy:
    if name == DDP:
        return DDPStrategy(start_method="spawn")
    compressor = COMPRESSORS[name]()
    return CompressedDDP(compressor, min_compress_numel=MIN_COMPRESS_NUMEL, monitor=False, start_method="spawn")


def run_real(name: str, ranks: int, width: int, layers: int, folder: str) -> list[dict[str, float]]:
    """Train ``STEPS`` steps on ``ranks`` processes and save one checkpoint; what each rank wrote and its time."""
    out = tempfile.mkdtemp(dir=folder)
    path = os.path.join(out, "model.ckpt")
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=ranks,
        strategy=_strategy(name),
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[_SaveAndMeasure(path, out)],
    )
    trainer.fit(SquareMLP(width, layers))
    records = []
    for rank in range(ranks):
        with open(os.path.join(out, f"rank{rank}.json")) as f:
            records.append(json.load(f))
    records[0]["path"] = path
    return records


def _nbytes(obj: Any) -> int:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getbuffer().nbytes


def simulated_rank_states(name: str, ranks: int, width: int, layers: int) -> list[dict[str, Any]]:
    """Every rank's compressor state after ``STEPS`` steps of the real hook on ``ranks`` simulated ranks."""
    shapes = [shape for _ in range(layers) for shape in ((width, width), (width,))]
    bucket_layers = layers_from_shapes(shapes)
    numel = sum(layer.numel for layer in bucket_layers)
    hook = SimulatedHook(
        [CompressionState(COMPRESSORS[name](), min_compress_numel=MIN_COMPRESS_NUMEL) for _ in range(ranks)],
        bucket_layers,
    )
    g = torch.Generator().manual_seed(0)
    for _ in range(STEPS):
        hook.step([torch.randn(numel, generator=g) for _ in range(ranks)])
    return [{**state.state_dict(), "global_step": STEPS} for state in hook.states]


def simulate(name: str, ranks: int, width: int, layers: int, checkpoint: dict[str, Any]) -> dict[str, int]:
    """What rank 0 and each other rank would write at ``ranks`` ranks (``checkpoint``: a real 2-rank checkpoint)."""
    states = simulated_rank_states(name, ranks, width, layers)
    files = [_nbytes({"format": 1, "rank": r, "world_size": ranks, "state": s}) for r, s in enumerate(states)]
    per_rank = {**checkpoint, "gradcomp": {"format": 2, "world_size": ranks, "step": STEPS}}
    gathered = {**checkpoint, "gradcomp": {"format": 1, "world_size": ranks, "ranks": states}}
    return {"checkpoint": _nbytes(per_rank), "own": files[0], "others": max(files[1:]), "gathered": _nbytes(gathered)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=256, help="each square layer's width (default 256)")
    parser.add_argument("--layers", type=int, default=4, help="how many square layers (default 4)")
    parser.add_argument("--ranks", type=int, nargs="*", default=[2, 4], help="real process counts (default 2 4)")
    parser.add_argument(
        "--simulate", type=int, nargs="*", default=[8, 16, 32, 64], help="simulated rank counts (default 8 16 32 64)"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    names = [DDP, *COMPRESSORS]
    params = args.layers * (args.width * args.width + args.width)
    print(
        f"MLP of {args.layers} layers of width {args.width} ({params:,} parameters, {4 * params:,} bytes fp32),"
        f" SGD with momentum, {STEPS} steps; bytes of what each rank writes with one checkpoint"
    )
    print(
        "| strategy | ranks | rank 0 checkpoint | / DDPStrategy's | rank 0 own file | each other rank |"
        " gathered into rank 0 | save s (rank 0) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as folder:
        dense: dict[int, int] = {}
        saved: dict[str, dict[str, Any]] = {}
        for ranks in args.ranks:
            for name in names:
                records = run_real(name, ranks, args.width, args.layers, folder)
                rank0 = records[0]
                dense.setdefault(ranks, int(rank0["checkpoint"]))
                if ranks == min(args.ranks):
                    saved[name] = torch.load(str(rank0["path"]), weights_only=False, map_location="cpu")
                others = max(int(r["own"]) for r in records[1:])
                print(
                    f"| `{name}` | {ranks} | {rank0['checkpoint']:,.0f} | {rank0['checkpoint'] / dense[ranks]:.3f} |"
                    f" {rank0['own']:,.0f} | {others:,} | | {rank0['seconds']:.3f} |"
                )
        if not saved:
            return
        reference = _nbytes(saved[DDP])
        for ranks in args.simulate:
            print(f"| `{DDP}` | {ranks} (simulated) | {reference:,} | 1.000 | 0 | 0 | | |")
            for name in COMPRESSORS:
                sizes = simulate(name, ranks, args.width, args.layers, saved[name])
                ratio = sizes["checkpoint"] / reference
                print(
                    f"| `{name}` | {ranks} (simulated) | {sizes['checkpoint']:,} | {ratio:.3f} | {sizes['own']:,} |"
                    f" {sizes['others']:,} | {sizes['gathered']:,} | |"
                )


if __name__ == "__main__":
    main()
