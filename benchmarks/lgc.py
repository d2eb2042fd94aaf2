"""LGC on ResNet-18: bytes per rank and step in each stage against TopK, DGC and ScaleCom, at 2 and 4 ranks.

The ranks are simulated in one process (``lightning_gradcomp.testing.simulate_reduce``, the code path of training);
the bytes are those the telemetry counts (the tensors handed to the collectives, the non-finite flag included), and
they equal :meth:`LGC.bytes_per_step`. The compressed layers of ResNet-18 for CIFAR-10 (>= 2-D, >= 1024 elements:
``CompressedDDP``'s default rule; 11.16M of its 11.17M parameters) form one bucket; the other layers (batch norm,
biases: 9.6k parameters, 38 kB) are averaged densely by every method alike and are reported apart. Gradients are
random (bytes do not depend on the values; the autoencoder's cost does not either). Per rank and step means the mean
over the ranks and over ``n`` steps (leaders rotate; LGC-PS's fixed leader is rank 0).

The encode and decode times (``gradcomp/encode_ms`` + ``decode_ms``, summed over the simulated ranks, so ``n`` times
one rank's work, measured on a shared CPU) show the autoencoder's cost: stage 2 includes one training step (on the
previous step's values), stage 3 the encoder on the leader (PS) or every rank (all-reduce) and ``n`` decoders (PS)
or one (all-reduce) on every rank.

The PS variant's alternative form, gather-to-the-leader-then-broadcast (the leader decodes everyone and broadcasts
the ``k`` averaged values with their indices), is reported by its formula: the innovations are gathered as in the
all-gather form and the leader broadcasts ``p(4 k) + B`` bytes instead of ``p(4 (c + L)) + B``.

Example::

    python benchmarks/lgc.py --json benchmarks/results/lgc_bytes.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from lightning_gradcomp.compressors import DGC, LGC, Compressor, ScaleCom, TopK
from lightning_gradcomp.compressors.base import BucketContext, Layer
from lightning_gradcomp.compressors.scalecom import index_blob_nbytes
from lightning_gradcomp.models import CifarResNet18
from lightning_gradcomp.telemetry import Telemetry
from lightning_gradcomp.testing import simulate_reduce


def resnet18_layers(min_numel: int = 1024) -> tuple[tuple[Layer, ...], int]:
    """The compressed layers of ResNet-18 (one flat layout) and the number of densely averaged elements."""
    layers, offset, dense = [], 0, 0
    for index, (name, p) in enumerate(CifarResNet18().named_parameters()):
        if p.ndim >= 2 and p.numel() >= min_numel:
            layers.append(Layer(name, index, p.shape, offset))
            offset += p.numel()
        else:
            dense += p.numel()
    return tuple(layers), dense


def measure(factory, layers, ranks: int, steps: list[int]) -> list[dict]:
    """Bytes and encode+decode time of each of ``steps`` (run in order from step 0) for ``ranks`` simulated ranks."""
    compressors: list[Compressor] = [factory() for _ in range(ranks)]
    numel = sum(layer.numel for layer in layers)
    residuals = [torch.zeros(numel) for _ in range(ranks)]
    generator = torch.Generator().manual_seed(0)
    out = []
    for step in range(max(steps) + 1):
        common = torch.randn(numel, generator=generator)
        grads = [common + 0.5 * torch.randn(numel, generator=generator) for _ in range(ranks)]
        telemetry = [Telemetry() for _ in range(ranks)]
        for t in telemetry:
            t.add_bucket(4 * numel)
        start = time.perf_counter()
        simulate_reduce(compressors, grads, layers, step=step, residuals=residuals, telemetry=telemetry)
        wall = time.perf_counter() - start
        stats = [t.pop_step() for t in telemetry]
        if step in steps:
            out.append({
                "step": step,
                "bytes_per_rank": [s.bytes_sent for s in stats],
                "encode_decode_ms": sum(s.encode_ms + s.decode_ms for s in stats),
                "decode_ms": sum(s.decode_ms for s in stats),
                "wall_ms": 1000 * wall,
            })  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ratio", type=float, default=1e-3)
    parser.add_argument("--innovation-ratio", type=float, default=1e-5)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    layers, dense = resnet18_layers()
    numel = sum(layer.numel for layer in layers)
    rho, rho_u = args.ratio, args.innovation_ratio
    rows = []
    for n in args.ranks:
        # stage 1 at step 0, stage 2 at steps 1-2 (step 2 trains on step 1's values), stage 3 from step 3
        lgc = {
            "ps": lambda: LGC(ratio=rho, innovation_ratio=rho_u, dense_steps=1, training_steps=2),
            "allreduce": lambda: LGC(variant="allreduce", ratio=rho, dense_steps=1, training_steps=2),
        }
        for variant, factory in lgc.items():
            runs = measure(factory, layers, n, steps=list(range(3, 3 + n)) + [0, 2])
            for stage, picked in ((1, [0]), (2, [2]), (3, list(range(3, 3 + n)))):
                chosen = [r for r in runs if r["step"] in picked]
                per_rank = sum(sum(r["bytes_per_rank"]) for r in chosen) / (n * len(chosen))
                rows.append({"ranks": n, "method": f"lgc-{variant}", "stage": stage, "bytes_per_rank": per_rank,
                             "leader_bytes": max(chosen[0]["bytes_per_rank"]),
                             "other_bytes": min(chosen[0]["bytes_per_rank"]),
                             "encode_decode_ms": sum(r["encode_decode_ms"] for r in chosen) / len(chosen),
                             "decode_ms": sum(r["decode_ms"] for r in chosen) / len(chosen)})  # fmt: skip
        for name, factory in (("topk", lambda: TopK(ratio=rho)), ("dgc", lambda: DGC(ratio=rho)),
                              ("scalecom", lambda: ScaleCom(ratio=rho))):  # fmt: skip
            runs = measure(factory, layers, n, steps=list(range(n)))
            per_rank = sum(sum(r["bytes_per_rank"]) for r in runs) / (n * len(runs))
            rows.append({"ranks": n, "method": name, "stage": None, "bytes_per_rank": per_rank,
                         "leader_bytes": max(runs[0]["bytes_per_rank"]), "other_bytes": min(runs[0]["bytes_per_rank"]),
                         "encode_decode_ms": sum(r["encode_decode_ms"] for r in runs) / len(runs),
                         "decode_ms": sum(r["decode_ms"] for r in runs) / len(runs)})  # fmt: skip
        # the PS variant's other form, by formula: the leader broadcasts k values instead of the code and scales
        ctx = BucketContext(index=0, step=3, rank=1, world_size=n, layers=layers)
        probe = lgc["ps"]()
        layout = probe._layout(ctx)
        innovations = probe.bytes_per_step(ctx)  # a non-leader's stage-3 bytes: its innovation (and the flag)
        leader_code = -(-4 * (probe._code_numel(ctx) + len(layers)) // 8) * 8 + index_blob_nbytes(layout)
        leader_values = -(-4 * layout.slots // 8) * 8 + index_blob_nbytes(layout)
        rows.append({"ranks": n, "method": "lgc-ps (gather, decode on the leader, broadcast values)", "stage": 3,
                     "bytes_per_rank": innovations + leader_values / n, "leader_bytes": innovations + leader_values,
                     "other_bytes": innovations, "encode_decode_ms": None, "decode_ms": None,
                     "note": f"leader broadcast {leader_values} B instead of {leader_code} B"})  # fmt: skip
    dense_bytes = 4 * numel
    print(
        f"ResNet-18 (CIFAR-10): {numel:,} compressed elements ({dense_bytes:,} B dense), {dense:,} densely averaged"
        f" elements ({4 * dense:,} B, every method alike, not included); ratio {rho:g}, innovation ratio {rho_u:g}"
    )
    print()
    print(
        "| ranks | method | stage | bytes per rank and step | vs dense | leader | other ranks"
        " | encode+decode ms (all ranks) | of which decode |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        ms = "" if r["encode_decode_ms"] is None else f"{r['encode_decode_ms']:.0f} | {r['decode_ms']:.0f}"
        stage = "" if r["stage"] is None else r["stage"]
        ratio = dense_bytes / r["bytes_per_rank"]
        print(
            f"| {r['ranks']} | {r['method']} | {stage} | {r['bytes_per_rank']:,.0f} | {ratio:,.0f}x |"
            f" {r['leader_bytes']:,} | {r['other_bytes']:,} | {ms or ' | '} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "compressed_elements": numel, "dense_elements": dense, "rows": rows}, f,
                      indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
