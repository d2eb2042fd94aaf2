"""``AutoCompression``: measure the link, the backward pass and every candidate; compress only where it pays.

The model and the planner are :mod:`lightning_gradcomp.auto.timeline`; the per-bucket dispatch is
:class:`~lightning_gradcomp.compressors.Planned`. See docs/auto.md for the model, its assumptions and its limits.
"""

from __future__ import annotations

import copy
import logging
import os
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_gradcomp.auto.candidates import DEFAULT_CANDIDATES, KNOWN_CANDIDATES
from lightning_gradcomp.auto.timeline import (
    DENSE,
    Bucket,
    Cost,
    Link,
    Plan,
    Timing,
    exposed_tail,
    fit_link,
    plan_greedy,
    predict,
)
from lightning_gradcomp.auto.timeline import wire_bytes as _wire_bytes
from lightning_gradcomp.compressors import Compressor, Identity, Planned
from lightning_gradcomp.compressors.base import Layer, check_gradient_dtypes
from lightning_gradcomp.hook import CompressionState
from lightning_gradcomp.strategy import CompressedDDP
from lightning_gradcomp.testing import SimulatedHook
from lightning_gradcomp.validation import check_int, check_number

log = logging.getLogger(__name__)

#: all-reduce sizes (bytes) timed to fit the link, each ``PROBE_REPEATS`` times; the first (one element) gives the
#: latency, the others the bandwidth
PROBE_SIZES = (4, 64 * 1024, 1024 * 1024, 4 * 1024 * 1024)
PROBE_REPEATS = 3
#: timed runs of each candidate on each bucket after one warm-up run; the fastest counts (a run on a loaded machine
#: can be an outlier: a single timed run once read TopK-10 % 3.7x slower than the next calibration did)
CODEC_TIMED_RUNS = 2


def _check_candidates(candidates: Any) -> dict[str, Compressor]:
    if candidates is None:
        candidates = DEFAULT_CANDIDATES
    if isinstance(candidates, Mapping):
        out = {}
        for name, c in candidates.items():
            if not isinstance(c, Compressor):
                raise MisconfigurationException(
                    f"Expected `candidates` to map names to compressors, got {name!r}: {c!r}."
                )
            out[str(name)] = c
    elif isinstance(candidates, Sequence) and not isinstance(candidates, str):
        unknown = [c for c in candidates if c not in KNOWN_CANDIDATES]
        if unknown:
            raise MisconfigurationException(
                f"Expected `candidates` to name known candidates ({', '.join(KNOWN_CANDIDATES)}) or map names to"
                f" compressors, got unknown {unknown}."
            )
        out = {name: KNOWN_CANDIDATES[name]() for name in candidates}
    else:
        raise MisconfigurationException(
            f"Expected `candidates` to be a list of names or a mapping, got {candidates!r}."
        )
    if DENSE not in out:
        out = {DENSE: Identity(), **out}
    elif not isinstance(out[DENSE], Identity):
        raise MisconfigurationException("`candidates['dense']` must be `Identity()` (plain all-reduce).")
    return {DENSE: out.pop(DENSE), **out}


def _element_size(bucket: Bucket, params: Mapping[str, torch.Tensor]) -> int:
    """Bytes per element of ``bucket``'s gradients (a DDP bucket holds one dtype; 16-bit training halves them)."""
    for name in bucket.layers:
        if name in params:
            return params[name].dtype.itemsize
    return 4


def _takes(candidate: Compressor, layers: Sequence[Layer], params: Mapping[str, torch.Tensor], min_numel: int) -> bool:
    """Whether ``candidate`` accepts the gradients of ``layers`` (a cast refuses 16-bit ones).

    The planner is offered a candidate only for the buckets it accepts, so it never assigns one a bucket it refuses.
    """
    try:
        check_gradient_dtypes(candidate, [(layer, params[layer.name].dtype) for layer in layers], min_numel)
    except ValueError:
        return False
    return True


