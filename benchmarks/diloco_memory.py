"""DiLoCo's memory per rank: the bytes of each piece of its state, and where it lives, with ``offload`` off and on.

DiLoCo (arXiv 2311.08105) keeps, besides the model and its inner optimizer, theta_global (one more copy of the
parameters, plus the floating-point buffers of the last sync) and the outer optimizer's state (Nesterov SGD: one
momentum buffer per parameter); a compressed outer exchange adds each rank's error-feedback residuals.
``DiLoCo(offload=True)`` keeps theta_global and the outer optimizer's state in CPU memory instead of the
accelerator's, as torchft and INTELLECT-1 do.

This fits a small model (an MLP, ``--width`` wide, ``--layers`` deep, AdamW as the inner optimizer, random data) for
``--steps`` steps with ``DiLoCo(sync_every=--sync-every, compressor=SparseLoCo())`` on one process, with ``offload``
off and on, and reads every piece from the real objects after ``fit``: its bytes, its bytes over the model's, and the
device it is on. The pieces are per rank and do not depend on the number of ranks. On an accelerator
(``--accelerator gpu``) it also reports the peak of the accelerator's allocated memory during ``fit``
(``torch.cuda.max_memory_allocated``): the saving ``offload`` makes. On a CPU-only machine every piece is in the same
memory whatever ``offload`` says; the table then shows what would leave the accelerator.

Examples::

    python benchmarks/diloco_memory.py
    python benchmarks/diloco_memory.py --width 1024 --layers 4 --accelerator gpu
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_gradcomp import DiLoCo
from lightning_gradcomp.compressors import SparseLoCo


class _MLP(pl.LightningModule):
    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        blocks: list[nn.Module] = []
        for _ in range(layers):
            blocks += [nn.Linear(width, width), nn.LayerNorm(width), nn.ReLU()]
        self.net = nn.Sequential(*blocks, nn.Linear(width, 10))
        self.width = width

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(512, self.width, generator=g), torch.randint(0, 10, (512,), generator=g))
        return DataLoader(data, batch_size=16)


def _tensors(obj: Any) -> Iterable[Tensor]:
    if isinstance(obj, Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _tensors(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _tensors(value)


def _piece(tensors: Iterable[Tensor]) -> tuple[int, str]:
    tensors = list(tensors)
    devices = sorted({str(t.device) for t in tensors}) or ["-"]
    return sum(t.numel() * t.element_size() for t in tensors), ",".join(devices)


def measure(offload: bool, args: argparse.Namespace) -> dict[str, Any]:
    """Fit once; every piece of DiLoCo's state per rank, read from the real objects after ``fit``."""
    pl.seed_everything(0, verbose=False)
    model = _MLP(args.width, args.layers)
    strategy = DiLoCo(sync_every=args.sync_every, offload=offload, compressor=SparseLoCo(), monitor=False)
    trainer = pl.Trainer(
        accelerator=args.accelerator,
        devices=1,
        strategy=strategy,
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    cuda = torch.cuda.is_available() and args.accelerator in ("gpu", "cuda")
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer.fit(model)
    outer = strategy.outer_state
    assert outer.optimizer is not None
    assert outer.exchange is not None
    pieces = {
        "model parameters (the rank's replica)": _piece(model.parameters()),
        "inner optimizer state (AdamW)": _piece(_tensors(list(trainer.optimizers[0].state.values()))),
        "theta_global (and the buffers of the last sync)": _piece([*outer.params, *outer.weights_of().buffers]),
        "outer optimizer state (Nesterov momentum)": _piece(_tensors(list(outer.optimizer.state.values()))),
        "error-feedback residuals (SparseLoCo)": _piece(_tensors(outer.exchange.residuals.state_dict())),
    }
    peak = torch.cuda.max_memory_allocated() if cuda else None
    return {"pieces": pieces, "peak": peak, "syncs": outer.syncs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--sync-every", type=int, default=4)
    parser.add_argument("--accelerator", default="cpu")
    args = parser.parse_args()
    results = {offload: measure(offload, args) for offload in (False, True)}
    model_bytes = results[False]["pieces"]["model parameters (the rank's replica)"][0]
    print(
        f"DiLoCo state per rank, MLP {args.layers} x {args.width} ({model_bytes / 4:,.0f} fp32 parameters,"
        f" {model_bytes / 2**20:.2f} MiB), {args.steps} steps, sync_every={args.sync_every},"
        f" {results[False]['syncs']} syncs; `python {' '.join(sys.argv)}`"
    )
    print("| piece | bytes | x model | device, offload=False | device, offload=True |")
    print("|---|---|---|---|---|")
    for name in results[False]["pieces"]:
        size, off = results[False]["pieces"][name]
        on = results[True]["pieces"][name][1]
        assert results[True]["pieces"][name][0] == size
        print(f"| {name} | {size:,} | {size / model_bytes:.2f} | {off} | {on} |")
    if results[False]["peak"] is not None:
        for offload, result in results.items():
            print(f"peak accelerator memory during fit, offload={offload}: {result['peak'] / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
