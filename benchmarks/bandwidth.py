"""When does compression pay? Step time against link bandwidth, next to the physical limit (a benchmark).

For each rate (default 100 Mbit/s, 1 Gbit/s, 10 Gbit/s) the workers run inside a fresh network namespace whose
loopback is shaped with ``tc tbf`` (loopback traffic only; the namespace is deleted afterwards, also on failure), and
``step_time.py`` measures every configuration: plain DDP, torch's ``fp16_compress_hook`` and ``powerSGD_hook`` on raw
torch DDP, and each of lightning-gradcomp's compressors. Output: a Markdown table and a PNG plot of step time and
speed-up over plain DDP against bandwidth, each next to the ideal time ``max(compute, bytes / bandwidth)``. On one
loopback every worker's traffic crosses the same link, so the ideal counts the bytes all workers send.

Example (needs root)::

    python benchmarks/bandwidth.py --out benchmarks/results/bandwidth
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from _netns import rate_bytes_per_second, shaped_namespace

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_RATES = ["100mbit", "1gbit", "10gbit"]
DEFAULT_CONFIGS = [
    "compute",
    "ddp",
    "torch-fp16",
    "torch-powersgd",
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
]


def measure(rate: str, configs: list[str], args: argparse.Namespace) -> list[dict]:
    """Run step_time.py for ``configs`` inside a namespace shaped to ``rate``; return its results."""
    with tempfile.TemporaryDirectory() as tmp, shaped_namespace(rate) as name:
        out = os.path.join(tmp, "result.json")
        command = [
            "ip",
            "netns",
            "exec",
            name,
            sys.executable,
            os.path.join(HERE, "step_time.py"),
            "--inside-namespace",
            "--rate",
            rate,
            "--configs",
            *configs,
            "--steps",
            str(args.steps),
            "--warmup",
            str(args.warmup),
            "--rounds",
            str(args.rounds),
            "--batch-size",
            str(args.batch_size),
            "--json",
            out,
        ]
        subprocess.run(command, check=True)
        with open(out) as f:
            return json.load(f)["results"]


def summarize(results: dict[str, list[dict]], workers: int) -> list[dict]:
    """One row per (rate, configuration): measured and ideal step time, speed-up over plain DDP."""
    rows = []
    for rate, measured in results.items():
        by_config = {r["config"]: r for r in measured if "error" not in r}
        compute = by_config["compute"]["step_s"]
        ddp = by_config.get("ddp", {}).get("step_s")
        for r in measured:
            row = {"rate": rate, "config": r["config"]}
            if "error" in r:
                rows.append({**row, "error": r["error"]})
                continue
            total_bytes = workers * r["bytes_sent"]
            ideal = max(compute, total_bytes / rate_bytes_per_second(rate))
            rows.append(
                {
                    **row,
                    "step_s": r["step_s"],
                    "ideal_s": ideal,
                    "bytes": r["bytes_sent"],
                    "speedup": ddp / r["step_s"] if ddp else float("nan"),
                    "ideal_speedup": (
                        max(compute, workers * by_config["ddp"]["bytes_sent"] / rate_bytes_per_second(rate)) / ideal
                    )
                    if ddp
                    else float("nan"),
                }
            )
    return rows


def markdown(rows: list[dict], args: argparse.Namespace) -> str:
    lines = [
        f"ResNet-18 (11.2M parameters), {args.workers} CPU workers, batch {args.batch_size} per worker; median of"
        f" {args.steps} steps after {args.warmup} warm-up steps, median over {args.rounds} round(s). Ideal ="
        f" max(compute-only step, bytes of all {args.workers} workers / bandwidth).",
        "",
        "| bandwidth | configuration | bytes per rank and step | step time (s) | ideal (s) | step / ideal |"
        " speed-up over plain DDP | ideal speed-up |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['rate']} | {r['config']} | failed: {r['error']} | | | | | |")
            continue
        lines.append(
            f"| {r['rate']} | {r['config']} | {r['bytes']:,.0f} | {r['step_s']:.3f} | {r['ideal_s']:.3f} |"
            f" {r['step_s'] / r['ideal_s']:.2f} | {r['speedup']:.2f}x | {r['ideal_speedup']:.2f}x |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if "error" not in r]
    rates = list(dict.fromkeys(r["rate"] for r in ok))
    bandwidth = {rate: rate_bytes_per_second(rate) * 8 / 1e6 for rate in rates}  # Mbit/s
    configs = list(dict.fromkeys(r["config"] for r in ok))
    fig, (ax_time, ax_speed) = plt.subplots(1, 2, figsize=(13, 5))
    for i, config in enumerate(configs):
        color = plt.cm.tab20(i % 20)
        mine = [r for r in ok if r["config"] == config]
        x = [bandwidth[r["rate"]] for r in mine]
        ax_time.plot(x, [r["step_s"] for r in mine], "o-", color=color, label=config)
        ax_time.plot(x, [r["ideal_s"] for r in mine], "--", color=color, alpha=0.6)
        if config != "compute":
            ax_speed.plot(x, [r["speedup"] for r in mine], "o-", color=color, label=config)
    for ax in (ax_time, ax_speed):
        ax.set_xscale("log")
        ax.set_xlabel("link bandwidth (Mbit/s)")
        ax.grid(True, which="both", alpha=0.3)
    ax_time.set_yscale("log")
    ax_time.set_ylabel("step time (s); dashed: ideal max(compute, bytes / bandwidth)")
    ax_speed.set_ylabel("speed-up over plain DDP")
    ax_speed.axhline(1.0, color="black", lw=0.8)
    ax_time.legend(fontsize=7, ncol=2)
    fig.suptitle("ResNet-18, 2 CPU workers on one shaped loopback")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", nargs="+", default=DEFAULT_RATES)
    parser.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument(
        "--out", default=os.path.join(HERE, "results", "bandwidth"), help="writes OUT.md, OUT.png and OUT.json"
    )
    args = parser.parse_args()
    if args.workers != 2:
        parser.error("--workers: step_time.py runs 2 workers (the setting of the published numbers)")
    for rate in args.rates:
        rate_bytes_per_second(rate)  # refuse a malformed rate before spending minutes on the others
    configs = args.configs if "compute" in args.configs else ["compute", *args.configs]
    results = {rate: measure(rate, configs, args) for rate in args.rates}
    rows = summarize(results, args.workers)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    table = markdown(rows, args)
    with open(args.out + ".md", "w") as f:
        f.write(table + "\n")
    with open(args.out + ".json", "w") as f:
        json.dump({"args": vars(args), "results": results, "rows": rows}, f, indent=1)
    plot(rows, args.out + ".png")
    print(table)
    print(f"\nwrote {args.out}.md, {args.out}.png, {args.out}.json")


if __name__ == "__main__":
    main()
