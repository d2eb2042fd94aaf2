"""``ImageClassifier``: the training setup of the compression papers' image experiments, for any architecture."""

from __future__ import annotations

from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn
from torchmetrics.classification import MulticlassAccuracy

from lightning_gradcomp.optim import DGCSGD
from lightning_gradcomp.validation import check_bool, check_choice, check_int, check_number, check_positive_int


def small_cnn(num_classes: int = 10, in_channels: int = 1) -> nn.Module:
    """Two convolutions and two linear layers for 8x8 images (the quickstart's model, ~38k parameters)."""
    return nn.Sequential(
        nn.Conv2d(in_channels, 32, 3, padding=1),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1),
        nn.BatchNorm2d(64),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(64 * 4 * 4, 128),
        nn.ReLU(),
        nn.Linear(128, num_classes),
    )


def mlp(num_classes: int = 10, in_features: int = 64, hidden: int = 256) -> nn.Module:
    """A two-hidden-layer perceptron over flattened images."""
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(in_features, hidden),
        nn.ReLU(),
        nn.Linear(hidden, hidden),
        nn.ReLU(),
        nn.Linear(hidden, num_classes),
    )


def build_model(arch: str, num_classes: int, in_channels: int) -> nn.Module:
    """An architecture by name.

    ``"cnn"`` and ``"mlp"`` (small models for 8x8 images), ``"cifar_resnet18"`` and ``"vgg19_bn"`` (the papers'
    CIFAR-10 architectures, :mod:`lightning_gradcomp.models`, 3 input channels), or ``"torchvision.<name>"`` (any
    torchvision classifier).
    """
    if arch == "cnn":
        return small_cnn(num_classes, in_channels)
    if arch == "mlp":
        return mlp(num_classes, in_features=in_channels * 64)
    if arch in _CIFAR_MODELS:
        if in_channels != 3:
            raise MisconfigurationException(
                f"`arch={arch!r}` takes RGB images: `in_channels` must be 3, got {in_channels}."
            )
        from lightning_gradcomp import models

        return getattr(models, _CIFAR_MODELS[arch])(num_classes=num_classes)
    if arch.startswith("torchvision."):
        import torchvision

        return torchvision.models.get_model(arch.removeprefix("torchvision."), num_classes=num_classes)
    raise MisconfigurationException(
        f"`arch` must be 'cnn', 'mlp', 'cifar_resnet18', 'vgg19_bn' or 'torchvision.<model name>' "
        f"(e.g. 'torchvision.resnet18'), got {arch!r}."
    )


_CIFAR_MODELS = {"cifar_resnet18": "CifarResNet18", "vgg19_bn": "VGG19BN"}


def check_milestones(milestones: Any, warmup_epochs: int) -> None:
    """Increasing epochs after the warm-up (a decay inside the warm-up would be cancelled by it)."""
    if milestones is None:
        return
    accepted = (
        f"None or a list of increasing integers > {warmup_epochs}"
        if warmup_epochs
        else ("None or a list of increasing integers >= 1")
    )
    low = warmup_epochs + 1 if warmup_epochs else 1
    if (
        isinstance(milestones, (str, bytes))
        or not all(isinstance(m, int) and not isinstance(m, bool) and m >= low for m in milestones)
        or list(milestones) != sorted(set(milestones))
    ):
        raise MisconfigurationException(f"Expected `milestones` to be {accepted}, got {milestones!r}.")


