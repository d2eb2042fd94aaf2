"""What ``lightning-gradcomp advise`` prints and plots, from the measurements of :class:`AutoCompression`."""

from __future__ import annotations

from collections.abc import Sequence

from lightning_gradcomp.auto.timeline import DENSE, Bucket, Link, Timing, plan_greedy, predict, speedup_curve

#: the bandwidths the table shows besides the measured one (bytes per second of all-reduce payload)
BANDWIDTHS = {"100 Mbit/s": 100e6 / 8, "1 Gbit/s": 1e9 / 8, "10 Gbit/s": 10e9 / 8, "100 Gbit/s": 100e9 / 8}


def _uniform(buckets: Sequence[Bucket], candidates: Sequence[str]) -> list[str]:
    return [c for c in [DENSE, *[c for c in candidates if c != DENSE]] if all(c in b.costs for b in buckets)]


def advice(
    buckets: Sequence[Bucket],
    candidates: Sequence[str],
    link: Link,
    timing: Timing,
    measured_step: float | None = None,
    margin: float = 0.03,
    encode_blocks_backward: bool = True,
    contended: bool = False,
) -> str:
    """The advise report: the measured link, backward and codec costs; predicted step times; the recommendation."""
    lines = [
        f"link (fitted on timed all-reduces): alpha {link.alpha * 1e3:.3f} ms per collective,"
        f" beta {link.beta * 8 / 1e9:.3f} Gbit/s"
        + ("; the CPU is contended: decoding counts against the backward pass" if contended else ""),
        f"forward {timing.forward * 1e3:.1f} ms, backward (last bucket ready) {timing.backward_end * 1e3:.1f} ms,"
        f" optimizer {timing.optimizer * 1e3:.1f} ms"
        + (f"; measured dense step {measured_step * 1e3:.1f} ms" if measured_step else ""),
        f"{len(buckets)} buckets, {sum(b.costs[DENSE].nbytes for b in buckets) / 1e6:.2f} MB of gradients",
        "",
        "| candidate | encode (ms/step) | decode (ms/step) | MB per step | ratio |",
        "|---|---|---|---|---|",
    ]
    names = _uniform(buckets, candidates)
    dense_bytes = sum(b.costs[DENSE].nbytes for b in buckets) or 1.0
    for name in names:
        enc = sum(b.costs[name].encode for b in buckets) * 1e3
        dec = sum(b.costs[name].decode for b in buckets) * 1e3
        nbytes = sum(b.costs[name].nbytes for b in buckets)
        lines.append(f"| {name} | {enc:.1f} | {dec:.1f} | {nbytes / 1e6:.3f} | {dense_bytes / nbytes:.1f}x |")
    columns = {"measured": link.beta, **BANDWIDTHS}
    lines += ["", "Predicted step time (ms), the timeline model (docs/auto.md); latency as measured:", ""]
    lines.append("| candidate | " + " | ".join(columns) + " |")
    lines.append("|---|" + "---|" * len(columns))
    options = {"encode_blocks_backward": encode_blocks_backward, "contended": contended}
    plans = {label: plan_greedy(buckets, candidates, Link(link.alpha, beta), timing, margin,
                                **options) for label, beta in columns.items()}  # fmt: skip
    for name in names:
        cells = [predict(buckets, [name] * len(buckets), Link(link.alpha, beta), timing,
                         **options).step for beta in columns.values()]  # fmt: skip
        lines.append(f"| {name} | " + " | ".join(f"{c * 1e3:.1f}" for c in cells) + " |")
    lines.append("| **auto** | " + " | ".join(f"{p.predicted * 1e3:.1f}" for p in plans.values()) + " |")
    lines.append("")
    for label, plan in plans.items():
        used = sorted(set(plan.assignment) - {DENSE})
        rest = ", the rest dense" if DENSE in plan.assignment else ""
        what = "plain DDP (every bucket dense)" if not used else (
            ", ".join(f"{n} on {plan.assignment.count(n)} bucket(s)" for n in used) + rest)  # fmt: skip
        speedup = plan.dense_predicted / plan.predicted
        lines.append(f"recommendation at {label}: {what}; predicted {speedup:.2f}x plain DDP")
    return "\n".join(lines)


def plot_speedup(
    path: str,
    buckets: Sequence[Bucket],
    candidates: Sequence[str],
    link: Link,
    timing: Timing,
    encode_blocks_backward: bool = True,
    contended: bool = False,
) -> None:
    """Write a PNG of every candidate's (and auto's) predicted speed-up over plain DDP against the bandwidth."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gbits = [10 ** (k / 8) for k in range(-16, 21)]  # 10 Mbit/s .. 316 Gbit/s
    betas = [g * 1e9 / 8 for g in gbits]
    curves = speedup_curve(buckets, candidates, link, timing, betas, encode_blocks_backward, contended)
    dense = curves[DENSE]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, steps in curves.items():
        if len(steps) != len(dense) or name == DENSE:
            continue
        ax.plot(gbits, [d / s for d, s in zip(dense, steps)], label=name, lw=2.5 if name == "auto" else 1.2)
    ax.axhline(1.0, color="k", lw=0.8, ls="--")
    ax.axvline(link.beta * 8 / 1e9, color="grey", lw=0.8, ls=":", label="measured link")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("bandwidth (Gbit/s), latency as measured")
    ax.set_ylabel("predicted speed-up over plain DDP")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
