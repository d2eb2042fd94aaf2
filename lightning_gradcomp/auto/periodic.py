"""Periodic synchronization in ``advise``: DiLoCo's predicted compute utilisation, and the settings to paste. Pure.

For a model of ``M`` parameters on ``N`` workers, with ``t`` the step with no communication (measured), ``T`` the time
of one outer exchange of the whole model in a payload (the fitted link's ``alpha + bytes / beta`` of the all-reduce
that moves as many bytes as the payload's byte model says) and ``c`` the payload's encode and decode time per
exchange (timed, on the main thread), the time of ``H`` steps is (the bound of arXiv 2501.18512 and 2502.12996, as
``shared/docs/frontier-2026.md`` section 4 writes it):

* **blocking** (``DiLoCo(sync_every=H)``): ``H t + T + c``;
* **streaming** (``fragments=F, overlap_steps=tau``): each fragment's exchange ``T_F`` (a fragment's bytes) has
  ``tau`` inner steps to finish, so ``H t + F max(0, T_F - tau t) + c``;
* **one-step delay** (``overlap_steps = H / F``, the eager merge): each has a whole period, ``H t + F max(0, T_F -
  (H / F) t) + c``.

The compute utilisation is ``H t`` over that. The recommendation is the setting whose loss costs least among those that
reach :data:`TARGET` (of the measured ones, docs/diloco.md: fp32, 8-bit and 4-bit cost under 0.5 % against each other,
a shorter round costs less than a longer one, SparseLoCo costs most; a blocking exchange before an overlapped one), or
the fastest when none does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from lightning_gradcomp.auto.timeline import Cost, Link

__all__ = [
    "FRAGMENTS",
    "PAYLOADS",
    "SCHEDULES",
    "SYNC_EVERY",
    "TARGET",
    "PeriodicPlan",
    "constructor",
    "periodic_plans",
    "periodic_table",
    "recommend",
]

#: the rounds ``advise`` prices
SYNC_EVERY = (10, 30, 100, 500)
#: the outer payloads, in the order of their measured loss cost, and the compressor each is (None: a plain mean)
PAYLOADS = {"fp32": None, "8-bit": "MinMax(bits=8)", "4-bit": "MinMax(bits=4)", "SparseLoCo": "SparseLoCo()"}
SCHEDULES = ("blocking", "streaming", "one-step delay")
#: the fragments of the streaming and one-step-delay rows
FRAGMENTS = 5
#: the compute utilisation a recommendation must reach
TARGET = 0.95


@dataclass(frozen=True)
class PeriodicPlan:
    """One DiLoCo setting and its predicted time.

    Attributes:
        sync_every: H.
        payload: a key of :data:`PAYLOADS`.
        schedule: one of :data:`SCHEDULES`.
        fragments: ``fragments`` (1 when blocking).
        overlap_steps: ``overlap_steps`` (0 when blocking).
        step: the predicted seconds per optimizer step.
        utilisation: the compute step over :attr:`step`.
    """

    sync_every: int
    payload: str
    schedule: str
    fragments: int
    overlap_steps: int
    step: float
    utilisation: float


def _schedule(schedule: str, h: int) -> tuple[int, int]:
    """``(fragments, overlap_steps)`` of a schedule at ``h``: streaming overlaps half a period, the delay all of it."""
    if schedule == "blocking":
        return 1, 0
    fragments = FRAGMENTS if h % FRAGMENTS == 0 and h >= FRAGMENTS else 1
    period = h // fragments
    return fragments, (max(period // 2, 1) if schedule == "streaming" else period)


def predict_periodic(
    compute: float, link: Link, cost: Cost, h: int, fragments: int, overlap_steps: int
) -> tuple[float, float]:
    """Seconds per step and compute utilisation of one setting (module docstring); ``cost``: one whole exchange's."""
    if overlap_steps:  # each fragment's exchange hides behind overlap_steps inner steps
        exposed = fragments * max(0.0, link.time(cost.nbytes / fragments, cost.rounds) - overlap_steps * compute)
    else:
        exposed = link.time(cost.nbytes, cost.rounds)
    total = h * compute + exposed + cost.encode + cost.decode
    return total / h, h * compute / total


def periodic_plans(
    compute: float, link: Link, costs: Mapping[str, Cost], sync_every: Sequence[int] = SYNC_EVERY
) -> list[PeriodicPlan]:
    """Every priced setting: each payload of ``costs`` at each H of ``sync_every``, in each schedule."""
    plans = []
    for h in sync_every:
        for payload in PAYLOADS:
            if payload not in costs:
                continue
            for schedule in SCHEDULES:
                fragments, overlap = _schedule(schedule, h)
                step, utilisation = predict_periodic(compute, link, costs[payload], h, fragments, overlap)
                plans.append(PeriodicPlan(h, payload, schedule, fragments, overlap, step, utilisation))
    return plans


def recommend(plans: Sequence[PeriodicPlan], target: float = TARGET) -> tuple[PeriodicPlan, bool]:
    """The plan to paste and whether it reaches ``target``: the least loss among those that do, else the fastest.

    Least loss: SparseLoCo last, then the shortest round, then the payload's order, then blocking before overlap.
    """
    payloads, schedules = list(PAYLOADS), list(SCHEDULES)

    def loss(p: PeriodicPlan) -> tuple[bool, int, int, int]:
        return p.payload == "SparseLoCo", p.sync_every, payloads.index(p.payload), schedules.index(p.schedule)

    reaching = [p for p in plans if p.utilisation >= target]
    if reaching:
        return min(reaching, key=loss), True
    return max(plans, key=lambda p: (p.utilisation, [-x for x in loss(p)])), False


def constructor(plan: PeriodicPlan) -> str:
    """The plan as the constructor call to paste (the merge is DiLoCo's default, eager)."""
    args = [f"sync_every={plan.sync_every}"]
    compressor = PAYLOADS[plan.payload]
    if compressor is not None:
        args.append(f"compressor={compressor}")
    if plan.fragments > 1:
        args.append(f"fragments={plan.fragments}")
    if plan.overlap_steps:
        args.append(f"overlap_steps={plan.overlap_steps}")
    return f"DiLoCo({', '.join(args)})"


def periodic_table(plans: Sequence[PeriodicPlan], compute: float) -> list[str]:
    """The table: compute utilisation per H (columns) for each payload and schedule (rows)."""
    lines = [
        f"DiLoCo: predicted compute utilisation (the step with no communication, {compute * 1e3:.1f} ms, over the"
        f" predicted step); streaming: {FRAGMENTS} fragments, each exchanged during half its period; one-step delay:"
        " during all of it:",
        "",
        "| payload | schedule | " + " | ".join(f"H={h}" for h in SYNC_EVERY) + " |",
        "|---|---|" + "---|" * len(SYNC_EVERY),
    ]
    cells: dict[tuple[str, str], dict[int, float]] = {}
    for p in plans:
        cells.setdefault((p.payload, p.schedule), {})[p.sync_every] = p.utilisation
    for (payload, schedule), by_h in cells.items():
        row = " | ".join(f"{100 * by_h[h]:.0f} %" if h in by_h else "" for h in SYNC_EVERY)
        lines.append(f"| {payload} | {schedule} | {row} |")
    return lines
