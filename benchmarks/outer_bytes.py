"""Bytes one DiLoCo sync sends per rank, with each outer compressor, as the package's telemetry counts them.

The pseudo-gradient of a GPT-style stack (``--blocks`` blocks of width ``--width``: attention's four matrices, the
MLP's two, their biases and two layer norms) goes through
:class:`~lightning_gradcomp.diloco.exchange.OuterExchange` on simulated ranks: the same layout, dense/compressed
split, payloads and counting as ``DiLoCo(compressor=...)``, without processes. Prints bytes sent per rank per sync
and the ratio to the plain fp32 all-reduce::

    python benchmarks/outer_bytes.py --width 256 --blocks 4 --ranks 2
"""

from __future__ import annotations

import argparse

import torch

from lightning_gradcomp.compressors import EFSignSGD, Identity, MinMax, PowerSGD, SparseLoCo, TopK
from lightning_gradcomp.compressors.base import layers_from_shapes
from lightning_gradcomp.diloco.exchange import OuterExchange
from lightning_gradcomp.testing import SimulatedWorld

COMPRESSORS = {
    "fp32 (Identity)": Identity,
    "MinMax(bits=8)": lambda: MinMax(bits=8),
    "MinMax(bits=4)": lambda: MinMax(bits=4),
    "SparseLoCo()": SparseLoCo,
    "TopK(ratio=0.01)": lambda: TopK(ratio=0.01),
    "PowerSGD(rank=4)": lambda: PowerSGD(rank=4),
    "EFSignSGD()": EFSignSGD,
}


def _shapes(width: int, blocks: int) -> list[tuple[int, ...]]:
    block = [
        (width,),
        (width,),
        (3 * width, width),
        (3 * width,),
        (width, width),
        (width,),
        (width,),
        (width,),
        (4 * width, width),
        (4 * width,),
        (width, 4 * width),
        (width,),
    ]
    return [shape for _ in range(blocks) for shape in block]


def measure(width: int, blocks: int, ranks: int) -> dict[str, int]:
    """Bytes sent per rank by one outer exchange of a random pseudo-gradient, per compressor."""
    layers = layers_from_shapes(_shapes(width, blocks))
    numel = sum(layer.numel for layer in layers)
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(numel, generator=g) for _ in range(ranks)]
    sent = {}
    for name, factory in COMPRESSORS.items():
        world = SimulatedWorld(ranks)
        exchanges = [OuterExchange(factory()) for _ in range(ranks)]
        for rank, exchange in enumerate(exchanges):
            exchange.attach(torch.device("cpu"), backend=world.backend(rank))
        rounds = [ex.average([grad.clone()], [layers]) for ex, grad in zip(exchanges, grads)]
        for r in rounds:
            r.wait()
        sent[name] = exchanges[0].last_bytes[0]
    return sent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--ranks", type=int, default=2)
    args = parser.parse_args()
    sent = measure(args.width, args.blocks, args.ranks)
    params = sum(torch.Size(s).numel() for s in _shapes(args.width, args.blocks))
    print(f"{params:,} parameters, {args.ranks} ranks: bytes sent per rank per sync")
    print("| outer compressor | bytes sent | fraction of fp32 |")
    print("|---|---|---|")
    dense = sent["fp32 (Identity)"]
    for name, nbytes in sent.items():
        print(f"| `{name}` | {nbytes:,} | {nbytes / dense:.4f} |")


if __name__ == "__main__":
    main()
