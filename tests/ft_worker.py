"""One replica group of a fault-tolerant DiLoCo run of TinyNet (a Lightning job), launched as a script by the tests.

Usage: ``python -m tests.ft_worker OUTDIR NAME [options]``. ``NAME`` is the replica group's id and, as an integer,
the data shard it reads (of ``--shards``). Without ``--lighthouse`` the same fit runs as plain ``DiLoCo`` on
``--devices`` processes of one job, rank r reading shard r: the reference the fault-tolerant runs are compared with.
The data of a worker is the same either way (an explicit ``DistributedSampler`` by shard, no Lightning sampler).

Fault injection (the process kills itself, so where it dies is exact, not timed):

- ``--kill-at STEP``: SIGKILL at the end of global step ``STEP`` (between syncs unless ``STEP`` is one);
- ``--kill-in-exchange K``: SIGKILL at the ``K``-th all-reduce of a pseudo-gradient or a dense step's gradient
  (1-based), after its quorum formed, as it issues it: the others' collective fails mid-exchange;
- ``--pause-at STEP --until-asking N``: wait (at most ``PAUSE_S``) before global step ``STEP`` until ``N`` groups ask
  the lighthouse for a quorum (its status page), so that a group that (re)started late is in the next sync (the
  lighthouse forms a quorum of the last one's groups at once, without waiting for a newcomer that has not asked);
- ``--lightning-sampler``: a plain ``shuffle=True`` loader and Lightning's own sampler instead of the shards;
- ``--touch FILE``: create ``FILE`` once the fit started (``--touch-at STEP``: at the end of global step ``STEP``);
  ``--wait-for FILE``: before the fit, wait until ``FILE`` exists (the group is unknown to the lighthouse until then).

Each finished fit saves ``OUTDIR/NAME-ATTEMPT.pt``: per optimizer step its global step, phase, theta_global, local
parameters, torchft's step and the round's counters, and the output's ``gradcomp/*`` metrics.
"""

import argparse
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader, DistributedSampler

from lightning_gradcomp import DiLoCo, TorchFT
from lightning_gradcomp.callbacks import DenseWarmup
from lightning_gradcomp.compressors import PowerSGD, RandomK
from tests.distributed import child_env, free_port
from tests.models import TinyNet, synthetic_classification

PAUSE_S = 240.0  # a restarted group is up long before that, even on a loaded machine
WAIT_S = 420  # one fit on a loaded 2-core machine takes well under a minute


class ShardNet(TinyNet):
    """TinyNet that reads shard ``shard`` of ``shards`` (what Lightning's sampler gives rank ``shard`` of a job)."""

    def __init__(
        self, shard: int | None, shards: int, lightning_sampler: bool = False, mask: str | None = None
    ) -> None:
        super().__init__(n=256, batch_size=8)
        self.shard, self.shards, self.lightning_sampler = shard, shards, lightning_sampler
        if mask is not None:  # a constant causal mask buffer mixing the logits: float 0/-inf, or its bool twin
            causal = torch.triu(torch.ones(10, 10, dtype=torch.bool), diagonal=1)
            value = causal if mask == "bool" else torch.zeros(10, 10).masked_fill(causal, float("-inf"))
            self.register_buffer("mask", value, persistent=False)
        self.masked = mask is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.net(x)
        if not self.masked:
            return logits
        if self.mask.dtype == torch.bool:
            scores = torch.zeros(10, 10).masked_fill(self.mask, float("-inf"))
        else:
            scores = torch.zeros(10, 10) + self.mask
        return logits + 0.1 * logits @ scores.softmax(-1).T

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.9)  # a heal must carry it over
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def train_dataloader(self) -> DataLoader:
        if self.lightning_sampler:  # a plain shuffled loader: Lightning's sampler splits it (over the groups too)
            return DataLoader(synthetic_classification(self.n), batch_size=self.batch_size, shuffle=True)
        # a group of several processes reads one shard per rank, as the same ranks of a plain job would
        shard = self.trainer.global_rank + (self.shard * self.trainer.world_size if self.shard is not None else 0)
        data = synthetic_classification(self.n)
        sampler = DistributedSampler(data, num_replicas=self.shards, rank=shard, shuffle=True, seed=0)
        return DataLoader(data, batch_size=self.batch_size, sampler=sampler)


