"""Encode+decode time of every compressor, next to the backward pass and to one memory pass (a benchmark, not a test).

One process. Lays out the model's layers that ``CompressedDDP`` compresses by default (>= 2-D, >= 1024 elements) in
buckets of ``--bucket-mb`` MiB, as DDP does (default 25 MiB, DDP's ``bucket_cap_mb``; ``0``: one bucket, the layout
of this benchmark's runs before 2026-11-23: on the CPU every fresh temporary of a 44 MiB bucket is above glibc's
32 MiB mmap threshold and pays all its page faults on every step, which those of DDP's buckets do not), runs
each compressor for ``--ranks`` simulated ranks through ``lightning_gradcomp.testing.simulate_reduce`` (the training
code path: error feedback, compress, packing, aggregation and decode; the collectives are simulated in memory and not
counted) and reports, per compressor and rank, the encode+decode time the hook's
telemetry measures (``gradcomp/encode_ms + decode_ms``), as:

* a share of the backward pass of the same model (forward excluded), measured in the same run;
* *passes*: the time divided by the time of one memory pass over the compressed gradient (``dst.copy_(src)``: one
  read and one write of every element), the unit every elementwise stage costs at least. A codec that reads the
  gradient, writes a residual and writes the output is three passes at best, whatever the device;
* next to them, one fp32 uniform draw per element (``compressors.draws.uniform_draws``: a counter-based hash of
  the layer and position), the floor of the stochastic quantisers (QSGD and TernGrad draw one per element:
  stochastic rounding needs independent draws), and the same with 16 random bits per element (``random_bits=16``);
* on a line of its own, the end-of-step commit of the error-feedback residual (outside encode+decode): a storage
  swap on the CPU, ``torch.where`` on CUDA, next to what a copy would cost.

With ``--operators`` it also counts the top-level torch operators one step issues per rank (``torch.profiler``; the
simulated collectives' few copies included, alike for every compressor): on the CPU a proxy for the launches, since on
a GPU every operator that computes launches at least one kernel, though the CPU path runs some stages in NumPy, which
the count does not see. On CUDA it also counts kernel launches per step and rank (``torch.profiler``) and runs one
step with ``torch.cuda.set_sync_debug_mode("error")``: any host synchronisation on the codec path raises, and the
table says ``sync`` instead of ``0``. ``--operators-only`` skips the timings and counts the operators of one step (after
a warm-up step) on two layouts, ResNet-18's 62 parameters and ResNet-50's 161, every parameter compressed, in
``--bucket-mb`` buckets, per step and per bucket: a codec whose count per bucket is the same on both does not loop
over the layers (``--device-paths``: the paths a GPU takes, where the CPU has a shortcut of its own, as DGC's
layer-by-layer selection). Timings are medians over ``--steps`` steps after two warm-up steps; on CPU one
torch thread, as each worker of ``step_time.py`` has. Gradients are random normal scaled to 1e-3 (``--gradients
gaussian``, the tables' default) or, with ``--gradients model``, the model's own: each rank's gradient of the
cross-entropy of a batch of random images and labels (a seed per rank) through the freshly initialised model, whose
magnitudes differ from layer to layer and are heavier-tailed than a Gaussian's (what the data-dependent selections of
AdaComp, DGC and TopK see in training); with ``--row-density D`` each rank keeps a random fraction ``D`` of every
layer's rows and zeroes the others, as an embedding's gradient is non-zero only in the rows of the batch's tokens (the
input Zen is for; a dense gradient takes its dense fallback).

Examples::

    python benchmarks/codec.py                                    # CPU, ResNet-18 (CIFAR shape), batch 32
    python benchmarks/codec.py --device cuda --batch-size 128      # GPU, ResNet-18, batch 128
    python benchmarks/codec.py --device cuda --model resnet50 --image-size 224 --batch-size 64
    python benchmarks/codec.py --compressors topk qsgd --out benchmarks/results/codec_cpu.json
    python benchmarks/codec.py --compressors zen zen-always --row-density 0.05
    python benchmarks/codec.py --gradients model                    # the model's gradients instead of Gaussian ones
    python benchmarks/codec.py --operators-only --compressors efsignsgd onebit   # operators, ResNet-18 and ResNet-50
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
import torchvision
from codec_profile import compressed_layers
from torch import Tensor

from lightning_gradcomp.compressors import LGC, Identity, LGCAllReduce, MaskedCompressor, Masks, TopK, dgc
from lightning_gradcomp.compressors.base import BucketContext, Layer
from lightning_gradcomp.compressors.ops.draws import uniform_draws
from lightning_gradcomp.engine.requests import StepUpdates
from lightning_gradcomp.engine.telemetry import Telemetry
from lightning_gradcomp.testing import EXAMPLES, simulate_reduce

DEFAULT_COMPRESSORS = (
    "fp16",
    "bf16",
    "randomk",
    "powersgd",
    "topk",
    "dgc",
    "scalecom",
    "signsgd",
    "efsignsgd",
    "onebit",
    "qsgd",
    "terngrad",
    "adacomp",
)
# LGC's stages at its default ratios (the contract suite's examples use 50x larger ones, to reach every path on
# small tensors): stage 1 is the plain all-reduce (`lgc`), these start in stage 2 or stage 3
LGC_STAGES = {
    "lgc-ps-default-stage2": lambda: LGC(dense_steps=0, training_steps=10**9),
    "lgc-ps-default-stage3": lambda: LGC(dense_steps=0, training_steps=0),
    "lgc-allreduce-default-stage2": lambda: LGCAllReduce(dense_steps=0, training_steps=10**9),
    "lgc-allreduce-default-stage3": lambda: LGCAllReduce(dense_steps=0, training_steps=0),
}
# PacTrain's MaskedCompressor with half of every compressed layer's entries pruned (the same random masks on every
# rank, as PacTrain keeps them), around Identity and TopK(0.2); the contract suite's `masked` examples have no masks
MASKED = {"masked-half": lambda: Identity(), "masked-half-topk": lambda: TopK(ratio=0.2)}
CONFIGS = {**EXAMPLES, **LGC_STAGES, **MASKED}


def half_masks(layout: list[tuple[Layer, ...]], device: torch.device) -> dict[str, torch.Tensor]:
    """A random mask keeping half of the entries of every layer of ``layout`` (fixed seed)."""
    generator = torch.Generator().manual_seed(1)
    return {
        layer.name: (torch.rand(layer.shape, generator=generator) < 0.5).to(device)
        for bucket in layout
        for layer in bucket
    }


TARGETS = {  # the codecs' CPU targets, as a share of the backward pass
    **dict.fromkeys(("fp16", "bf16", "randomk", "powersgd", "topk", "dgc", "scalecom"), 0.10),
    **dict.fromkeys(("signsgd", "efsignsgd", "onebit", "qsgd", "terngrad", "adacomp"), 0.30),
    **dict.fromkeys(("qsgd-16bit-draws", "terngrad-16bit-draws"), 0.30),
}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_ms(fn: Callable[[], None], device: torch.device, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def random_batch(args: argparse.Namespace, device: torch.device, seed: int) -> tuple[Tensor, Tensor]:
    """A batch of random images and labels (10 classes) of the benchmark's shape, from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(args.batch_size, 3, args.image_size, args.image_size, generator=g).to(device)
    return x, torch.randint(0, 10, (args.batch_size,), generator=g).to(device)


