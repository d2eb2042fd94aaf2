"""Every benchmark runs as the docs write it, ``python benchmarks/NAME.py ...`` from the repository root.

Each one's ``--help`` runs as a script (``__main__``, ``benchmarks/`` first on ``sys.path``, the repository root as
the current directory) in a subprocess that can import the package but not the test suite: ``tests/`` is no part of
an installed package, so a benchmark shares helpers through the package or ``benchmarks/``, never ``tests/``. One
interpreter runs them all, one after the other (``runpy``), so torch and Lightning are imported once.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = sorted(p.name for p in (ROOT / "benchmarks").glob("*.py") if not p.name.startswith("_"))

#: run in the subprocess: each script as ``python benchmarks/NAME.py --help`` would, its exit status and a line
DRIVER = """
import contextlib, io, json, runpy, sys
sys.path.insert(0, "benchmarks")
for script in sys.argv[1:]:
    sys.argv = [f"benchmarks/{script}", "--help"]
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(f"benchmarks/{script}", run_name="__main__")
        status = "no exit"
    except SystemExit as done:
        status = done.code or 0
    except BaseException as err:
        status = f"{type(err).__name__}: {err}"
    print(json.dumps({"script": script, "status": status, "usage": "usage:" in out.getvalue()}), flush=True)
"""


def test_every_benchmarks_help_runs_from_the_repository_root(tmp_path):
    (tmp_path / "lightning_gradcomp").symlink_to(ROOT / "lightning_gradcomp")  # the package, and nothing else
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-c", DRIVER, *SCRIPTS], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    reports = {r["script"]: r for r in map(json.loads, result.stdout.splitlines())}
    assert sorted(reports) == SCRIPTS
    failed = {s: r for s, r in reports.items() if r["status"] != 0 or not r["usage"]}
    assert not failed, failed
    # control: the suite itself is not importable there, so a benchmark importing from tests/ would fail above
    probe = subprocess.run([sys.executable, "-c", "import tests.distributed"], cwd=ROOT / "benchmarks", env=env,
                           capture_output=True, text=True, timeout=60)  # fmt: skip
    assert probe.returncode != 0


def _imports(path: Path) -> set[str]:
    modules = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            modules.add(node.module)
    return modules


def test_no_benchmark_imports_the_test_suite_even_inside_a_function():
    # --help exits before a function's own imports run; what a run would import is read from the source
    offenders = {s: sorted(m for m in _imports(ROOT / "benchmarks" / s) if m == "tests" or m.startswith("tests."))
                 for s in SCRIPTS}  # fmt: skip
    assert not {s: m for s, m in offenders.items() if m}


def test_diloco_benchmark_reads_its_outer_optimizer_from_the_config_name_and_refuses_a_bad_one():
    from benchmarks.diloco import parse_diloco_config

    assert parse_diloco_config("diloco-h50") == (50, 0.7, 0.9)  # the paper's outer Nesterov SGD
    assert parse_diloco_config("diloco-h20-lr1.0-m0") == (20, 1.0, 0.0)
    assert parse_diloco_config("diloco-h50-lr0.5") == (50, 0.5, 0.9)
    assert parse_diloco_config("diloco-h50-m0.5") == (50, 0.7, 0.5)
    for bad in ("diloco-h0", "diloco-hx", "diloco-h50-lr0", "diloco-h50-m1", "diloco-h50-m0.5-lr1", "diloco-h5-m"):
        with pytest.raises(ValueError, match=f"--configs: expected ddp or diloco-h<H>.*got '{bad}'"):
            parse_diloco_config(bad)
    run = subprocess.run([sys.executable, "benchmarks/diloco.py", "convergence", "--configs", "ddp", "diloco-h50-m2"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert run.returncode == 2
    assert run.stderr.strip().splitlines()[-1].endswith("got 'diloco-h50-m2'")
