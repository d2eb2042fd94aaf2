"""``AutoCompression`` on two CPU processes: one plan on every rank, fallback, resume, dense on a fast link."""

import os
import time

import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_gradcomp import CompressedDDP
from lightning_gradcomp.auto.timeline import Link
from lightning_gradcomp.callbacks import AutoCompression, DenseWarmup
from lightning_gradcomp.runtime.rank_state import checkpoint_file
from tests.models import TinyNet, fit

SLOW = (1e-3, 1e5)  # 1 ms, 100 kB/s: compression pays on every bucket (the model's input, not a real link)
CANDIDATES = ["dense", "bf16", "powersgd-r1", "topk-10%"]
FAST = {"calibration_steps": 3, "skip_steps": 2, "verify_steps": 3, "candidates": CANDIDATES}


def _strategy():
    return CompressedDDP(min_compress_numel=64, bucket_cap_mb=0.01, start_method="spawn")


class Disagree(AutoCompression):
    """Rank 1 measures a fast link, so its own plan is dense; rank 0's (slow link) must still be applied."""

    def _local_measurements(self, trainer, measured):
        if trainer.global_rank == 1:
            return {**measured, "link": Link(1e-7, 1e13)}
        return measured


class Record(Callback):
    """Save, per rank, the assignment in force at every step and the callback's state, to ``dirpath/auto{rank}.pt``."""

    def __init__(self, dirpath):
        self.dirpath = dirpath
        self.steps = []

    def _auto(self, trainer):
        return next(cb for cb in trainer.callbacks if isinstance(cb, AutoCompression))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.steps.append((trainer.global_step, dict(trainer.strategy.compressor.assignment)))

    def on_train_end(self, trainer, pl_module):
        auto = self._auto(trainer)
        torch.save(
            {
                "steps": self.steps,
                "assignment": dict(auto.assignment),
                "history": auto.history,
                "calibrations": auto.calibrations,
                "local": None if auto.local_plan is None else auto.local_plan.assignment,
                "plan": None if auto.plan is None else auto.plan.assignment,
                "phase": auto.phase,
                "buckets": [(b.numel, {name: c.nbytes for name, c in b.costs.items()}) for b in auto.buckets],
            },
            os.path.join(self.dirpath, f"auto{trainer.global_rank}.pt"),
        )


class DelayCompressed(Callback):
    """The link gets slower once the plan compresses: every collective of the hook sleeps ``seconds`` first."""

    def __init__(self, seconds=0.03):
        self.seconds = seconds

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        backend = trainer.strategy.compression_state.comm.backend
        slow = bool(trainer.strategy.compressor.assignment)
        for name in ("all_reduce", "all_gather"):
            original = getattr(type(backend), name).__get__(backend)
            if slow:

                def delayed(*args, _original=original, **kwargs):
                    time.sleep(self.seconds)
                    return _original(*args, **kwargs)

                setattr(backend, name, delayed)
            elif name in backend.__dict__:
                delattr(backend, name)


def _run(tmp_path, auto, extra=(), **kwargs):
    dirpath = str(tmp_path)
    fit(_strategy(), dirpath, model=TinyNet(n=256), callbacks=[*extra, auto, Record(dirpath)], **kwargs)
    return [torch.load(os.path.join(dirpath, f"auto{r}.pt"), weights_only=False) for r in range(2)]


@pytest.mark.slow
def test_every_rank_applies_rank_zeros_plan_and_calibrates_inside_a_dense_warmup(tmp_path):
    warmup = DenseWarmup(steps=7)
    ranks = _run(tmp_path, Disagree(link=SLOW, tolerance=10.0, **FAST), extra=[warmup], max_steps=14)
    # the ranks' own plans differ: without the broadcast they would compress different buckets (a hang or garbage)
    assert any(name != "dense" for name in ranks[0]["local"])
    assert all(name == "dense" for name in ranks[1]["local"])
    assert ranks[0]["plan"] == ranks[1]["plan"] == ranks[0]["local"]
    assert ranks[0]["steps"] == ranks[1]["steps"], "the assignment in force differs between ranks at some step"
    assert any(assignment for _, assignment in ranks[0]["steps"]), "the plan never compressed anything"
    assert ranks[0]["assignment"], "kept (tolerance 10x): still compressing at the end"
    # calibrated in the warm-up (steps 2-4), verified only on compressed steps (from step 7 on)
    plan = next(e for e in ranks[0]["history"] if e["event"] == "plan")
    verify = next(e for e in ranks[0]["history"] if e["event"] == "verify")
    assert plan["step"] < 7 <= verify["step"] - FAST["verify_steps"] + 1


