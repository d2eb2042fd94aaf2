"""Where a compressor's encode+decode time goes, on ResNet-18's gradients, in one process (a profile, not a test).

Lays out torchvision's ResNet-18 layers that ``CompressedDDP`` compresses by default (>= 2-D, >= 1024 elements) as one
bucket, runs the compressor for ``--ranks`` simulated ranks through ``lightning_gradcomp.testing.simulate_reduce``
(the training code path: the same compress, packing, aggregation and decode; the collectives are simulated in
memory), and prints the wall time per step and rank and the ``torch.profiler`` table of the operators that take the
time. One torch thread, as each worker of ``step_time.py`` has. Gradients are random normal (scaled to 1e-3).

Example::

    python benchmarks/codec_profile.py qsgd
    python benchmarks/codec_profile.py efsignsgd --rows 20
"""

from __future__ import annotations

import argparse
import time

import torch
import torchvision
from step_time import COMPRESSORS, MIN_COMPRESS_NUMEL
from torch.profiler import profile

from lightning_gradcomp.compressors.base import Layer
from lightning_gradcomp.testing import simulate_reduce


def compressed_layers(model: torch.nn.Module) -> tuple[Layer, ...]:
    """The layers CompressedDDP compresses by default, laid out back to back."""
    layers, offset = [], 0
    for index, (name, p) in enumerate(model.named_parameters()):
        if p.dim() >= 2 and p.numel() >= MIN_COMPRESS_NUMEL:
            layers.append(Layer(name, index, p.shape, offset))
            offset += p.numel()
    return tuple(layers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("compressor", choices=list(COMPRESSORS))
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3, help="timed steps (after 2 warm-up steps)")
    parser.add_argument("--rows", type=int, default=12, help="operators in the profile table")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    layers = compressed_layers(torchvision.models.resnet18(num_classes=10))
    numel = layers[-1].offset + layers[-1].numel
    grads = [torch.randn(numel) * 1e-3 for _ in range(args.ranks)]
    compressors = [COMPRESSORS[args.compressor]() for _ in range(args.ranks)]
    residuals = [torch.zeros(numel) for _ in range(args.ranks)] if compressors[0].default_error_feedback else None

    def run(step: int) -> None:
        simulate_reduce(compressors, grads, layers, step=step, residuals=residuals)

    for step in range(2):
        run(step)
    start = time.perf_counter()
    for step in range(2, 2 + args.steps):
        run(step)
    per_rank_ms = (time.perf_counter() - start) / args.steps / args.ranks * 1000
    print(
        f"{args.compressor}: {len(layers)} layers, {numel:,} elements; encode+decode {per_rank_ms:.1f} ms per step "
        f"and rank ({args.ranks} simulated ranks, 1 thread)"
    )
    with profile() as prof:
        run(2 + args.steps)
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows)
    print(table)


if __name__ == "__main__":
    main()
