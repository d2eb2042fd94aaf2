"""A small real LightningModule and helpers for two-process Trainer tests (importable by spawned workers)."""

import os
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_gradcomp.engine.collectives import hand_off_gil


def synthetic_classification(n: int = 128, seed: int = 0) -> TensorDataset:
    """8x8 one-channel images labelled by a fixed random teacher network: learnable, offline, deterministic."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 1, 8, 8, generator=g)
    teacher = torch.randn(64, 10, generator=g)
    y = (x.flatten(1) @ teacher).argmax(1)
    return TensorDataset(x, y)


class TinyNet(pl.LightningModule):
    """Two convolutions with batch norm and two linear layers (~21k parameters)."""

    def __init__(self, lr: float = 0.05, n: int = 128, batch_size: int = 8) -> None:
        super().__init__()
        self.lr, self.n, self.batch_size = lr, n, batch_size
        torch.manual_seed(0)
        self.net = nn.Sequential(
            nn.Conv2d(1, 16, 3),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.Conv2d(16, 32, 3),
            nn.ReLU(),
            nn.Flatten(),
            nn.Linear(32 * 4 * 4, 32),
            nn.ReLU(),
            nn.Linear(32, 10),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss, on_step=True, on_epoch=False)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(synthetic_classification(self.n), batch_size=self.batch_size, shuffle=False)


class SparseEmbeddingNet(TinyNet):
    """TinyNet plus ``nn.Embedding(16, 10, sparse=True)`` looked up by a 4-bit code of each image (sparse gradients).

    Plain SGD: torch's momentum would turn the embedding's sparse gradient into a dense buffer.
    """

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(16, 10, sparse=True)

    @staticmethod
    def codes(x: torch.Tensor) -> torch.Tensor:
        """The signs of each image's first four pixels as a number in [0, 16): the embedding's rows."""
        return ((x.flatten(1)[:, :4] > 0).long() << torch.arange(4)).sum(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x) + self.embedding(self.codes(x))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.touched_rows.append(self.codes(batch[0]).unique().numel())  # the rows of this step's sparse gradient
        return super().training_step(batch, batch_idx)

    def on_train_start(self) -> None:
        self.touched_rows: list[int] = []

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class RecordRanks(Callback):
    """Save what every rank ends with (its parameters, telemetry per step, DDP facts) to ``dirpath/rank{r}.pt``."""

    def __init__(self, dirpath: str) -> None:
        self.dirpath = dirpath
        self.steps: list[dict] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        strategy = trainer.strategy
        telemetry = getattr(getattr(strategy, "compression_state", None), "telemetry", None)
        last = telemetry.last if telemetry is not None else None
        self.steps.append(
            {
                "global_step": trainer.global_step,
                "params": torch.cat([p.detach().flatten() for p in pl_module.parameters()]),
                "loss": float(outputs["loss"]),
                "stats": last,
                "reductions": telemetry.total_steps if telemetry is not None else None,
                "residuals": sum(
                    t.abs().sum().item() for t in strategy.compression_state.residuals.state_dict().values()
                )
                if telemetry is not None
                else 0.0,
            }
        )

    def on_train_end(self, trainer, pl_module) -> None:
        ddp = trainer.strategy.model
        logging_data = ddp._get_ddp_logging_data()
        state = getattr(trainer.strategy, "compression_state", None)
        torch.save(
            {
                "params": torch.cat([p.detach().flatten() for p in pl_module.parameters()]),
                "state_dict": {k: v.detach().clone() for k, v in pl_module.state_dict().items()},
                "steps": self.steps,
                "comm_hook": logging_data.get("comm_hook"),
                "static_graph": bool(ddp.static_graph),
                "gradient_as_bucket_view": bool(ddp.gradient_as_bucket_view),
                "world_size": trainer.world_size,
                "total_steps": state.telemetry.total_steps if state is not None else None,
                "touched_rows": getattr(pl_module, "touched_rows", None),
                # what the callbacks logged (the monitor's last step and totals: it ends training before this one)
                "callback_metrics": {k: v.detach().clone() for k, v in trainer.callback_metrics.items()},
                "checkpoints_written": list(getattr(trainer.strategy.checkpoint_io, "written", [])),
            },
            os.path.join(self.dirpath, f"rank{trainer.global_rank}.pt"),
        )
        # after the run's last collective: plain DDPStrategy control runs have no CompressedDDP.teardown to do this
        hand_off_gil()


def fit(strategy: Any, dirpath: str, model: pl.LightningModule | None = None, callbacks=(), **trainer_kwargs) -> tuple:
    """Fit ``TinyNet`` on two CPU processes; return the main-process model, the trainer and every rank's record."""
    model = model or TinyNet()
    os.makedirs(dirpath, exist_ok=True)
    kwargs = {
        "accelerator": "cpu",
        "devices": 2,
        "max_steps": 6,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    }
    kwargs.update(trainer_kwargs)
    ckpt_path = kwargs.pop("ckpt_path", None)
    from lightning_gradcomp import CompressedDDP
    from lightning_gradcomp.callbacks import CompressionMonitor

    # the monitor finishes each step's telemetry before the recorder reads it
    monitor = [CompressionMonitor()] if isinstance(strategy, CompressedDDP) else []
    trainer = pl.Trainer(strategy=strategy, callbacks=[*callbacks, *monitor, RecordRanks(dirpath)], **kwargs)
    trainer.fit(model, ckpt_path=ckpt_path)
    world = trainer.world_size
    records = [torch.load(os.path.join(dirpath, f"rank{r}.pt"), weights_only=False) for r in range(world)]
    return model, trainer, records