def backward_ms(model: torch.nn.Module, args: argparse.Namespace, device: torch.device) -> float:
    """The median backward pass (forward excluded) of one batch."""
    x, y = random_batch(args, device, seed=0)
    loss_fn = torch.nn.CrossEntropyLoss()
    times = []
    for i in range(args.steps + 2):
        model.zero_grad(set_to_none=False)
        loss = loss_fn(model(x), y)
        _sync(device)
        start = time.perf_counter()
        loss.backward()
        _sync(device)
        if i >= 2:
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _profiled(run: Callable[[], None], cuda: bool = False) -> torch.profiler.profile:
    """One call of ``run`` under ``torch.profiler`` (CPU events, and CUDA's where asked)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        run()
    return prof


def kernel_launches(run: Callable[[], None], ranks: int) -> float:
    """CUDA kernel launches (and memcpy/memset calls) per call of ``run`` and rank."""
    names = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cudaMemcpyAsync", "cudaMemsetAsync")
    return sum(e.count for e in _profiled(run, cuda=True).key_averages() if e.key in names) / ranks


def operators(run: Callable[[], None], ranks: int) -> float:
    """Top-level torch operators (``aten::``, not those an operator calls) per call of ``run`` and rank."""
    events = _profiled(run).events()
    return sum(1 for e in events if e.cpu_parent is None and e.name.startswith("aten::")) / ranks


def has_host_sync(run: Callable[[], None]) -> bool:
    """Whether ``run`` synchronises the host with the GPU (``set_sync_debug_mode("error")`` raises)."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        run()
    except RuntimeError as err:
        if "synchroniz" not in str(err).lower():
            raise
        print(f"  host sync: {str(err).splitlines()[0]}")
        return True
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return False


