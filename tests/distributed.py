"""Run a function on several processes (gloo, or NCCL on a GPU); collect what each returns (torchmetrics' pattern)."""

import faulthandler
import os
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_gradcomp.demo.ports import free_port

#: what the caller's environment may set that changes what a child process prints or joins: the tests read their
#: children's warnings and logs, and name the lighthouse and replica group themselves: every child starts without them
_CALLER_ONLY = ("PYTHONWARNINGS", "TORCHFT_LIGHTHOUSE", "REPLICA_GROUP_ID")


def child_env(**extra: str) -> dict[str, str]:
    """The environment for a child process of a test: this one's, without what would change its output, plus ``extra``.

    ``PYTHONWARNINGS=ignore`` in the caller's environment would hide the warnings the tests read from a child's output;
    a caller's ``TORCHFT_LIGHTHOUSE`` would give a child a lighthouse the test did not start.
    """
    env = {k: v for k, v in os.environ.items() if k not in _CALLER_ONLY}
    env.update(extra)
    return env


def _entry(
    rank: int, world_size: int, port: int, fn: Callable, args: tuple, outdir: str, backend: str = "gloo"
) -> None:
    # keep what a crashing rank prints (C++ aborts included) and the Python stack at a fatal signal, for the report
    err = open(os.path.join(outdir, f"rank{rank}.err"), "w")  # noqa: SIM115 (open for the life of the process)
    os.dup2(err.fileno(), 2)
    faulthandler.enable(err, all_threads=True)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group(backend, rank=rank, world_size=world_size)
    try:
        result = fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()
    torch.save(result, os.path.join(outdir, f"rank{rank}.pt"))


def run_distributed(fn: Callable, *args: Any, world_size: int = 2, backend: str = "gloo") -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned processes (``backend``: their process group's
    backend, gloo unless given); return each rank's result."""
    with tempfile.TemporaryDirectory() as outdir:
        try:
            mp.spawn(_entry, args=(world_size, free_port(), fn, args, outdir, backend), nprocs=world_size)
        except mp.ProcessExitedException as error:
            raise RuntimeError(f"{error}\n{_stderr_tails(outdir, world_size)}") from error
        return [torch.load(os.path.join(outdir, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]


def _stderr_tails(outdir: str, world_size: int, chars: int = 6000) -> str:
    tails = []
    for rank in range(world_size):
        path = os.path.join(outdir, f"rank{rank}.err")
        text = "(nothing)"
        if os.path.exists(path):
            with open(path, errors="replace") as f:
                text = f.read()
        tails.append(f"--- rank {rank} stderr (tail) ---\n{text[-chars:]}")
    return "\n".join(tails)
