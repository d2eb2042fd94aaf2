"""``AutoCompression``: measure the link, the backward pass and every candidate; compress only where it pays.

The model and the planner are :mod:`lightning_gradcomp.auto.timeline`; the per-bucket dispatch is
:class:`~lightning_gradcomp.compressors.Planned`. See docs/auto.md for the model, its assumptions and its limits.
The callback goes through these phases:

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
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_gradcomp.auto.candidates import check_candidates, check_link
from lightning_gradcomp.auto.measure import (
    StepRecord,
    dense_costs,
    last_layout,
    measure_codecs,
    model_options,
    probe_link,
    summarise,
    timed_buckets,
)
from lightning_gradcomp.auto.report import compressed_share, describe_plan, plan_event, plan_metrics
from lightning_gradcomp.auto.timeline import DENSE, Bucket, Link, Plan, Timing, plan_greedy
from lightning_gradcomp.compressors import Compressor, Identity, Planned
from lightning_gradcomp.ddp.hook import CompressionState
from lightning_gradcomp.ddp.strategy import CompressedDDP
from lightning_gradcomp.validation import check_choice, check_int, check_number

log = logging.getLogger(__name__)

#: the checkpointed attributes that are plain values
_PLAIN_STATE = ("phase", "phase_start", "baseline_step", "expected_step", "calibrations")


class AutoCompression(Callback):
    """Choose per DDP bucket whether and how to compress, from measurements of this run; verify and fall back.

    It calibrates (dense steps, timed), plans on rank 0 with the timeline model, verifies the plan against the dense
    baseline and re-plans when the buckets, the limits or the step time change (the module's docstring has the
    details). The callback replaces the strategy's compressor by a :class:`~lightning_gradcomp.compressors.Planned`
    holding the candidates (or uses the strategy's own, when it is already one). Its state (the plan, the link, the
    measurements, the phase) is checkpointed: a resumed run keeps its plan and does not calibrate again.

    Args:
        candidates: names from :data:`~lightning_gradcomp.auto.candidates.KNOWN_CANDIDATES` (default
            :data:`~lightning_gradcomp.auto.candidates.DEFAULT_CANDIDATES`), least lossy first, or a mapping from
            names to compressors. ``"dense"`` (plain all-reduce) is always a candidate.
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
        self.candidates = check_candidates(candidates)
        self.calibration_steps = check_int(calibration_steps, "calibration_steps", low=1, error=error)
        self.skip_steps = check_int(skip_steps, "skip_steps", low=0, error=error)
        self.margin = check_number(margin, "margin", low=0, high=1, high_open=True, error=error)
        self.verify_steps = check_int(verify_steps, "verify_steps", low=1, error=error)
        self.tolerance = check_number(tolerance, "tolerance", low=0, error=error)
        self.replan_every = check_int(replan_every, "replan_every", low=1, allow_none=True, error=error)
        self.drift = check_number(drift, "drift", low=0, low_open=True, error=error)
        self.check_every = check_int(check_every, "check_every", low=1, error=error)
        self.fixed_link = check_link(link)
        self.measure = check_choice(measure, "measure", ("tail", "all"), error=error)
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
        self._records: list[StepRecord] = []
        self._recent: list[float] = []
        self._t: dict[str, float] = {}
        self._layout_version = -1
        self._limits: dict[str, Any] = {}  # the limits (Planned's levels) the plan in force was made within
        self._trainer_step = 0
        self._fit_start = 0
        self.model_options: dict[str, bool] = {"encode_blocks_backward": True, "contended": False}

    @property
    def planned(self) -> Planned:
        """The strategy's compressor, whose per-layer assignment this callback sets (known from ``setup`` on)."""
        if self._planned is None:
            raise RuntimeError("`AutoCompression` has no compressor to plan for before `setup`.")
        return self._planned

    def _strategy(self, trainer: pl.Trainer) -> CompressedDDP:
        return CompressedDDP.require(trainer, self)

    def _state(self, trainer: pl.Trainer) -> CompressionState:
        return self._strategy(trainer).compression_state

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
        self.planned.set_assignment(self.assignment)
        workers = max(1, len(getattr(trainer.strategy, "parallel_devices", None) or [None]))
        self.model_options = model_options(trainer.strategy.root_device, workers)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._fit_start = trainer.global_step
        if self.phase == "calibrate":
            self.phase_start = max(self.phase_start, self._fit_start + self.skip_steps)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        state = self._state(trainer)
        step = trainer.global_step
        self._trainer_step = step
        # DDP's own rebuild after the first steps of a fit (a resume starts with one bucket) is no change of layout
        settled = step >= self._fit_start + self.skip_steps
        if self.phase == "steady" and settled and state.layout_version != self._layout_version:
            self._layout_version = state.layout_version
            if self.buckets and state.bucket_layouts() != {bucket.layers for bucket in self.buckets}:
                self._start("calibrate", step, "DDP's buckets changed")
        if self.phase == "steady" and self.buckets and self.planned.layer_levels != self._limits:
            self._plan_within_new_limits(step)
        recording = (self.phase == "calibrate" and step >= self.phase_start) or (
            self.phase == "verify" and step >= self.phase_start and self._strategy(trainer).compression_enabled
        )
        if self.phase == "calibrate" and step >= self.phase_start:
            self.planned.set_assignment({})  # measure the dense timeline
        if recording:
            state.start_recording()
        else:
            state.stop_recording()
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
        recorded = self._state(trainer).stop_recording()
        t = self._t
        if "backward" not in t or "optimizer" not in t:
            return  # a skipped step (no backward, or accumulation): nothing to measure
        step_time = end - t["start"]
        step = self._trainer_step
        if recorded is not None:
            self._records.append(StepRecord.from_times(t["start"], t["backward"], t["optimizer"], end, recorded))
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
            share = compressed_share(self.buckets, self.assignment)
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

    def _calibrate_and_plan(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        buckets, timing, measured_dense = summarise(last_layout(self._records))
        begin = time.perf_counter()
        group = self._strategy(trainer).ddp_process_group
        link = self.fixed_link or probe_link(trainer.strategy.root_device, group)
        buckets, timed = self._measure_codecs(trainer, pl_module, buckets, link, timing)
        local: dict[str, Any] = {"link": link, "buckets": buckets, "timing": timing, "measured": measured_dense}
        local.update(timed=timed, measuring_s=time.perf_counter() - begin)
        local = self._local_measurements(trainer, local)
        self._limits = self.planned.layer_levels
        self.local_plan = self._plan(local["buckets"], local["link"], local["timing"])
        shared: dict[str, Any] = trainer.strategy.broadcast(
            {**{k: (asdict(v) if k in ("link", "timing") else v) for k, v in local.items()}, "plan": self.local_plan},
            src=0,
        )
        self.link = link = Link(**shared["link"])
        self.timing = timing = Timing(**shared["timing"])
        self.buckets = list(shared["buckets"])
        self.plan = plan = shared["plan"]
        self.calibrations += 1
        self.baseline_step = shared["measured"]
        event = plan_event(plan, self.buckets, link, timing, shared["measured"], self.model_options)
        measuring = {"timed_buckets": shared["timed"], "measuring_s": shared["measuring_s"]}
        self.history.append({"step": self._trainer_step, **event, **measuring})
        rank_zero_info(self.describe())
        if trainer.logger is not None and trainer.is_global_zero:
            finished = [b.finished for b in self._records[-1].buckets]  # the dense timeline, as measured
            candidates, options = list(self.candidates), self.model_options
            metrics = plan_metrics(plan, self.buckets, candidates, link, timing, self.baseline_step, finished, options)
            trainer.logger.log_metrics(metrics, step=trainer.global_step)
        new = self._apply_plan(plan)
        if new != self.previous_assignment and new:
            self._start("verify", self._trainer_step + 2, "a new plan is applied; its step time is measured")
        else:
            # a dense plan runs at the measured baseline; an unchanged compressed plan is measured by the drift check
            self.expected_step = None if new else self.baseline_step
            self._start("steady", self._trainer_step + 1, "the plan is dense" if not new else "the plan is unchanged")

    def _apply_plan(self, plan: Plan) -> dict[str, str]:
        """Assign ``plan``'s compressed layers (the one in force becomes the previous); return the new assignment."""
        self.previous_assignment = dict(self.assignment)
        self.assignment = {name: c for name, c in plan.layer_assignment(self.buckets).items() if c != DENSE}
        self.planned.set_assignment(self.assignment)
        return self.assignment

    def _plan(self, buckets: list[Bucket], link: Link, timing: Timing) -> Plan:
        """The timeline model's plan for ``buckets`` within the limits in force."""
        return plan_greedy(
            self._within_limits(buckets), list(self.candidates), link, timing, self.margin, **self.model_options
        )

    def _within_limits(self, buckets: list[Bucket]) -> list[Bucket]:
        """``buckets`` with only the candidates their layers' limits allow (Accordion's, through ``Planned``)."""
        return [bucket.restricted(set(self.planned.allowed(bucket.layers))) for bucket in buckets]

    def _plan_within_new_limits(self, step: int) -> None:
        """The limits changed (Accordion's regime): plan again from the stored measurements, no new calibration.

        The limits and the measurements are the same on every rank, so is the plan: nothing is broadcast.
        """
        assert self.link is not None
        assert self.timing is not None
        self._limits = self.planned.layer_levels
        self.plan = self._plan(self.buckets, self.link, self.timing)
        limited = sum(len(self.planned.allowed(b.layers)) < len(self.candidates) for b in self.buckets)
        self.history.append(
            {
                "step": step,
                "event": "plan",
                "why": f"limits changed ({limited} bucket(s) limited)",
                "predicted": self.plan.predicted,
                "assignment": list(self.plan.assignment),
                "reasons": list(self.plan.reasons),
            }
        )
        rank_zero_info(self.describe())
        new = self._apply_plan(self.plan)
        if new != self.previous_assignment and new:
            self._start("verify", step + 1, "the limits changed; the new plan's step time is measured")
        elif new != self.previous_assignment:
            self.expected_step = self.baseline_step
            self._start("steady", step, "the limits changed; the plan is dense")

    def _verify(self, trainer: pl.Trainer) -> None:
        mine = statistics.median(r.step for r in self._records)
        measured = trainer.strategy.broadcast(mine, src=0)
        assert self.baseline_step is not None
        assert self.plan is not None
        record = {
            "step": self._trainer_step,
            "event": "verify",
            "measured": measured,
            "baseline": self.baseline_step,
            "predicted": self.plan.predicted,
        }
        self.history.append(record)
        if measured > self.baseline_step * (1 + self.tolerance):
            why = (
                f"fallback: the plan measured {measured * 1e3:.1f} ms per step, the previous one"
                f" {self.baseline_step * 1e3:.1f} ms (more than {self.tolerance:.0%} slower; predicted"
                f" {self.plan.predicted * 1e3:.1f} ms)"
            )
            record["fallback"] = why
            self.assignment = dict(self.previous_assignment)
            self.planned.set_assignment(self.assignment)
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

    def _measure_codecs(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, buckets: list[Bucket], link: Link, timing: Timing
    ) -> tuple[list[Bucket], list[int]]:
        """The buckets with each candidate's cost on the real gradients of those that may pay (``measure``).

        Returns:
            The buckets with their costs, and the indices of the buckets whose candidates were timed.
        """
        params = dict(pl_module.named_parameters())
        dense = dense_costs(buckets, params)
        timed = timed_buckets(dense, link, timing, self.margin, self.measure, self.model_options)
        state = self._state(trainer)
        world_size = self._strategy(trainer).world_size
        return measure_codecs(self.candidates, state, params, dense, timed, world_size), timed

    def _local_measurements(self, trainer: pl.Trainer, measured: dict[str, Any]) -> dict[str, Any]:
        """This rank's measurements, before rank 0's are broadcast (tests override it to make ranks disagree)."""
        return measured

    # ------------------------------------------------------------------------------------------------------------
    # Reporting
    # ------------------------------------------------------------------------------------------------------------
    def describe(self) -> str:
        """The plan as a table: per bucket its size, ready time, candidate and predicted finish."""
        if self.plan is None or self.link is None or self.timing is None:
            return "gradcomp auto: no plan yet"
        return describe_plan(self.plan, self.buckets, self.link, self.timing, self.baseline_step, self.model_options)

    # ------------------------------------------------------------------------------------------------------------
    # State
    # ------------------------------------------------------------------------------------------------------------
    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            **{name: getattr(self, name) for name in _PLAIN_STATE},
            "assignment": dict(self.assignment),
            "previous_assignment": dict(self.previous_assignment),
            "link": None if self.link is None else asdict(self.link),
            "timing": None if self.timing is None else asdict(self.timing),
            "buckets": [asdict(b) for b in self.buckets],
            "plan": None if self.plan is None else asdict(self.plan),
            "history": list(self.history),
            "limits": dict(self._limits),
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for name in _PLAIN_STATE:
            setattr(self, name, state_dict[name])
        self.assignment = dict(state_dict["assignment"])
        self.previous_assignment = dict(state_dict["previous_assignment"])
        link = state_dict["link"]
        self.link = None if link is None else Link(alpha=link["alpha"], beta=link["beta"])
        self.timing = None if state_dict["timing"] is None else Timing(**state_dict["timing"])
        self.buckets = [Bucket.from_dict(b) for b in state_dict["buckets"]]
        self.plan = None if state_dict["plan"] is None else Plan.from_dict(state_dict["plan"])
        self.history = list(state_dict["history"])
        self._limits = dict(state_dict["limits"])
        if self.phase in ("calibrate", "verify"):
            self._records = []  # a window cut by the checkpoint starts again
        if self._planned is not None:
            self.planned.set_assignment(self.assignment)