@pytest.mark.slow
def test_a_slower_link_after_the_switch_falls_back_with_the_reason(tmp_path):
    # the "slow link" is the model's input: on the real loopback TinyNet's codecs cost more than they save (2-3x the
    # dense step), hence the tolerance of 5x; 30 ms per collective (6+ per step) puts the step far beyond it
    ranks = _run(
        tmp_path, AutoCompression(link=SLOW, tolerance=5.0, **FAST), extra=[DelayCompressed(0.03)], max_steps=14
    )
    for rank in ranks:
        verdicts = [e for e in rank["history"] if e["event"] == "verify"]
        assert verdicts, "no verification ran"
        assert "fallback" in verdicts[0], verdicts[0]
        assert "slower" in verdicts[0]["fallback"]
        assert rank["assignment"] == {}, "the previous (dense) plan is back"
        assert any(assignment for _, assignment in rank["steps"])
    assert ranks[0]["steps"] == ranks[1]["steps"]


@pytest.mark.slow
def test_without_the_delay_the_plan_is_kept(tmp_path):
    """The control of the test above: the same run without the injected delay keeps its plan."""
    ranks = _run(tmp_path, AutoCompression(link=SLOW, tolerance=5.0, **FAST), max_steps=14)
    for rank in ranks:
        verdicts = [e for e in rank["history"] if e["event"] == "verify"]
        assert verdicts
        assert "fallback" not in verdicts[0], verdicts[0]
        assert rank["assignment"]


def _first_run_with_a_checkpoint(tmp_path):
    """12 steps compressing on 0.01 MB buckets; every rank's record and the checkpoint's directory."""
    ckpt = str(tmp_path / "ckpt")
    dirpath = str(tmp_path / "first")
    os.makedirs(dirpath, exist_ok=True)
    fit(
        _strategy(),
        dirpath,
        model=TinyNet(n=256),
        max_steps=12,
        enable_checkpointing=True,
        callbacks=[
            AutoCompression(link=SLOW, tolerance=10.0, **FAST),
            Record(dirpath),
            ModelCheckpoint(dirpath=ckpt, filename="last"),
        ],
    )
    return [torch.load(os.path.join(dirpath, f"auto{r}.pt"), weights_only=False) for r in range(2)], ckpt


@pytest.mark.slow
def test_a_resumed_run_keeps_its_plan_and_measurements(tmp_path):
    before, ckpt = _first_run_with_a_checkpoint(tmp_path)
    assert before[0]["assignment"], "the first run compresses"
    saved = torch.load(checkpoint_file(os.path.join(ckpt, "last.ckpt")), weights_only=False)
    assert any(v.get("assignment") == before[0]["assignment"] for v in saved["callbacks"].values())
    # resumed with a callback that would measure the (fast) real link if it calibrated again
    after = _run(tmp_path / "resumed", AutoCompression(**FAST), max_steps=20, ckpt_path=os.path.join(ckpt, "last.ckpt"))
    for rank in after:
        assert rank["calibrations"] == 1, "the resumed run calibrated again"
        assert all(assignment == before[0]["assignment"] for _, assignment in rank["steps"])
        assert rank["phase"] == "steady"


