"""Bytes a rank receives per step: the all-gather against the two-phase exchange, on simulated ranks.

For each compressor and world size ``N``, ``simulate_reduce`` runs one step of ``--layers`` layers of ``--numel``
elements each through ``transport="allgather"``, ``"two_phase"`` and ``"auto"``, on ``N`` simulated ranks, and prints
what rank 0 received (the telemetry's ``bytes_received``, flags included) as a fraction of a dense fp32 ring
all-reduce's ``2 (N - 1) / N * 4 d``. The all-gather's fraction grows with ``N``; the two-phase exchange's stays flat.

Example::

    python benchmarks/two_phase.py --ranks 2 4 16 64 --compressors signsgd qsgd
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from lightning_gradcomp.compressors import QSGD, AdaComp, EFSignSGD, MinMax, OneBit, SignSGD
from lightning_gradcomp.compressors.base import Compressor, layers_from_shapes
from lightning_gradcomp.engine.telemetry import Telemetry
from lightning_gradcomp.testing import simulate_reduce

FACTORIES: dict[str, Callable[[str], Compressor]] = {
    "adacomp": lambda t: AdaComp(transport=t),
    "signsgd": lambda t: SignSGD(transport=t),
    "efsignsgd": lambda t: EFSignSGD(transport=t),
    "onebit": lambda t: OneBit(transport=t),
    "qsgd": lambda t: QSGD(transport=t),
    "minmax8": lambda t: MinMax(bits=8, transport=t),
    "minmax4": lambda t: MinMax(bits=4, transport=t),
}


def received_fraction(name: str, transport: str, ranks: int, numel: int, layers: int) -> float:
    """Rank 0's received bytes over a dense fp32 ring all-reduce's, for one step."""
    shapes = [(numel // 64, 64)] * layers
    flat = numel // 64 * 64 * layers
    telemetry = [Telemetry() for _ in range(ranks)]
    for t in telemetry:
        t.add_bucket(4 * flat)
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(flat, generator=g) for _ in range(ranks)]
    residuals = None if name == "signsgd" else [torch.zeros(flat) for _ in range(ranks)]
    compressors = [FACTORIES[name](transport) for _ in range(ranks)]
    simulate_reduce(compressors, grads, layers_from_shapes(shapes), residuals=residuals, telemetry=telemetry)
    stats = telemetry[0].pop_step()
    assert stats is not None
    return stats.bytes_received / (2 * (ranks - 1) / ranks * 4 * flat)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--compressors", nargs="+", default=list(FACTORIES), choices=list(FACTORIES))
    parser.add_argument("--ranks", nargs="+", type=int, default=[2, 3, 4, 8, 16])
    parser.add_argument("--numel", type=int, default=65536, help="elements per layer (default 65536)")
    parser.add_argument("--layers", type=int, default=4, help="layers in the bucket (default 4)")
    args = parser.parse_args()
    print("| compressor | N | all-gather | two-phase | auto |")
    print("|---|---|---|---|---|")
    for name in args.compressors:
        for n in args.ranks:
            row = [received_fraction(name, t, n, args.numel, args.layers) for t in ("allgather", "two_phase", "auto")]
            print(f"| {name} | {n} | " + " | ".join(f"{f:.4f}" for f in row) + " |")


if __name__ == "__main__":
    main()
