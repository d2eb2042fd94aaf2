"""A two-process fit in which one rank fails at one step (launched as a script by tests/test_faults.py).

Usage: ``python -m tests.fault_worker OUTDIR FAULT RANK STEP TIMEOUT_S [CKPT_PATH]`` with ``FAULT`` one of ``raise``,
``exit`` (``os._exit(3)``: the process vanishes without Python's clean-up), ``kill`` (SIGKILL to itself), ``hang``
(sleeps far longer than the timeout) or ``none``. Lightning's default launcher is used, as a user's script gets it:
rank 0 is this process, rank 1 a child that runs this same command. Every rank writes its pid to ``OUTDIR/pid{rank}``
so the test can check that no process is left running; ``ModelCheckpoint`` saves ``OUTDIR/ckpt/last.ckpt`` every
step. ``TIMEOUT_S`` is the strategy's timeout (the rendezvous's and the collectives'); the environment variable
``FAULT_COLLECTIVE_TIMEOUT_S``, if set, shortens the collectives' once every rank has joined. The strategy is
``CompressedDDP(TopK)`` unless the environment variable ``FAULT_STRATEGY`` names one of
:data:`DILOCO`: ``diloco`` (rounds of 5 steps: a failure at step 3 is in an inner step, and the other rank notices
at its next sync), ``diloco-overlap`` (rounds of 3, each exchange in flight during the next step: a failure at step 3
happens while an exchange is in flight).
"""

import os
import signal
import sys
import time
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_gradcomp import CompressedDDP, DiLoCo
from lightning_gradcomp.compressors import TopK
from tests.models import TinyNet

MAX_STEPS = 6
DILOCO = {"diloco": {"sync_every": 5}, "diloco-overlap": {"sync_every": 3, "overlap_steps": 1}}


class FailingNet(TinyNet):
    """TinyNet whose rank ``rank`` fails in ``training_step`` at global step ``step`` (the way ``fault`` says)."""

    def __init__(self, outdir: str, fault: str, rank: int, step: int) -> None:
        super().__init__(n=96, batch_size=8)
        self.outdir, self.fault, self.fail_rank, self.fail_step = outdir, fault, rank, step

    def setup(self, stage: str) -> None:
        # after the rendezvous (the child rank had the strategy's whole timeout to start), before training's first
        # collective; the round groups CompressedDDP makes next take this group's timeout
        collective_timeout_s = os.environ.get("FAULT_COLLECTIVE_TIMEOUT_S")
        if collective_timeout_s:
            torch.distributed.set_timeout(timedelta(seconds=float(collective_timeout_s)))

    def on_fit_start(self) -> None:
        with open(os.path.join(self.outdir, f"pid{self.global_rank}"), "w") as f:
            f.write(str(os.getpid()))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.global_rank == self.fail_rank and self.global_step == self.fail_step:
            with open(os.path.join(self.outdir, "failed_at"), "w") as f:
                f.write(repr(time.time()))
            if self.fault == "raise":
                raise ValueError(f"injected failure at step {self.global_step}")
            if self.fault == "exit":
                os._exit(3)
            if self.fault == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if self.fault == "hang":
                time.sleep(3600)
        return super().training_step(batch, batch_idx)


def main(outdir: str, fault: str, rank: int, step: int, timeout_s: float, ckpt_path: str | None) -> None:
    """Fit ``FailingNet`` for ``MAX_STEPS`` steps on two CPU processes, checkpointing every step."""
    torch.set_num_threads(1)
    timeout = timedelta(seconds=timeout_s)
    diloco = DILOCO.get(os.environ.get("FAULT_STRATEGY", ""))
    strategy = (
        DiLoCo(**diloco, timeout=timeout)
        if diloco is not None
        else CompressedDDP(TopK(ratio=0.1), min_compress_numel=64, timeout=timeout)
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=MAX_STEPS,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[ModelCheckpoint(dirpath=os.path.join(outdir, "ckpt"), every_n_train_steps=1, save_last=True)],
    )
    trainer.fit(FailingNet(outdir, fault, rank, step), ckpt_path=ckpt_path)
    if trainer.global_rank == 0:
        with open(os.path.join(outdir, "finished"), "w") as f:
            f.write(str(trainer.global_step))


if __name__ == "__main__":
    main(
        sys.argv[1],
        sys.argv[2],
        int(sys.argv[3]),
        int(sys.argv[4]),
        float(sys.argv[5]),
        sys.argv[6] if len(sys.argv) > 6 else None,
    )
