"""Compression ratios of every compressor, measured on real gradients (a benchmark, not a test).

Two workers train a model with the compressor in the loop (each on its own data: different digits, different text
windows), simulated in one process with ``lightning_gradcomp.testing.simulate_reduce``: the code path of training,
with the bytes counted by the same telemetry (the sizes of the tensors handed to the collectives, not formulas).
The compressed layers (>= 2-D, >= ``--min-numel`` elements, CompressedDDP's default rule) are reduced in one bucket
per layer kind (convolutions, fully-connected, recurrent), so each kind's ratio is its own; the remaining layers are
averaged densely. Ratios are ``dense bytes / bytes sent`` per rank, summed over the measured steps and both ranks.

Models: ``DigitsCNN`` on scikit-learn's digits, ``CharLSTM`` on the standard library's source text (see
``lightning_gradcomp/demo/workloads.py``). Everything is deterministic: the numbers do not depend on the machine's load.

Examples::

    python benchmarks/compression_ratios.py                      # every configuration, both models
    python benchmarks/compression_ratios.py --configs adacomp dgc-0.1% --steps 20
    python benchmarks/compression_ratios.py --configs adacomp --workloads digits --batch-size 128 --steps 60
"""

from __future__ import annotations

import argparse
import copy
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from lightning_gradcomp.compressors import (
    DGC,
    Compressor,
    ScaleCom,
    SignSGD,
)
from lightning_gradcomp.compressors.base import layers_from_shapes
from lightning_gradcomp.demo.workloads import CharLSTM, DigitsCNN, digits, layer_kind, stdlib_text, text_batch
from lightning_gradcomp.engine.telemetry import Telemetry
from lightning_gradcomp.testing import EXAMPLES, simulate_reduce

CONFIGS: dict[str, Callable[[], Compressor]] = {
    # the methods' default configurations come from the package's one table of examples; the rest are the papers'
    # settings measured here and nowhere else
    "adacomp": EXAMPLES["adacomp"],
    "dgc-0.1%": lambda: DGC(ratio=0.001),
    "scalecom-1%": EXAMPLES["scalecom"],
    "scalecom-0.16%": lambda: ScaleCom(ratio=0.0016),
    "topk-1%": EXAMPLES["topk"],
    "signsgd": EXAMPLES["signsgd"],
    "efsignsgd": EXAMPLES["efsignsgd"],
    "onebit": EXAMPLES["onebit"],
    "qsgd": EXAMPLES["qsgd"],
    "terngrad": EXAMPLES["terngrad"],
}
WORLD = 2
MIN_NUMEL = 1024  # CompressedDDP's default min_compress_numel


@dataclass
class Workload:
    name: str
    model: Callable[[], nn.Module]
    batch: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]  # (rank, step) -> inputs, targets
    loss: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


def digits_workload(batch_size: int = 32) -> Workload:
    x, y, _, _ = digits()

    def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        shard_x, shard_y = x[rank::WORLD], y[rank::WORLD]  # each worker its own half of the data
        start = step * batch_size % (len(shard_y) - batch_size)
        return shard_x[start : start + batch_size], shard_y[start : start + batch_size]

    return Workload("DigitsCNN (digits)", DigitsCNN, batch, lambda m, a, b: nn.functional.cross_entropy(m(a), b))


