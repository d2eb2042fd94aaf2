"""Two fault-tolerant DiLoCo groups on one machine: their step time with and without a thread setting (a benchmark).

The launch of docs/fault_tolerance.md's "One machine": a lighthouse on loopback, then two replica groups of one
process each (``TorchFT(min_replicas=1, start_replicas=2)``, ``REPLICA_GROUP_ID`` 0 and 1), started together. Each
group trains a small GPT on the language task (vocab 256, 64 positions, 2 blocks of width 128, batch 16; AdamW) with
Lightning's own sampler, ``sync_every=10``, for ``--steps`` steps. A step's time is the wall time between the ends of
two consecutive optimizer steps; a run's figure is the median over both groups' steps after ``--skip`` (the first
steps and the first quorum). Launches, interleaved over ``--repeats`` rounds:

- ``unset``: no ``OMP_NUM_THREADS`` in the groups' environment and no ``torch.set_num_threads`` (the package chooses);
- ``omp1``: ``OMP_NUM_THREADS=1`` in each group's environment (what torchrun sets);
- ``lightning``: ``OMP_NUM_THREADS`` set to the cores (what Lightning's launcher chose for a one-process job, the
  behaviour before the package chose: every group runs as many threads as there are cores).

Example::

    python benchmarks/ft_threads.py --out benchmarks/results/ft_threads
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = {"block_size": 64, "n_layer": 2, "n_head": 4, "n_embd": 128}
MODES = ("unset", "omp1", "lightning")


def group(args: argparse.Namespace) -> None:
    """One replica group: fit, appending each optimizer step's end time to ``OUTDIR/steps-NAME.jsonl``."""
    import lightning.pytorch as pl
    import torch

    from lightning_gradcomp import DiLoCo, TorchFT
    from lightning_gradcomp.tasks import GPTLanguageModel, TextDataModule

    class Times(pl.Callback):
        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            line = {"step": trainer.global_step, "t": time.perf_counter(), "threads": torch.get_num_threads()}
            with open(os.path.join(args.outdir, f"steps-{args.name}.jsonl"), "a") as f:
                f.write(json.dumps(line) + "\n")

    pl.seed_everything(0, verbose=False)
    strategy = DiLoCo(sync_every=10, fault_tolerance=TorchFT(min_replicas=1, start_replicas=2))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=[Times()],
    )
    model = GPTLanguageModel(**MODEL, lr=1e-3, warmup_steps=10)
    trainer.fit(model, datamodule=TextDataModule(seq_len=MODEL["block_size"], batch_size=16))


def _run(mode: str, args: argparse.Namespace, outdir: str) -> dict[str, Any]:
    from elastic import _free_port, _lighthouse, _stop  # the fault-tolerance benchmark's (run as a script: its folder)

    os.makedirs(outdir, exist_ok=True)
    port = _free_port()
    lighthouse = _lighthouse(outdir, port, 5000)
    procs = [lighthouse]
    try:
        for name in ("0", "1"):
            env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "PYTHONWARNINGS")}
            env.update(TORCHFT_LIGHTHOUSE=f"http://127.0.0.1:{port}", REPLICA_GROUP_ID=name, PYTHONPATH=ROOT)
            env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
            if mode == "omp1":
                env["OMP_NUM_THREADS"] = "1"
            elif mode == "lightning":
                env["OMP_NUM_THREADS"] = str(len(os.sched_getaffinity(0)))
            command = [sys.executable, os.path.abspath(__file__), "group", outdir, name, "--steps", str(args.steps)]
            with open(os.path.join(outdir, f"group{name}.log"), "w") as log:
                procs.append(subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
        codes = [p.wait(timeout=args.timeout) for p in procs[1:]]
    finally:
        _stop(procs)
    steps = []
    threads = set()
    for name in ("0", "1"):
        with open(os.path.join(outdir, f"steps-{name}.jsonl")) as f:
            lines = [json.loads(line) for line in f]
        times = [b["t"] - a["t"] for a, b in zip(lines, lines[1:]) if b["step"] > args.skip]
        steps.extend(times)
        threads.update(line["threads"] for line in lines)
    return {"mode": mode, "exit_codes": codes, "median_step_s": statistics.median(steps), "threads": sorted(threads)}


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command")
    one = sub.add_parser("group", help="one replica group (internal)")
    one.add_argument("outdir")
    one.add_argument("name")
    one.add_argument("--steps", type=int, default=60)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--skip", type=int, default=15, help="steps left out of the median (start, first quorum)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--out", default="benchmarks/results/ft_threads")
    args = parser.parse_args(argv)
    if args.command == "group":
        group(args)
        return
    runs = []
    for repeat in range(args.repeats):
        for mode in args.modes.split(","):
            run = _run(mode, args, os.path.abspath(f"{args.out}.d/{mode}-{repeat}"))
            print(json.dumps(run), flush=True)
            runs.append({"repeat": repeat, **run})
    load = os.getloadavg()
    result = {"command": "python " + " ".join(["benchmarks/ft_threads.py", *argv]), "load": load, "runs": runs}
    with open(args.out + ".json", "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
