"""Progress where the output goes to a file: a line every so often, from the callback and from the CLI."""

import os
import subprocess
import sys

import pytest
import torch
from lightning.pytorch import Trainer

from lightning_gradcomp.callbacks import ProgressLines
from lightning_gradcomp.callbacks.progress import format_duration
from tests.distributed import child_env
from tests.models import TinyNet

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _Clock:
    """Two seconds per optimizer step: the time a test reads, not the machine's."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class _Tick(ProgressLines):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._clock.now += 2.0
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)


def test_lines_come_first_after_first_seconds_then_every_every_seconds_with_speed_and_time_left():
    lines: list[str] = []
    progress = _Tick(every=30.0, first=10.0, clock=_Clock(), out=lines.append)
    torch.manual_seed(0)
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=40,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[progress],
    )
    trainer.fit(TinyNet(n=512, batch_size=8))
    steps = [int(line.split()[2].split("/")[0]) for line in lines]
    assert steps == [5, 20, 35, 40], "10 s in (5 steps of 2 s), then every 30 s, and one at the end"
    assert lines[0].startswith("progress: step 5/40 (12%), loss ")
    assert lines[0].endswith(", 0.5 steps/s, 1m10s left")  # 35 steps at 2 s each
    assert lines[-1].endswith("0.5 steps/s, 0s left")


def test_durations_read_as_hours_minutes_or_seconds():
    assert [format_duration(s) for s in (12.4, 250, 3900, float("inf"))] == ["12s", "4m10s", "1h05m", "?"]
    with pytest.raises(ValueError, match="Expected `every` to be a finite number > 0, got 0."):
        ProgressLines(every=0)


@pytest.mark.slow
def test_fit_with_stdout_to_a_file_prints_progress_lines(tmp_path):
    env = child_env(OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    overrides = ["--trainer.devices", "1", "--trainer.max_steps", "3", "--trainer.limit_val_batches", "0"]
    command = [
        sys.executable,
        "-m",
        "lightning_gradcomp",
        "fit",
        "--config",
        os.path.join(ROOT, "recipes/quickstart.yaml"),
    ]
    with open(tmp_path / "out.log", "w") as out:
        done = subprocess.run(
            [*command, *overrides, "--trainer.default_root_dir", str(tmp_path)],
            cwd=str(tmp_path),
            env=env,
            stdout=out,
            stderr=subprocess.PIPE,
            text=True,
            timeout=300,
        )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in (tmp_path / "out.log").read_text().splitlines() if line.startswith("progress:")]
    assert lines, "no progress line in the log"
    assert lines[-1].startswith("progress: step 3/3 (100%), loss ")
    assert "steps/s, 0s left" in lines[-1]
