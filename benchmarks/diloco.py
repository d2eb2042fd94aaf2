"""DiLoCo against per-step exchanges on a slow link, and its convergence on the language task (a benchmark).

``steps``: step time and bytes per step on a loopback shaped with ``tc tbf`` (needs root). For each rate the workers
run inside a fresh network namespace (``_netns.py``; loopback traffic only, deleted afterwards, also on failure), every
worker under ``ip netns exec``. A GPT-style model (``GPTLanguageModel``, inner optimizer AdamW) on random tokens,
one CPU thread per worker. Configurations, in one run:

* ``compute``: every worker trains alone (no process group): the step with no communication, the floor;
* ``ddp``: Lightning's ``DDPStrategy`` (plain all-reduce of the gradients at every step);
* ``powersgd``: ``CompressedDDP(PowerSGD(rank=4))``;
* ``probe-fp32``, ``probe-minmax8``, ``probe-sparseloco``: ``DiLoCo`` with a short round (``--probe-every`` steps)
  and no compressor, ``MinMax(bits=8)`` or ``SparseLoCo()``. They measure an inner step and a sync step; the table's
  rows for ``sync_every`` = H (``--sync-every``) are the round composed from them,
  ``((H - 1) * inner + sync step) / H`` per step, and the bytes of one sync divided by H;
* ``h100-minmax8``: ``DiLoCo(sync_every=100, compressor=MinMax(bits=8))`` timed over one whole round (100 steps);
* ``h100-minmax8-streaming``: the same with ``fragments`` and ``overlap_steps`` (Streaming DiLoCo: each fragment's
  exchange runs in the background during the following inner steps).

Bytes per step are what the package's telemetry counts: ``DiLoCo.outer_state.bytes_sent`` for DiLoCo (what its
collectives send), ``CompressedDDP``'s telemetry for PowerSGD, and the gradients' bytes for plain DDP (what the
telemetry counts for an all-reduce: the buffer sent).

``convergence``: the language task (``TextDataModule`` on Python's standard library, bytes), ``--workers`` worker
processes (2 by default), plain DDP against ``DiLoCo`` at equal steps, its outer exchange in fp32 or through
``MinMax(bits=8)``, ``MinMax(bits=4)`` or ``SparseLoCo()``, optionally after a dense warm-up (``DenseWarmup``), for
several seeds (``nice`` it: it is not timed); validation loss against steps and against wall-clock time.

Examples::

    python benchmarks/diloco.py steps --rates 100mbit --configs compute ddp probe-minmax8 --quick
    python benchmarks/diloco.py steps --out benchmarks/results/diloco_steps
    nice -n 10 python benchmarks/diloco.py convergence --seeds 0 1 2 --out benchmarks/results/diloco_convergence
    nice -n 10 python benchmarks/diloco.py convergence --seeds 0 --configs ddp diloco-h50-minmax8 --workers 4
    nice -n 10 python benchmarks/diloco.py convergence --seeds 0 --configs diloco-h50-w50 diloco-h50-w50-lr0.7-m0.5
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial
from typing import Any, NamedTuple

HERE = os.path.dirname(os.path.abspath(__file__))
RATES = ["10mbit", "100mbit", "1gbit"]
STEP_CONFIGS = [
    "compute",
    "ddp",
    "powersgd",
    "probe-fp32",
    "probe-minmax8",
    "probe-sparseloco",
    "h100-minmax8",
    "h100-minmax8-streaming",
]
PROBES = {"probe-fp32": "none", "probe-minmax8": "minmax8", "probe-sparseloco": "sparseloco"}
CONVERGENCE_CONFIGS = ["ddp", "diloco-h50"]


# ----------------------------------------------------------------------------------------------------------------
# One worker process (run as ``diloco.py _worker SPEC``): a Lightning fit, its step clock and its bytes
# ----------------------------------------------------------------------------------------------------------------


OUTER_COMPRESSORS = ("minmax8", "minmax4", "sparseloco")


def _compressor(name: str) -> Any:
    """``none`` or one of ``OUTER_COMPRESSORS``: ``MinMax(bits=8)``, ``MinMax(bits=4)``, ``SparseLoCo()``."""
    from lightning_gradcomp.compressors import MinMax, SparseLoCo

    return {"none": None, "minmax8": MinMax(bits=8), "minmax4": MinMax(bits=4), "sparseloco": SparseLoCo()}[name]


def _strategy(spec: dict) -> Any:
    """The strategy of a configuration name (``ddp``, ``powersgd``, ``probe-*``, ``h100-*``, ``diloco-hH[-...]``)."""
    import torch
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_gradcomp import CompressedDDP, DiLoCo
    from lightning_gradcomp.compressors import PowerSGD

    config = spec["config"]
    if config == "ddp":
        return DDPStrategy()
    if config == "powersgd":
        return CompressedDDP(PowerSGD(rank=4))
    if config in PROBES:
        return DiLoCo(sync_every=spec["probe_every"], compressor=_compressor(PROBES[config]))
    if config.startswith("h100-minmax8"):
        streaming = config.endswith("streaming")
        return DiLoCo(
            sync_every=100,
            compressor=_compressor("minmax8"),
            fragments=spec["fragments"] if streaming else 1,
            overlap_steps=spec["overlap_steps"] if streaming else 0,
            sigterm_check=spec["sigterm_check"],
        )
    # convergence: diloco-h<H>[-w<dense warm-up steps>][-lr<outer lr>][-m<outer momentum>][-<outer compressor>]
    parsed = parse_diloco_config(config)
    outer = partial(torch.optim.SGD, lr=parsed.outer_lr, momentum=parsed.momentum, nesterov=parsed.momentum > 0)
    return DiLoCo(sync_every=parsed.sync_every, outer_optimizer=outer, compressor=_compressor(parsed.compressor))


class DiLoCoConfig(NamedTuple):
    """A convergence configuration's DiLoCo: H, the outer SGD's lr and momentum, the outer exchange's compressor,
    and the optimizer steps of plain data parallelism (``DenseWarmup(steps=...)``) before the first round."""

    sync_every: int
    outer_lr: float
    momentum: float
    compressor: str  # "none" (fp32) or one of OUTER_COMPRESSORS
    warmup_steps: int  # 0: DiLoCo's rounds from the first step


DILOCO_CONFIG = re.compile(
    r"diloco-h([1-9][0-9]*)(?:-w([1-9][0-9]*))?(?:-lr([0-9]*\.?[0-9]+))?(?:-m(0|0?\.[0-9]+))?"
    r"(?:-(" + "|".join(OUTER_COMPRESSORS) + "))?"
)


def parse_diloco_config(config: str) -> DiLoCoConfig:
    """``diloco-h<H>[-w<warm-up steps>][-lr<outer lr>][-m<outer momentum>][-<outer compressor>]`` as a
    ``DiLoCoConfig``; the defaults are no dense warm-up, the paper's outer Nesterov SGD, lr 0.7, momentum 0.9
    (momentum 0 is plain SGD: lr 1.0 averages the replicas), and an uncompressed (fp32) outer exchange."""
    match = DILOCO_CONFIG.fullmatch(config)
    if match is None or float(match.group(3) or 0.7) <= 0:
        raise ValueError(
            "--configs: expected ddp or diloco-h<H>[-w<warm-up steps >= 1>][-lr<outer lr>][-m<momentum in [0, 1)>]"
            f"[-{'|'.join(OUTER_COMPRESSORS)}], got {config!r}"
        )
    sync_every, warmup, outer_lr, momentum, compressor = match.groups()
    return DiLoCoConfig(
        int(sync_every), float(outer_lr or 0.7), float(momentum or 0.9), compressor or "none", int(warmup or 0)
    )


def _warmup(config: str) -> list:
    """A convergence configuration's ``DenseWarmup(steps=W)`` (its ``-w<W>``), or no callback."""
    from lightning_gradcomp.callbacks import DenseWarmup

    if not config.startswith("diloco-h"):
        return []
    steps = parse_diloco_config(config).warmup_steps
    return [DenseWarmup(steps=steps)] if steps else []


