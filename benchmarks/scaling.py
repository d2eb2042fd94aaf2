"""Bytes per rank against the number of workers: every compressor's telemetry next to its declared byte model.

For each compressor at its default configuration (the entries of ``lightning_gradcomp.testing.EXAMPLES`` named
after a method) and each number of workers ``N``, one step of the real communication hook on ``N`` simulated ranks
(``SimulatedHook``: the driver, error feedback, the non-finite flag, the dense layers) reduces one bucket holding a
ResNet-18-shaped layout (CIFAR head, base width 24: 1.58M parameters). Every rank holds the same seeded Gaussian
gradient, so data-dependent sizes (AdaComp's bins) are the same in the telemetry and in the model. Printed per
compressor and ``N``: the bytes each rank moved (sent + received, mean over ranks, from the telemetry) as a fraction
of what a dense ring all-reduce of the bucket moves at that ``N``, and the same fraction from the compressor's
declared byte model (``Compressor.wire_bytes``, through ``wire_model.bucket_wire_bytes``). The two must agree: the
benchmark exits with status 1 if any pair differs by more than ``--tolerance`` (relative).

Simulated ranks cost ``N`` encodings and, for the all-gather methods, ``N^2`` decodings per step, so from
``--narrow-above`` workers on the layout is narrowed (base width halved per doubling of ``N``: 12 at 16 workers, 6
at 32, 3 at 64), and both columns are for that layout: the check is exact there, while the fraction itself moves a
little with the layout (fewer layers reach ``min_compress_numel``; per-layer scales weigh more). A second table
gives the model alone on the full layout up to ``N = 1024``.

Examples::

    python benchmarks/scaling.py                              # every default compressor, N = 2 .. 64
    python benchmarks/scaling.py --configs qsgd signsgd --workers 2 8 64
    python benchmarks/scaling.py --json /tmp/scaling.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from lightning_gradcomp.compressors.base import Layer
from lightning_gradcomp.ddp.simulation import hook_wire_bytes
from lightning_gradcomp.engine import wire
from lightning_gradcomp.engine.wire_model import bucket_wire_bytes
from lightning_gradcomp.testing import EXAMPLES

#: every method at its default configuration (TernGrad also in its all-gather form, for the growth it shows)
DEFAULTS = (
    "identity",
    "fp16",
    "bf16",
    "powersgd",
    "topk",
    "randomk",
    "dgc",
    "adacomp",
    "scalecom",
    "signsgd",
    "efsignsgd",
    "onebit",
    "qsgd",
    "terngrad",
    "terngrad-allgather",
    "minmax8",
    "minmax4",
    "sparseloco",
    "zen",
    "lgc",
    "lgc-allreduce",
)
MIN_NUMEL = 1024  # CompressedDDP's default min_compress_numel


def resnet18_layout(width: int = 24, classes: int = 10) -> tuple[Layer, ...]:
    """The parameters of a CIFAR ResNet-18 with base width ``width`` (64 is the standard one), in module order."""
    shapes: list[tuple[str, tuple[int, ...]]] = [("conv1.weight", (width, 3, 3, 3))]
    shapes += [("bn1.weight", (width,)), ("bn1.bias", (width,))]
    inplanes = width
    for stage, planes in enumerate((width, 2 * width, 4 * width, 8 * width), start=1):
        for block in range(2):
            prefix = f"layer{stage}.{block}"
            shapes += [
                (f"{prefix}.conv1.weight", (planes, inplanes, 3, 3)),
                (f"{prefix}.bn1.weight", (planes,)),
                (f"{prefix}.bn1.bias", (planes,)),
                (f"{prefix}.conv2.weight", (planes, planes, 3, 3)),
                (f"{prefix}.bn2.weight", (planes,)),
                (f"{prefix}.bn2.bias", (planes,)),
            ]
            if block == 0 and planes != inplanes:
                shapes += [
                    (f"{prefix}.downsample.0.weight", (planes, inplanes, 1, 1)),
                    (f"{prefix}.downsample.1.weight", (planes,)),
                    (f"{prefix}.downsample.1.bias", (planes,)),
                ]
            inplanes = planes
    shapes += [("fc.weight", (classes, inplanes)), ("fc.bias", (classes,))]
    layers, offset = [], 0
    for index, (name, shape) in enumerate(shapes):
        layer = Layer(name, index, torch.Size(shape), offset)
        layers.append(layer)
        offset += layer.numel
    return tuple(layers)


def fraction(moved: wire.Wire, layers: tuple[Layer, ...], workers: int) -> float:
    """``moved`` over what a dense fp32 ring all-reduce of ``layers`` moves at ``workers`` ranks (sent + received)."""
    dense = wire.all_reduce(4 * sum(layer.numel for layer in layers), workers)
    return moved.moved / dense.moved


def width_for(workers: int, width: int, narrow_above: int) -> int:
    """The base width simulated at ``workers`` ranks: halved per doubling of the workers beyond ``narrow_above``."""
    factor = 1
    while workers > narrow_above * factor:
        factor *= 2
    return max(width // factor, 1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--configs",
        nargs="+",
        default=list(DEFAULTS),
        choices=sorted(EXAMPLES),
        metavar="NAME",
        help="entries of lightning_gradcomp.testing.EXAMPLES (default: every method's default)",
    )
    parser.add_argument("--workers", nargs="+", type=int, default=[2, 4, 8, 16, 32, 64])
    parser.add_argument(
        "--analytical",
        nargs="+",
        type=int,
        default=[2, 8, 64, 256, 1024],
        help="worker counts of the model-only table (full layout)",
    )
    parser.add_argument("--width", type=int, default=24, help="the ResNet-18's base width (24: 1.58M parameters)")
    parser.add_argument(
        "--narrow-above",
        type=int,
        default=8,
        help="above this many workers, halve the width per doubling (simulation cost)",
    )
    parser.add_argument("--tolerance", type=float, default=1e-3, help="relative; telemetry against the model")
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args(argv)

    full = resnet18_layout(args.width)
    print(
        f"layout: ResNet-18 (CIFAR), base width {args.width}, {sum(layer.numel for layer in full):,} parameters,"
        f" one bucket; min_compress_numel {MIN_NUMEL}; one step, the same gradient on every rank\n"
    )
    measured: dict[str, dict[int, dict[str, float]]] = {}
    failures = []
    header = "| compressor | " + " | ".join(f"N={n} telemetry / model" for n in args.workers) + " |"
    print(header)
    print("|---|" + "---|" * len(args.workers))
    for name in args.configs:
        make, row = EXAMPLES[name], {}
        cells = []
        for workers in args.workers:
            layers = resnet18_layout(width_for(workers, args.width, args.narrow_above))
            gradient = torch.randn(sum(layer.numel for layer in layers), generator=torch.Generator().manual_seed(0))
            begin = time.perf_counter()
            telemetry = hook_wire_bytes(make, layers, gradient, workers)[0]
            model = bucket_wire_bytes(make(), layers, workers, min_compress_numel=MIN_NUMEL, tensor=gradient)
            seconds = time.perf_counter() - begin
            got, declared = fraction(telemetry, layers, workers), fraction(model, layers, workers)
            row[workers] = {
                "telemetry": got,
                "model": declared,
                "params": sum(layer.numel for layer in layers),
                "seconds": seconds,
            }
            agrees = abs(got - declared) <= args.tolerance * max(abs(declared), 1e-12)
            if not agrees:
                failures.append(f"{name} at N={workers}: telemetry {got:.6f}, model {declared:.6f}")
            cells.append(f"{got:.3f} / {declared:.3f}" + ("" if agrees else " (differ)"))
        measured[name] = row
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)
    narrowed = [n for n in args.workers if width_for(n, args.width, args.narrow_above) != args.width]
    if narrowed:
        widths = ", ".join(f"N={n}: width {width_for(n, args.width, args.narrow_above)}" for n in narrowed)
        print(f"\nnarrowed layouts (simulation cost): {widths}")

    print("\nDeclared model on the full layout, bytes moved per rank as a fraction of a dense ring all-reduce:\n")
    print("| compressor | " + " | ".join(f"N={n}" for n in args.analytical) + " |")
    print("|---|" + "---|" * len(args.analytical))
    analytical: dict[str, dict[int, float]] = {}
    for name in args.configs:
        figures = {
            n: fraction(bucket_wire_bytes(EXAMPLES[name](), full, n, min_compress_numel=MIN_NUMEL), full, n)
            for n in args.analytical
        }
        analytical[name] = figures
        print(f"| {name} | " + " | ".join(f"{figures[n]:.3f}" for n in args.analytical) + " |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"measured": measured, "analytical": analytical, "width": args.width}, f, indent=1)
    if failures:
        print("\nthe telemetry and the declared model differ:\n  " + "\n  ".join(failures), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
