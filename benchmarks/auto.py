"""AutoCompression on ResNet-18, 2 CPU gloo workers: the model's predictions against measured step times, and auto
against dense (plain DDP's all-reduce) and every fixed candidate, side by side in one run per bandwidth.

One Lightning run per link: ``AutoCompression`` calibrates (dense steps, link probe, codec timing) and plans; then the
run goes through segments, each a fixed assignment for ``--warm`` + ``--measure`` steps: dense, every candidate on
every bucket, and auto's own plan, ``--rounds`` times interleaved (the median over all measured steps). For each
configuration it reports the timeline model's prediction and the measured median step time. The dense segment is the
hook's dense path (torch's ``allreduce_hook``, bitwise plain DDP) inside the same run, so that every configuration
shares the process, the data and the machine's state.

Examples::

    python benchmarks/auto.py --json benchmarks/results/auto_loopback.json
    python benchmarks/auto.py --rate 100mbit --json benchmarks/results/auto_100mbit.json    # needs root
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import lightning.pytorch as pl
import torch
import torchvision
from _netns import shaped_namespace
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_gradcomp import CompressedDDP
from lightning_gradcomp.auto.timeline import DENSE, predict
from lightning_gradcomp.callbacks import AutoCompression

CANDIDATES = ["dense", "bf16", "powersgd-r4", "powersgd-r1", "topk-10%", "topk-1%", "zen"]


class ResNet18(pl.LightningModule):
    def __init__(self, batch_size: int = 32, steps: int = 200) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torchvision.models.resnet18(num_classes=10)
        self.batch_size, self.steps = batch_size, steps

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(self.global_rank)
        x = torch.randn(self.batch_size, 3, 32, 32, generator=g)
        y = torch.randint(0, 10, (self.batch_size,), generator=g)
        data = TensorDataset(x.repeat(self.steps, 1, 1, 1), y.repeat(self.steps))
        return DataLoader(data, batch_size=self.batch_size, shuffle=False)


class Sweep(AutoCompression):
    """AutoCompression's calibration and plan, then fixed assignments in turn, each measured."""

    def __init__(self, out: str, warm: int, measure: int, rounds: int = 1, **kwargs) -> None:
        super().__init__(**kwargs)
        self.out, self.warm, self.measure, self.rounds = out, warm, measure, rounds
        self.segments: list[tuple[str, list[str]]] = []
        self.times: dict[str, list[float]] = {}
        self.segment = -1
        self.in_segment = 0
        self.plan_seconds = 0.0
        self.calibration_steps_times: list[float] = []

    def _calibrate_and_plan(self, trainer, pl_module):
        self.calibration_steps_times = [r.step for r in self._records]
        begin = time.perf_counter()
        super()._calibrate_and_plan(trainer, pl_module)
        self.plan_seconds = time.perf_counter() - begin  # what auto costs: the default measures the exposed tail only
        # every candidate on every bucket, for the report's uniform rows (not part of auto's cost)
        self.buckets, _ = self._measure_codecs_all(trainer, pl_module)
        n = len(self.buckets)
        one = [(name, [name] * n) for name in self.candidates] + [("auto", list(self.plan.assignment))]
        self.segments = one * self.rounds  # interleaved rounds: a drift of the machine hits every configuration
        self.phase = "sweep"
        self._next_segment()

    def _measure_codecs_all(self, trainer, pl_module):
        measure, self.measure = self.measure, "all"
        try:
            return self._measure_codecs(trainer, pl_module, self.buckets, self.link, self.timing)
        finally:
            self.measure = measure

    def _next_segment(self):
        self.segment += 1
        self.in_segment = 0
        if self.segment < len(self.segments):
            label, assignment = self.segments[self.segment]
            layer = {name: c for b, c in zip(self.buckets, assignment) for name in b.layers if c != DENSE}
            self._planned.set_assignment(layer)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step_time = time.perf_counter() - self._t.get("start", time.perf_counter())
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if self.phase != "sweep" or self.segment >= len(self.segments):
            return
        label = self.segments[self.segment][0]
        self.in_segment += 1
        if self.in_segment > self.warm:
            self.times.setdefault(label, []).append(step_time)
        if self.in_segment >= self.warm + self.measure:
            self._next_segment()
            if self.segment >= len(self.segments):
                self._report(trainer)
                trainer.should_stop = True

    def _report(self, trainer):
        medians = {k: statistics.median(v) for k, v in self.times.items()}
        medians = trainer.strategy.broadcast(medians, src=0)
        plan_event = [e for e in self.history if e["event"] == "plan"][-1]
        if not trainer.is_global_zero:
            return
        rows = []
        for label, assignment in self.segments[: len(self.segments) // self.rounds]:
            predicted = predict(self.buckets, assignment, self.link, self.timing, **self.model_options).step
            measured = medians[label]
            rows.append(
                {
                    "config": label,
                    "assignment": assignment,
                    "predicted_s": predicted,
                    "measured_s": measured,
                    "error": (predicted - measured) / measured,
                    "steps_s": self.times[label],
                }
            )
        result = {
            "link": {"alpha_s": self.link.alpha, "beta_Bps": self.link.beta},
            "model_options": self.model_options,
            "timing": vars(self.timing) if hasattr(self.timing, "__dict__") else str(self.timing),
            "buckets": [
                {
                    "numel": b.numel,
                    "ready_s": b.ready,
                    "layers": len(b.layers),
                    "costs": {k: vars(c) for k, c in b.costs.items()},
                }
                for b in self.buckets
            ],
            "plan": {
                "assignment": list(self.plan.assignment),
                "predicted_s": self.plan.predicted,
                "reasons": list(self.plan.reasons),
            },
            "calibration": {
                "dense_step_s": self.calibration_steps_times,
                "plan_seconds": self.plan_seconds,
                "calibration_steps": self.calibration_steps,
                "timed_buckets": plan_event["timed_buckets"],
            },
            "rows": rows,
        }
        with open(self.out, "w") as f:
            json.dump(result, f, indent=1, default=str)


def table(result: dict, rate: str) -> str:
    rows = result["rows"]
    by = {r["config"]: r for r in rows}
    dense = by["dense"]["measured_s"]
    fixed = [r for r in rows if r["config"] != "auto"]
    best = min(fixed, key=lambda r: r["measured_s"])
    auto = by["auto"]
    calib = result["calibration"]
    extra = calib["plan_seconds"] + sum(max(0.0, t - auto["measured_s"]) for t in calib["dense_step_s"])
    amortised = auto["measured_s"] + extra / 500
    link = result["link"]
    lines = [
        f"ResNet-18, 2 CPU gloo workers x 1 thread, batch 32 per worker, link: {rate}; fitted alpha"
        f" {link['alpha_s'] * 1e3:.3f} ms, beta {link['beta_Bps'] * 8 / 1e9:.3f} Gbit/s",
        "",
        "| configuration | predicted step (s) | measured step (s) | model error | vs dense |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['config']} | {r['predicted_s']:.3f} | {r['measured_s']:.3f} | {100 * r['error']:+.1f}% |"
            f" {r['measured_s'] / dense:.2f}x |"
        )
    lines += [
        "",
        f"auto's plan: {auto['assignment']}",
        f"best fixed: {best['config']} {best['measured_s']:.3f} s; auto {auto['measured_s']:.3f} s"
        f" ({100 * (auto['measured_s'] / best['measured_s'] - 1):+.1f}% vs best fixed,"
        f" {100 * (auto['measured_s'] / dense - 1):+.1f}% vs dense)",
        f"calibration cost: {extra:.1f} s (planning {calib['plan_seconds']:.1f} s + {calib['calibration_steps']} dense"
        f" steps' excess over auto); amortised over 500 steps: auto {amortised:.3f} s per step"
        f" ({100 * (amortised / dense - 1):+.1f}% vs dense)",
        f"max |model error|: {100 * max(abs(r['error']) for r in rows):.1f}%",
    ]
    return "\n".join(lines)


def plot_from(path: str, png: str) -> None:
    """The advise plot (predicted speed-up against bandwidth) from a result's measurements."""
    from lightning_gradcomp.auto.report import plot_speedup
    from lightning_gradcomp.auto.timeline import Bucket, Cost, Link, Timing

    with open(path) as f:
        result = json.load(f)
    link = result["link"]
    buckets = [
        Bucket(b["ready_s"], b["numel"], (), {k: Cost(**c) for k, c in b["costs"].items()}) for b in result["buckets"]
    ]
    plot_speedup(
        png,
        buckets,
        list(buckets[0].costs),
        Link(link["alpha_s"], link["beta_Bps"]),
        Timing(**result["timing"]),
        **result["model_options"],
    )


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--plot-from":  # python auto.py --plot-from result.json out.png
        plot_from(sys.argv[2], sys.argv[3])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", default=None, help="shape loopback to this tc rate, e.g. 100mbit (needs root)")
    parser.add_argument("--warm", type=int, default=2)
    parser.add_argument("--measure", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds over the configurations")
    parser.add_argument("--calibration-steps", type=int, default=4)
    parser.add_argument("--skip-steps", type=int, default=6, help="steps before calibrating (the first are slow)")
    parser.add_argument("--candidates", nargs="+", default=CANDIDATES)
    parser.add_argument("--json", required=True)
    parser.add_argument("--inside-namespace", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rate and not args.inside_namespace:
        with shaped_namespace(args.rate) as name:
            command = ["ip", "netns", "exec", name, sys.executable, *sys.argv, "--inside-namespace"]
            sys.exit(subprocess.run(command, check=False).returncode)
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    out = os.path.abspath(args.json)
    sweep = Sweep(
        out,
        args.warm,
        args.measure,
        args.rounds,
        candidates=args.candidates,
        calibration_steps=args.calibration_steps,
        skip_steps=args.skip_steps,
    )
    segments = len(args.candidates) + 1
    steps = args.skip_steps + args.calibration_steps + args.rounds * segments * (args.warm + args.measure) + 2
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=CompressedDDP(start_method="spawn"),
        max_steps=steps,
        callbacks=[sweep],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    begin = time.time()
    trainer.fit(ResNet18(steps=steps))
    with open(out) as f:
        result = json.load(f)
    result["args"] = vars(args)
    result["wall_s"] = time.time() - begin
    with open(out, "w") as f:
        json.dump(result, f, indent=1, default=str)
    print(table(result, args.rate or "loopback, unshaped"))


if __name__ == "__main__":
    main()
