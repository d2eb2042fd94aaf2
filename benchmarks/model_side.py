"""Model-side compression: step time and bytes per step of dense vs Pufferfish vs PacTrain (a benchmark, not a test).

The paper's CIFAR-10 ResNet-18 (``lightning_gradcomp.models.CifarResNet18``, 11.2M parameters, 32x32 random inputs),
N gloo workers, raw ``DistributedDataParallel`` with lightning-gradcomp's communication hook (what ``CompressedDDP``
registers), SGD with momentum. Configurations:

* ``dense``: the full-rank model, ``Identity`` (plain DDP averaging);
* ``pufferfish``: the model factorized as the paper does (rank ratio 1/4; conv1, layer1.0, shortcuts and the
  classifier full-rank; 3.3M parameters), ``Identity``;
* ``pactrain-50``, ``pactrain-90``, ``pactrain-95``: the full-rank model pruned by weight magnitude (one shot, every
  prunable layer at that sparsity, the state at the end of PacTrain's schedule), gradients through
  ``MaskedCompressor(Identity())`` (only the surviving entries are all-reduced), and the weights re-masked after
  every optimizer step as ``PacTrain`` does;
* ``pactrain-90-channel``: as ``pactrain-90`` with whole output channels pruned.

Each row reports the median step time (forward + backward with overlapped communication + optimizer step, plus
PacTrain's re-masking), each rank's bytes per step counted by the hook's telemetry, and the analytical bytes (4 x the
parameters that are sent). Bytes are deterministic; times depend on the machine (``--rate`` shapes the loopback as in
``step_time.py``, needs root).

Examples::

    python benchmarks/model_side.py
    python benchmarks/model_side.py --rate 100mbit --steps 6
    python benchmarks/model_side.py --configs dense pactrain-90 --steps 3 --warmup 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from lightning_gradcomp import CompressionState, compression_hook
from lightning_gradcomp.compressors import Identity, MaskedCompressor, Masks
from lightning_gradcomp.models import CifarResNet18
from lightning_gradcomp.transforms.pactrain import magnitude_masks, prunable_parameters
from lightning_gradcomp.transforms.pufferfish import apply_factorization, plan

CONFIGS = ["dense", "pufferfish", "pactrain-50", "pactrain-90", "pactrain-95", "pactrain-90-channel"]


def build(config: str) -> tuple[nn.Module, Masks | None]:
    """The model of ``config`` (and its masks), identical in every worker."""
    torch.manual_seed(0)
    model = CifarResNet18()
    if config == "pufferfish":
        apply_factorization(model, [d.name for d in plan(model, 0.25) if d.factorize], 0.25)
        return model, None
    if config.startswith("pactrain"):
        _, sparsity, *granularity = config.split("-")
        weights = prunable_parameters(model)
        masks = Masks(
            magnitude_masks(weights, int(sparsity) / 100, granularity=granularity[0] if granularity else "element")
        )
        with torch.no_grad():
            for name, p in weights.items():
                p.mul_(masks[name])
        return model, masks
    return model, None


def analytical_bytes(model: nn.Module, masks: Masks | None) -> int:
    """4 bytes per parameter that is sent: every parameter, minus the pruned entries of masked ones."""
    total = sum(p.numel() for p in model.parameters())
    if masks is not None:
        total -= sum(masks[name].numel() - masks.kept(name) for name in masks)
    return 4 * total


def worker(rank: int, world_size: int, port: int, config: str, args: argparse.Namespace, out: str) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    model, masks = build(config)
    ddp = DDP(model, bucket_cap_mb=args.bucket_mb)
    compressor = Identity() if masks is None else MaskedCompressor(Identity(), masks)
    state = CompressionState(compressor)
    state.attach(ddp)
    ddp.register_comm_hook(state, compression_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    pruned = [(p, masks[name]) for name, p in model.named_parameters() if masks is not None and masks.partial(name)]
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch_size, 3, 32, 32, generator=g)
    y = torch.randint(0, 10, (args.batch_size,), generator=g)
    steps, sent = [], []
    for step in range(args.warmup + args.steps):
        dist.barrier()
        begin = time.perf_counter()
        nn.functional.cross_entropy(ddp(x), y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():  # PacTrain holds pruned weights at zero after every step
            for p, mask in pruned:
                p.mul_(mask)
        end = time.perf_counter()
        stats = state.telemetry.pop_step()
        if step >= args.warmup:
            steps.append(end - begin)
            sent.append(stats.bytes_sent)
    if rank == 0:
        torch.save(
            {
                "config": config,
                "step_s": statistics.median(steps),
                "bytes_sent": statistics.median(sent),
                "bytes_dense": stats.bytes_dense,
                "bytes_analytical": analytical_bytes(model, masks),
                "params": sum(p.numel() for p in model.parameters()),
            },
            os.path.join(out, "result.pt"),
        )
    dist.destroy_process_group()


def run_config(config: str, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as out:
        port = 29500 + (os.getpid() + CONFIGS.index(config) * 97) % 2000
        mp.spawn(worker, args=(args.workers, port, config, args, out), nprocs=args.workers)
        return torch.load(os.path.join(out, "result.pt"), weights_only=False)


def table(results: list[dict], args: argparse.Namespace) -> str:
    dense = next((r for r in results if r["config"] == "dense"), None)
    lines = [
        f"CifarResNet18, {args.workers} CPU workers x {args.threads} thread, batch {args.batch_size} per worker,"
        f" link: {args.rate or 'loopback, unshaped'}; median of {args.steps} steps after {args.warmup} warm-up steps,"
        f" median over {args.rounds} round(s)",
        "",
        "| configuration | parameters | step time (s) | vs dense | bytes sent per step | analytical bytes"
        " | vs the dense model's bytes |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        rel = f"{r['step_s'] / dense['step_s']:.2f}x" if dense else ""
        ratio = f"{r['bytes_sent'] / (dense or r)['bytes_dense']:.4f}"
        lines.append(
            f"| {r['config']} | {r['params']:,} | {r['step_s']:.3f} | {rel} | {r['bytes_sent']:,.0f} |"
            f" {r['bytes_analytical']:,} | {ratio} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", nargs="+", default=CONFIGS, choices=CONFIGS)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--bucket-mb", type=float, default=25.0)
    parser.add_argument("--rounds", type=int, default=1, help="interleaved rounds; the median over rounds is kept")
    parser.add_argument("--rate", default=None, help="shape loopback to this tc rate, e.g. 100mbit (needs root)")
    parser.add_argument("--inside-namespace", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.rate and not args.inside_namespace:
        from step_time import shaped_namespace

        with shaped_namespace(args.rate) as name:
            command = ["ip", "netns", "exec", name, sys.executable, *sys.argv, "--inside-namespace"]
            sys.exit(subprocess.run(command, check=False).returncode)

    runs: dict[str, list[dict]] = {config: [] for config in args.configs}
    for _ in range(args.rounds):
        for config in args.configs:
            runs[config].append(run_config(config, args))
    results = []
    for rounds in runs.values():
        merged = dict(rounds[0])
        merged["step_s"] = statistics.median(r["step_s"] for r in rounds)
        results.append(merged)
    print(table(results, args))


if __name__ == "__main__":
    main()
