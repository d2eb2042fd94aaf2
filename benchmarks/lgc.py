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

The PS variant's two forms are both measured: ``ps_form="allgather"`` (every rank decodes every rank from the
leader's code) and ``ps_form="gather"`` (the leader decodes everyone and broadcasts the averaged values with its code
and indices; every other rank decodes only itself, for its error feedback). The table also gives, by formula, the
gather form without the code (the leader's ``p(4 (k + n k_u)) + B``: its other ranks could not decode themselves, so
their error feedback could not subtract what the aggregate used for them).

``--time``: the time of one stage-3 reduction (``Compressor.reduce`` on the ResNet-18 bucket, error feedback on, the
autoencoder's default size) on real gloo processes, one thread each, at each of ``--ranks``: the stage-3 steps after
two stage-2 steps and the first stage-3 step (which trains on the last stage-2 data) are timed from a barrier to the
reduction's result; per step the slowest rank's time, then the median over the steps; each rank's own compute
(the telemetry's encode + decode time: top-k, innovation, encoder, decoders, error feedback) is its median. With
``--rates`` each rate runs inside a network namespace whose loopback is shaped with ``tc tbf`` (root,
``benchmarks/_netns.py``); ``none`` is the plain loopback. On this project's machine the ranks share 2 cores with
other jobs, so 4 ranks do not run their decoders in parallel.

Examples::

    python benchmarks/lgc.py --json benchmarks/results/lgc_bytes.json
    python benchmarks/lgc.py --time --ranks 2 4 --rates none 100mbit --json benchmarks/results/lgc_ps_forms.json
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

from lightning_gradcomp.compressors import DGC, LGC, Compressor, LGCAllReduce, ScaleCom, TopK
from lightning_gradcomp.compressors.base import BucketContext, Layer, ResidualBuffers
from lightning_gradcomp.compressors.scalecom import index_blob_nbytes
from lightning_gradcomp.engine.collectives import TorchCollectives
from lightning_gradcomp.engine.comm import Comm
from lightning_gradcomp.engine.telemetry import Telemetry
from lightning_gradcomp.models import CifarResNet18
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
            out.append(
                {
                    "step": step,
                    "bytes_per_rank": [s.bytes_sent for s in stats],
                    "encode_decode_ms": sum(s.encode_ms + s.decode_ms for s in stats),
                    "decode_ms": sum(s.decode_ms for s in stats),
                    "wall_ms": 1000 * wall,
                }
            )
    return out


# ----------------------------------------------------------------------------------------------------------------
# Time of a stage-3 reduction on real processes (--time)
# ----------------------------------------------------------------------------------------------------------------
def _time_factories(rho: float, rho_u: float) -> dict:
    """Stage 2 at steps 0-1, stage 3 from step 2 (which trains on step 1's values)."""
    return {
        "lgc-ps (all-gather)": lambda: LGC(ratio=rho, innovation_ratio=rho_u, dense_steps=0, training_steps=2),
        "lgc-ps (gather)": lambda: LGC(
            ratio=rho, innovation_ratio=rho_u, dense_steps=0, training_steps=2, ps_form="gather"
        ),
        "lgc-allreduce": lambda: LGCAllReduce(ratio=rho, dense_steps=0, training_steps=2),
    }


def _time_worker(rank: int, world_size: int, port: int, args: argparse.Namespace, out: str) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    backend = TorchCollectives()
    backend.ensure_rounds(LGC.rounds)
    layers, _ = resnet18_layers()
    numel = sum(layer.numel for layer in layers)
    common = torch.randn(numel, generator=torch.Generator().manual_seed(0))
    grad = common + 0.5 * torch.randn(numel, generator=torch.Generator().manual_seed(1 + rank))
    results = {}
    for name, factory in _time_factories(args.ratio, args.innovation_ratio).items():
        compressor, residual = factory(), torch.zeros(numel)
        seconds, sent, compute = [], [], []
        for step in range(3 + args.steps):
            telemetry = Telemetry()
            telemetry.add_bucket(4 * numel)
            ctx = BucketContext(
                index=0,
                step=step,
                rank=rank,
                world_size=world_size,
                layers=layers,
                comm=Comm(backend, telemetry, grad.device),
            )
            tensor = grad.clone()
            dist.barrier()
            begin = time.perf_counter()
            compressor.reduce(tensor, ctx, ResidualBuffers(residual)).wait()
            elapsed = time.perf_counter() - begin
            stats = telemetry.pop_step()
            if step >= 3:
                seconds.append(elapsed)
                sent.append(stats.bytes_sent)
                compute.append(stats.encode_ms + stats.decode_ms)
        results[name] = {"seconds": seconds, "bytes_sent": sent, "compute_ms": compute}
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


def _time_rows(args: argparse.Namespace, rate: str) -> list[dict]:
    rows = []
    for n in args.ranks:
        with tempfile.TemporaryDirectory() as out:
            port = 29500 + (os.getpid() + 7 * n) % 2000
            mp.spawn(_time_worker, args=(n, port, args, out), nprocs=n)
            ranks = [torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=False) for r in range(n)]
        for name in ranks[0]:
            per_step = [max(r[name]["seconds"][i] for r in ranks) for i in range(args.steps)]
            rows.append(
                {
                    "rate": rate,
                    "ranks": n,
                    "method": name,
                    "step_ms": 1000 * statistics.median(per_step),
                    "step_ms_all": [1000 * t for t in per_step],
                    "bytes_per_rank": [r[name]["bytes_sent"][0] for r in ranks],
                    "compute_ms_per_rank": [statistics.median(r[name]["compute_ms"]) for r in ranks],
                }
            )
            print(f"# {rate} {n} ranks {name}: {rows[-1]['step_ms']:.0f} ms", file=sys.stderr, flush=True)
    return rows


def time_main(args: argparse.Namespace) -> None:
    from _netns import shaped_namespace

    rows = []
    if args.inside_namespace:
        rows = _time_rows(args, args.rates[0])
    else:
        for rate in args.rates:
            if rate == "none":
                rows.extend(_time_rows(args, rate))
                continue
            with tempfile.TemporaryDirectory() as tmp, shaped_namespace(rate) as name:
                path = os.path.join(tmp, "rows.json")
                command = [
                    "ip",
                    "netns",
                    "exec",
                    name,
                    sys.executable,
                    os.path.abspath(__file__),
                    "--time",
                    "--inside-namespace",
                    "--rates",
                    rate,
                    "--ranks",
                    *map(str, args.ranks),
                    "--steps",
                    str(args.steps),
                    "--ratio",
                    str(args.ratio),
                    "--innovation-ratio",
                    str(args.innovation_ratio),
                    "--json",
                    path,
                ]
                subprocess.run(command, check=True)
                with open(path) as f:
                    rows.extend(json.load(f)["rows"])
    if not args.inside_namespace:
        print(
            "| link | ranks | method | stage-3 reduction, ms (median, slowest rank) | min - max | leader's bytes |"
            " other ranks' bytes | encode+decode ms per rank (rank 0 first) |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for r in rows:
            leader = max(r["bytes_per_rank"])
            other = min(r["bytes_per_rank"])
            compute = " / ".join(f"{d:.0f}" for d in r["compute_ms_per_rank"])
            print(
                f"| {r['rate']} | {r['ranks']} | {r['method']} | {r['step_ms']:.0f} |"
                f" {min(r['step_ms_all']):.0f} - {max(r['step_ms_all']):.0f} | {leader:,} | {other:,} |"
                f" {compute} |"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ratio", type=float, default=1e-3)
    parser.add_argument("--innovation-ratio", type=float, default=1e-5)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--json", default=None)
    parser.add_argument("--time", action="store_true", help="time a stage-3 reduction on real gloo processes")
    parser.add_argument("--rates", nargs="+", default=["none"], help="--time: loopback rates ('none': unshaped)")
    parser.add_argument("--steps", type=int, default=5, help="--time: timed stage-3 steps")
    parser.add_argument("--inside-namespace", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.time:
        time_main(args)
        return
    torch.set_num_threads(1)
    layers, dense = resnet18_layers()
    numel = sum(layer.numel for layer in layers)
    rho, rho_u = args.ratio, args.innovation_ratio
    rows = []
    for n in args.ranks:
        # stage 1 at step 0, stage 2 at steps 1-2 (step 2 trains on step 1's values), stage 3 from step 3
        lgc = {
            "ps": lambda: LGC(ratio=rho, innovation_ratio=rho_u, dense_steps=1, training_steps=2),
            "ps-gather": lambda: LGC(
                ratio=rho, innovation_ratio=rho_u, dense_steps=1, training_steps=2, ps_form="gather"
            ),
            "allreduce": lambda: LGCAllReduce(ratio=rho, dense_steps=1, training_steps=2),
        }
        for variant, factory in lgc.items():
            runs = measure(factory, layers, n, steps=list(range(3, 3 + n)) + [0, 2])
            stages = ((1, [0]), (2, [2]), (3, list(range(3, 3 + n))))
            for stage, picked in stages[2:] if variant == "ps-gather" else stages:  # stages 1-2: those of "ps"
                chosen = [r for r in runs if r["step"] in picked]
                per_rank = sum(sum(r["bytes_per_rank"]) for r in chosen) / (n * len(chosen))
                rows.append(
                    {
                        "ranks": n,
                        "method": f"lgc-{variant}",
                        "stage": stage,
                        "bytes_per_rank": per_rank,
                        "leader_bytes": max(chosen[0]["bytes_per_rank"]),
                        "other_bytes": min(chosen[0]["bytes_per_rank"]),
                        "encode_decode_ms": sum(r["encode_decode_ms"] for r in chosen) / len(chosen),
                        "decode_ms": sum(r["decode_ms"] for r in chosen) / len(chosen),
                    }
                )
        for name, factory in (
            ("topk", lambda: TopK(ratio=rho)),
            ("dgc", lambda: DGC(ratio=rho)),
            ("scalecom", lambda: ScaleCom(ratio=rho)),
        ):
            runs = measure(factory, layers, n, steps=list(range(n)))
            per_rank = sum(sum(r["bytes_per_rank"]) for r in runs) / (n * len(runs))
            rows.append(
                {
                    "ranks": n,
                    "method": name,
                    "stage": None,
                    "bytes_per_rank": per_rank,
                    "leader_bytes": max(runs[0]["bytes_per_rank"]),
                    "other_bytes": min(runs[0]["bytes_per_rank"]),
                    "encode_decode_ms": sum(r["encode_decode_ms"] for r in runs) / len(runs),
                    "decode_ms": sum(r["decode_ms"] for r in runs) / len(runs),
                }
            )
        # the gather form without the code, by formula: the leader broadcasts the averaged values (at its k indices
        # and at every rank's k_u innovation indices) and its indices only; the other ranks could not decode
        # themselves, so their error feedback could not subtract what the aggregate used for them
        ctx = BucketContext(index=0, step=3, rank=1, world_size=n, layers=layers)
        probe = lgc["ps"]()
        layout = probe._layout(ctx)
        innovations = probe.bytes_per_step(ctx)  # a non-leader's stage-3 bytes: its innovation (and the flag)
        k_u = sum(probe._innovation_counts(ctx))
        leader_code = -(-4 * (probe._code_numel(ctx) + len(layers)) // 8) * 8 + index_blob_nbytes(layout)
        leader_values = -(-4 * (layout.slots + n * k_u) // 8) * 8 + index_blob_nbytes(layout)
        rows.append(
            {
                "ranks": n,
                "method": "lgc-ps (gather form without the code: formula)",
                "stage": 3,
                "bytes_per_rank": innovations + leader_values / n,
                "leader_bytes": innovations + leader_values,
                "other_bytes": innovations,
                "encode_decode_ms": None,
                "decode_ms": None,
                "note": f"leader broadcast {leader_values} B instead of {leader_code} B",
            }
        )
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
            json.dump(
                {"args": vars(args), "compressed_elements": numel, "dense_elements": dense, "rows": rows}, f, indent=1
            )


if __name__ == "__main__":
    main()
