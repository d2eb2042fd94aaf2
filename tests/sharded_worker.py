"""Fits of a small FSDP2-ready module under ``ShardedDiLoCo`` and its references, several in one launch.

Run under Lightning's default launcher (the script runs again for every further rank)::

    python -m tests.sharded_worker DIRPATH DEVICES RUN ...

Each ``RUN`` names an entry of :data:`RUNS` (``NAME`` or ``NAME+EARLIER``: resumed from the checkpoint that the run
``EARLIER`` of the same launch saved); every rank saves its record to ``DIRPATH/RUN/rank{r}.pt``:
the batches it read, theta_global (whole, gathered inside the group) and the model after every optimizer step.
"""

import faulthandler
import glob
import math
import os
import subprocess
import sys
from collections.abc import Callable
from functools import partial
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy, Strategy
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader, TensorDataset

from lightning_gradcomp import DiLoCo, ShardedDiLoCo
from lightning_gradcomp.callbacks import DenseWarmup
from lightning_gradcomp.compressors import MinMax
from tests.distributed import child_env, free_port

#: the paper's outer optimizer (Nesterov SGD, lr 0.7, momentum 0.9)
PAPER_OUTER = partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)
OUTER_SGD_1 = partial(torch.optim.SGD, lr=1.0)
SAMPLES, BATCH = 64, 4  # 4 ranks: 4 steps per epoch


class ShardNet(pl.LightningModule):
    """An MLP written for ``ModelParallelStrategy`` (each ``Linear`` and the whole sharded in ``configure_model``).

    The last layer has 5 rows: split unevenly over 2 shards (3 and 2). ``mesh="hsdp"`` shards over a 2-D HSDP mesh
    of its own instead (the trap ``ShardedDiLoCo`` refuses); ``mesh="tp"`` applies tensor parallelism over
    ``self.device_mesh["tensor_parallel"]`` first (column-wise, row-wise, then column-wise with whole outputs), and
    ``mesh="tp-only"`` that alone.
    """

    def __init__(
        self,
        inner: str = "adamw",
        mesh: str = "group",
        nan_step: int | None = None,
        width: int = 16,
        mask: str | None = None,
    ) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(
            nn.Linear(8, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 5)
        )
        self.inner, self.mesh_kind, self.nan_step = inner, mesh, nan_step
        self.masked = mask is not None  # a constant causal mask mixing the outputs: float 0/-inf, or its bool twin
        causal = torch.triu(torch.ones(5, 5, dtype=torch.bool), diagonal=1)
        self.register_buffer("mask", causal if mask == "bool" else torch.zeros(5, 5).masked_fill(causal, -math.inf))
        self.batches: list[list[int]] = []
        self.validated: list[Tensor] = []  # the model validation saw (whole), at every validation step

    def configure_model(self) -> None:
        if not isinstance(self.trainer.strategy, ModelParallelStrategy):
            return
        mesh = self.device_mesh["data_parallel"]
        if self.mesh_kind == "hsdp":
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        if self.mesh_kind in ("tp", "tp-only"):
            plan = {"0": ColwiseParallel(), "2": RowwiseParallel(), "4": ColwiseParallel(output_layouts=Replicate())}
            parallelize_module(self.net, self.device_mesh["tensor_parallel"], plan)
        if self.mesh_kind == "tp-only":
            return
        for layer in self.net:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        index, x, y = batch
        self.batches.append(index.tolist())
        out = self.net(x)
        if self.masked:
            scores = torch.zeros(5, 5).masked_fill(self.mask, -math.inf) if self.mask.dtype == torch.bool else self.mask
            out = out + 0.1 * out @ (torch.zeros(5, 5) + scores).softmax(-1).T
        return nn.functional.mse_loss(out, y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.validated.append(torch.cat([whole(p).flatten() for p in self.parameters()]))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.inner == "sgd":
            return torch.optim.SGD(self.parameters(), lr=0.1)
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.01)

    def on_after_backward(self) -> None:
        """At step ``nan_step``, after FSDP2's reduce-scatter: rank 1's gradient shards (its shard only) not finite.

        Not the gradients of parameters replicated over tensor parallelism: theirs are the same on every rank of the
        block (computed from the same activations), and so would a non-finite one be.
        """
        if self.nan_step is not None and self.global_rank == 1 and self.global_step + 1 == self.nan_step:
            for p in self.parameters():
                if self.mesh_kind.startswith("tp") and p.placements[-1].is_replicate():  # over tensor_parallel
                    continue
                grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                grad.fill_(float("nan"))

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(1)
        x = torch.randn(SAMPLES, 8, generator=g)
        y = torch.randn(SAMPLES, 5, generator=g)
        return DataLoader(TensorDataset(torch.arange(SAMPLES), x, y), batch_size=BATCH)

    def val_dataloader(self) -> DataLoader:  # one batch per rank of 4
        return DataLoader(TensorDataset(torch.arange(16), torch.zeros(16, 8), torch.zeros(16, 5)), batch_size=BATCH)


def whole(p: Tensor) -> Tensor:
    return p.full_tensor().detach().clone() if isinstance(p, DTensor) else p.detach().clone()