def commit_ms(numel: int, device: torch.device, swap: bool, repeats: int = 20) -> float:
    """The end of step commit of one gradient-sized residual: a storage swap (what the hook does on the CPU) or a copy.

    Outside encode+decode (``StepUpdates.commit`` runs once per step after the last bucket), but on the step's path.
    """
    residual, twin = torch.zeros(numel, device=device), torch.randn(numel, device=device)
    ok = torch.ones((), dtype=torch.bool, device=device)

    def run() -> None:
        updates = StepUpdates()
        updates.stage(residual, twin, swap=swap)
        updates.observe(ok)
        updates.commit()

    run()
    return _median_ms(run, device, repeats)


def buckets(layers: tuple[Layer, ...], cap_mb: float) -> list[tuple[Layer, ...]]:
    """``layers`` in buckets of at most ``cap_mb`` MiB of fp32 (a layer larger than that alone), offsets per bucket.

    Filled in reverse order, as DDP fills its buckets (DDP's smaller first bucket is not modelled); ``cap_mb <= 0``
    puts every layer in one bucket.
    """
    if cap_mb <= 0:
        return [layers]
    cap, groups, current, size = cap_mb * 2**20, [], [], 0
    for layer in reversed(layers):
        if current and size + 4 * layer.numel > cap:
            groups.append(current)
            current, size = [], 0
        current.append(layer)
        size += 4 * layer.numel
    groups.append(current)
    out = []
    for group in groups:
        offset, relaid = 0, []
        for layer in reversed(group):  # model order inside a bucket
            relaid.append(Layer(layer.name, layer.index, layer.shape, offset))
            offset += layer.numel
        out.append(tuple(relaid))
    return out


def model_gradients(
    model: torch.nn.Module, layout: list[tuple[Layer, ...]], args: argparse.Namespace, device: torch.device
) -> list[list[Tensor]]:
    """Per bucket of ``layout``, every rank's flat gradient of a batch of random images and labels (seed 1 + rank)."""
    params = dict(model.named_parameters())
    loss_fn = torch.nn.CrossEntropyLoss()
    per_rank = []
    for rank in range(args.ranks):
        x, y = random_batch(args, device, seed=1 + rank)
        model.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        per_rank.append([torch.cat([params[layer.name].grad.reshape(-1) for layer in bucket]) for bucket in layout])
    model.zero_grad(set_to_none=True)
    return [[per_rank[rank][index] for rank in range(args.ranks)] for index in range(len(layout))]


def step_runner(
    name: str,
    layout: list[tuple[Layer, ...]],
    args: argparse.Namespace,
    device: torch.device,
    model_grads: list[list[Tensor]] | None = None,
) -> tuple[Callable[[], None], list[Telemetry]]:
    """One step of ``name`` over every bucket of ``layout`` for ``args.ranks`` simulated ranks, and their telemetry."""
    sizes = [bucket[-1].offset + bucket[-1].numel for bucket in layout]
    torch.manual_seed(0)
    if model_grads is None:
        grads = [[(torch.randn(n) * 1e-3).to(device) for _ in range(args.ranks)] for n in sizes]
    else:
        grads = [[grad.clone() for grad in ranks] for ranks in model_grads]
    if args.row_density < 1:
        for bucket, ranks in zip(layout, grads):
            for grad in ranks:
                for layer in bucket:
                    rows = layer.matrix(grad)
                    rows[torch.rand(rows.shape[0], device=device) >= args.row_density] = 0
    if name in MASKED:
        masks = Masks(half_masks(layout, device))
        compressors = [MaskedCompressor(MASKED[name](), masks=masks) for _ in range(args.ranks)]
    else:
        compressors = [CONFIGS[name]() for _ in range(args.ranks)]
    feedback = compressors[0].default_error_feedback
    residuals = [[torch.zeros(n, device=device) for _ in range(args.ranks)] if feedback else None for n in sizes]
    # the updated residual's buffers persist between steps, as the hook's twin buffers do in training
    twins = [None if r is None else [torch.empty_like(x) for x in r] for r in residuals]
    telemetry = [Telemetry() for _ in range(args.ranks)]
    step = 0

    def run() -> None:
        nonlocal step
        for index, bucket in enumerate(layout):
            simulate_reduce(
                compressors,
                grads[index],
                bucket,
                step=step,
                residuals=residuals[index],
                index=index,
                telemetry=telemetry,
                new_residuals=twins[index],
            )
        step += 1

    return run, telemetry