class AutoCompression(Callback):
    """Choose per DDP bucket whether and how to compress, from measurements of this run; verify and fall back.

    1. **Calibrate** for ``calibration_steps`` steps (after ``skip_steps``, so that DDP has rebuilt its buckets;
       during a :class:`~lightning_gradcomp.callbacks.DenseWarmup` the window falls in the dense phase): every
       bucket is averaged densely while every rank records when each bucket reaches the hook (its ready time), the
       forward and optimizer times and the step time. Then every rank times dense all-reduces of a few sizes (the
       link's latency ``alpha`` and bandwidth ``beta`` by least squares) and each candidate's encode and decode on the
       step's real bucket gradients, through the real hook on simulated ranks in this process (no communication;
       bytes from the payloads), on the buckets where compression could pay (``measure``).
    2. **Plan** on rank 0 with the timeline model (:func:`~lightning_gradcomp.auto.timeline.plan_greedy`): buckets
       whose communication is hidden by the backward pass stay dense, the exposed tail is compressed with the least
       lossy candidate that pays, and a switch must gain more than ``margin``. The plan (and rank 0's measurements)
       is broadcast, so every rank applies the same plan.
    3. **Verify**: after a switch, the median step time of ``verify_steps`` steps is compared with the dense
       baseline measured in calibration; if it is more than ``tolerance`` slower, the previous plan is restored and
       a line says why.
    4. **Re-plan** when DDP's buckets change (their layers, not only their order), every ``replan_every`` steps if
       set, and when the step time drifts from what was verified by more than ``drift`` (checked every
       ``check_every`` steps: one small broadcast).
    5. **Limits**: a layer's level on ``Planned`` (set by :class:`~lightning_gradcomp.callbacks.Accordion`, listed
       after this callback) is the most lossy candidate it may use; plans stay within the limits, and a change of
       limits re-plans from the stored measurements (then verifies).

    The callback replaces the strategy's compressor by a :class:`~lightning_gradcomp.compressors.Planned` holding the
    candidates (or uses the strategy's own, when it is already one). Its state (the plan, the link, the measurements,
    the phase) is checkpointed: a resumed run keeps its plan and does not calibrate again.

    Args:
        candidates: names from :data:`KNOWN_CANDIDATES` (default :data:`DEFAULT_CANDIDATES`), least lossy first, or a
            mapping from names to compressors. ``"dense"`` (plain all-reduce) is always a candidate.
        calibration_steps: steps measured before each plan (>= 1).
        skip_steps: steps before the first calibration (DDP rebuilds its buckets after the first step).
        margin: a switch must gain more than this fraction of the predicted step time, in [0, 1).
        verify_steps: steps measured after a switch before it is kept (>= 1).
        tolerance: the verified step may be this fraction slower than the dense baseline before falling back.
        replan_every: calibrate and plan again every this many steps (``None``: only on changes).
        drift: re-plan when the median step time moves by more than this fraction from the verified one.
        check_every: steps between drift checks.
        link: ``(alpha seconds, beta bytes/s)`` to plan for instead of probing the link (to plan for a link you
            know, or for tests).
        measure: ``"tail"`` times the candidates only on the buckets whose dense communication is exposed (the only
            ones the planner may compress; cheap on a fast link), ``"all"`` on every bucket (what
            ``lightning-gradcomp advise`` uses, to predict every candidate at other bandwidths).

    Raises:
        MisconfigurationException: If an argument is out of range or names an unknown candidate, or (in ``setup``)
            the strategy is not ``CompressedDDP``.

    Example::

        >>> from lightning.pytorch import Trainer
        >>> from lightning_gradcomp import CompressedDDP
        >>> from lightning_gradcomp.callbacks import AutoCompression
        >>> trainer = Trainer(accelerator="cpu", devices=2, strategy=CompressedDDP(), callbacks=[AutoCompression()])
    """

    def __init__(
        self,
        candidates: Sequence[str] | Mapping[str, Compressor] | None = None,
        calibration_steps: int = 5,
        skip_steps: int = 2,
        margin: float = 0.03,
        verify_steps: int = 5,
        tolerance: float = 0.05,
        replan_every: int | None = None,
        drift: float = 0.25,
        check_every: int = 50,
        link: tuple[float, float] | None = None,
        measure: str = "tail",
    ) -> None:
        error = MisconfigurationException
        self.candidates = _check_candidates(candidates)
        self.calibration_steps = check_int(calibration_steps, "calibration_steps", low=1, error=error)
        self.skip_steps = check_int(skip_steps, "skip_steps", low=0, error=error)
        self.margin = check_number(margin, "margin", low=0, high=1, high_open=True, error=error)
        self.verify_steps = check_int(verify_steps, "verify_steps", low=1, error=error)
        self.tolerance = check_number(tolerance, "tolerance", low=0, error=error)
        self.replan_every = check_int(replan_every, "replan_every", low=1, allow_none=True, error=error)
        self.drift = check_number(drift, "drift", low=0, low_open=True, error=error)
        self.check_every = check_int(check_every, "check_every", low=1, error=error)
        if link is not None:
            if not (isinstance(link, Sequence) and len(link) == 2):
                raise error(f"Expected `link` to be None or (alpha seconds, beta bytes per second), got {link!r}.")
            check_number(link[0], "link[0] (alpha)", low=0, error=error)
            check_number(link[1], "link[1] (beta)", low=0, low_open=True, error=error)
        self.fixed_link = None if link is None else Link(float(link[0]), float(link[1]))
        if measure not in ("tail", "all"):
            raise error(f"Expected `measure` to be 'tail' or 'all', got {measure!r}.")
        self.measure = measure
        # state (checkpointed; identical on every rank: rank 0's measurements and decisions are broadcast)
        self.phase = "calibrate"
        self.phase_start = self.skip_steps
        self.assignment: dict[str, str] = {}
        self.previous_assignment: dict[str, str] = {}
        self.link: Link | None = None
        self.buckets: list[Bucket] = []
        self.timing: Timing | None = None
        self.plan: Plan | None = None
        self.baseline_step: float | None = None  # measured median step time of the plan before the switch
        self.expected_step: float | None = None  # measured median step time of the plan in force (drift reference)
        self.history: list[dict[str, Any]] = []
        self.calibrations = 0
        # runtime
        self.local_plan: Plan | None = None  # this rank's own plan from its own measurements (not applied)
        self._planned: Planned | None = None
        self._records: list[dict[str, Any]] = []
        self._recent: list[float] = []
        self._t: dict[str, float] = {}
        self._layout_version = -1
        self._limits: dict[str, Any] = {}  # the limits (Planned's levels) the plan in force was made within
        self._trainer_step = 0
        self._fit_start = 0
        self.model_options: dict[str, bool] = {"encode_blocks_backward": True, "contended": False}

    # ------------------------------------------------------------------------------------------------------------
    # Lightning hooks
    # ------------------------------------------------------------------------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        strategy = CompressedDDP.require(trainer, self)
        current = strategy.compressor
        if isinstance(current, Planned):
            self._planned = current
            self.candidates = current.candidates
        else:
            if not isinstance(current, Identity):
                rank_zero_warn(
                    f"AutoCompression replaces the strategy's compressor {current!r} by its candidates"
                    f" ({', '.join(self.candidates)}); pass it in `candidates` to keep it as one."
                )
            self._planned = Planned(self.candidates, default=DENSE)
            strategy.compressor = self._planned
        self._planned.set_assignment(self.assignment)
        self._set_model_options(trainer)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._fit_start = trainer.global_step
        if self.phase == "calibrate":
            self.phase_start = max(self.phase_start, self._fit_start + self.skip_steps)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        state = trainer.strategy.compression_state
        step = trainer.global_step
        self._trainer_step = step
        # DDP's own rebuild after the first steps of a fit (a resume starts with one bucket) is no change of layout
        settled = step >= self._fit_start + self.skip_steps
        if self.phase == "steady" and settled and state.layout_version != self._layout_version:
            self._layout_version = state.layout_version
            if self.buckets and self._layout_changed(state):
                self._start("calibrate", step, "DDP's buckets changed")
        if self.phase == "steady" and self.buckets and self._planned.layer_levels != self._limits:
            self._plan_within_new_limits(step)
        recording = (self.phase == "calibrate" and step >= self.phase_start) or (
            self.phase == "verify" and step >= self.phase_start and trainer.strategy.compression_enabled
        )
        if self.phase == "calibrate" and step >= self.phase_start:
            self._planned.set_assignment({})  # measure the dense timeline
        state.recorder = [] if recording else None
        self._t = {"start": time.perf_counter()}

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        self._t["backward"] = time.perf_counter()

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        self._t["optimizer"] = time.perf_counter()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        end = time.perf_counter()
        state = trainer.strategy.compression_state
        recorder, state.recorder = state.recorder, None
        t = self._t
        if "backward" not in t or "optimizer" not in t:
            return  # a skipped step (no backward, or accumulation): nothing to measure
        step_time = end - t["start"]
        step = self._trainer_step
        if recorder is not None:
            self._records.append(
                {
                    "forward": t["backward"] - t["start"],
                    "optimizer": end - t["optimizer"],
                    "backward": t["optimizer"] - t["backward"],
                    "step": step_time,
                    "buckets": [(r[0] - t["backward"], r[1], r[2], (r[3] or end) - t["backward"]) for r in recorder],
                }
            )
        if self.phase == "calibrate" and len(self._records) >= self.calibration_steps:
            self._calibrate_and_plan(trainer, pl_module)
        elif self.phase == "verify" and len(self._records) >= self.verify_steps:
            self._verify(trainer)
        elif self.phase == "steady":
            self._recent.append(step_time)
            if self.replan_every is not None and step + 1 - self.phase_start >= self.replan_every:
                self._start("calibrate", step + 1, f"periodic re-plan (every {self.replan_every} steps)")
            elif len(self._recent) >= self.check_every:
                self._check_drift(trainer)
        if self.plan is not None:
            share = self._compressed_share()
            pl_module.log("auto/compressed", share, prog_bar=True, on_step=True, on_epoch=False, batch_size=1)

    # ------------------------------------------------------------------------------------------------------------
    # Phases
    # ------------------------------------------------------------------------------------------------------------
    def _start(self, phase: str, step: int, why: str) -> None:
        self.phase, self.phase_start = phase, step
        self._records = []
        self._recent = []
        self.history.append({"step": step, "event": "phase", "phase": phase, "why": why})
        rank_zero_info(f"gradcomp auto: {phase} from step {step}: {why}")

    def _layout_changed(self, state: Any) -> bool:
        layouts = {tuple(layer.name for layer in plan.every) for plan in state._plans.values()}
        return layouts != {bucket.layers for bucket in self.buckets}

    def _calibrate_and_plan(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        records = self._last_layout(self._records)
        buckets, timing, measured_dense = self._summarise(records)
        begin = time.perf_counter()
        link = self.fixed_link or self._probe_link(trainer)
        buckets, timed = self._measure_codecs(trainer, pl_module, buckets, link, timing)
        local = {"link": link, "buckets": buckets, "timing": timing, "measured": measured_dense, "timed": timed,
                 "measuring_s": time.perf_counter() - begin}  # fmt: skip
        local = self._local_measurements(trainer, local)
        self._limits = self._planned.layer_levels
        self.local_plan = plan_greedy(self._within_limits(local["buckets"]), list(self.candidates), local["link"],
                                      local["timing"], self.margin, **self.model_options)  # fmt: skip
        shared = trainer.strategy.broadcast(
            {**{k: (asdict(v) if k in ("link", "timing") else v) for k, v in local.items()}, "plan": self.local_plan},
            src=0,
        )
        self.link = Link(**shared["link"])
        self.timing = Timing(**shared["timing"])
        self.buckets = list(shared["buckets"])
        self.plan = shared["plan"]
        self.calibrations += 1
        dense_pred = predict(self.buckets, [DENSE] * len(self.buckets), self.link, self.timing, **self.model_options)
        self.baseline_step = shared["measured"]
        error = (dense_pred.step - self.baseline_step) / self.baseline_step
        event = {
            "step": self._trainer_step,
            "event": "plan",
            "link": asdict(self.link),
            "dense_predicted": dense_pred.step,
            "dense_measured": self.baseline_step,
            "dense_error": error,
            "predicted": self.plan.predicted,
            "assignment": list(self.plan.assignment),
            "reasons": list(self.plan.reasons),
            "timed_buckets": shared["timed"],
            "measuring_s": shared["measuring_s"],
        }
        self.history.append(event)
        rank_zero_info(self.describe())
        self._log_plan(trainer, dense_pred)
        self.previous_assignment = dict(self.assignment)
        new = {name: cand for name, cand in self.plan.layer_assignment(self.buckets).items() if cand != DENSE}
        self.assignment = new
        self._planned.set_assignment(new)
        if new != self.previous_assignment and new:
            self._start("verify", self._trainer_step + 2, "a new plan is applied; its step time is measured")
        else:
            # a dense plan runs at the measured baseline; an unchanged compressed plan is measured by the drift check
            self.expected_step = None if new else self.baseline_step
            self._start("steady", self._trainer_step + 1, "the plan is dense" if not new else "the plan is unchanged")

    def _within_limits(self, buckets: list[Bucket]) -> list[Bucket]:
        """``buckets`` with only the candidates their layers' limits allow (Accordion's, through ``Planned``)."""
        out = []
        for bucket in buckets:
            allowed = set(self._planned.allowed(bucket.layers))
            out.append(Bucket(bucket.ready, bucket.numel, bucket.layers,
                              {name: cost for name, cost in bucket.costs.items() if name in allowed}))  # fmt: skip
        return out

    def _plan_within_new_limits(self, step: int) -> None:
        """The limits changed (Accordion's regime): plan again from the stored measurements, no new calibration.

        The limits and the measurements are the same on every rank, so is the plan: nothing is broadcast.
        """
        assert self.link is not None
        assert self.timing is not None
        self._limits = self._planned.layer_levels
        self.plan = plan_greedy(self._within_limits(self.buckets), list(self.candidates), self.link, self.timing,
                                self.margin, **self.model_options)  # fmt: skip
        limited = sum(len(self._planned.allowed(b.layers)) < len(self.candidates) for b in self.buckets)
        self.history.append({"step": step, "event": "plan", "why": f"limits changed ({limited} bucket(s) limited)",
                             "predicted": self.plan.predicted, "assignment": list(self.plan.assignment),
                             "reasons": list(self.plan.reasons)})  # fmt: skip
        rank_zero_info(self.describe())
        self.previous_assignment = dict(self.assignment)
        new = {name: cand for name, cand in self.plan.layer_assignment(self.buckets).items() if cand != DENSE}
        self.assignment = new
        self._planned.set_assignment(new)
        if new != self.previous_assignment and new:
            self._start("verify", step + 1, "the limits changed; the new plan's step time is measured")
        elif new != self.previous_assignment:
            self.expected_step = self.baseline_step
            self._start("steady", step, "the limits changed; the plan is dense")

    def _verify(self, trainer: pl.Trainer) -> None:
        mine = statistics.median(r["step"] for r in self._records)
        measured = trainer.strategy.broadcast(mine, src=0)
        assert self.baseline_step is not None
        assert self.plan is not None
        record = {"step": self._trainer_step, "event": "verify", "measured": measured, "baseline": self.baseline_step,
                  "predicted": self.plan.predicted}  # fmt: skip
        self.history.append(record)
        if measured > self.baseline_step * (1 + self.tolerance):
            why = (
                f"fallback: the plan measured {measured * 1e3:.1f} ms per step, the previous one"
                f" {self.baseline_step * 1e3:.1f} ms (more than {self.tolerance:.0%} slower; predicted"
                f" {self.plan.predicted * 1e3:.1f} ms)"
            )
            record["fallback"] = why
            self.assignment = dict(self.previous_assignment)
            self._planned.set_assignment(self.assignment)
            self.expected_step = self.baseline_step
            rank_zero_warn(f"gradcomp auto: {why}")
            self._start("steady", self._trainer_step + 1, why)
        else:
            self.expected_step = measured
            self._start("steady", self._trainer_step + 1, f"kept: measured {measured * 1e3:.1f} ms per step")

    def _check_drift(self, trainer: pl.Trainer) -> None:
        mine = statistics.median(self._recent)
        self._recent = []
        now = trainer.strategy.broadcast(mine, src=0)
        if self.expected_step is None:
            self.expected_step = now
        elif abs(now - self.expected_step) > self.drift * self.expected_step:
            why = f"the step time drifted from {self.expected_step * 1e3:.1f} to {now * 1e3:.1f} ms"
            self._start("calibrate", self._trainer_step + 1, why)

    # ------------------------------------------------------------------------------------------------------------
    # Measurements
    # ------------------------------------------------------------------------------------------------------------
    @staticmethod
    def _last_layout(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
        layout = [b[1] for b in records[-1]["buckets"]]
        return [r for r in records if [b[1] for b in r["buckets"]] == layout]

    @staticmethod
    def _summarise(records: list[dict[str, Any]]) -> tuple[list[Bucket], Timing, float]:
        n = len(records[-1]["buckets"])
        buckets = []
        for b in range(n):
            ready = statistics.median(r["buckets"][b][0] for r in records)
            _, names, numel, _ = records[-1]["buckets"][b]
            buckets.append(Bucket(ready=ready, numel=numel, layers=tuple(names), costs={}))
        backward_end = max(bucket.ready for bucket in buckets) if buckets else 0.0
        # after the last reduction finished, the backward call still copies the averages into the gradients
        tails = [r["backward"] - max([b[3] for b in r["buckets"]] + [b[0] for b in r["buckets"]]) for r in records]
        timing = Timing(
            forward=statistics.median(r["forward"] for r in records),
            backward_end=backward_end,
            optimizer=statistics.median(r["optimizer"] for r in records),
            tail=max(0.0, statistics.median(tails)),
        )
        return buckets, timing, statistics.median(r["step"] for r in records)

    def _probe_link(self, trainer: pl.Trainer) -> Link:
        """Time dense all-reduces of a few sizes on the real process group; fit ``alpha`` and ``beta``."""
        device = trainer.strategy.root_device
        group = trainer.strategy._ddp_kwargs.get("process_group")
        samples = []
        for nbytes in PROBE_SIZES:
            tensor = torch.zeros(max(1, nbytes // 4), dtype=torch.float32, device=device)
            times = []
            for _ in range(PROBE_REPEATS):
                dist.barrier(group=group)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                begin = time.perf_counter()
                dist.all_reduce(tensor, group=group)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                times.append(time.perf_counter() - begin)
            samples.append((nbytes, statistics.median(times)))
        return fit_link(samples[1:], alpha=samples[0][1])

    def _measure_codecs(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, buckets: list[Bucket], link: Link, timing: Timing
    ) -> tuple[list[Bucket], list[int]]:
        """Each candidate's encode and decode time and payload bytes on the real gradients of the buckets that pay.

        With ``measure="tail"`` only the buckets of the dense timeline's exposed tail are timed
        (:func:`~lightning_gradcomp.auto.timeline.exposed_tail`): the planner never compresses a bucket before it,
        since one that finishes before an idle gap cannot shorten the step, and compressing a later bucket does not
        change that. None is timed when the exposed time is at most ``margin`` of the step: compression cannot
        end a step before the backward pass does, so it could not gain the margin. On a fast link this is the last
        bucket or none, which keeps the calibration cheap.

        Returns:
            The buckets with their costs, and the indices of the buckets whose candidates were timed.
        """
        params = dict(pl_module.named_parameters())
        dense = [
            Bucket(b.ready, b.numel, b.layers, {DENSE: Cost(0.0, 0.0, float(b.numel * _element_size(b, params)), 1)})
            for b in buckets
        ]
        if self.measure == "all":
            timed = list(range(len(dense)))
        else:
            prediction = predict(dense, [DENSE] * len(dense), link, timing, **self.model_options)
            if prediction.exposed <= self.margin * prediction.step:
                timed = []  # compression can at most remove the exposed time: it cannot gain the margin
            else:
                timed = list(range(exposed_tail(prediction, dense, link), len(dense)))
        state = trainer.strategy.compression_state
        world = trainer.strategy.world_size
        index = {name: i for i, name in enumerate(params)}
        out = list(dense)
        for b in timed:
            bucket = dense[b]
            layers, offset, grads = [], 0, []
            for name in bucket.layers:
                p = params.get(name)
                if p is None:
                    continue
                layers.append(Layer(name, index[name], p.shape, offset))
                offset += p.numel()
                grads.append((p.grad if p.grad is not None else torch.randn_like(p)).detach().reshape(-1))
            flat = torch.cat(grads) if grads else torch.zeros(0)  # in the gradients' dtype, as the hook sees them
            costs = dict(bucket.costs)
            for name, candidate in self.candidates.items():
                if name != DENSE and _takes(candidate, layers, params, state.min_compress_numel):
                    costs[name] = self._codec_cost(candidate, state, tuple(layers), flat, world)
            out[b] = Bucket(bucket.ready, bucket.numel, bucket.layers, costs)
        return out, timed

    @staticmethod
    def _codec_cost(
        candidate: Compressor, state: Any, layers: tuple[Layer, ...], flat: torch.Tensor, world: int
    ) -> Cost:
        """One candidate on one bucket, through the real hook on simulated ranks in this process.

        The hook's own work (the gather and scatter of the compressed layers, the error-feedback staging, the
        finiteness guard and the commit) costs as much as a light codec's: timing only the compressor predicted
        PowerSGD up to 15 % too fast. Encode and decode are the compressor's own timed blocks on rank 0; the rest of
        the wall time per rank is the hook's and counts as encoding (it runs at the hook's call, on the autograd
        thread).
        """
        compressed = [layer for layer in layers if candidate.compresses(layer, state.min_compress_numel)]
        dense_numel = sum(layer.numel for layer in layers) - sum(layer.numel for layer in compressed)
        element = flat.element_size()
        if not compressed:
            return Cost(0.0, 0.0, float(flat.numel() * element), 1)
        states = [
            CompressionState(copy.deepcopy(candidate), error_feedback=state.error_feedback,
                             min_compress_numel=state.min_compress_numel, seed=state.seed)
            for _ in range(world)
        ]  # fmt: skip
        hook = SimulatedHook(states, layers)
        best: tuple[float, Any] | None = None
        for attempt in range(1 + CODEC_TIMED_RUNS):  # the first run allocates and warms up (PowerSGD's query)
            begin = time.perf_counter()
            hook.step([flat] * world)
            wall = time.perf_counter() - begin
            stats = [s.telemetry.pop_step() for s in states][0]
            assert stats is not None
            if attempt and (best is None or wall < best[0]):
                best = (wall, stats)
        assert best is not None
        wall, stats = best
        encode, decode = stats.encode_ms / 1e3, stats.decode_ms / 1e3
        hook_s = max(0.0, wall / world - encode - decode)
        dense_bytes = dense_numel * element
        nbytes = _wire_bytes(stats.bytes_sent - dense_bytes, candidate.collective, world) + dense_bytes
        rounds = candidate.rounds + (1 if dense_numel else 0)
        return Cost(encode + hook_s, decode, float(nbytes), rounds)

    def _local_measurements(self, trainer: pl.Trainer, measured: dict[str, Any]) -> dict[str, Any]:
        """This rank's measurements, before rank 0's are broadcast (tests override it to make ranks disagree)."""
        return measured

    def _set_model_options(self, trainer: pl.Trainer) -> None:
        cpu = trainer.strategy.root_device.type == "cpu"
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        workers = max(1, len(getattr(trainer.strategy, "parallel_devices", None) or [None]))
        self.model_options = {
            # the hook runs on the autograd thread: on the CPU encoding delays the rest of the backward pass
            "encode_blocks_backward": cpu,
            # fewer cores than the workers' compute threads plus a communication thread each: gloo's CPU work (and
            # the decoding) takes its share from the backward pass even when it overlaps
            "contended": cpu and cores < workers * (torch.get_num_threads() + 1),
        }

    # ------------------------------------------------------------------------------------------------------------
    # Reporting
    # ------------------------------------------------------------------------------------------------------------
    def _compressed_share(self) -> float:
        total = sum(b.numel for b in self.buckets) or 1
        compressed = sum(b.numel for b in self.buckets if self.assignment.get(b.layers[0] if b.layers else "", DENSE)
                         != DENSE)  # fmt: skip
        return compressed / total

    def describe(self) -> str:
        """The plan as a table: per bucket its size, ready time, candidate and predicted finish."""
        if self.plan is None or self.link is None or self.timing is None:
            return "gradcomp auto: no plan yet"
        pred = predict(self.buckets, list(self.plan.assignment), self.link, self.timing, **self.model_options)
        lines = [
            f"gradcomp auto: link alpha {self.link.alpha * 1e3:.3f} ms, beta {self.link.beta * 8 / 1e9:.3f} Gbit/s;"
            f" forward {self.timing.forward * 1e3:.1f} ms, backward {self.timing.backward_end * 1e3:.1f} ms,"
            f" optimizer {self.timing.optimizer * 1e3:.1f} ms",
            f"predicted step: {self.plan.predicted * 1e3:.1f} ms (dense {self.plan.dense_predicted * 1e3:.1f} ms,"
            f" measured dense {self.baseline_step * 1e3 if self.baseline_step else float('nan'):.1f} ms)",
            "| bucket | MB | ready (ms) | method | predicted finish (ms) |",
            "|---|---|---|---|---|",
        ]
        for b, (bucket, name) in enumerate(zip(self.buckets, self.plan.assignment)):
            lines.append(f"| {b} | {bucket.costs[DENSE].nbytes / 1e6:.2f} | {bucket.ready * 1e3:.1f} | {name} |"
                         f" {pred.finish[b] * 1e3:.1f} |")  # fmt: skip
        lines.extend(f"  {reason}" for reason in self.plan.reasons)
        return "\n".join(lines)

    def _log_plan(self, trainer: pl.Trainer, dense_pred: Any) -> None:
        logger = trainer.logger
        if logger is None or self.plan is None or self.link is None or self.timing is None:
            return
        pred = predict(self.buckets, list(self.plan.assignment), self.link, self.timing, **self.model_options)
        names = list(self.candidates)
        metrics = {"auto/predicted_step_ms": self.plan.predicted * 1e3, "auto/dense_predicted_step_ms":
                   dense_pred.step * 1e3, "auto/dense_measured_step_ms": (self.baseline_step or 0) * 1e3,
                   "auto/alpha_ms": self.link.alpha * 1e3, "auto/beta_gbit": self.link.beta * 8 / 1e9}  # fmt: skip
        measured = self._records[-1]["buckets"] if self._records else []
        for b, name in enumerate(self.plan.assignment):
            metrics[f"auto/bucket{b}/method"] = float(names.index(name))
            metrics[f"auto/bucket{b}/predicted_finish_ms"] = pred.finish[b] * 1e3
            if b < len(measured):
                metrics[f"auto/bucket{b}/measured_dense_finish_ms"] = measured[b][3] * 1e3
        if trainer.is_global_zero:
            logger.log_metrics(metrics, step=trainer.global_step)

    # ------------------------------------------------------------------------------------------------------------
    # State
    # ------------------------------------------------------------------------------------------------------------
    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "phase": self.phase,
            "phase_start": self.phase_start,
            "assignment": dict(self.assignment),
            "previous_assignment": dict(self.previous_assignment),
            "link": None if self.link is None else asdict(self.link),
            "timing": None if self.timing is None else asdict(self.timing),
            "buckets": [asdict(b) for b in self.buckets],
            "plan": None if self.plan is None else asdict(self.plan),
            "baseline_step": self.baseline_step,
            "expected_step": self.expected_step,
            "history": list(self.history),
            "calibrations": self.calibrations,
            "limits": dict(self._limits),
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.phase = state_dict["phase"]
        self.phase_start = state_dict["phase_start"]
        self.assignment = dict(state_dict["assignment"])
        self.previous_assignment = dict(state_dict["previous_assignment"])
        link = state_dict["link"]  # older checkpoints also hold "cpu_per_byte", no longer modelled
        self.link = None if link is None else Link(alpha=link["alpha"], beta=link["beta"])
        self.timing = None if state_dict["timing"] is None else Timing(**state_dict["timing"])
        self.buckets = [
            Bucket(b["ready"], b["numel"], tuple(b["layers"]), {k: Cost(**c) for k, c in b["costs"].items()})
            for b in state_dict["buckets"]
        ]
        plan = state_dict["plan"]
        self.plan = None if plan is None else Plan(tuple(plan["assignment"]), plan["predicted"],
                                                   plan["dense_predicted"], tuple(plan["reasons"]))  # fmt: skip
        self.baseline_step = state_dict["baseline_step"]
        self.expected_step = state_dict["expected_step"]
        self.history = list(state_dict["history"])
        self.calibrations = state_dict["calibrations"]
        self._limits = dict(state_dict.get("limits", {}))
        if self.phase in ("calibrate", "verify"):
            self._records = []  # a window cut by the checkpoint starts again
        if self._planned is not None:
            self._planned.set_assignment(self.assignment)


CompressedDDP.auto_callback = AutoCompression  # what CompressedDDP(compressor="auto") adds when fitting