def theta_global(strategy: Strategy, module: pl.LightningModule) -> Tensor | None:
    """theta_global, whole (gathered inside the group for ``ShardedDiLoCo``: a collective on every rank)."""
    round = getattr(strategy, "outer_state", None)
    if round is None or not round.params:
        return None
    params = [p for p in module.parameters() if p.requires_grad]
    pieces = []
    for p, mine in zip(params, round.params):
        if isinstance(p, DTensor):
            mine = DTensor.from_local(mine.clone(), p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
        pieces.append(whole(mine).flatten())
    return torch.cat(pieces)


class Record(pl.Callback):
    """Every optimizer step: the model and theta_global, whole; the round's phase."""

    def __init__(self) -> None:
        self.steps: list[dict[str, Any]] = []
        self.start: dict[str, Any] = {}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        params = torch.cat([whole(p).flatten() for p in pl_module.parameters()])
        round = getattr(trainer.strategy, "outer_state", None)
        phase = None if round is None else round.phase
        self.start = {"params": params, "global": theta_global(trainer.strategy, pl_module), "phase": phase}
        self.start["step"] = trainer.global_step

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        params = torch.cat([whole(p).flatten() for p in pl_module.parameters()])
        round = getattr(trainer.strategy, "outer_state", None)
        self.steps.append(
            {
                "params": params,
                "global": theta_global(trainer.strategy, pl_module),
                "phase": None if round is None else round.phase,
            }
        )


def _sharded(**kwargs: Any) -> Callable[[], Strategy]:
    return lambda: ShardedDiLoCo(replica_group=2, **kwargs)


#: name -> (strategy factory, module kwargs, trainer kwargs)
RUNS: dict[str, tuple[Callable[[], Strategy], dict[str, Any], dict[str, Any]]] = {
    "sharded-h2": (_sharded(sync_every=2, outer_optimizer=PAPER_OUTER), {}, {}),
    "diloco-h2-g2": (lambda: DiLoCo(sync_every=2, outer_optimizer=PAPER_OUTER, replica_group=2), {}, {}),
    # Streaming DiLoCo with eager updates: 2 fragments, each exchange overlapped with one inner step
    "sharded-h4-eager": (
        _sharded(sync_every=4, fragments=2, overlap_steps=1, merge="eager", outer_optimizer=PAPER_OUTER),
        {},
        {},
    ),
    "diloco-h4-eager-g2": (
        lambda: DiLoCo(
            sync_every=4, fragments=2, overlap_steps=1, merge="eager", outer_optimizer=PAPER_OUTER, replica_group=2
        ),
        {},
        {},
    ),
    "sharded-h1-sgd": (_sharded(sync_every=1, outer_optimizer=OUTER_SGD_1), {"inner": "sgd"}, {}),
    "model-parallel-sgd": (
        lambda: ModelParallelStrategy(data_parallel_size=4, tensor_parallel_size=1),
        {"inner": "sgd"},
        {},
    ),
    "sharded-hsdp": (_sharded(sync_every=2), {"mesh": "hsdp"}, {}),
    # DenseWarmup: 3 HSDP steps, then rounds of 2; the same under two-level DiLoCo
    "sharded-h2-w3": (_sharded(sync_every=2, outer_optimizer=PAPER_OUTER), {}, {"warmup": 3}),
    "diloco-h2-g2-w3": (lambda: DiLoCo(sync_every=2, outer_optimizer=PAPER_OUTER, replica_group=2), {}, {"warmup": 3}),
    # offload: theta_global's shards and the outer momentum on the CPU; validation in the middle of a round
    "sharded-h2-offload": (_sharded(sync_every=2, outer_optimizer=PAPER_OUTER, offload=True), {}, {}),
    "sharded-h2-val3": (_sharded(sync_every=2, outer_optimizer=PAPER_OUTER), {}, {"val_every": 3}),
    # rank 1's shards (only) not finite at the sync of step 4: every rank of every group skips that outer step
    "sharded-h2-nan4": (_sharded(sync_every=2, outer_optimizer=PAPER_OUTER), {"nan_step": 4}, {}),
    "sharded-h2-mask": (_sharded(sync_every=2, outer_optimizer=PAPER_OUTER), {"mask": "float"}, {}),
    "sharded-h2-boolmask": (_sharded(sync_every=2, outer_optimizer=PAPER_OUTER), {"mask": "bool"}, {}),
    # checkpoints after every epoch of 4 steps: one step into a round of 3; with an exchange in flight (Streaming
    # DiLoCo's overlap, a compressor's residuals); the first resumed on 2 x 1
    "sharded-h3": (_sharded(sync_every=3, outer_optimizer=PAPER_OUTER), {}, {"save": True}),
    "sharded-h3-2x1": (_sharded(sync_every=3, outer_optimizer=PAPER_OUTER), {}, {"save": True, "group_size": 1}),
    "sharded-h3-1x1": (_sharded(sync_every=3, outer_optimizer=PAPER_OUTER), {}, {"save": True, "group_size": 1}),
    "sharded-h4-streaming": (
        lambda: ShardedDiLoCo(
            replica_group=2,
            sync_every=4,
            fragments=2,
            overlap_steps=1,
            outer_optimizer=PAPER_OUTER,
            compressor=MinMax(bits=8),
        ),
        {"width": 64},  # the middle layer's shards of 2,048 elements are compressed (1,024 and more)
        {"save": True},
    ),
    # tensor parallelism inside the groups: 2 x (S=1, T=2) and 1 x (S=2, T=2) on 4 processes, as DiLoCo on 2
    "sharded-tp-h2": (_sharded(sync_every=2, outer_optimizer=PAPER_OUTER, tensor_parallel_size=2), {"mesh": "tp"}, {}),
    "diloco-h2-g1": (lambda: DiLoCo(sync_every=2, outer_optimizer=PAPER_OUTER, replica_group=1), {}, {}),
    "sharded-tp-only-h2": (
        _sharded(sync_every=2, outer_optimizer=PAPER_OUTER, tensor_parallel_size=2),
        {"mesh": "tp-only"},
        {},
    ),
    "sharded-tp-1x2x2": (
        _sharded(sync_every=2, outer_optimizer=PAPER_OUTER, tensor_parallel_size=2),
        {"mesh": "tp"},
        {"group_size": 4},
    ),
    # the module applies FSDP2 only: each parameter on a mesh of one rank of its group of 2 (refused)
    "sharded-tp-fsdp-only": (_sharded(sync_every=2, tensor_parallel_size=2), {}, {}),
    "sharded-tp-h2-nan4": (
        _sharded(sync_every=2, outer_optimizer=PAPER_OUTER, tensor_parallel_size=2),
        {"mesh": "tp", "nan_step": 4},
        {},
    ),
    "sharded-tp-h3": (
        _sharded(sync_every=3, outer_optimizer=PAPER_OUTER, tensor_parallel_size=2),
        {"mesh": "tp"},
        {"save": True},
    ),
    "sharded-tp-h3-2x1": (_sharded(sync_every=3, outer_optimizer=PAPER_OUTER), {}, {"save": True, "group_size": 1}),
}


def train(run: str, root: str, devices: int) -> None:
    name, _, earlier = run.partition("+")
    factory, module_kwargs, options = RUNS[name]
    folder = os.path.join(root, run)
    module = ShardNet(**module_kwargs)
    record = Record()
    callbacks: list[pl.Callback] = [record]
    if "warmup" in options:
        callbacks.append(DenseWarmup(steps=options["warmup"]))
    if options.get("save"):
        callbacks.append(ModelCheckpoint(dirpath=folder, save_top_k=-1, every_n_epochs=1))
    group_size = int(options.get("group_size", 2))
    strategy = factory()
    if isinstance(strategy, ShardedDiLoCo):
        strategy.replica_group = group_size
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_epochs=2,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=bool(options.get("save")),
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=1.0 if "val_every" in options else 0,
        val_check_interval=options.get("val_every"),
        check_val_every_n_epoch=None if "val_every" in options else 1,
    )
    ckpt = None
    if earlier:
        (ckpt,) = glob.glob(os.path.join(root, earlier, "epoch=0-step=*.ckpt"))
    result: dict[str, Any] = {}
    try:
        trainer.fit(module, ckpt_path=ckpt)
    except Exception as error:  # a refusal, recorded for the test (every rank raises it in setup)
        result["error"] = f"{type(error).__name__}: {error}"
    final = torch.cat([whole(p).flatten() for p in module.parameters()])
    round = getattr(strategy, "outer_state", None)
    result["outer_numel"] = None if round is None else sum(p.numel() for p in round.params)
    result["skipped"] = None if round is None else round.skipped
    result["placements"] = [str(p.placements) for p in module.parameters() if isinstance(p, DTensor)]
    result.update(
        validated=module.validated,
        start=record.start,
        steps=record.steps,
        batches=module.batches,
        rank=trainer.global_rank,
        final=final,
    )
    os.makedirs(folder, exist_ok=True)
    torch.save(result, os.path.join(folder, f"rank{trainer.global_rank}.pt"))


def run_launch(dirpath: Any, devices: int, runs: list[str]) -> tuple[int, str, dict]:
    """Launch this script: its return code, its output and, per run, every rank's record."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = child_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1", PYTHONPATH=root)
    for key in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE"):
        env.pop(key, None)
    command = [sys.executable, "-m", "tests.sharded_worker", str(dirpath), str(devices), *runs]
    done = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    output = done.stdout + done.stderr
    if done.returncode:
        return done.returncode, output, {}
    records = {}
    for run in runs:
        folder = os.path.join(dirpath, run)
        records[run] = [torch.load(os.path.join(folder, f"rank{r}.pt"), weights_only=False) for r in range(devices)]
    return 0, output, records


if __name__ == "__main__":
    root, devices, *runs = sys.argv[1:]
    torch.set_num_threads(1)
    faulthandler.dump_traceback_later(float(os.environ.get("SHARDED_WORKER_STACKS_AFTER", "240")), exit=True)
    for run in runs:
        train(run, root, int(devices))
