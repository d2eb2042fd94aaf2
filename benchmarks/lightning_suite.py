"""Lightning's own tests with ``CompressedDDP`` standing in for ``DDPStrategy``, against Lightning's ``DDPStrategy``.

A developer's step, not CI's: it needs Lightning's test suite at the tag of the installed Lightning, and an hour or
more of two CPU cores per configuration. Get the tests, and the one plugin they need that this package's dev
dependencies lack::

    git clone --depth 1 --branch 2.6.6 https://github.com/Lightning-AI/pytorch-lightning /tmp/pl
    pip install pytest-rerunfailures

with the installed Lightning's version as the branch (where it has no tag, the closest earlier one: a record names the
installed version, not the tag). Then run the suite once per configuration, each recorded in a JSON file (test id ->
outcome), and compare::

    python benchmarks/lightning_suite.py run /tmp/pl --swap ddp --out ddp.json
    python benchmarks/lightning_suite.py run /tmp/pl --swap identity --out identity.json
    python benchmarks/lightning_suite.py run /tmp/pl --swap powersgd --out powersgd.json
    python benchmarks/lightning_suite.py compare ddp.json identity.json powersgd.json

``--swap`` picks what stands in for ``DDPStrategy`` (``ddp``: nothing, Lightning's own; ``identity``:
``CompressedDDP(Identity())``; ``powersgd``: ``CompressedDDP(PowerSGD(rank=2))``; see
``benchmarks/_lightning_swap.py``).
The folders run by default are those of Lightning's suite that exercise DDP (``--folders``). Lightning's
standalone tests (``@RunIf(standalone=True)``: real multi-process launches under the ``popen`` launcher, which starts
pytest again for every further rank) run one per pytest process with ``PL_RUN_STANDALONE_TESTS=1``, as Lightning's
CI runs them. ``--only`` restricts a run to the test ids of a file (one a line), such as the ``touched`` list the
baseline run records: the tests that built a ``DDPStrategy``, the only ones the swap can change.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import lightning

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
FOLDERS = [
    "tests/tests_pytorch/strategies",
    "tests/tests_pytorch/checkpointing",
    "tests/tests_pytorch/trainer",
    "tests/tests_pytorch/callbacks",
    "tests/tests_pytorch/tuner",
    "tests/tests_pytorch/loggers",
]
#: per test, as Lightning's CI allows
TIMEOUT_S = 600


def _env(swap: str, scratch: Path, standalone: bool) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        GRADCOMP_SWAP=swap,
        GRADCOMP_TOUCHED=str(scratch / "touched.txt"),
        GRADCOMP_OUTCOMES=str(scratch / "outcomes.txt"),
        OMP_NUM_THREADS="1",
        PL_RUN_STANDALONE_TESTS="1" if standalone else "0",
    )
    env.pop("GRADCOMP_SUITE_PID", None)  # each pytest process the runner starts records its own tests
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(HERE), str(ROOT), env.get("PYTHONPATH", "")] if p)
    return env


def _pytest(
    tests: Path, targets: list[str], env: dict[str, str], timeout_s: float, *extra: str, full: bool = False
) -> str:
    """Run pytest on ``targets`` in ``tests`` with the stand-in plugin; the tail of its output (``full``: all of it)."""
    command = [sys.executable, "-m", "pytest", *targets, "-p", "_lightning_swap", "-p", "no:cacheprovider", *extra]
    try:
        done = subprocess.run(command, cwd=tests, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"(pytest ran past {timeout_s:.0f} s and was stopped)"
    if full:
        return done.stdout + done.stderr
    return done.stdout[-3000:] + done.stderr[-3000:]


def _read(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def run(args: argparse.Namespace) -> None:
    # pytest runs in the checkout's root, the folder of its pyproject.toml (its rootdir: test ids start with tests/)
    tests = Path(args.checkout).resolve()
    only = set(Path(args.only).read_text().split()) if args.only else None
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as folder:
        scratch = Path(folder)
        # Lightning's conftest keeps only the standalone tests when PL_RUN_STANDALONE_TESTS=1
        listing = _pytest(tests, args.folders, _env(args.swap, scratch, True), 600, "--collect-only", "-q", full=True)
        standalone = [line for line in listing.splitlines() if "::" in line and not line.startswith(" ")]
        if only is not None:
            standalone = [t for t in standalone if t in only]
        targets = sorted(only - set(standalone)) if only is not None else args.folders
        if targets:
            print(f"+ pytest on {len(targets)} targets", flush=True)
            extra = ["-q", f"--timeout={TIMEOUT_S}"]
            tail = _pytest(tests, targets, _env(args.swap, scratch, False), 24 * 3600.0, *extra)
            print(tail.strip().splitlines()[-1] if tail.strip() else "(no output)", flush=True)
        for i, test_id in enumerate(standalone):
            before = len(_read(scratch / "outcomes.txt"))
            tail = _pytest(tests, [test_id], _env(args.swap, scratch, True), TIMEOUT_S + 60.0, "-q")
            new = _read(scratch / "outcomes.txt")[before:]
            if not new:  # the process died or hung before pytest reported
                with open(scratch / "outcomes.txt", "a") as f:
                    f.write(f"{test_id}\terror\n")
            print(f"+ standalone {i + 1}/{len(standalone)}: {new or tail[-300:]}", flush=True)
        outcomes = dict(line.split("\t") for line in _read(scratch / "outcomes.txt"))
        touched = sorted(set(_read(scratch / "touched.txt")))
    record = {
        "lightning": lightning.__version__,
        "swap": args.swap,
        "folders": args.folders,
        "seconds": round(time.monotonic() - started),
        "standalone": standalone,
        "touched": touched,
        "tests": dict(sorted(outcomes.items())),
    }
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    counts: dict[str, int] = {}
    for outcome in outcomes.values():
        counts[outcome] = counts.get(outcome, 0) + 1
    print(f"{args.swap}: {counts}, {len(touched)} tests built a DDPStrategy, {record['seconds']} s -> {args.out}")


def compare(args: argparse.Namespace) -> None:
    baseline, *others = (json.loads(Path(p).read_text()) for p in args.records)
    passed = {t for t, o in baseline["tests"].items() if o == "passed"}
    print(f"{baseline['swap']} (Lightning {baseline['lightning']}): {len(baseline['tests'])} tests, {len(passed)} pass")
    for other in others:
        ran = other["tests"]
        lost = sorted(t for t in passed if t in ran and ran[t] != "passed")
        gained = sorted(t for t, o in ran.items() if o == "passed" and t not in passed)
        print(
            f"{other['swap']}: {sum(t in passed for t in ran)} of the baseline's passing tests ran,"
            f" {len(lost)} of them do not pass; {len(gained)} pass that do not pass in the baseline"
        )
        for test in lost:
            print(f"  not passing: {test} ({ran[test]})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    runner = sub.add_parser("run", help="run Lightning's tests with one stand-in")
    runner.add_argument("checkout", help="a checkout of Lightning at the installed tag (its root folder)")
    runner.add_argument("--swap", choices=["ddp", "identity", "powersgd"], default="ddp")
    runner.add_argument("--out", required=True, help="the JSON record to write")
    runner.add_argument("--folders", nargs="+", default=FOLDERS, help="folders of the checkout to run")
    runner.add_argument("--only", help="a file of test ids (one a line): run only these")
    comparer = sub.add_parser("compare", help="tests that pass in the first record and not in the others")
    comparer.add_argument("records", nargs="+", help="JSON records of `run`, the baseline first")
    args = parser.parse_args()
    {"run": run, "compare": compare}[args.command](args)


if __name__ == "__main__":
    main()
