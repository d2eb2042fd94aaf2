"""How long each recipe takes on this machine: a few minutes of ``lightning-gradcomp fit``, extrapolated (a benchmark).

Each recipe runs as a user would run it (``lightning-gradcomp fit --config recipes/NAME.yaml``, stdout to a file,
validation off so that the figure is the training steps' own) until the second progress line
(:class:`~lightning_gradcomp.callbacks.ProgressLines`, which the CLI adds when stdout is not a terminal: the first 10 s
into training, the second a minute later), then it is stopped. That line's step count, speed and time left are the
package's own extrapolation over the recipe's whole length (``trainer.estimated_stepping_batches``); validation and
checkpoints come on top.

Example::

    python benchmarks/recipe_times.py --recipes quickstart lm_diloco --out benchmarks/results/recipe_times
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def measure(recipe: str, lines: int, timeout: float) -> dict:
    """Run ``recipe`` until its ``lines``-th progress line (or ``timeout`` seconds); that line and the wall time."""
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "out.log")
        command = [sys.executable, "-m", "lightning_gradcomp", "fit", "--config", os.path.join(ROOT, "recipes", recipe)]
        command += ["--trainer.limit_val_batches", "0", "--trainer.num_sanity_val_steps", "0"]
        command += ["--trainer.default_root_dir", tmp]
        env = {**os.environ, "PYTHONPATH": ROOT, "PYTHONUNBUFFERED": "1"}
        start = time.monotonic()
        with open(log, "w") as out:
            proc = subprocess.Popen(
                command, cwd=tmp, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        found: list[str] = []
        while time.monotonic() - start < timeout and proc.poll() is None:
            with open(log) as f:
                found = [line.strip() for line in f if line.startswith("progress:")]
            if len(found) >= lines:
                break
            time.sleep(1.0)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)  # the recipe's own process group: its launcher and its ranks
            proc.wait()
        with open(log) as f:
            text = f.read()
        found = [line.strip() for line in text.splitlines() if line.startswith("progress:")]
        tail = text[-2000:] if not found else ""
    return {"recipe": recipe, "progress": found, "wall_s": round(time.monotonic() - start, 1), "tail": tail}


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipes", nargs="+", required=True, help="recipe names (quickstart, lm_diloco, ...)")
    parser.add_argument("--lines", type=int, default=2, help="stop at this progress line")
    parser.add_argument("--timeout", type=float, default=240)
    parser.add_argument("--out", default="benchmarks/results/recipe_times")
    args = parser.parse_args(argv)
    results = []
    for name in args.recipes:
        result = measure(name if name.endswith(".yaml") else f"{name}.yaml", args.lines, args.timeout)
        print(json.dumps(result), flush=True)
        results.append(result)
    with open(args.out + ".json", "w") as f:
        json.dump(
            {
                "command": "python " + " ".join(["benchmarks/recipe_times.py", *argv]),
                "load": os.getloadavg(),
                "cores": os.cpu_count(),
                "results": results,
            },
            f,
            indent=1,
        )


if __name__ == "__main__":
    main(sys.argv[1:])
