"""scikit-learn's bundled digits (1797 8x8 images, 10 classes), a small MLP and a small convnet: real, offline data.

Shared by the Accordion, TracIn and PacTrain benchmarks in ``benchmarks/`` and by their tests (importable by spawned
workers).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_gradcomp.tasks.data import flip_labels


def digits(n: int | None = None, flip_fraction: float = 0.0, seed: int = 0) -> tuple[TensorDataset, list[int]]:
    """The digits as ``(x, y)`` with ``x`` of 64 features in [0, 1]; ``flip_fraction`` of the labels are changed.

    The first ``n`` examples of a fixed shuffle (all when ``None``). A flipped label is replaced by a different class
    drawn uniformly. Returns the dataset and the sorted indices of the flipped examples.
    """
    from sklearn.datasets import load_digits

    data = load_digits()
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(data.target), generator=g)
    if n is not None:
        order = order[:n]
    x = torch.tensor(data.data, dtype=torch.float32)[order] / 16.0
    y = torch.tensor(data.target, dtype=torch.long)[order]
    flipped: list[int] = []
    if flip_fraction > 0:
        y, changed = flip_labels(y, flip_fraction, g)
        flipped = changed.tolist()
    return TensorDataset(x, y), flipped


class DigitsMLP(pl.LightningModule):
    """A three-layer MLP on the digits, SGD with momentum and an optional step learning-rate decay.

    Args:
        dataset: the training set (``digits(...)[0]``).
        hidden: widths of the hidden layers.
        lr: the initial learning rate.
        milestones: epochs at which the learning rate is multiplied by ``gamma`` (``MultiStepLR``).
        gamma: the decay factor.
        batch_size: per-process batch size.
        shuffle: shuffle the training data (every epoch, with a fixed seed).
    """

    def __init__(
        self,
        dataset: TensorDataset,
        hidden: Sequence[int] = (128, 64),
        lr: float = 0.05,
        milestones: Sequence[int] = (),
        gamma: float = 0.1,
        batch_size: int = 32,
        shuffle: bool = True,
        weight_decay: float = 0.0,
    ) -> None:
        super().__init__()
        self.dataset = dataset
        self.lr, self.milestones, self.gamma = lr, list(milestones), gamma
        self.batch_size, self.shuffle, self.weight_decay = batch_size, shuffle, weight_decay
        torch.manual_seed(0)
        widths = [64, *hidden]
        layers: list[nn.Module] = []
        for a, b in zip(widths[:-1], widths[1:]):
            layers += [nn.Linear(a, b), nn.ReLU()]
        self.net = nn.Sequential(*layers, nn.Linear(widths[-1], 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits."""
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        """Cross-entropy on one batch."""
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss, on_step=True, on_epoch=False)
        return loss

    def configure_optimizers(self) -> Any:
        """SGD with momentum (and the learning-rate schedule)."""
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9, weight_decay=self.weight_decay)
        if not self.milestones:
            return optimizer
        scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, self.milestones, self.gamma)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "epoch"}}

    def train_dataloader(self) -> DataLoader:
        """The training set."""
        g = torch.Generator().manual_seed(0)
        return DataLoader(self.dataset, batch_size=self.batch_size, shuffle=self.shuffle, generator=g)


def accuracy(model: nn.Module, dataset: TensorDataset) -> float:
    """Fraction of ``dataset`` the model classifies correctly."""
    x, y = dataset.tensors
    with torch.no_grad():
        return (model.eval()(x).argmax(1) == y).float().mean().item()


