"""Step time and bytes per step of DDP gradient compression on CPU workers (a benchmark, not a test).

Trains torchvision's ResNet-18 (11.2M parameters, 10 classes, 32x32 inputs) with N gloo workers on random data and
reports, per configuration, the median step time (forward + backward + communication + optimizer step), the
backward+communication time, each rank's payload bytes per step with the analytical payload size next to it, the
encode+decode time of the compressor and, next to it, the backward pass's time (the ``compute`` configuration's
backward, which has no communication, when it is run; else the configuration's own backward + communication) and
encode+decode as a share of it. Configurations:

* ``ddp``: plain DDP (torch's built-in all-reduce);
* ``compute``: DDP with torch's ``noop_hook`` (no communication at all: the compute-only floor);
* ``identity``, ``fp16``, ``topk``, ``powersgd``, ``dgc``, ``adacomp``, ``scalecom``, ``signsgd``, ``efsignsgd``,
  ``onebit``, ``qsgd``, ``terngrad``, ...: lightning-gradcomp's hook with that compressor (defaults);
* ``torch-fp16``: raw torch DDP with torch's ``fp16_compress_hook``;
* ``torch-powersgd``: raw torch DDP with torch's ``powerSGD_hook`` at the same rank.

Examples::

    python benchmarks/step_time.py                        # loopback at full speed
    python benchmarks/step_time.py --rate 100mbit         # loopback limited to 100 Mbit/s (needs root)
    python benchmarks/step_time.py --configs ddp identity --steps 20

``--rate`` runs the workers inside a fresh network namespace whose loopback is shaped with ``tc tbf``; the
namespace is deleted afterwards, also on failure. Every worker's traffic crosses that one link.

``--profile N`` records rank 0's measured steps with ``torch.profiler`` and prints, per configuration, the ``N``
operators with the most CPU time of their own per step (count per step, self ms per step), after the last round's
run: where a step's time goes beyond the codec (DDP's copies, the hook's gather of the compressed layers, the
optimizer). The step times of such a run include the profiler's overhead.
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
import torchvision
from _netns import shaped_namespace
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from lightning_gradcomp import CompressionState, compression_hook
from lightning_gradcomp.compressors import (
    DGC,
    QSGD,
    AdaComp,
    EFSignSGD,
    OneBit,
    PowerSGD,
    RandomK,
    ScaleCom,
    SignSGD,
    TernGrad,
    TopK,
)
from lightning_gradcomp.compressors.base import Layer, keep_count
from lightning_gradcomp.compressors.ops.packing import field_width, index_nbytes, words_needed
from lightning_gradcomp.testing import EXAMPLES

RANK = 2
# every method's default configuration, from the package's one table of examples (PowerSGD: rank RANK)
COMPRESSORS = {
    name: EXAMPLES[name]
    for name in (
        "identity",
        "fp16",
        "bf16",
        "topk",
        "randomk",
        "powersgd",
        "dgc",
        "adacomp",
        "scalecom",
        "signsgd",
        "efsignsgd",
        "onebit",
        "qsgd",
        "terngrad",
    )
}
DEFAULT_CONFIGS = ["ddp", "compute", "identity", "fp16", "topk", "powersgd", "torch-powersgd"]
MIN_COMPRESS_NUMEL = 1024  # CompressedDDP's default


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return torchvision.models.resnet18(num_classes=10)


def analytical_bytes(model: nn.Module, config: str, workers: int = 2) -> int | None:
    """Payload bytes per step and rank from the formulas in docs/compressors.md (plain DDP: every gradient, fp32).

    Per layer, without the alignment padding of packed payloads (up to 7 bytes per tensor per bucket). ScaleCom: the
    average over ``workers`` steps (a rank broadcasts indices when it leads). AdaComp: ``None`` (data-dependent).
    """
    params = [p for p in model.parameters() if p.requires_grad]
    dense = sum(p.numel() for p in params) * 4
    if config in ("ddp", "identity"):
        return dense
    if config == "compute":
        return 0
    if config in ("fp16", "bf16", "torch-fp16"):
        return dense // 2
    if config == "torch-powersgd":
        total = 0
        for p in params:  # torch's rule: any tensor whose (rows + cols) r * 2 < rows * cols, 1-D ones never
            rows, cols = p.shape[0], p.numel() // p.shape[0]
            r = min(rows, cols, RANK)
            total += (rows + cols) * r * 4 if (rows + cols) * r * 2 < rows * cols else p.numel() * 4
        return total
    compressor = COMPRESSORS[config]()
    if isinstance(compressor, AdaComp):
        return None
    if isinstance(compressor, SignSGD):  # every layer, one bit per element
        return sum(-(-p.numel() // 8) for p in params)
    total = 0
    for i, p in enumerate(params):
        layer = Layer(str(i), i, p.shape)
        d = p.numel()
        if not compressor.compresses(layer, MIN_COMPRESS_NUMEL) or (
            isinstance(compressor, DGC) and not (p.ndim >= 2 and d >= MIN_COMPRESS_NUMEL)
        ):
            total += d * 4
        elif isinstance(compressor, DGC):
            k = -(-d * compressor.ratio // 1)
            total += int(k) * 4 + index_nbytes(int(k), d)[1]
        elif isinstance(compressor, ScaleCom):
            k = keep_count(d, compressor.ratio)
            total += k * 4 + index_nbytes(k, d)[1] / workers
        elif isinstance(compressor, EFSignSGD):
            total += -(-d // 8) + 4
        elif isinstance(compressor, OneBit):
            total += -(-d // 8) + 8
        elif isinstance(compressor, QSGD):
            total += 4 * -(-d // compressor.bucket_size) + -(-d * (compressor.levels.bit_length() + 1) // 8)
        elif isinstance(compressor, TernGrad):
            total += 4 + 8 * words_needed(d, field_width(2 * workers))
        elif isinstance(compressor, TopK):
            total += keep_count(p.numel(), compressor.ratio) * 8  # fp32 value + int32 index
        elif isinstance(compressor, RandomK):
            total += keep_count(p.numel(), compressor.ratio) * 4
        elif isinstance(compressor, PowerSGD):
            rows, cols = p.shape[0], p.numel() // p.shape[0]
            total += (rows + cols) * min(rows, cols, compressor.rank) * 4
    return round(total)


def worker(rank: int, world_size: int, port: int, config: str, args: argparse.Namespace, out: str) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    model = build_model()
    bucket_mb = args.torch_bucket_mb if config == "torch-powersgd" else args.bucket_mb
    ddp = DDP(model, bucket_cap_mb=bucket_mb, gradient_as_bucket_view=args.gradient_as_bucket_view)
    state = None
    warmup = args.warmup
    if config == "compute":
        ddp.register_comm_hook(None, noop_hook)
    elif config == "torch-fp16":
        ddp.register_comm_hook(None, fp16_compress_hook)
    elif config == "torch-powersgd":
        # torch's hook needs start_powerSGD_iter >= 2 (dense steps); they fall within the warm-up
        warmup = max(warmup, 2)
        ddp.register_comm_hook(
            PowerSGDState(process_group=None, matrix_approximation_rank=RANK, start_powerSGD_iter=2), powerSGD_hook
        )
    elif config != "ddp":
        state = CompressionState(COMPRESSORS[config](), min_compress_numel=MIN_COMPRESS_NUMEL)
        state.attach(ddp)
        ddp.register_comm_hook(state, compression_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch_size, 3, 32, 32, generator=g)
    y = torch.randint(0, 10, (args.batch_size,), generator=g)
    steps, backwards, sent, codec = [], [], [], []
    recorder = torch.profiler.profile() if args.profile and rank == 0 else None
    for step in range(warmup + args.steps):
        if recorder is not None and step == warmup:
            recorder.start()
        dist.barrier()  # start every step together, so one rank's slow step is not charged to the next
        begin = time.perf_counter()
        loss = nn.functional.cross_entropy(ddp(x), y)
        mid = time.perf_counter()
        loss.backward()  # returns once every bucket's communication has finished
        end_backward = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        end = time.perf_counter()
        stats = state.telemetry.pop_step() if state is not None else None
        if step >= warmup:
            steps.append(end - begin)
            backwards.append(end_backward - mid)
            if stats is not None:
                sent.append(stats.bytes_sent)
                codec.append(stats.encode_ms + stats.decode_ms)
    if recorder is not None:
        recorder.stop()
        ops = sorted(recorder.key_averages(), key=lambda e: -e.self_cpu_time_total)[: args.profile]
        profile = [(e.key, e.count / args.steps, e.self_cpu_time_total / 1e3 / args.steps) for e in ops]
    result = {
        "config": config,
        "step_s": statistics.median(steps),
        "step_s_all": steps,
        "backward_comm_s": statistics.median(backwards),
        "bytes_sent": statistics.mean(sent) if sent else analytical_bytes(model, config, world_size),
        "bytes_measured": bool(sent),
        "bytes_analytical": analytical_bytes(model, config, world_size),
        "codec_ms": statistics.median(codec) if codec else 0.0,
    }
    if recorder is not None:
        result["profile"] = profile
    torch.save(result, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


def run_config(config: str, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as out:
        port = 29500 + (os.getpid() + hash(config)) % 2000
        try:
            mp.spawn(worker, args=(args.workers, port, config, args, out), nprocs=args.workers)
        except Exception as error:  # report a configuration that fails (torch's hook under gloo) and go on
            return {"config": config, "error": str(error).strip().splitlines()[-1][:200]}
        return torch.load(os.path.join(out, "rank0.pt"), weights_only=False)


def _median_over_rounds(config: str, rounds: list[dict]) -> dict:
    ok = [r for r in rounds if "error" not in r]
    if not ok:
        return rounds[0]
    merged = dict(ok[0])
    for key in ("step_s", "backward_comm_s", "codec_ms"):
        merged[key] = statistics.median(r[key] for r in ok)
    merged["step_s_rounds"] = [r["step_s"] for r in ok]
    if "profile" in ok[-1]:
        merged["profile"] = ok[-1]["profile"]
    merged["failed_rounds"] = len(rounds) - len(ok)
    return merged


def table(results: list[dict], args: argparse.Namespace) -> str:
    by_name = {r["config"]: r for r in results}
    ddp = by_name.get("ddp", {}).get("step_s")
    compute_backward = by_name.get("compute", {}).get("backward_comm_s")
    lines = [
        f"ResNet-18 (11.2M parameters), {args.workers} CPU workers x {args.threads} thread, batch {args.batch_size}"
        f" per worker, link: {args.rate or 'loopback, unshaped'}; median of {args.steps} steps after"
        f" {args.warmup} warm-up steps, median over {args.rounds} interleaved round(s);"
        f" DDP buckets {args.bucket_mb:g} MB (torch-powersgd: {args.torch_bucket_mb:g} MB)"
        + (", gradient_as_bucket_view=True" if args.gradient_as_bucket_view else ""),
        "",
        "| configuration | step time (s) | vs plain DDP | backward + comm (s) | bytes sent per step"
        " | analytical bytes | encode+decode (ms) | backward (ms) | encode+decode / backward |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['config']} | failed: {r['error']} | | | | | | | |")
            continue
        rel = f"{r['step_s'] / ddp:.2f}x" if ddp else ""
        measured = f"{r['bytes_sent']:,.0f}" if r["bytes_measured"] else f"({r['bytes_sent']:,.0f})"
        analytical = f"{r['bytes_analytical']:,}" if r["bytes_analytical"] is not None else "data-dependent"
        backward_ms = 1e3 * (compute_backward if compute_backward is not None else r["backward_comm_s"])
        share = f"{100 * r['codec_ms'] / backward_ms:.0f}%" if r["codec_ms"] else ""
        lines.append(
            f"| {r['config']} | {r['step_s']:.3f} | {rel} | {r['backward_comm_s']:.3f} | {measured} |"
            f" {analytical} | {r['codec_ms']:.1f} | {backward_ms:.0f} | {share} |"
            + (f" ({r['failed_rounds']} round(s) failed)" if r.get("failed_rounds") else "")
        )
    lines.append("")
    lines.append("Bytes in parentheses are analytical (plain DDP and torch's hooks have no byte counter);")
    lines.append("bytes sent are the mean over the measured steps (ScaleCom's alternate with the leader).")
    backward_source = (
        "the `compute` configuration's (no communication)"
        if compute_backward is not None
        else ("each configuration's own backward + communication")
    )
    lines.append(f"Backward (ms): {backward_source}.")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--configs",
        nargs="+",
        default=DEFAULT_CONFIGS,
        choices=["ddp", "compute", "torch-fp16", "torch-powersgd", *COMPRESSORS],
    )
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--bucket-mb", type=float, default=25.0, help="DDP bucket cap for our hook and plain DDP")
    parser.add_argument(
        "--torch-bucket-mb",
        type=float,
        default=500.0,
        help="bucket cap for torch's powerSGD_hook (it aborts under gloo with several buckets)",
    )
    parser.add_argument(
        "--gradient-as-bucket-view",
        action="store_true",
        help="DDP's gradient_as_bucket_view=True for every configuration (no copies into buckets)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run every configuration this many times, interleaved; report the median over rounds",
    )
    parser.add_argument("--rate", default=None, help="shape loopback to this tc rate, e.g. 100mbit (needs root)")
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="print rank 0's N operators with the most self CPU time per step (torch.profiler)",
    )
    parser.add_argument("--inside-namespace", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.profile < 0:
        parser.error(f"expected --profile to be a number of operators (0 for none), got {args.profile}")

    if args.rate and not args.inside_namespace:
        with shaped_namespace(args.rate) as name:
            command = ["ip", "netns", "exec", name, sys.executable, *sys.argv, "--inside-namespace"]
            sys.exit(subprocess.run(command, check=False).returncode)

    runs: dict[str, list[dict]] = {config: [] for config in args.configs}
    for round_ in range(args.rounds):  # interleaved, so slow drifts of the machine hit every configuration alike
        for config in args.configs:
            begin = time.time()
            runs[config].append(run_config(config, args))
            print(f"# round {round_ + 1}, {config}: {time.time() - begin:.0f} s", file=sys.stderr, flush=True)
    results = [_median_over_rounds(config, rounds) for config, rounds in runs.items()]
    print(table(results, args))
    for result in results:
        if result.get("profile"):
            print(f"\n{result['config']} (rank 0, last round): operator, calls per step, self CPU ms per step")
            for name, calls, ms in result["profile"]:
                print(f"  {name[:48]:<48} {calls:7.1f} {ms:8.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1, default=str)


if __name__ == "__main__":
    main()
