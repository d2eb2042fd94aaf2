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

from tests.distributed import child_env

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = sorted(p.name for p in (ROOT / "benchmarks").glob("*.py") if not p.name.startswith("_"))

#: run in the subprocess: each script as ``python benchmarks/NAME.py --help`` would, its exit status and a line
DRIVER = """
import contextlib, io, json, runpy, sys
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
    # benchmarks/ first, as `python benchmarks/NAME.py` puts it on sys.path
    env = child_env(PYTHONPATH=os.pathsep.join([str(ROOT / "benchmarks"), str(tmp_path)]), OMP_NUM_THREADS="1")
    result = subprocess.run(
        [sys.executable, "-c", DRIVER, *SCRIPTS], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    reports = {r["script"]: r for r in map(json.loads, result.stdout.splitlines())}
    assert sorted(reports) == SCRIPTS
    failed = {s: r for s, r in reports.items() if r["status"] != 0 or not r["usage"]}
    assert not failed, failed
    # control: the suite itself is not importable there, so a benchmark importing from tests/ would fail above
    probe = subprocess.run(
        [sys.executable, "-c", "import tests.distributed"],
        cwd=ROOT / "benchmarks",
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
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
    offenders = {
        s: sorted(m for m in _imports(ROOT / "benchmarks" / s) if m == "tests" or m.startswith("tests."))
        for s in SCRIPTS
    }
    assert not {s: m for s, m in offenders.items() if m}


def test_diloco_benchmark_reads_its_outer_optimizer_and_warmup_from_the_config_name_and_refuses_a_bad_one():
    from benchmarks.diloco import _warmup, parse_diloco_config
    from lightning_gradcomp.callbacks import DenseWarmup

    def head(config: str) -> tuple:
        return tuple(parse_diloco_config(config)[:5])

    assert head("diloco-h50") == (50, 0.7, 0.9, "none", 0)  # the paper's outer Nesterov SGD, fp32
    assert head("diloco-h20-lr1.0-m0") == (20, 1.0, 0.0, "none", 0)
    assert head("diloco-h50-lr0.5") == (50, 0.5, 0.9, "none", 0)
    assert head("diloco-h50-m0.5") == (50, 0.7, 0.5, "none", 0)
    assert head("diloco-h50-minmax8") == (50, 0.7, 0.9, "minmax8", 0)
    assert head("diloco-h50-lr0.7-m0.5-sparseloco") == (50, 0.7, 0.5, "sparseloco", 0)
    assert head("diloco-h50-w100") == (50, 0.7, 0.9, "none", 100)
    assert head("diloco-h50-w50-lr1.0-m0-minmax4") == (50, 1.0, 0.0, "minmax4", 50)
    # DiLoCo's own defaults, the round "auto", the overlap and its merge, Muon inside
    assert head("diloco-h50-defaults") == (50, None, None, "none", 0)
    assert head("diloco-auto") == ("auto", None, None, "none", 0)
    assert parse_diloco_config("diloco-h50-defaults-f5-t10-mix0.5-minmax8-muon")[5:] == (5, 10, "mix", 0.5, True)
    assert parse_diloco_config("diloco-h50-f5-t10-eager")[5:] == (5, 10, "eager", None, False)
    assert parse_diloco_config("diloco-h50-t10")[5:] == (1, 10, None, None, False)
    (warmup,) = _warmup("diloco-h50-w30-m0.5")
    assert isinstance(warmup, DenseWarmup)
    assert (warmup.unit, warmup.length) == ("steps", 30)
    assert _warmup("diloco-h50-m0.5") == []
    assert _warmup("ddp") == []
    for bad in (
        "diloco-h0",
        "diloco-hx",
        "diloco-h50-lr0",
        "diloco-h50-m1",
        "diloco-h50-m0.5-lr1",
        "diloco-h5-m",
        "diloco-h50-minmax2",
        "diloco-h50-minmax8-m0.5",
        "diloco-h50-w0",
        "diloco-h50-w",
        "diloco-h50-w1.5",
        "diloco-h50-m0.5-w50",
        "diloco-h50-w-5",
        "diloco-h50-defaults-lr1",
        "diloco-h50-eager",
        "diloco-h50-t5-mix1.0",
        "diloco-h50-muon-minmax8",
    ):
        with pytest.raises(ValueError, match=f"--configs: expected ddp.* or diloco-<h<H>.*got '{bad}'"):
            parse_diloco_config(bad)
    run = subprocess.run(
        [sys.executable, "benchmarks/diloco.py", "convergence", "--configs", "ddp", "diloco-h50-m2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2
    assert run.stderr.strip().splitlines()[-1].endswith("got 'diloco-h50-m2'")


def test_diloco_trace_summary_times_each_exchange_and_counts_the_cpu_beyond_plain_steps():
    from benchmarks.diloco_trace import summarize

    main_cpu, gloo_cpu, events = 0.0, 0.0, []
    for step in range(1, 11):  # step k ends at t = k; the main thread spends 0.2 s of CPU on a plain step
        main_cpu += 0.2 + {3: 0.3, 7: 0.1}.get(step, 0.0)  # what starting and applying the exchange cost it
        gloo_cpu += 0.05 if step == 4 else 0.0  # decoding on gloo's thread
        events.append(("step", float(step), True, {"cpu": {"100:python": main_cpu, "200:pt_gloo_runloop": gloo_cpu}}))
    events += [
        ("start>", 2.5, True, {}),
        ("compress<", 2.55, True, {}),
        ("issue all_gather", 2.6, True, {"nbytes": 1000}),
        ("start<", 2.7, True, {}),
        ("done all_gather", 3.6, False, {"nbytes": 1000}),
        ("decompress<", 3.8, False, {}),
        ("finish>", 6.5, True, {}),
        ("wait>", 6.5, True, {}),
        ("wait<", 6.6, True, {}),
        ("finish<", 6.7, True, {}),
    ]
    events.sort(key=lambda e: e[1])
    summary = summarize(events, 2, 10)
    assert summary["steps"] == 9
    assert summary["wall_s"] == pytest.approx(9.0)
    assert summary["plain_step_cpu_s"] == pytest.approx(0.2)
    assert summary["extra_cpu_s"] == pytest.approx(0.3 + 0.1 + 0.05)
    (exchange,) = summary["exchanges"]
    assert exchange["start_step"] == 3
    assert exchange["finish_step"] == 7
    assert exchange["start_s"] == pytest.approx(0.2)
    assert exchange["wire_bytes"] == 1000
    assert exchange["on_wire_s"] == pytest.approx(1.0)
    assert exchange["decoded_after_s"] == pytest.approx(0.2)
    assert exchange["decode_thread"] == "gloo"
    assert exchange["waited_s"] == pytest.approx(0.1)
    assert exchange["finish_s"] == pytest.approx(0.2)
