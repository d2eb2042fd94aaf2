"""The lightning-gradcomp command: the quickstart end to end (short), and the subcommands it offers."""

import os
import re
import subprocess
import sys

import pytest

from lightning_gradcomp.cli import GradcompCLI, format_quickstart_table

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    return subprocess.run(
        [sys.executable, "-m", "lightning_gradcomp", *args], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip


def test_quickstart_trains_compressed_and_dense_and_prints_the_comparison():
    result = _run("quickstart", "--trainer.max_epochs", "2", "--trainer.enable_progress_bar", "false")
    assert result.returncode == 0, result.stderr[-4000:]
    rows = re.findall(r"^\| (compressed|dense) \| (\S+) \| ([\d.]+)% \| ([+-][\d.]+) \| ([\d.]+) \| ([\d.]+)x \|$",
                      result.stdout, flags=re.M)  # fmt: skip
    assert [r[0] for r in rows] == ["compressed", "dense"], result.stdout[-3000:]
    compressed, dense = rows
    assert compressed[1] == "PowerSGD(rank=4)"
    assert dense[1] == "Identity"
    assert float(compressed[5]) > 10
    assert float(dense[5]) == 1.0
    assert float(dense[4]) > 10 * float(compressed[4])
    assert float(compressed[2]) > 80
    assert float(dense[2]) > 80
    assert "gradcomp summary" in result.stdout + result.stderr  # the end-of-fit table of each run


def test_only_fit_validate_and_test_are_offered():
    assert set(GradcompCLI.subcommands()) == {"fit", "validate", "test"}
    result = _run("predict", "--help", timeout=120)
    assert result.returncode != 0


def test_quickstart_table_reports_points_against_dense():
    rows = [
        {"run": "compressed", "compressor": "TopK(ratio=0.01)", "val_acc": 0.95, "steps": 4, "sent": 1e5, "dense": 2e6},
        {"run": "dense", "compressor": "Identity", "val_acc": 0.97, "steps": 4, "sent": 2e6, "dense": 2e6},
    ]
    table = format_quickstart_table(rows)
    assert "| compressed | TopK(ratio=0.01) | 95.00% | -2.00 | 0.100 | 20.0x |" in table
    assert "| dense | Identity | 97.00% | +0.00 | 2.000 | 1.0x |" in table


@pytest.mark.parametrize("missing", ["nonexistent.yaml"])
def test_quickstart_names_the_missing_recipe(missing, tmp_path):
    result = _run("quickstart", "--config", str(tmp_path / missing), timeout=120)
    assert result.returncode != 0


def test_advise_measures_a_few_steps_and_prints_the_prediction_and_the_recommendation(tmp_path):
    png = tmp_path / "advise.png"
    result = _run("advise", "--config", "recipes/quickstart.yaml", "--calibration-steps", "2", "--png", str(png),
                  "--candidates", "dense", "bf16", "powersgd-r1", "--trainer.enable_progress_bar", "false")  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    out = result.stdout
    assert "link (fitted on timed all-reduces): alpha" in out
    assert re.search(r"^\| powersgd-r1 \| [\d.]+ \| [\d.]+ \| [\d.]+ \| [\d.]+x \|$", out, flags=re.M), out[-3000:]
    assert "| candidate | measured | 100 Mbit/s | 1 Gbit/s | 10 Gbit/s | 100 Gbit/s |" in out
    assert re.search(r"^\| \*\*auto\*\* \|( [\d.]+ \|){5}$", out, flags=re.M)
    for label in ("measured", "100 Mbit/s", "1 Gbit/s", "10 Gbit/s", "100 Gbit/s"):
        assert f"recommendation at {label}: " in out
    assert re.search(r"^\| H=100 8-bit \|( [\d.]+ \|){5}$", out, flags=re.M), "DiLoCo's rows"
    assert "Periodic synchronization" in out
    assert png.stat().st_size > 1000