class ImageClassifier(pl.LightningModule):
    """Cross-entropy classification trained with SGD, momentum, weight decay and step learning-rate decay.

    The defaults are the CIFAR-10 setting shared by the PowerSGD, Pufferfish and Accordion experiments (SGD, lr 0.1,
    momentum 0.9, weight decay 1e-4, lr divided by 10 at fixed epochs). Logs ``train_loss``, ``train_acc``,
    ``val_loss``, ``val_acc`` and ``test_acc`` (accuracies over all ranks).

    Args:
        arch: ``"cnn"`` (small convnet for 8x8 images), ``"mlp"``, ``"cifar_resnet18"``, ``"vgg19_bn"`` or
            ``"torchvision.<name>"`` (see :func:`build_model`).
        num_classes: number of classes.
        in_channels: image channels.
        lr: learning rate.
        momentum: SGD momentum. With ``optimizer="dgc_sgd"`` it applies to the weight decay alone (DGC keeps the
            gradient's momentum itself).
        nesterov: Nesterov momentum.
        weight_decay: L2 penalty.
        milestones: epochs at which the learning rate is multiplied by ``gamma``.
        gamma: the decay factor.
        warmup_epochs: linear learning-rate warm-up from ``lr / 10`` over this many epochs (0: none).
        optimizer: ``"sgd"`` (``torch.optim.SGD``) or ``"dgc_sgd"`` (:class:`~lightning_gradcomp.optim.DGCSGD`,
            Deep Gradient Compression's optimizer, for :class:`~lightning_gradcomp.compressors.DGC`).
    """

    def __init__(
        self,
        arch: str = "cnn",
        num_classes: int = 10,
        in_channels: int = 1,
        lr: float = 0.1,
        momentum: float = 0.9,
        nesterov: bool = False,
        weight_decay: float = 1e-4,
        milestones: list[int] | None = None,
        gamma: float = 0.1,
        warmup_epochs: int = 0,
        optimizer: Literal["sgd", "dgc_sgd"] = "sgd",
    ) -> None:
        super().__init__()
        check_positive_int(num_classes, "num_classes", error=MisconfigurationException)
        check_positive_int(in_channels, "in_channels", error=MisconfigurationException)
        check_number(lr, "lr", low=0, low_open=True, error=MisconfigurationException)
        check_number(momentum, "momentum", low=0, high=1, high_open=True, error=MisconfigurationException)
        check_bool(nesterov, "nesterov", error=MisconfigurationException)
        check_number(weight_decay, "weight_decay", low=0, error=MisconfigurationException)
        check_number(gamma, "gamma", low=0, high=1, low_open=True, error=MisconfigurationException)
        check_int(warmup_epochs, "warmup_epochs", low=0, error=MisconfigurationException)
        check_milestones(milestones, warmup_epochs)
        check_choice(optimizer, "optimizer", ("sgd", "dgc_sgd"), error=MisconfigurationException)
        self.save_hyperparameters()
        self.net = build_model(arch, num_classes, in_channels)
        self.train_acc = MulticlassAccuracy(num_classes, average="micro")
        self.val_acc = MulticlassAccuracy(num_classes, average="micro")
        self.test_acc = MulticlassAccuracy(num_classes, average="micro")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits."""
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        """Cross-entropy on one batch."""
        x, y = batch
        logits = self(x)
        loss = nn.functional.cross_entropy(logits, y)
        self.train_acc(logits, y)
        self.log("train_loss", loss, prog_bar=True)
        self.log("train_acc", self.train_acc, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        """Loss and accuracy on held-out data."""
        x, y = batch
        logits = self(x)
        self.val_acc(logits, y)
        self.log("val_loss", nn.functional.cross_entropy(logits, y), sync_dist=True)
        self.log("val_acc", self.val_acc, prog_bar=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        """Accuracy on test data."""
        x, y = batch
        self.test_acc(self(x), y)
        self.log("test_acc", self.test_acc)

    def configure_optimizers(self) -> Any:
        """SGD with the step decay (and optional linear warm-up), stepped every epoch."""
        hp = self.hparams
        factory = DGCSGD if hp.get("optimizer", "sgd") == "dgc_sgd" else torch.optim.SGD
        optimizer = factory(
            self.parameters(),
            lr=hp["lr"],
            momentum=hp["momentum"],
            nesterov=hp["nesterov"],
            weight_decay=hp["weight_decay"],
        )
        # SequentialLR restarts the decay scheduler's epoch counter when the warm-up ends, so its milestones are
        # counted from there: shifted by the warm-up, the decay lands on the epochs given in `milestones`
        shift = hp["warmup_epochs"]
        decay: torch.optim.lr_scheduler.LRScheduler = torch.optim.lr_scheduler.MultiStepLR(
            optimizer, milestones=[m - shift for m in hp["milestones"] or []], gamma=hp["gamma"]
        )
        if hp["warmup_epochs"]:
            warmup = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.1, total_iters=hp["warmup_epochs"])
            decay = torch.optim.lr_scheduler.SequentialLR(optimizer, [warmup, decay], milestones=[hp["warmup_epochs"]])
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": decay, "interval": "epoch"}}