def _worker(spec: dict) -> None:
    """Every run of ``spec["runs"]`` in turn, in one process per rank (one launch: imports and the process group are
    paid once); rank 0 writes each run's step clock, validations and bytes."""
    import torch

    rank, world = spec["rank"], spec["world"]
    torch.set_num_threads(spec["threads"])
    if spec["alone"]:  # every worker trains on its own: no process group at all
        world = 1
    else:  # Lightning sees processes started by someone else (LightningEnvironment) and joins them
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(spec["port"]), LOCAL_RANK=str(rank), NODE_RANK="0")
    records = [_fit({**spec, **run}, rank, world) for run in spec["runs"]]
    if rank == 0:
        with open(spec["out"], "w") as f:
            json.dump(records, f)


def _fit(spec: dict, rank: int, world: int) -> dict:
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_gradcomp.tasks import GPTLanguageModel, TextDataModule

    pl.seed_everything(spec["seed"], verbose=False)
    model = GPTLanguageModel(**spec["model"])
    clock = _make_clock()
    common: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": world,
        "max_steps": spec["steps"],
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "callbacks": [clock, *_warmup(spec["config"])],
        "num_sanity_val_steps": 0,
        "max_epochs": -1,
        "strategy": "auto" if spec["alone"] else _strategy(spec),
    }
    if spec["task"] == "steps":
        generator = torch.Generator().manual_seed(1000 + rank)
        tokens = torch.randint(0, 256, (64 * spec["batch_size"], spec["model"]["block_size"] + 1), generator=generator)
        data = TensorDataset(tokens[:, :-1], tokens[:, 1:])
        trainer = pl.Trainer(**common, limit_val_batches=0)
        trainer.fit(model, train_dataloaders=DataLoader(data, batch_size=spec["batch_size"], shuffle=False))
    else:
        datamodule = TextDataModule(seq_len=spec["model"]["block_size"], batch_size=spec["batch_size"])
        trainer = pl.Trainer(
            **common,
            val_check_interval=spec["val_every"],
            check_val_every_n_epoch=None,
            limit_val_batches=spec["val_batches"],
            gradient_clip_val=1.0,
        )
        trainer.fit(model, datamodule=datamodule)
    return {"ends": clock.ends, "sent": clock.sent, "val": clock.val, **_bytes(trainer, model)}