def collectives_so_far(*groups: Any) -> int:
    """How many collectives the default process group and ``groups`` have run (each group's own sequence number: C++
    callers count too)."""
    default = torch.distributed.distributed_c10d._get_default_group()
    others = [g for g in groups if g is not None and g is not default]
    return sum(g._get_sequence_number_for_group() for g in [default, *others])


class CountAllReduces:
    """``torch.distributed`` as a module sees it, with the bytes of the tensors handed to ``all_reduce`` counted."""

    def __init__(self, real: Any) -> None:
        self._real, self.nbytes = real, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def all_reduce(self, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        self.nbytes += tensor.numel() * tensor.element_size()
        return self._real.all_reduce(tensor, *args, **kwargs)


class RecordRounds(Callback):
    """Save what every rank of a ``DiLoCo`` run did at each step and ends with to ``dirpath/rank{r}.pt``.

    Per step: the collectives it ran, the bytes of the tensors the outer loop handed to ``all_reduce``, the
    ``gradcomp/*`` metrics logged, the phase in the round, the rank's parameters and theta_global. Per validation
    batch: the parameters evaluated and theta_global. At the end of ``fit`` (after DiLoCo's last outer step), the
    parameters, the state dict, the outer loop's counters and the ``gradcomp/*`` callback metrics.
    """

    def __init__(self, dirpath: str) -> None:
        self.dirpath = dirpath
        self.steps: list[dict] = []
        self.validated: list[dict] = []
        self._counter: CountAllReduces | None = None

    @staticmethod
    def _logged(trainer) -> dict[str, float]:
        return {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("gradcomp/")}

    def on_train_start(self, trainer, pl_module) -> None:
        import lightning_gradcomp.engine.collectives as outer_module

        self._counter = CountAllReduces(outer_module.dist)
        outer_module.dist = self._counter
        self._world_at_end = collectives_so_far()

    @staticmethod
    def _flat(tensors) -> torch.Tensor:
        return torch.cat([t.detach().flatten().clone() for t in tensors])

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._group = trainer.strategy.outer_state.process_group  # DiLoCo's own group for the outer exchange
        self._before = collectives_so_far(self._group)
        self._world_before = collectives_so_far()
        self._reduced_before = self._counter.nbytes if self._counter else 0
        if self.steps:  # the metrics a step logs reach callback_metrics after its batch-end hooks
            self.steps[-1]["logged"] = self._logged(trainer)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        outer = trainer.strategy.outer_state
        self.steps.append(
            {
                "global_step": trainer.global_step,
                "collectives": collectives_so_far(self._group) - self._before,
                "world_collectives": collectives_so_far() - self._world_before,  # the default group's alone
                # the default group's since the last step ended: also Lightning's loop, before the batch starts
                "world_collectives_since_last_step": collectives_so_far() - self._world_at_end,
                "all_reduced": (self._counter.nbytes if self._counter else 0) - self._reduced_before,
                "loss": float(outputs["loss"]) if isinstance(outputs, dict) and "loss" in outputs else None,
                "phase": outer.phase,
                "params": self._flat(pl_module.parameters()),
                "global": self._flat(outer.params),
            }
        )
        self._world_at_end = collectives_so_far()

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        if trainer.state.fn == "fit":
            flat = self._flat(pl_module.parameters())
            self.validated.append({"params": flat, "global": self._flat(trainer.strategy.outer_state.params)})

    def on_fit_end(self, trainer, pl_module) -> None:
        import lightning_gradcomp.engine.collectives as outer_module

        if self._counter is not None:
            outer_module.dist = self._counter._real
        if self.steps:
            self.steps[-1]["logged"] = self._logged(trainer)
        outer = trainer.strategy.outer_state
        torch.save(
            {
                "params": self._flat(pl_module.parameters()),
                "state_dict": {k: v.detach().clone() for k, v in pl_module.state_dict().items()},
                "steps": self.steps,
                "validated": self.validated,
                "world_size": trainer.world_size,
                "syncs": outer.syncs,
                "skipped": outer.skipped,
                "bytes_sent": outer.bytes_sent,
                "logged": self._logged(trainer),
                "bytes_received": outer.bytes_received,
                "exchange": outer.exchange.state_dict() if outer.exchange.compressor is not None else None,
                "outer_state": outer.optimizer.state_dict(),
                "checkpoints_written": list(getattr(trainer.strategy.checkpoint_io, "written", [])),
            },
            os.path.join(self.dirpath, f"rank{trainer.global_rank}.pt"),
        )
        hand_off_gil()
