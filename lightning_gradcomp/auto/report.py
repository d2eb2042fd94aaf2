"""What ``AutoCompression`` reports of its plans, and what ``lightning-gradcomp advise`` prints and plots."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from lightning_gradcomp.auto.periodic import SYNC_EVERY, constructor, periodic_plans, periodic_table, recommend
from lightning_gradcomp.auto.run_length import choices_note, sync_every_choices
from lightning_gradcomp.auto.timeline import (
    DENSE,
    Bucket,
    Cost,
    Link,
    Plan,
    Timing,
    plan_greedy,
    predict,
    speedup_curve,
)

#: the bandwidths the table shows besides the measured one (bytes per second of all-reduce payload)
BANDWIDTHS = {"100 Mbit/s": 100e6 / 8, "1 Gbit/s": 1e9 / 8, "10 Gbit/s": 10e9 / 8, "100 Gbit/s": 100e9 / 8}
#: DiLoCo's rows: rounds of ``sync_every`` steps, and the bytes per parameter of the outer exchange
DILOCO_SYNC_EVERY = (20, 100, 500)
DILOCO_PRECISIONS = {"fp32": 4, "8-bit": 1}


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
    outer: Mapping[str, Cost] | None = None,
    total_steps: float | None = None,
) -> str:
    """The advise report: the measured link, backward and codec costs; predicted step times; the recommendation.

    ``outer``: DiLoCo's outer payloads' costs per exchange (:func:`~lightning_gradcomp.auto.measure.outer_costs`);
    given, the report ends with DiLoCo's predicted compute utilisation and the setting to paste.
    """
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
    plans = {
        label: plan_greedy(buckets, candidates, Link(link.alpha, beta), timing, margin, **options)
        for label, beta in columns.items()
    }
    for name in names:
        cells = [
            predict(buckets, [name] * len(buckets), Link(link.alpha, beta), timing, **options).step
            for beta in columns.values()
        ]
        lines.append(f"| {name} | " + " | ".join(f"{c * 1e3:.1f}" for c in cells) + " |")
    lines.append("| **auto** | " + " | ".join(f"{p.predicted * 1e3:.1f}" for p in plans.values()) + " |")
    lines.append("")
    for label, plan in plans.items():
        used = sorted(set(plan.assignment) - {DENSE})
        rest = ", the rest dense" if DENSE in plan.assignment else ""
        what = (
            "plain DDP (every bucket dense)"
            if not used
            else (", ".join(f"{n} on {plan.assignment.count(n)} bucket(s)" for n in used) + rest)
        )
        speedup = plan.dense_predicted / plan.predicted
        lines.append(f"recommendation at {label}: {what}; predicted {speedup:.2f}x plain DDP")
    numel = sum(b.numel for b in buckets)
    best = {label: plan.predicted for label, plan in plans.items()}
    lines += ["", *periodic_sync_advice(numel, link.alpha, columns, timing, best, margin)]
    if outer:
        lines += ["", *diloco_recommendation(timing, link, outer, total_steps)]
    return "\n".join(lines)


def diloco_recommendation(
    timing: Timing, link: Link, outer: Mapping[str, Cost], total_steps: float | None = None
) -> list[str]:
    """DiLoCo's predicted compute utilisation at the measured link, and the constructor call it recommends.

    ``total_steps``: the run's optimizer steps; the recommendation is then one DiLoCo's preflight accepts for it
    (:func:`~lightning_gradcomp.auto.run_length.sync_every_choices`).
    """
    compute = timing.forward + timing.backward_end + timing.tail + timing.optimizer
    plans = periodic_plans(compute, link, outer)
    choices = sync_every_choices(total_steps)
    plan, reaches = recommend(periodic_plans(compute, link, outer, choices))
    verdict = "the setting of least loss that reaches 95 %" if reaches else "no setting reaches 95 %: the fastest"
    return [
        *periodic_table(plans, compute),
        "",
        f"DiLoCo at the measured link ({verdict}; predicted {plan.step * 1e3:.1f} ms per step,"
        f" {100 * plan.utilisation:.0f} % of the compute):",
        "",
        f"    trainer = Trainer(..., strategy={constructor(plan)})",
        "",
        *([choices_note(total_steps, choices)] if choices != SYNC_EVERY else []),
        "Once it runs, DiLoCo's summary line at the end of fit gives the measured ms per step to check against this."
        " The loss is not in this model (docs/diloco.md, Recommended settings).",
    ]


def diloco_wire_per_step(numel: int, bytes_per_element: int, sync_every: int, link: Link) -> float:
    """Seconds of DiLoCo's outer exchange per optimizer step: one all-reduce of the model every ``sync_every`` steps.

    The table's model of an all-reduce (:meth:`Link.time`: ``alpha`` plus the payload per rank over ``beta``, the
    all-reduce payload rate, which a ring over ``N`` ranks turns into ``2 (N - 1) / N`` times the payload on each
    link), for one flat buffer of ``numel`` elements, divided by the ``sync_every`` steps that share it.
    """
    return link.time(numel * bytes_per_element) / sync_every


def periodic_sync_advice(
    numel: int,
    alpha: float,
    columns: Mapping[str, float],
    timing: Timing,
    best_per_step: Mapping[str, float],
    margin: float,
) -> list[str]:
    """DiLoCo's rows (exchange time per step at each bandwidth) and when periodic synchronization pays.

    It pays where no per-step plan hides the wire: where the best plan's predicted step (``best_per_step``, by
    column) is more than ``margin`` above the step with no communication, and a DiLoCo row adds less than that.
    """
    silent = timing.forward + timing.backward_end + timing.tail + timing.optimizer  # the step with no communication
    lines = [
        f"DiLoCo: the outer exchange's time per step (ms), one all-reduce of the {numel:,} parameters every H"
        f" steps; the step with no communication takes {silent * 1e3:.1f} ms:",
        "",
        "| DiLoCo | " + " | ".join(columns) + " |",
        "|---|" + "---|" * len(columns),
    ]
    for precision, size in DILOCO_PRECISIONS.items():
        for h in DILOCO_SYNC_EVERY:
            cells = [diloco_wire_per_step(numel, size, h, Link(alpha, beta)) for beta in columns.values()]
            lines.append(f"| H={h} {precision} | " + " | ".join(f"{c * 1e3:.2f}" for c in cells) + " |")
    lines.append("")
    exposed = {label: best_per_step[label] - silent for label in columns}
    exposed = {label: extra for label, extra in exposed.items() if extra > margin * silent}
    if not exposed:
        lines.append(
            f"Periodic synchronization would not pay here: at every bandwidth a per-step plan comes within"
            f" {margin:.0%} of the step with no communication."
        )
        return lines
    pays = []
    for label, extra in exposed.items():
        link = Link(alpha, columns[label])
        enough = next((h for h in DILOCO_SYNC_EVERY if diloco_wire_per_step(numel, 4, h, link) < extra), None)
        if enough is not None:
            fp32 = diloco_wire_per_step(numel, 4, enough, link)
            pays.append(
                f"{label} (best per-step plan +{extra * 1e3:.1f} ms, DiLoCo H={enough} fp32 +{fp32 * 1e3:.2f} ms)"
            )
    if pays:
        lines.append(
            "Periodic synchronization pays where no per-step plan hides the wire: at " + "; ".join(pays) + "."
            " DiLoCo trades that time for a different optimization (docs/diloco.md): check its loss at your H."
        )
    else:
        lines.append(
            f"No per-step plan hides the wire at {', '.join(exposed)}, and neither does DiLoCo at H <="
            f" {DILOCO_SYNC_EVERY[-1]} in fp32."
        )
    return lines


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


def describe_plan(
    plan: Plan,
    buckets: Sequence[Bucket],
    link: Link,
    timing: Timing,
    measured_dense: float | None,
    options: Mapping[str, bool],
) -> str:
    """A plan as a table: per bucket its size, ready time, candidate and predicted finish (``AutoCompression``)."""
    pred = predict(buckets, list(plan.assignment), link, timing, **options)
    lines = [
        f"gradcomp auto: link alpha {link.alpha * 1e3:.3f} ms, beta {link.beta * 8 / 1e9:.3f} Gbit/s;"
        f" forward {timing.forward * 1e3:.1f} ms, backward {timing.backward_end * 1e3:.1f} ms,"
        f" optimizer {timing.optimizer * 1e3:.1f} ms",
        f"predicted step: {plan.predicted * 1e3:.1f} ms (dense {plan.dense_predicted * 1e3:.1f} ms,"
        f" measured dense {measured_dense * 1e3 if measured_dense else float('nan'):.1f} ms)",
        "| bucket | MB | ready (ms) | method | predicted finish (ms) |",
        "|---|---|---|---|---|",
    ]
    for b, (bucket, name) in enumerate(zip(buckets, plan.assignment)):
        lines.append(
            f"| {b} | {bucket.costs[DENSE].nbytes / 1e6:.2f} | {bucket.ready * 1e3:.1f} | {name} |"
            f" {pred.finish[b] * 1e3:.1f} |"
        )
    lines.extend(f"  {reason}" for reason in plan.reasons)
    return "\n".join(lines)


def plan_metrics(
    plan: Plan,
    buckets: Sequence[Bucket],
    candidates: Sequence[str],
    link: Link,
    timing: Timing,
    measured_dense: float | None,
    measured_finish: Sequence[float | None],
    options: Mapping[str, bool],
) -> dict[str, float]:
    """A plan as logger metrics: predicted and measured step times and the link.

    Per bucket: its method (the index of its candidate in ``candidates``), its predicted finish and, where
    ``measured_finish`` has it, its measured dense finish.
    """
    pred = predict(buckets, list(plan.assignment), link, timing, **options)
    dense = predict(buckets, [DENSE] * len(buckets), link, timing, **options)
    metrics = {
        "auto/predicted_step_ms": plan.predicted * 1e3,
        "auto/dense_predicted_step_ms": dense.step * 1e3,
        "auto/dense_measured_step_ms": (measured_dense or 0) * 1e3,
        "auto/alpha_ms": link.alpha * 1e3,
        "auto/beta_gbit": link.beta * 8 / 1e9,
    }
    for b, name in enumerate(plan.assignment):
        metrics[f"auto/bucket{b}/method"] = float(candidates.index(name))
        metrics[f"auto/bucket{b}/predicted_finish_ms"] = pred.finish[b] * 1e3
        finish = measured_finish[b] if b < len(measured_finish) else None
        if finish is not None:
            metrics[f"auto/bucket{b}/measured_dense_finish_ms"] = finish * 1e3
    return metrics


def plan_event(
    plan: Plan,
    buckets: Sequence[Bucket],
    link: Link,
    timing: Timing,
    measured_dense: float,
    options: Mapping[str, bool],
) -> dict[str, object]:
    """A new plan as an entry of ``AutoCompression.history``.

    What it predicts, and how far the model's dense step is from the measured one (``dense_error``).
    """
    dense = predict(buckets, [DENSE] * len(buckets), link, timing, **options)
    error = (dense.step - measured_dense) / measured_dense
    return {
        "event": "plan",
        "link": {"alpha": link.alpha, "beta": link.beta},
        "dense_predicted": dense.step,
        "dense_measured": measured_dense,
        "dense_error": error,
        "predicted": plan.predicted,
        "assignment": list(plan.assignment),
        "reasons": list(plan.reasons),
    }


def compressed_share(buckets: Sequence[Bucket], assignment: Mapping[str, str]) -> float:
    """The share of the buckets' elements that ``assignment`` (layer name -> candidate) compresses."""
    total = sum(b.numel for b in buckets) or 1
    compressed = sum(b.numel for b in buckets if b.layers and assignment.get(b.layers[0], DENSE) != DENSE)
    return compressed / total