def test_a_fast_link_stays_dense(tmp_path):
    """Measured for real on loopback: TinyNet's 84 kB of gradients hide behind its backward pass, or cost less than
    any codec saves; the plan is all-dense, i.e. plain DDP."""
    ranks = _run(tmp_path, AutoCompression(**FAST), max_steps=8)
    for rank in ranks:
        plan = next(e for e in rank["history"] if e["event"] == "plan")
        assert set(plan["assignment"]) == {"dense"}, plan
        assert plan["link"]["beta"] > 1e7, "loopback is faster than 10 MB/s"
        assert rank["assignment"] == {}
        assert not any(assignment for _, assignment in rank["steps"])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"candidates": ["dense", "nope"]}, "candidates"),
        ({"candidates": "bf16"}, "candidates"),
        ({"margin": 1.0}, "margin"),
        ({"margin": -0.1}, "margin"),
        ({"calibration_steps": 0}, "calibration_steps"),
        ({"verify_steps": 0}, "verify_steps"),
        ({"link": (1e-3, 0)}, "beta"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, match):
    with pytest.raises(MisconfigurationException, match=match):
        AutoCompression(**kwargs)


@pytest.mark.slow
def test_periodic_replanning_calibrates_again_from_a_compressed_plan(tmp_path):
    auto = AutoCompression(link=SLOW, tolerance=10.0, replan_every=4, **FAST)
    ranks = _run(tmp_path, auto, max_steps=24)
    for rank in ranks:
        assert rank["calibrations"] >= 2, rank["history"]
        whys = [e["why"] for e in rank["history"] if e["event"] == "phase" and e["phase"] == "calibrate"]
        assert any("periodic" in why for why in whys)
        # during the second calibration the buckets were dense again, then the same plan came back
        assert rank["assignment"]
    assert ranks[0]["steps"] == ranks[1]["steps"]


class SlowSteps(Callback):
    """From step ``start`` on, every step sleeps ``seconds`` before the optimizer step (the machine got slower)."""

    def __init__(self, start, seconds):
        self.start, self.seconds = start, seconds

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.global_step >= self.start:
            time.sleep(self.seconds)


@pytest.mark.slow
def test_a_step_time_that_drifts_calibrates_again(tmp_path):
    # calibrate steps 2-4, verify 6-8, steady from 9; drift checks every 3 steps against the verified time; from step
    # 12 every step is 0.5 s longer (TinyNet's step is tens of ms): the check of steps 12-14 re-plans from step 15
    auto = AutoCompression(link=SLOW, tolerance=10.0, check_every=3, drift=2.0, **FAST)
    ranks = _run(tmp_path, auto, extra=[SlowSteps(12, 0.5)], max_steps=17)
    for rank in ranks:
        calibrations = [e for e in rank["history"] if e["event"] == "phase" and e["phase"] == "calibrate"]
        drifted = [e for e in calibrations if "drifted" in e["why"]]
        assert [e["step"] for e in drifted] == [15], rank["history"]
        assert rank["phase"] == "calibrate"
    assert ranks[0]["history"] == ranks[1]["history"]


@pytest.mark.slow
def test_a_resume_on_other_buckets_calibrates_again(tmp_path):
    """The checkpoint's plan was measured on 0.01 MB buckets; resumed with one bucket, DDP's layout differs."""
    before, ckpt = _first_run_with_a_checkpoint(tmp_path)
    buckets_before = len(next(e for e in before[0]["history"] if e["event"] == "plan")["assignment"])
    assert buckets_before > 1
    strategy = CompressedDDP(min_compress_numel=64, bucket_cap_mb=25, start_method="spawn")
    dirpath = str(tmp_path / "resumed")
    fit(
        strategy,
        dirpath,
        model=TinyNet(n=256),
        max_steps=22,
        ckpt_path=os.path.join(ckpt, "last.ckpt"),
        callbacks=[AutoCompression(link=SLOW, tolerance=10.0, **FAST), Record(dirpath)],
    )
    after = [torch.load(os.path.join(dirpath, f"auto{r}.pt"), weights_only=False) for r in range(2)]
    for rank in after:
        assert rank["calibrations"] == 2, rank["history"]
        whys = [e["why"] for e in rank["history"] if e["event"] == "phase" and e["phase"] == "calibrate"]
        assert whys[-1] == "DDP's buckets changed"
        plans = [e for e in rank["history"] if e["event"] == "plan"]
        assert len(plans[-1]["assignment"]) == 1 < buckets_before
    assert after[0]["steps"] == after[1]["steps"]