def text_workload(batch_size: int = 16, seq_len: int = 64) -> Workload:
    corpus = stdlib_text()
    generators = [torch.Generator().manual_seed(100 + r) for r in range(WORLD)]

    def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return text_batch(corpus, batch_size, seq_len, generators[rank])

    def loss(model: nn.Module, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(model(a).flatten(0, 1), b.flatten())

    return Workload("CharLSTM (stdlib text)", CharLSTM, batch, loss)


@dataclass
class Measurement:
    sent: dict[str, int] = field(default_factory=dict)  # per kind, summed over steps and ranks
    dense: dict[str, int] = field(default_factory=dict)

    def ratio(self, kinds: list[str]) -> float:
        sent = sum(self.sent.get(k, 0) for k in kinds)
        return sum(self.dense.get(k, 0) for k in kinds) / sent if sent else float("nan")


def measure(workload: Workload, factory: Callable[[], Compressor], steps: int, lr: float = 0.05) -> Measurement:
    """Train ``steps`` steps with two simulated workers; count each layer kind's bytes per rank."""
    model = workload.model()
    prototype = factory()
    names = [n for n, _ in model.named_parameters()]
    params = list(model.parameters())
    groups: dict[str, list[int]] = {}
    for i, (name, p) in enumerate(zip(names, params)):
        kind = layer_kind(name, p)
        compressed = p.ndim >= 2 and p.numel() >= MIN_NUMEL
        groups.setdefault(kind if compressed else "dense", []).append(i)
    buckets = {}
    for kind, members in groups.items():
        if kind == "dense":
            continue
        layers = layers_from_shapes([params[i].shape for i in members], [names[i] for i in members])
        layers = tuple(type(layer)(layer.name, members[j], layer.shape, layer.offset) for j, layer in enumerate(layers))
        numel = sum(params[i].numel() for i in members)
        residuals = [torch.zeros(numel) for _ in range(WORLD)] if prototype.default_error_feedback else None
        buckets[kind] = (members, layers, [copy.deepcopy(prototype) for _ in range(WORLD)], residuals)
    # DGC carries its own momentum; sign steps need a learning rate for signs
    momentum = 0.0 if isinstance(prototype, DGC) else 0.9
    step_lr = lr / 50 if isinstance(prototype, SignSGD) else lr
    optimizer = torch.optim.SGD(model.parameters(), lr=step_lr, momentum=momentum)
    result = Measurement()
    for step in range(steps):
        grads = []
        for rank in range(WORLD):
            model.zero_grad()
            workload.loss(model, *workload.batch(rank, step)).backward()
            grads.append([p.grad.detach().clone() for p in params])
        for i in groups.get("dense", []):
            params[i].grad = sum(g[i] for g in grads) / WORLD
            result.sent["dense"] = result.sent.get("dense", 0) + WORLD * params[i].numel() * 4
            result.dense["dense"] = result.dense.get("dense", 0) + WORLD * params[i].numel() * 4
        for kind, (members, layers, compressors, residuals) in buckets.items():
            flats = [torch.cat([g[i].flatten() for i in members]) for g in grads]
            telemetry = [Telemetry() for _ in range(WORLD)]
            for t, flat in zip(telemetry, flats):
                t.add_bucket(flat.numel() * 4)
            average = simulate_reduce(compressors, flats, layers, step=step, residuals=residuals, telemetry=telemetry)[
                0
            ]
            for layer, i in zip(layers, members):
                params[i].grad = layer.view(average).clone()
            for t in telemetry:
                stats = t.pop_step()
                result.sent[kind] = result.sent.get(kind, 0) + stats.bytes_sent
                result.dense[kind] = result.dense.get(kind, 0) + stats.bytes_dense
        optimizer.step()
    return result


def run(configs: list[str], steps: int, workloads: list[str], batch_size: int = 32, lr: float = 0.05) -> list[dict]:
    rows = []
    makers = {"digits": lambda: digits_workload(batch_size), "text": text_workload}
    for name in workloads:
        workload = makers[name]()
        for config in configs:
            m = measure(workload, CONFIGS[config], steps, lr=lr)
            kinds = [k for k in ("conv", "fc", "recurrent") if k in m.sent]
            rows.append(
                {
                    "model": workload.name,
                    "config": config,
                    **{k: m.ratio([k]) for k in kinds},
                    "fc+recurrent": m.ratio([k for k in kinds if k != "conv"]),
                    "compressed": m.ratio(kinds),
                    "whole": m.ratio([*kinds, "dense"]),
                }
            )
            print(f"# {workload.name} {config}: {rows[-1]}", file=sys.stderr, flush=True)
    return rows


def table(rows: list[dict]) -> str:
    cols = ["conv", "fc", "recurrent", "fc+recurrent", "compressed", "whole"]
    lines = [
        "| model | compressor | " + " | ".join(cols) + " |",
        "|---|---|" + "---|" * len(cols),
    ]
    for row in rows:
        cells = [f"{row[c]:,.1f}x" if c in row and row[c] == row[c] else "" for c in cols]
        lines.append(f"| {row['model']} | {row['config']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--steps", type=int, default=30, help="training steps measured per configuration")
    parser.add_argument("--workloads", nargs="+", default=["digits", "text"], choices=["digits", "text"])
    parser.add_argument("--batch-size", type=int, default=32, help="digits: images per worker and step")
    parser.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (signSGD: divided by 50)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(table(run(args.configs, args.steps, args.workloads, args.batch_size, args.lr)))


if __name__ == "__main__":
    main()