def _bytes_counter(trainer: Any) -> int | None:
    """The bytes this rank has sent so far, as the package's telemetry counts them (``None`` for plain DDP)."""
    strategy = trainer.strategy
    if hasattr(strategy, "outer_state"):  # DiLoCo: what the outer exchange's collectives sent
        return strategy.outer_state.bytes_sent
    if hasattr(strategy, "compression_state"):  # CompressedDDP's telemetry
        return strategy.compression_state.telemetry.total_bytes_sent
    return None


def _bytes(trainer: Any, model: Any) -> dict:
    """Plain DDP's bytes per step: the all-reduce of every gradient, counted as the telemetry counts an all-reduce."""
    return {"gradient_bytes": sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)}


def _make_clock() -> Any:
    """A callback that records when each step ends, and each validation's loss with its step and time since start."""
    import lightning.pytorch as pl

    class StepClock(pl.Callback):  # defined here: the driver never imports Lightning
        def __init__(self) -> None:
            self.ends: list[float] = []
            self.sent: list[int | None] = []
            self.start = 0.0
            self.val: list[tuple[int, float, float]] = []

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            self.start = time.perf_counter()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            self.ends.append(time.perf_counter())
            self.sent.append(_bytes_counter(trainer))

        def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
            loss = trainer.callback_metrics.get("val_loss")
            if loss is not None:
                self.val.append((trainer.global_step, time.perf_counter() - self.start, float(loss)))

    return StepClock()


# ----------------------------------------------------------------------------------------------------------------
# The driver: launch the workers (inside a shaped namespace for ``steps``), collect rank 0's record
# ----------------------------------------------------------------------------------------------------------------


def launch(spec: dict, namespace: str | None, script: str | None = None) -> list[dict]:
    """Run ``spec["world"]`` worker processes (under ``ip netns exec namespace`` if given); rank 0's record of each
    of ``spec["runs"]``. ``script``: the worker's script (run as ``script _worker SPEC``; default this one)."""
    from lightning_gradcomp.demo.ports import free_port

    prefix = ["ip", "netns", "exec", namespace] if namespace else []
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank0.json")
        # the port is picked outside the namespace: inside it every port is free, as the namespace is fresh
        spec = {**spec, "port": free_port(), "out": out}
        procs = []
        for rank in range(spec["world"]):
            arg = json.dumps({**spec, "rank": rank})
            worker = script or os.path.abspath(__file__)
            procs.append(subprocess.Popen([*prefix, sys.executable, worker, "_worker", arg]))
        codes = [p.wait() for p in procs]
        if any(codes) or not os.path.exists(out):
            return [{"error": f"workers exited with {codes}"}] * len(spec["runs"])
        with open(out) as f:
            return json.load(f)


