"""One replica group of FSDP2 shards in a fault-tolerant ``ShardedDiLoCo`` run (a Lightning job), launched by the tests.

Usage: ``python -m tests.sharded_ft_worker OUTDIR NAME [options]``. ``NAME`` is the group's id and, as an integer, its
part of the data (Lightning's sampler over every rank of every group). Without ``--lighthouse`` the same fit runs as
plain ``ShardedDiLoCo`` on ``--devices`` processes in groups of ``--group-size``: the reference, whose group ``g`` reads
what the fault-tolerant group ``g`` reads.

Fault injection (the process kills itself at an exact point): ``--kill-at STEP --kill-rank R``, SIGKILL of the group's
rank ``R`` at the end of global step ``STEP`` (its other ranks then fail in their next collective, and the job ends);
``--kill-in-exchange K``: SIGKILL of rank ``R`` as it issues its ``K``-th all-reduce across groups (a dense step's or
a sync's, after the quorum formed);
``--pause-at STEP --until-asking N``: before global step ``STEP``, wait until ``N`` groups ask the lighthouse for a
quorum, so that a restarted group is in the next sync.

``--warmup-steps N`` starts with ``DenseWarmup``; ``--save-every S`` saves ``OUTDIR/ckpt-NAME/step=S.ckpt`` every ``S``
steps, and ``--resume-at S`` resumes from the one of step ``S``.

Each rank saves ``OUTDIR/NAME-ATTEMPT-rankR.pt`` (``plain-rankR.pt`` for the reference): per optimizer step its global
step, phase, theta_global and the model (whole, gathered inside the group), torchft's step, heals and contributors.
"""

import argparse
import os
import signal
import subprocess
import sys
import time
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.tensor import DTensor

from lightning_gradcomp import ShardedDiLoCo, TorchFT
from lightning_gradcomp.callbacks import DenseWarmup
from tests.distributed import child_env, free_port
from tests.ft_worker import PAUSE_S, _asking, _kill_in_exchange
from tests.sharded_worker import PAPER_OUTER, ShardNet, theta_global, whole


class Record(pl.Callback):
    """Every optimizer step of this rank; the faults injected at exact steps."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.steps: list[dict[str, Any]] = []

    def on_fit_start(self, trainer, pl_module) -> None:
        if self.args.kill_in_exchange and trainer.global_rank == self.args.kill_rank:
            _kill_in_exchange(self.args.kill_in_exchange)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.args.pause_at is not None and trainer.global_step == self.args.pause_at:
            deadline = time.monotonic() + PAUSE_S
            while _asking(self.args.lighthouse) < self.args.until_asking and time.monotonic() < deadline:
                time.sleep(0.05)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        outer = trainer.strategy.outer_state
        members = outer.membership
        session = getattr(members, "session", None)
        self.steps.append(
            {
                "global_step": trainer.global_step,
                "phase": outer.phase,
                "global": theta_global(trainer.strategy, pl_module),
                "params": torch.cat([whole(p).flatten() for p in pl_module.parameters()]),
                "ft_step": session.step if session is not None else outer.syncs,
                "syncs": outer.syncs,
                "discarded": members.discarded,
                "heals": getattr(members, "heals", 0),
                "participants": getattr(members, "contributors", 0),
                "batch": batch[0].tolist(),
                "inner": _inner_state(trainer.optimizers[0]),
            }
        )
        if self.args.kill_at == trainer.global_step and trainer.global_rank == self.args.kill_rank:
            os.kill(os.getpid(), signal.SIGKILL)

    def on_fit_end(self, trainer, pl_module) -> None:
        name = f"{self.args.name}-{self.args.attempt}" if self.args.lighthouse else "plain"
        path = os.path.join(self.args.outdir, f"{name}-rank{trainer.global_rank}.pt")
        torch.save({"steps": self.steps}, path)


def _inner_state(optimizer: torch.optim.Optimizer) -> torch.Tensor:
    """This rank's shards of the inner optimizer's state tensors (AdamW's moments and step), flat."""
    pieces = []
    for p in (p for group in optimizer.param_groups for p in group["params"]):
        state = optimizer.state.get(p, {})
        for value in (state[key] for key in sorted(state)):
            local = value.to_local() if isinstance(value, DTensor) else value
            pieces.append(local.detach().flatten().clone().float())
    return torch.cat(pieces) if pieces else torch.zeros(0)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("outdir")
    parser.add_argument("name")
    parser.add_argument("--lighthouse")
    parser.add_argument("--attempt", type=int, default=0)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--sync-every", type=int, default=4)
    parser.add_argument("--start-replicas", type=int, default=2)
    parser.add_argument("--kill-at", type=int)
    parser.add_argument("--kill-rank", type=int, default=1)
    parser.add_argument("--kill-in-exchange", type=int, help="SIGKILL of --kill-rank in its K-th all-reduce")
    parser.add_argument("--pause-at", type=int)
    parser.add_argument("--until-asking", type=int)
    parser.add_argument("--warmup-steps", type=int, help="DenseWarmup(steps=N): HSDP steps before the rounds")
    parser.add_argument("--save-every", type=int, help="save OUTDIR/ckpt-NAME/step=S.ckpt every S global steps")
    parser.add_argument("--resume-at", type=int, help="resume from OUTDIR/ckpt-NAME/step=S.ckpt")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    fault_tolerance = None
    if args.lighthouse:
        fault_tolerance = TorchFT(
            lighthouse=args.lighthouse,
            replica_group_id=args.name,
            min_replicas=1,
            start_replicas=args.start_replicas,
            timeout=20.0,
            quorum_timeout=120.0,
            connect_timeout=10.0,
        )
    strategy = ShardedDiLoCo(
        sync_every=args.sync_every,
        outer_optimizer=PAPER_OUTER,
        replica_group=args.devices if args.lighthouse else args.group_size,
        fault_tolerance=fault_tolerance,
        process_group_backend="gloo",
    )
    callbacks: list[pl.Callback] = [Record(args)]
    if args.warmup_steps:
        callbacks.append(DenseWarmup(steps=args.warmup_steps))
    ckpt_dir = os.path.join(args.outdir, f"ckpt-{args.name}")
    if args.save_every:
        every = args.save_every
        callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, filename="{step}", every_n_train_steps=every, save_top_k=-1))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        max_steps=args.steps,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=bool(args.save_every),
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    resume = os.path.join(ckpt_dir, f"step={args.resume_at}.ckpt") if args.resume_at else None
    trainer.fit(ShardNet(), ckpt_path=resume)


def launch(outdir: Any, name: str, *options: str) -> subprocess.Popen:
    """Start one group (or, without ``--lighthouse``, the plain run) as its own job; its output to ``NAME.log``."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = child_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1", PYTHONPATH=root)
    for key in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "TORCHFT_LIGHTHOUSE", "REPLICA_GROUP_ID"):
        env.pop(key, None)
    with open(os.path.join(str(outdir), f"{name}.log"), "a") as out:
        command = [sys.executable, "-m", "tests.sharded_ft_worker", str(outdir), name, *options]
        return subprocess.Popen(command, cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT)


def load(outdir: Any, name: str) -> list[dict[str, Any]]:
    """The steps :class:`Record` saved as ``NAME`` (``G-ATTEMPT-rankR`` or ``plain-rankR``)."""
    return torch.load(os.path.join(str(outdir), f"{name}.pt"), weights_only=False)["steps"]


if __name__ == "__main__":
    main(sys.argv[1:])
