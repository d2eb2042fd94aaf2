"""Count aborts at process exit over many two-process runs (not collected by pytest: no ``test_`` prefix).

Four patterns, each run ``--runs`` times in a fresh Python process so that every run ends with a real interpreter
teardown:

- ``hook``: the module fixture of ``tests/test_hook.py`` (raw DDP + ``compression_hook`` with every compressor,
  two gloo processes spawned by ``tests/distributed.py``);
- ``fit``: a Lightning fit with ``CompressedDDP`` (its ``CompressionMonitor`` added automatically) and a
  ``ModelCheckpoint`` every step, two CPU processes, Lightning's default launcher (rank 1 is a child script);
- ``static``: Lightning's plain ``DDPStrategy(static_graph=True, gradient_as_bucket_view=True, bucket_cap_mb=0.01)``
  with spawned workers, the control run of ``tests/test_strategy.py::test_static_graph_and_bucket_views_pass_through``
  (``tests.models.fit``, whose ``RecordRanks`` calls ``process_groups.hand_off_gil`` at the end of training). Under
  torch 2.15 it aborted at exit in 1 run of 40 before that call and in none of 40 after (docs/concepts.md, "Failures");
- ``inflight``: the mechanism, made deterministic: rank 0 issues a round-1 all-reduce through ``Comm`` (Python
  ``.then`` callbacks on a gloo future) and exits at once, rank 1 joins the collective a second later, so the
  collective completes while rank 0's interpreter shuts down. Before ``release_round_groups`` ran at exit, rank 0
  crashed every time (SIGSEGV / ``terminate called without an active exception``): the gloo worker thread that
  completes the future runs the Python callback and takes the GIL of a finalised interpreter.

A run counts as an abort when any process printed ``terminate called`` or died by a signal / exit code 134; the
command exits non-zero if any run aborted::

    PYTHONPATH=$PWD python tests/stress_exit.py hook --runs 30
    PYTHONPATH=$PWD python tests/stress_exit.py fit --runs 30
    PYTHONPATH=$PWD python tests/stress_exit.py static --runs 40
    PYTHONPATH=$PWD python tests/stress_exit.py inflight --runs 10
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ABORT_MARKERS = ("terminate called", "Fatal Python error", "Aborted", "terminated with signal")


def _hook_worker() -> None:
    from tests.distributed import run_distributed
    from tests.test_hook import _hook_vs_reference

    results = run_distributed(_hook_vs_reference)  # raises (with both ranks' stderr) if a rank died
    bad = {name: r["mismatches"] for r in results for name, r in r.items() if r["mismatches"]}
    if bad:
        raise SystemExit(f"mismatches: {bad}")


def _inflight_rank(rank: int, world_size: int) -> None:
    import time

    import torch

    from lightning_gradcomp.engine.collectives import TorchCollectives
    from lightning_gradcomp.engine.comm import Comm
    from lightning_gradcomp.engine.telemetry import Telemetry

    backend = TorchCollectives()
    backend.ensure_rounds(2)
    comm = Comm(backend, Telemetry(), torch.device("cpu"))
    if rank == 1:
        time.sleep(1.0)
    future = comm.all_reduce((torch.ones(1000), torch.ones(10)), round=1)
    if rank == 1:
        future.wait()
    # rank 0 returns at once: its interpreter shuts down while the collective and its callbacks are pending


def _inflight_worker() -> None:
    import torch.multiprocessing as mp

    from tests.distributed import free_port

    port = free_port()
    mp.spawn(_inflight_entry, args=(port,), nprocs=2)  # raises if a rank died (by a signal: SIGSEGV, SIGABRT)


def _inflight_entry(rank: int, port: int) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    _inflight_rank(rank, 2)  # no destroy_process_group: as Lightning leaves gloo groups


def _fit_worker(outdir: str) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_gradcomp import CompressedDDP
    from lightning_gradcomp.compressors import EFSignSGD
    from tests.models import TinyNet

    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=CompressedDDP(EFSignSGD(), min_compress_numel=64),  # the probe's most frequent aborter
        max_steps=8,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[ModelCheckpoint(dirpath=outdir, every_n_train_steps=1, save_top_k=-1)],
    )
    trainer.fit(TinyNet(n=64))


def _static_worker(outdir: str) -> None:
    from lightning.pytorch.strategies import DDPStrategy

    from tests.models import fit

    strategy = DDPStrategy(static_graph=True, gradient_as_bucket_view=True, bucket_cap_mb=0.01, start_method="spawn")
    fit(strategy, os.path.join(outdir, "static"))


def _allow_core_dumps() -> None:
    # a C++ abort leaves a core (kernel.core_pattern permitting) whose stack names the thread that called terminate
    resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))


def _loop(pattern: str, runs: int, cores: str | None) -> int:
    aborts, failures = 0, 0
    started = time.perf_counter()
    for run in range(runs):
        with tempfile.TemporaryDirectory() as outdir:
            command = [sys.executable, os.path.abspath(__file__), f"{pattern}-worker", outdir]
            from tests.distributed import child_env

            env = child_env(OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1")
            begin = time.perf_counter()
            env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
            proc = subprocess.run(
                command,
                cwd=outdir,
                env=env,
                capture_output=True,
                text=True,
                timeout=600,
                preexec_fn=_allow_core_dumps if cores else None,
            )
            output = proc.stdout + proc.stderr
            aborted = proc.returncode in (134, -6) or any(marker in output for marker in ABORT_MARKERS)
            failed = proc.returncode != 0 and not aborted
            aborts += aborted
            failures += failed
            verdict = "ABORT" if aborted else "FAIL" if failed else "ok"
            print(
                f"run {run + 1:3d}/{runs}: {verdict} rc={proc.returncode} {time.perf_counter() - begin:.1f}s",
                flush=True,
            )
            if cores:
                for name in os.listdir(outdir):
                    if name.startswith("core"):
                        os.makedirs(cores, exist_ok=True)
                        shutil.move(os.path.join(outdir, name), os.path.join(cores, f"{pattern}-run{run + 1}-{name}"))
            if aborted or failed:
                print("    " + output[-4000:].replace("\n", "\n    "), flush=True)
    print(
        f"{pattern}: {runs} runs, {aborts} aborted, {failures} failed otherwise"
        f" ({time.perf_counter() - started:.0f}s in all)"
    )
    return 1 if aborts or failures else 0


def main() -> None:
    """Parse the command line and run the loop (or one worker run)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    patterns = ["hook", "fit", "static", "inflight"]
    parser.add_argument("pattern", choices=patterns + [f"{p}-worker" for p in patterns])
    parser.add_argument("outdir", nargs="?", default=None)
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--cores", default=None, help="keep core dumps of aborted processes in this directory")
    args = parser.parse_args()
    if args.pattern == "hook-worker":
        _hook_worker()
    elif args.pattern == "fit-worker":
        _fit_worker(args.outdir)
    elif args.pattern == "static-worker":
        _static_worker(args.outdir)
    elif args.pattern == "inflight-worker":
        _inflight_worker()
    else:
        sys.exit(_loop(args.pattern, args.runs, args.cores))


if __name__ == "__main__":
    main()