def measure(
    name: str,
    layout: list[tuple[Layer, ...]],
    args: argparse.Namespace,
    device: torch.device,
    model_grads: list[list[Tensor]] | None = None,
) -> dict:
    """One compressor: encode+decode per step and rank (telemetry medians, every bucket), launches and syncs on CUDA."""
    sizes = [bucket[-1].offset + bucket[-1].numel for bucket in layout]
    run, telemetry = step_runner(name, layout, args, device, model_grads)
    per_step = []
    for i in range(args.steps + 2):
        run()
        _sync(device)
        for t in telemetry:
            for n in sizes:
                t.add_bucket(n * 4)  # what the hook counts per bucket; pop_step reports nothing without one
        stats = [t.pop_step() for t in telemetry]
        if i >= 2:
            per_step.append(statistics.fmean(s.encode_ms + s.decode_ms for s in stats if s is not None))
    result = {"compressor": name, "codec_ms": statistics.median(per_step)}
    if args.operators:
        result["operators"] = operators(run, args.ranks)
    if device.type == "cuda":
        result["launches"] = kernel_launches(run, args.ranks)
        result["host_sync"] = has_host_sync(run)
    return result


def all_layers(model: torch.nn.Module) -> tuple[Layer, ...]:
    """Every parameter of ``model`` as a layer, back to back (ResNet-18: 62 tensors, ResNet-50: 161)."""
    layers, offset = [], 0
    for index, (name, p) in enumerate(model.named_parameters()):
        layers.append(Layer(name, index, p.shape, offset))
        offset += p.numel()
    return tuple(layers)


OPERATOR_MODELS = ("resnet18", "resnet50")


def operator_table(names: list[str], args: argparse.Namespace, device: torch.device) -> dict[str, dict[str, float]]:
    """Per compressor and model of :data:`OPERATOR_MODELS`: top-level operators per step and rank (one step after a
    warm-up step), every parameter compressed, in ``--bucket-mb`` buckets."""
    table: dict[str, dict[str, float]] = {name: {} for name in names}
    for model_name in OPERATOR_MODELS:
        layout = buckets(all_layers(getattr(torchvision.models, model_name)(num_classes=10)), args.bucket_mb)
        for name in names:
            run, _ = step_runner(name, layout, args, device)
            run()
            table[name][model_name] = operators(run, args.ranks)
        table.setdefault("_buckets", {})[model_name] = len(layout)
    return table