class Record(Callback):
    """What each step of this group did; faults injected at exact points."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.steps: list[dict[str, Any]] = []

    def on_fit_start(self, trainer, pl_module) -> None:
        if self.args.touch and self.args.touch_at is None and trainer.global_rank == 0:
            open(self.args.touch, "w").close()
        if self.args.kill_in_exchange:
            _kill_in_exchange(self.args.kill_in_exchange)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.args.pause_at is not None and trainer.global_step == self.args.pause_at:
            deadline = time.monotonic() + PAUSE_S
            while not self._may_go_on() and time.monotonic() < deadline:
                time.sleep(0.05)

    def _may_go_on(self) -> bool:
        """Whether a pause at ``--pause-at`` is over: enough groups ask the lighthouse for a quorum."""
        return _asking(self.args.lighthouse) >= self.args.until_asking

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        outer = trainer.strategy.outer_state
        members = outer.membership  # plain DiLoCo's is static: no session, never a discard, heal or quorum
        session = getattr(members, "session", None)
        self.steps.append(
            {
                "global_step": trainer.global_step,
                "epoch": trainer.current_epoch,
                "phase": outer.phase,
                "global": torch.cat([p.detach().flatten().clone() for p in outer.params]),
                "params": torch.cat([p.detach().flatten().clone() for p in pl_module.parameters()]),
                "ft_step": session.step if session is not None else outer.syncs,
                "syncs": outer.syncs,
                "discarded": members.discarded,
                "heals": getattr(members, "heals", 0),
                "participants": getattr(members, "contributors", 0),
                "lr": trainer.optimizers[0].param_groups[0]["lr"],
                "loss": float(outputs["loss"]) if isinstance(outputs, dict) and "loss" in outputs else None,
                "skipped": outer.skipped,
                "batch": batch[0].flatten(1)[:, 0].tolist(),  # a fingerprint of each sample the step read
            }
        )
        if self.args.touch and self.args.touch_at == trainer.global_step and trainer.global_rank == 0:
            open(self.args.touch, "w").close()
        if self.args.kill_at is not None and trainer.global_step == self.args.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    def on_fit_end(self, trainer, pl_module) -> None:
        logged = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("gradcomp/")}
        name = f"{self.args.name}-{self.args.attempt}" if self.args.lighthouse else "plain"
        if trainer.world_size > 1 or not self.args.lighthouse:  # one file per rank of a job of several
            name += f"-rank{trainer.global_rank}"
        torch.save({"steps": self.steps, "logged": logged}, os.path.join(self.args.outdir, f"{name}.pt"))


def _asking(lighthouse: str) -> int:
    """How many live groups ask the lighthouse for the next quorum now (its status page's ``[A/B participants
    healthy]``); 0 if the page cannot be read."""
    try:
        with urllib.request.urlopen(f"{lighthouse}/status", timeout=5) as page:
            found = re.search(r"\[(\d+)/\d+ participants healthy\]", page.read().decode())
    except OSError:
        return 0
    return int(found.group(1)) if found else 0


def _kill_in_exchange(k: int) -> None:
    """SIGKILL this process when it issues the all-reduce of its ``k``-th outer exchange (after the quorum)."""
    from lightning_gradcomp.ft.collectives import TorchFTCollectives

    real = TorchFTCollectives.all_reduce
    seen = {"n": 0}

    def all_reduce(self, tensor, round, op):
        if tensor.numel() > 64:  # the pseudo-gradient, not the buffers' or the members' check
            seen["n"] += 1
            if seen["n"] == k:
                os.kill(os.getpid(), signal.SIGKILL)
        return real(self, tensor, round, op)

    TorchFTCollectives.all_reduce = all_reduce


def strategy(args: argparse.Namespace) -> DiLoCo:
    kwargs: dict[str, Any] = {"sync_every": args.sync_every, "fragments": args.fragments}
    kwargs["overlap_steps"] = args.overlap
    if args.merge:
        kwargs["merge"] = args.merge
    if args.replica_group and not args.lighthouse:
        kwargs["replica_group"] = args.replica_group
    if args.compressor == "randomk":
        kwargs["compressor"] = RandomK(ratio=0.25)
    elif args.compressor == "powersgd":  # two dependent rounds: a process group each
        kwargs["compressor"] = PowerSGD(rank=2)
    if args.lighthouse:
        kwargs["fault_tolerance"] = TorchFT(
            lighthouse=args.lighthouse,
            replica_group_id=args.name,
            min_replicas=args.min_replicas,
            start_replicas=args.start_replicas,
            timeout=args.timeout,
            quorum_timeout=args.quorum_timeout,
            connect_timeout=args.connect_timeout,
        )
    return DiLoCo(process_group_backend="gloo", **kwargs)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("outdir")
    parser.add_argument("name")
    parser.add_argument("--lighthouse")
    parser.add_argument("--attempt", type=int, default=0)
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--sync-every", type=int, default=4)
    parser.add_argument("--fragments", type=int, default=1)
    parser.add_argument("--overlap", type=int, default=0)
    parser.add_argument("--merge", choices=("mix", "eager"), help="DiLoCo(merge=...) with --overlap")
    parser.add_argument("--compressor")
    parser.add_argument("--replica-group", type=int, help="plain DiLoCo's two levels (ranks per replica)")
    parser.add_argument("--min-replicas", type=int, default=1)
    parser.add_argument("--start-replicas", type=int)
    parser.add_argument("--timeout", type=float, default=20.0)
    parser.add_argument("--quorum-timeout", type=float, default=120.0)
    parser.add_argument("--connect-timeout", type=float, default=10.0)
    parser.add_argument("--kill-at", type=int)
    parser.add_argument("--kill-in-exchange", type=int)
    parser.add_argument("--pause-at", type=int)
    parser.add_argument("--until-asking", type=int)
    parser.add_argument("--touch")
    parser.add_argument("--touch-at", type=int)
    parser.add_argument("--wait-for")
    parser.add_argument("--save-at", type=int, help="save OUTDIR/ckpt-NAME/last.ckpt at this global step")
    parser.add_argument("--resume", action="store_true", help="resume from OUTDIR/ckpt-NAME/last.ckpt")
    parser.add_argument("--warmup-steps", type=int, help="DenseWarmup(steps=N): dense steps before the rounds")
    parser.add_argument("--lightning-sampler", action="store_true", help="a plain shuffled loader, Lightning's sampler")
    parser.add_argument("--mask", choices=("float", "bool"), help="a constant causal mask buffer of that dtype")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    # before the fit: a group whose manager heartbeats without asking would hold the others' first quorum, a valid
    # one, for the lighthouse's join timeout
    deadline = time.monotonic() + PAUSE_S
    while args.wait_for and not os.path.exists(args.wait_for) and time.monotonic() < deadline:
        time.sleep(0.05)
    shard = int(args.name) if args.lighthouse else None
    ckpt_dir = os.path.join(args.outdir, f"ckpt-{args.name}")
    saving = []
    if args.save_at:
        saving.append(ModelCheckpoint(dirpath=ckpt_dir, filename="last", every_n_train_steps=args.save_at))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy(args),
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=bool(saving),
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=args.lightning_sampler,
        callbacks=[Record(args), *saving, *([DenseWarmup(steps=args.warmup_steps)] if args.warmup_steps else [])],
    )
    trainer.fit(
        ShardNet(shard, args.shards, args.lightning_sampler, args.mask),
        ckpt_path=os.path.join(ckpt_dir, "last.ckpt") if args.resume else None,
    )


def launch(outdir: Any, name: str, *options: str, log: str | None = None) -> subprocess.Popen:
    """Start one replica group (or, without ``--lighthouse``, the plain run) as its own job; output to ``log``."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = child_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1")
    for key in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "TORCHFT_LIGHTHOUSE", "REPLICA_GROUP_ID"):
        env.pop(key, None)
    path = os.path.join(str(outdir), log or f"{name}.log")
    with open(path, "a") as out:
        command = [sys.executable, "-m", "tests.ft_worker", str(outdir), name, *options]
        return subprocess.Popen(command, cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT)


def wait_for(proc: subprocess.Popen, outdir: Any, name: str, timeout: float = WAIT_S) -> int:
    """``proc``'s return code; a test failure with the end of ``NAME.log`` if it runs past ``timeout``."""
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail(f"{name} did not finish within {timeout} s:\n{log_of(outdir, name)[-4000:]}")


def log_of(outdir: Any, name: str) -> str:
    """What a process launched as ``name`` printed (``NAME.log``)."""
    with open(os.path.join(str(outdir), f"{name}.log")) as f:
        return f.read()


def load(outdir: Any, name: str) -> dict[str, Any]:
    """What :class:`Record` saved for ``name`` (``NAME-ATTEMPT`` or ``plain-rankR``)."""
    return torch.load(os.path.join(str(outdir), f"{name}.pt"), weights_only=False)


if __name__ == "__main__":
    main(sys.argv[1:])