def _window(ends: list[float], first: int, last: int) -> list[float]:
    """Durations of steps ``first..last`` (1-based): each step's end minus the previous one's."""
    return [ends[k - 1] - ends[k - 2] for k in range(first, last + 1)]


def measure_steps(rate: str, args: argparse.Namespace, namespace: str | None) -> list[dict]:
    """Every configuration at one rate: seconds per step and bytes per step (rank 0)."""
    from _netns import rate_bytes_per_second

    model = _step_model(args)
    base = {
        "task": "steps",
        "world": args.workers,
        "threads": 1,
        "seed": 0,
        "model": model,
        "batch_size": args.batch_size,
        "probe_every": args.probe_every,
        "fragments": args.fragments,
        "overlap_steps": args.overlap_steps,
        "sigterm_check": args.sigterm_check,
    }
    plan = []
    for config in args.configs:
        if config in ("ddp", "powersgd"):
            # at 10 Mbit/s and below a dense step takes minutes: two timed steps
            slow = rate != "none" and rate_bytes_per_second(rate.split()[0]) <= 1.25e6
            warmup, timed = 1, min(args.dense_steps, 2) if slow else args.dense_steps
        elif config in PROBES:  # one warm-up step, then a window of two rounds (two syncs); no partial round
            warmup, timed = 1, 2 * args.probe_every - 1
        elif config.startswith("h100"):
            # 100 consecutive steps that hold one round's exchanges: the sync at step 100, and with streaming the
            # fragments started at steps 20, ..., 100 and applied overlap_steps later (the last at step 115)
            warmup, timed = 15, 100
        else:  # the same warm-up as the h100 runs, and as many timed steps by default: the baseline is not noisier
            warmup, timed = 15, args.compute_steps
        plan.append((config, warmup, timed))
    records: dict[str, dict] = {}
    # the no-communication runs in one launch, the others in another; when there are both, the no-communication
    # run again afterwards: the machine's load drifts over minutes, so the baseline brackets the runs it divides
    others = [c for c, _, _ in plan if c != "compute"]
    order = [True, False, True] if others and len(others) < len(plan) else [True, False]
    for index, alone in enumerate(order):
        runs = [{"config": c, "steps": w + t, "alone": alone} for c, w, t in plan if (c == "compute") == alone]
        if runs:
            begin = time.time()
            for run, record in zip(runs, launch({**base, "runs": runs, "alone": alone}, namespace)):
                records[run["config"] + ("-after" if index == 2 else "")] = record
            print(f"# {rate} {[r['config'] for r in runs]}: {time.time() - begin:.0f} s", file=sys.stderr, flush=True)
    rows = [_step_row(rate, config, warmup, timed, records[config], args) for config, warmup, timed in plan]
    for row in rows:
        if row["config"] == "compute" and "compute-after" in records and "error" not in row:
            warmup, timed = next((w, t) for c, w, t in plan if c == "compute")
            after = _step_row(rate, "compute", warmup, timed, records["compute-after"], args)
            if "error" not in after:  # the baseline: the mean of the runs before and after the others
                row.update(
                    before_s=row["step_s"],
                    after_s=after["step_s"],
                    step_s=(row["step_s"] + after["step_s"]) / 2,
                    median_s=(row["median_s"] + after["median_s"]) / 2,
                )
    return rows


def _step_row(rate: str, config: str, warmup: int, timed: int, record: dict, args: argparse.Namespace) -> dict:
    row: dict[str, Any] = {"rate": rate, "config": config}
    if "error" in record:
        return {**row, "error": record["error"]}
    durations = _window(record["ends"], warmup + 1, warmup + timed)
    # the median as well: on a shared machine a few steps held up by other work move the mean
    row.update(
        step_s=sum(durations) / len(durations), median_s=statistics.median(durations), steps_timed=len(durations)
    )
    sent = record["sent"]
    if sent[-1] is not None:  # bytes sent over the timed window, per step
        row["bytes_per_step"] = (sent[warmup + timed - 1] - sent[warmup - 1]) / timed
    elif config == "ddp":
        row["bytes_per_step"] = record["gradient_bytes"]
    if config in PROBES:
        steps = range(warmup + 1, warmup + timed + 1)
        row.update(
            inner_s=statistics.median(d for k, d in zip(steps, durations) if k % args.probe_every),
            sync_step_s=statistics.mean(d for k, d in zip(steps, durations) if k % args.probe_every == 0),
            bytes_per_sync=row.pop("bytes_per_step") * timed / 2,
        )
    return row