@pytest.mark.slow
def test_a_hidden_link_times_no_codec_and_the_plan_is_logged(tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    # a link that hides every bucket: no candidate is worth timing (measure="tail"), the plan is dense
    auto = AutoCompression(link=(1e-7, 1e13), **FAST)
    ranks = _run(tmp_path, auto, max_steps=8, logger=CSVLogger(str(tmp_path), name="log"), log_every_n_steps=1)
    for rank in ranks:
        plan = next(e for e in rank["history"] if e["event"] == "plan")
        assert plan["timed_buckets"] == []
        assert set(plan["assignment"]) == {"dense"}
    metrics = (tmp_path / "log" / "version_0" / "metrics.csv").read_text()
    for column in (
        "auto/predicted_step_ms",
        "auto/dense_measured_step_ms",
        "auto/bucket0/method",
        "auto/bucket0/predicted_finish_ms",
        "auto/compressed",
    ):
        assert column in metrics.splitlines()[0], column


@pytest.mark.parametrize("precision", ["32-true", "bf16-true"])
def test_a_slow_link_times_every_bucket_in_the_gradients_own_bytes(tmp_path, precision):
    """Every bucket is timed; its dense bytes are its gradients' (2 per element in 16-bit training), and the bf16 cast
    is offered for 32-bit gradients only (it would refuse 16-bit ones: the planner must never assign it those)."""
    auto = AutoCompression(link=SLOW, tolerance=10.0, **FAST)
    ranks = _run(tmp_path, auto, max_steps=6, precision=precision)
    plan = next(e for e in ranks[0]["history"] if e["event"] == "plan")
    assert plan["timed_buckets"] == list(range(len(plan["assignment"])))
    element = 2 if precision == "bf16-true" else 4
    for numel, nbytes in ranks[0]["buckets"]:
        assert nbytes["dense"] == numel * element
        assert ("bf16" in nbytes) == (element == 4)
        assert "topk-10%" in nbytes
        assert "bf16" not in plan["assignment"] or element == 4


class RecordLimits(Record):
    """Also record the limits (Accordion's levels on ``Planned``) in force at every step."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        planned = trainer.strategy.compressor
        self.steps.append((trainer.global_step, dict(planned.assignment), planned.layer_levels))


def test_accordion_limits_what_auto_may_choose(tmp_path):
    """Accordion's first epochs are critical (limit: dense); once they are not, auto plans compression within the
    new limit, from the measurements it already has (no second calibration)."""
    from lightning_gradcomp.callbacks import Accordion

    dirpath = str(tmp_path)
    auto = AutoCompression(link=SLOW, tolerance=10.0, **FAST)
    accordion = Accordion(interval=1, eta=100.0, high_compression_level="powersgd-r1")
    fit(
        _strategy(),
        dirpath,
        model=TinyNet(n=256),
        max_epochs=4,
        max_steps=-1,
        limit_train_batches=4,
        callbacks=[auto, accordion, RecordLimits(dirpath)],
    )
    ranks = [torch.load(os.path.join(dirpath, f"auto{r}.pt"), weights_only=False) for r in range(2)]
    assert ranks[0]["steps"] == ranks[1]["steps"]
    assert ranks[0]["history"] == ranks[1]["history"]
    steps = ranks[0]["steps"]
    # epochs 0 and 1 (steps 0-7): critical, every tracked layer limited to dense, and nothing compressed
    assert all(set(levels.values()) == {"dense"} and not assignment for step, assignment, levels in steps[:8])
    # from step 8 on: limited to powersgd-r1, which auto now uses; nothing lossier (topk-10%) is ever assigned
    assert all(set(levels.values()) == {"powersgd-r1"} for _, _, levels in steps[8:])
    assert any(assignment for _, assignment, _ in steps[8:])
    assert all(set(assignment.values()) <= {"bf16", "powersgd-r1"} for _, assignment, _ in steps)
    plans = [e for e in ranks[0]["history"] if e["event"] == "plan"]
    assert [e.get("why") for e in plans] == [None, "limits changed (3 bucket(s) limited)"], plans
    assert ranks[0]["calibrations"] == 1