class RecordRun(pl.Callback):
    """Save what every rank saw to ``dirpath/rank{r}.pt``: bytes per step, epochs, callback states, final weights.

    Put it after a :class:`~lightning_gradcomp.callbacks.CompressionMonitor` in the callback list (the monitor
    closes each step's telemetry before this reads it).
    """

    def __init__(self, dirpath: str) -> None:
        self.dirpath = dirpath
        self.steps: list[dict[str, Any]] = []
        self.weights: list[dict[str, torch.Tensor]] = []

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Record the step's telemetry and weights."""
        state = getattr(trainer.strategy, "compression_state", None)
        stats = state.telemetry.last if state is not None else None
        self.steps.append(
            {
                "global_step": trainer.global_step,
                "epoch": trainer.current_epoch,
                "bytes_sent": stats.bytes_sent if stats is not None else None,
                "bytes_guard": stats.bytes_guard if stats is not None else None,
                "bytes_dense": stats.bytes_dense if stats is not None else None,
                "compression_enabled": state.enabled if state is not None else None,
            }
        )
        self.weights.append({k: v.detach().clone() for k, v in pl_module.state_dict().items()})

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Save this rank's record."""
        import os

        from lightning_gradcomp.callbacks import TracIn

        callbacks: list[pl.Callback] = getattr(trainer, "callbacks", [])  # set at init, undeclared on Trainer
        states = {type(cb).__name__: cb.state_dict() for cb in callbacks if cb is not self}
        extra = {}
        for cb in callbacks:
            if isinstance(cb, TracIn):
                extra["tracin_scores"] = cb.scores
                extra["tracin_losses"] = cb.final_losses
        state = getattr(trainer.strategy, "compression_state", None)
        torch.save(
            {
                "steps": self.steps,
                "weights": self.weights,
                "final": {k: v.detach().clone() for k, v in pl_module.state_dict().items()},
                "callbacks": states,
                "total_bytes_sent": state.telemetry.total_bytes_sent if state is not None else None,
                "total_bytes_dense": state.telemetry.total_bytes_dense if state is not None else None,
                **extra,
            },
            os.path.join(self.dirpath, f"rank{trainer.global_rank}.pt"),
        )


def fit(
    model: pl.LightningModule, strategy: Any, dirpath: str, callbacks: Sequence[pl.Callback] = (), **trainer_kwargs: Any
) -> tuple[pl.Trainer, list[dict[str, Any]]]:
    """Fit on two CPU processes (spawned); return the trainer and every rank's :class:`RecordRun` record."""
    import os

    from lightning_gradcomp import CompressedDDP
    from lightning_gradcomp.callbacks import CompressionMonitor

    os.makedirs(dirpath, exist_ok=True)
    kwargs: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 2,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    }
    kwargs.update(trainer_kwargs)
    ckpt_path = kwargs.pop("ckpt_path", None)
    monitor = [CompressionMonitor(prog_bar=False)] if isinstance(strategy, CompressedDDP) else []
    trainer = pl.Trainer(strategy=strategy, callbacks=[*callbacks, *monitor, RecordRun(dirpath)], **kwargs)
    trainer.fit(model, ckpt_path=ckpt_path)
    records = [torch.load(os.path.join(dirpath, f"rank{r}.pt"), weights_only=False) for r in range(trainer.world_size)]
    return trainer, records


# ----------------------------------------------------------------------------------------------------------------
# A convnet on a fixed train/test split (the PacTrain and Pufferfish accuracy runs)
# ----------------------------------------------------------------------------------------------------------------
BATCH_SIZE = 32  # per rank


def digits_split(train: bool) -> TensorDataset:
    """The fixed split of scikit-learn's digits: 1,437 training or 360 test images, scaled to [0, 1]."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, random_state=0, stratify=y)
    x, y = (x_train, y_train) if train else (x_test, y_test)
    return TensorDataset(torch.tensor(x, dtype=torch.float32).view(-1, 1, 8, 8) / 16.0, torch.tensor(y))


class DigitsNet(pl.LightningModule):
    """Conv(1->32) - Conv(32->64) - Linear(1024->128) - Linear(128->10), ReLU between, batch norm after the convs."""

    def __init__(self, epochs: int = 30, lr: float = 0.05) -> None:
        super().__init__()
        self.epochs, self.lr = epochs, lr
        torch.manual_seed(0)
        self.conv1 = nn.Conv2d(1, 32, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(32)
        self.conv2 = nn.Conv2d(32, 64, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(64)
        self.fc1 = nn.Linear(64 * 4 * 4, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits."""
        x = torch.relu(self.bn1(self.conv1(x)))
        x = nn.functional.max_pool2d(torch.relu(self.bn2(self.conv2(x))), 2)
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))

    def training_step(self, batch, batch_idx):
        """Cross-entropy on one batch."""
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss, on_step=True, on_epoch=False)
        return loss

    def configure_optimizers(self):
        """SGD with momentum (and the learning-rate schedule)."""
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9, weight_decay=5e-4)
        steps = int(self.trainer.estimated_stepping_batches)  # finite: the demo sets max_epochs
        return {
            "optimizer": optimizer,
            "lr_scheduler": {
                "scheduler": torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, steps),
                "interval": "step",
            },
        }

    def train_dataloader(self) -> DataLoader:
        """The training set."""
        # shuffled by Lightning's DistributedSampler (seeded), the same on every run
        return DataLoader(digits_split(train=True), batch_size=BATCH_SIZE, shuffle=True)