def _step_model(args: argparse.Namespace) -> dict:
    return {
        "block_size": args.seq_len,
        "n_layer": args.n_layer,
        "n_head": args.n_embd // 64,
        "n_embd": args.n_embd,
        "warmup_steps": 0,
    }


def compose(rows: list[dict], sync_every: list[int], ddp_bytes: int) -> list[dict]:
    """The table's rows: measured configurations, and DiLoCo at each H composed from its probe.

    ``ddp_bytes``: plain DDP's bytes per step (the gradients' bytes, what its row reports), for the byte ratio.
    """
    table = []
    for r in rows:
        if r["config"] not in PROBES or "error" in r:
            table.append(r)
            continue
        for h in sync_every:
            step = ((h - 1) * r["inner_s"] + r["sync_step_s"]) / h
            table.append(
                {
                    "rate": r["rate"],
                    "config": f"diloco H={h} {PROBES[r['config']]}",
                    "step_s": step,
                    "bytes_per_step": r["bytes_per_sync"] / h,
                    "composed": True,
                }
            )
    for r in table:
        same = {x["config"]: x for x in table if x["rate"] == r["rate"] and "error" not in x}
        if "error" not in r and "compute" in same:
            r["vs_compute"] = r["step_s"] / same["compute"]["step_s"]
        if "error" not in r and r.get("bytes_per_step"):
            r["ddp_bytes_over"] = ddp_bytes / r["bytes_per_step"]
    return table


def steps_markdown(table: list[dict], raw: list[dict], args: argparse.Namespace, params: int, load: str) -> str:
    lines = [
        f"GPT ({params / 1e6:.1f}M parameters: {args.n_layer} blocks, width {args.n_embd}), {args.workers} CPU workers"
        f" x 1 thread, batch {args.batch_size} x {args.seq_len} tokens per worker, AdamW; load average before the"
        f" run: {load}.",
        "",
        "| link | configuration | s / step | x no-comm step | bytes sent per step and rank"
        " | plain DDP's bytes / these |",
        "|---|---|---|---|---|---|",
    ]
    for r in table:
        if "error" in r:
            lines.append(f"| {r['rate']} | {r['config']} | failed: {r['error']} | | | |")
            continue
        name = r["config"] + (" (composed)" if r.get("composed") else "")
        ratio = f"{r['vs_compute']:.2f}x" if "vs_compute" in r else ""
        nbytes = f"{r['bytes_per_step']:,.0f}" if "bytes_per_step" in r else ""
        over = f"{r['ddp_bytes_over']:,.0f}" if "ddp_bytes_over" in r else ""
        seconds = f"{r['step_s']:.3f}" + (f" (median {r['median_s']:.3f})" if "median_s" in r else "")
        if "before_s" in r:
            seconds += f" (mean of {r['before_s']:.3f} before the others and {r['after_s']:.3f} after)"
        lines.append(f"| {r['rate']} | {name} | {seconds} | {ratio} | {nbytes} | {over} |")
    lines += ["", f"Probes (DiLoCo, sync_every={args.probe_every}): inner step, sync step, bytes per sync:", ""]
    for r in raw:
        if r["config"] in PROBES and "error" not in r:
            lines.append(
                f"- {r['rate']} {r['config']}: inner {r['inner_s']:.3f} s, sync step {r['sync_step_s']:.3f}"
                f" s, {r['bytes_per_sync']:,.0f} bytes per sync and rank"
            )
    return "\n".join(lines)


def run_steps(args: argparse.Namespace) -> None:
    from _netns import rate_bytes_per_second, shaped_namespace

    for rate in (r for r in args.rates if r != "none"):
        rate_bytes_per_second(rate)  # refuse a malformed rate before spending minutes on the others
    from lightning_gradcomp.models.gpt import GPT

    model = _step_model(args)
    params = sum(
        p.numel()
        for p in GPT(256, model["block_size"], model["n_layer"], model["n_head"], model["n_embd"]).parameters()
    )
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    raw: list[dict] = []
    for rate in args.rates:
        if rate == "none":
            raw += measure_steps(rate, args, None)
            continue
        if args.per_worker:  # each worker's uplink is the rate: the one shared bucket gets the workers' sum
            shaped = f"{rate_bytes_per_second(rate) * 8 * args.workers / 1e3:g}kbit"
            with shaped_namespace(shaped) as name:
                raw += measure_steps(f"{rate} per worker", args, name)
        else:
            with shaped_namespace(rate) as name:
                raw += measure_steps(rate, args, name)
    table = compose(raw, args.sync_every, 4 * params)  # the model is fp32
    text = steps_markdown(table, raw, args, params, load)
    _write(args.out, text, {"args": vars(args), "parameters": params, "load": load, "raw": raw, "table": table})