def print_operator_table(table: dict[str, dict[str, float]]) -> None:
    """The operators per step and rank on each model, and ResNet-50's count over ResNet-18's."""
    counts = table.pop("_buckets")
    layouts = ", ".join(f"{model}: {n} bucket(s)" for model, n in counts.items())
    print(f"operators per step and rank, and per bucket, every parameter compressed ({layouts})")
    print(f"{'compressor':<28} {'R-18 step':>9} {'R-50 step':>9} {'R-18 bucket':>11} {'R-50 bucket':>11} {'ratio':>6}")
    for name, row in table.items():
        r18, r50 = row["resnet18"] / counts["resnet18"], row["resnet50"] / counts["resnet50"]
        print(f"{name:<28} {row['resnet18']:9.0f} {row['resnet50']:9.0f} {r18:11.0f} {r50:11.0f} {r50 / r18:6.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", choices=["resnet18", "resnet50"], default="resnet18")
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--ranks", type=int, default=2, help="simulated ranks (each one's codec time is averaged)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps, after 2 warm-up steps")
    parser.add_argument("--threads", type=int, default=1, help="torch threads on CPU")
    parser.add_argument("--compressors", nargs="+", default=list(DEFAULT_COMPRESSORS), choices=sorted(CONFIGS))
    parser.add_argument(
        "--bucket-mb",
        type=float,
        default=25.0,
        help="bucket size in MiB, as DDP's bucket_cap_mb (default 25, DDP's); 0: one bucket",
    )
    parser.add_argument(
        "--row-density",
        type=float,
        default=1.0,
        help="fraction of every layer's rows left non-zero on each rank (default 1: dense)",
    )
    parser.add_argument(
        "--gradients",
        choices=["gaussian", "model"],
        default="gaussian",
        help="random normal gradients (default) or the model's own of random batches",
    )
    parser.add_argument(
        "--operators", action="store_true", help="also count the top-level torch operators of one step per rank"
    )
    parser.add_argument(
        "--device-paths",
        action="store_true",
        help="on the CPU, take the paths a GPU takes (DGC selects the bucket at once, not layer by layer)",
    )
    parser.add_argument(
        "--operators-only",
        action="store_true",
        help="only count operators per step: ResNet-18's and ResNet-50's layouts, no timing",
    )
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.device_paths:  # DGC's CPU-only shortcut off: the operators a GPU issues
        dgc.LOOP_ON_CPU = False
    if args.operators_only:
        table = operator_table(args.compressors, args, device)
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"meta": {**vars(args), "torch": torch.__version__}, "operators": table}, f, indent=2)
        print_operator_table(table)
        return
    model = getattr(torchvision.models, args.model)(num_classes=10).to(device)
    layers = compressed_layers(model)
    numel = layers[-1].offset + layers[-1].numel
    backward = backward_ms(model, args, device)
    src, dst = torch.randn(numel, device=device), torch.empty(numel, device=device)
    one_pass = _median_ms(lambda: dst.copy_(src), device, 20)
    # the stochastic quantisers' floor: QSGD and TernGrad draw one uniform per element (a counter-based hash of the
    # layer and position, the bucket at once), fp32 and as ``random_bits=16`` draws them; timed as they run it
    # (``draws.uniform_draws``), into a kept buffer (a fresh one adds page faults that vary from run to run with the
    # allocator's state)
    ctx = BucketContext(index=0, step=0, rank=0, world_size=1, layers=layers, device=device)

    def draws(bits: int | None) -> Callable[[], None]:
        def run() -> None:
            uniform_draws(ctx, torch.float32, bits, out=dst)

        return run

    draw, draw16 = (_median_ms(draws(bits), device, 20) for bits in (None, 16))
    layout = buckets(layers, args.bucket_mb)
    model_grads = model_gradients(model, layout, args, device) if args.gradients == "model" else None
    rows = [measure(name, layout, args, device, model_grads) for name in args.compressors]
    commit = {"swap": commit_ms(numel, device, swap=True), "copy": commit_ms(numel, device, swap=False)}
    header = (
        f"{args.model} ({numel:,} compressed elements in {len(layers)} layers, {len(layout)} bucket(s)),"
        f" batch {args.batch_size}x"
        f"{args.image_size}x{args.image_size}, {device}, {args.ranks} simulated ranks"
        + (f", {args.threads} thread(s)" if device.type == "cpu" else "")
        + (f", row density {args.row_density:g}" if args.row_density < 1 else "")
        + (", the model's gradients" if args.gradients == "model" else "")
        + f": backward {backward:.1f} ms, one memory pass {one_pass:.2f} ms,"
        f" one uniform draw per element {draw:.2f} ms ({draw16:.2f} ms with 16 random bits)"
    )
    print(header)
    print(
        f"commit of the error-feedback residual per step (not in the codec times): {commit['swap']:.3f} ms"
        f" ({'a storage swap' if device.type == 'cpu' else 'torch.where'}; a copy would be {commit['copy']:.2f} ms)"
    )
    cuda = device.type == "cuda"
    print(
        f"{'compressor':<28} {'codec ms':>9} {'% backward':>10} {'passes':>7}"
        + ("  operators" if args.operators else "")
        + ("  launches  sync" if cuda else "")
    )
    for row in rows:
        row["share_of_backward"] = row["codec_ms"] / backward
        row["passes"] = row["codec_ms"] / one_pass
        share = 100 * row["share_of_backward"]
        line = f"{row['compressor']:<28} {row['codec_ms']:9.2f} {share:9.1f}% {row['passes']:7.1f}"
        if args.operators:
            line += f"  {row['operators']:9.0f}"
        if cuda:
            line += f"  {row['launches']:8.0f}  {'sync' if row['host_sync'] else 'none'}"
        elif row["compressor"] in TARGETS:
            line += f"   (target {100 * TARGETS[row['compressor']]:.0f}%)"
        print(line)
    if args.out:
        meta = {k: v for k, v in vars(args).items() if k != "out"}
        meta.update(
            torch=torch.__version__,
            backward_ms=backward,
            one_pass_ms=one_pass,
            draw_ms=draw,
            draw16_ms=draw16,
            numel=numel,
            commit_ms=commit,
        )
        if cuda:
            meta["gpu"] = torch.cuda.get_device_name(device)
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