# ----------------------------------------------------------------------------------------------------------------
# Convergence
# ----------------------------------------------------------------------------------------------------------------


def run_convergence(args: argparse.Namespace) -> None:
    model = {
        "block_size": args.seq_len,
        "n_layer": args.n_layer,
        "n_head": max(args.n_embd // 32, 1),
        "n_embd": args.n_embd,
        "lr": args.lr,
        "warmup_steps": args.lr_warmup,
    }
    runs = []
    for seed in args.seeds:  # one launch per seed, its configurations in turn
        spec = {
            "task": "convergence",
            "world": args.workers,
            "threads": 1,
            "alone": False,
            "model": model,
            "batch_size": args.batch_size,
            "val_every": args.val_every,
            "val_batches": args.val_batches,
            "runs": [{"config": c, "seed": seed, "steps": args.steps} for c in args.configs],
        }
        begin = time.time()
        for run, record in zip(spec["runs"], launch(spec, None)):
            runs.append({"seed": seed, "config": run["config"], **record})
        print(f"# seed {seed}: {time.time() - begin:.0f} s", file=sys.stderr, flush=True)
    lines = [
        f"GPT ({args.n_layer} blocks, width {args.n_embd}), bytes of the standard library, {args.workers} workers"
        f" x batch {args.batch_size} x {args.seq_len}, AdamW lr {args.lr}, {args.steps} steps; validation loss"
        f" ({args.val_batches} batches) at the last step, mean ± std over seeds {args.seeds}:",
        "",
        "| configuration | final val loss | vs plain DDP | wall-clock (s) |",
        "|---|---|---|---|",
    ]
    finals: dict[str, list[float]] = {}
    walls: dict[str, list[float]] = {}
    for r in runs:
        if "error" not in r and r["val"]:
            finals.setdefault(r["config"], []).append(r["val"][-1][2])
            walls.setdefault(r["config"], []).append(r["val"][-1][1])
    ddp = statistics.mean(finals["ddp"]) if "ddp" in finals else None
    for config, values in finals.items():
        mean = statistics.mean(values)
        std = statistics.stdev(values) if len(values) > 1 else 0.0
        rel = f"{100 * (mean / ddp - 1):+.1f} %" if ddp else ""
        lines.append(f"| {config} | {mean:.4f} ± {std:.4f} | {rel} | {statistics.mean(walls[config]):.0f} |")
    _write(args.out, "\n".join(lines), {"args": vars(args), "runs": runs})
    _plot_convergence(runs, args.out + ".png")


def _plot_convergence(runs: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_steps, ax_wall) = plt.subplots(1, 2, figsize=(12, 4.5))
    configs = list(dict.fromkeys(r["config"] for r in runs))
    for r in runs:
        if "error" in r or not r["val"]:
            continue
        color = plt.cm.tab10(configs.index(r["config"]) % 10)
        label = r["config"] if r["seed"] == runs[0]["seed"] else None
        steps, wall, loss = zip(*r["val"])
        ax_steps.plot(steps, loss, "o-", color=color, ms=3, label=label)
        ax_wall.plot(wall, loss, "o-", color=color, ms=3, label=label)
    ax_steps.set_xlabel("optimizer steps")
    ax_wall.set_xlabel("wall-clock since fit began (s)")
    for ax in (ax_steps, ax_wall):
        ax.set_ylabel("validation loss (nats per byte)")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _write(out: str, text: str, data: dict) -> None:
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out + ".md", "w") as f:
        f.write(text + "\n")
    with open(out + ".json", "w") as f:
        json.dump(data, f, indent=1)
    print(text)
    print(f"\nwrote {out}.md and {out}.json")


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "_worker":
        _worker(json.loads(sys.argv[2]))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="part", required=True)
    steps = sub.add_parser("steps", help="step time and bytes per step on a tc-shaped loopback (root)")
    steps.add_argument("--rates", nargs="+", default=RATES, help="tc rates; 'none' for the unshaped loopback")
    steps.add_argument("--configs", nargs="+", default=STEP_CONFIGS, choices=STEP_CONFIGS)
    steps.add_argument("--workers", type=int, default=2)
    steps.add_argument(
        "--per-worker",
        action="store_true",
        help="each rate is every worker's own uplink (a switched network): the one shaped loopback,"
        " which all workers share, gets the rate times the workers",
    )
    steps.add_argument("--n-layer", type=int, default=8)
    steps.add_argument("--n-embd", type=int, default=512)
    steps.add_argument("--seq-len", type=int, default=32)
    steps.add_argument("--batch-size", type=int, default=1)
    steps.add_argument("--compute-steps", type=int, default=100, help="timed steps of the no-communication run")
    steps.add_argument(
        "--dense-steps",
        type=int,
        default=3,
        help="timed steps of plain DDP and PowerSGD (at most 2 at 10 Mbit/s and below)",
    )
    steps.add_argument("--probe-every", type=int, default=3, help="sync_every of the DiLoCo probes")
    steps.add_argument("--sync-every", type=int, nargs="+", default=[20, 100, 500], help="H of the composed rows")
    steps.add_argument("--fragments", type=int, default=5, help="fragments of h100-minmax8-streaming")
    steps.add_argument("--overlap-steps", type=int, default=15, help="overlap_steps of h100-minmax8-streaming")
    steps.add_argument(
        "--sigterm-check",
        choices=["sync", "step"],
        default="sync",
        help="sigterm_check of the h100-* configurations (Lightning's SIGTERM broadcast once per "
        "sync period, or at every step)",
    )
    steps.add_argument(
        "--quick", action="store_true", help="a tiny model and few steps, to check the harness (numbers meaningless)"
    )
    steps.add_argument("--out", default=os.path.join(HERE, "results", "diloco_steps"), help="writes OUT.md, OUT.json")
    conv = sub.add_parser("convergence", help="validation loss of plain DDP and DiLoCo on the language task")
    conv.add_argument(
        "--configs",
        nargs="+",
        default=CONVERGENCE_CONFIGS,
        help="ddp, or diloco-h<H>[-w<W>][-lr<outer lr>][-m<outer momentum>]"
        "[-minmax8|-minmax4|-sparseloco] (e.g. diloco-h50, diloco-h20-lr1.0-m0,"
        " diloco-h50-w50-lr0.7-m0.5, diloco-h50-lr0.7-m0.5-minmax8; -w<W>: DenseWarmup(steps=W),"
        " plain data parallelism for the first W steps, then DiLoCo's rounds; default outer"
        " Nesterov SGD lr 0.7 momentum 0.9, momentum 0 is plain SGD; the last suffix compresses"
        " the outer exchange: MinMax(bits=8), MinMax(bits=4), SparseLoCo(); default"
        " fp32)",
    )
    conv.add_argument("--workers", type=int, default=2, help="worker processes (ranks)")
    conv.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    conv.add_argument("--steps", type=int, default=400)
    conv.add_argument("--val-every", type=int, default=50)
    conv.add_argument("--val-batches", type=int, default=16)
    conv.add_argument("--n-layer", type=int, default=2)
    conv.add_argument("--n-embd", type=int, default=128)
    conv.add_argument("--seq-len", type=int, default=64)
    conv.add_argument("--batch-size", type=int, default=16)
    conv.add_argument("--lr", type=float, default=3e-3)
    conv.add_argument("--lr-warmup", type=int, default=40)
    conv.add_argument(
        "--out", default=os.path.join(HERE, "results", "diloco_convergence"), help="writes OUT.md, OUT.json, OUT.png"
    )
    args = parser.parse_args()
    if args.part == "steps":
        if args.quick:
            args.n_layer, args.n_embd, args.compute_steps, args.dense_steps = 1, 64, 3, 2
        run_steps(args)
    else:
        if args.workers < 1:
            parser.error(f"--workers: expected an integer >= 1, got {args.workers}")
        for config in args.configs:
            if config != "ddp":
                try:
                    parse_diloco_config(config)
                except ValueError as error:
                    parser.error(str(error))
        run_convergence(args)


if __name__ == "__main__":
    main()
