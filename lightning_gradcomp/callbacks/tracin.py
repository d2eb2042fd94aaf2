"""``TracIn``: save the checkpoints TracIn needs while training, then score the training data's influence."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, SingleDeviceStrategy
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override

from lightning_gradcomp.tracin.report import write_report
from lightning_gradcomp.tracin.scoring import LOSSES, Method, TracInScorer, save_tracin_checkpoint
from lightning_gradcomp.validation import check_bool, check_choice, check_int, check_positive_int

_MiscError = MisconfigurationException


class TracIn(Callback):
    """TracIn influence analysis: checkpoints while training, self-influence and a report after it.

    Pruthi, Liu, Kale & Sundararajan, "Estimating Training Data Influence by Tracing Gradient Descent", NeurIPS 2020.

    **While training** it saves checkpoints for TracInCP every ``every_n_epochs`` epochs or ``every_n_steps``
    optimizer steps: ``{"state_dict", "learning_rate", "epoch", "global_step"}`` in ``dirpath``, written by rank 0
    alone after the optimizer step (the weights every rank holds then are the same, synchronised ones). The learning
    rate stored is the one in force over the interval the checkpoint ends: the mean over its optimizer steps
    (``learning_rate="mean"``), or the last step's (``"last"``), of the first optimizer's first parameter group.
    :func:`~lightning_gradcomp.tracin.scoring.load_tracin_checkpoint` loads them with Captum's
    ``checkpoints_load_func`` signature.

    **After training** (``score_on_train_end``) every rank scores a shard of the training dataset (the training
    dataloader's ``dataset``) and the scores are gathered, so every rank holds :attr:`scores`, the self-influence of
    every training example; rank 0 writes the report (:func:`~lightning_gradcomp.tracin.report.write_report`):
    a CSV of every example's self-influence and loss under the final weights, most influential first, and a PNG grid
    of the ``top_n`` most self-influential examples with their labels. Mislabeled examples tend to be at the top.

    **On demand**, :meth:`scorer` returns a :class:`~lightning_gradcomp.tracin.scoring.TracInScorer` over the saved
    checkpoints for self-influence, proponents and opponents of test examples
    (``scorer(model).top_influential(train_dataset, test_batch, k)``).

    Strategies: any strategy whose every rank holds the whole model, i.e. single-device, ``DDPStrategy`` and
    :class:`~lightning_gradcomp.CompressedDDP` (sharded strategies are refused). Gradient compression does not
    change the analysis: TracIn uses exact per-example gradients at the saved (synchronised) weights.

    Args:
        dirpath: directory of the checkpoints (and of the report, under ``report/``). It need not exist: it is
            created (with its parents) when the first checkpoint is saved, during ``fit``, so a path that cannot be
            created fails then, not at construction. On several nodes it must be shared: every rank reads the
            checkpoints to score.
        every_n_epochs: save at the end of every ``every_n_epochs``-th epoch (default 1 when ``every_n_steps`` is
            not given).
        every_n_steps: save after every ``every_n_steps``-th optimizer step instead.
        learning_rate: which learning rate weights a checkpoint: ``"mean"`` over the interval's steps or ``"last"``.
        score_on_train_end: score the training set's self-influence after training and write the report.
        method: ``"full"`` (per-example gradients with ``torch.func``) or ``"last_layer"`` (outer-product identity on
            the final ``nn.Linear``).
        layers: module names whose parameters the gradients cover (``None``: all; see ``TracInScorer``).
        projection_dim: random projection dimension (``None``: exact).
        loss: the per-example loss of the scoring: ``"cross_entropy"`` or ``"mse"``.
        batch_size: examples per scoring batch.
        top_n: how many examples the PNG grid shows (0: no PNG).
        image_shape: the shape to show an input as an image (e.g. ``[28, 28]``); ``None`` guesses (C x H x W, H x W,
            or a flat square).
        seed: seed of the random projection.
        show_progress: progress bar (rank 0) while scoring.

    Raises:
        MisconfigurationException: If an argument is out of range, both cadences are given, or (in ``setup``) the
            strategy shards the model.

    Example::

        >>> from lightning.pytorch import Trainer
        >>> from lightning_gradcomp.callbacks import TracIn
        >>> trainer = Trainer(accelerator="cpu", callbacks=[TracIn("tracin", every_n_epochs=1)])
    """

    def __init__(
        self,
        dirpath: str,
        every_n_epochs: int | None = None,
        every_n_steps: int | None = None,
        learning_rate: Literal["mean", "last"] = "mean",
        score_on_train_end: bool = True,
        method: Method = "full",
        layers: Sequence[str] | None = None,
        projection_dim: int | None = None,
        loss: Literal["cross_entropy", "mse"] = "cross_entropy",
        batch_size: int = 256,
        top_n: int = 64,
        image_shape: Sequence[int] | None = None,
        seed: int = 0,
        show_progress: bool = True,
    ) -> None:
        if not isinstance(dirpath, (str, os.PathLike)):
            raise MisconfigurationException(f"`dirpath` must be a path, got {dirpath!r}.")
        if every_n_epochs is not None and every_n_steps is not None:
            raise MisconfigurationException("Give `every_n_epochs` or `every_n_steps`, not both.")
        for name, value in (
            ("every_n_epochs", every_n_epochs),
            ("every_n_steps", every_n_steps),
            ("projection_dim", projection_dim),
        ):
            check_int(value, name, low=1, allow_none=True, error=_MiscError)
        check_choice(learning_rate, "learning_rate", ("mean", "last"), error=_MiscError)
        check_bool(score_on_train_end, "score_on_train_end", error=_MiscError)
        check_choice(method, "method", ("full", "last_layer"), error=_MiscError)
        check_choice(loss, "loss", tuple(LOSSES), error=_MiscError)
        check_positive_int(batch_size, "batch_size", error=_MiscError)
        check_int(top_n, "top_n", low=0, error=_MiscError)
        check_int(seed, "seed", error=_MiscError)
        check_bool(show_progress, "show_progress", error=_MiscError)
        self.dirpath = os.fspath(dirpath)
        self.every_n_steps = every_n_steps
        self.every_n_epochs = every_n_epochs if every_n_epochs is not None or every_n_steps is not None else 1
        self.learning_rate = learning_rate
        self.score_on_train_end = score_on_train_end
        self.method = method
        self.layers = list(layers) if layers is not None else None
        self.projection_dim = projection_dim
        self.loss = loss
        self.batch_size = batch_size
        self.top_n = top_n
        self.image_shape = list(image_shape) if image_shape is not None else None
        self.seed = seed
        self.show_progress = show_progress
        # state
        self.checkpoints: list[str] = []
        self.learning_rates: list[float] = []
        self._lr_sum = 0.0
        self._lr_steps = 0
        self._lr_last: float | None = None
        self._saved_step = -1
        self.scores: torch.Tensor | None = None
        self.final_losses: torch.Tensor | None = None
        self.report: tuple[str, str | None] | None = None

    # ------------------------------------------------------------------------------------------------------------
    # Setup
    # ------------------------------------------------------------------------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        strategy = trainer.strategy
        if isinstance(strategy, DeepSpeedStrategy) or not isinstance(strategy, (SingleDeviceStrategy, DDPStrategy)):
            raise MisconfigurationException(
                f"`TracIn` needs every rank to hold the whole model (single device, DDPStrategy or CompressedDDP),"
                f" got `{type(strategy).__name__}`."
            )

    # ------------------------------------------------------------------------------------------------------------
    # Saving
    # ------------------------------------------------------------------------------------------------------------
    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        # the rate this step uses (Lightning steps epoch schedulers before on_train_epoch_end)
        lr = float(optimizer.param_groups[0]["lr"])
        self._lr_sum += lr
        self._lr_steps += 1
        self._lr_last = lr

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if self.every_n_steps is not None and step % self.every_n_steps == 0 and step != self._saved_step:
            self._save(trainer, pl_module)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.every_n_epochs is not None and (trainer.current_epoch + 1) % self.every_n_epochs == 0:
            self._save(trainer, pl_module)

    def _save(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._lr_steps == 0 or self._lr_last is None or trainer.global_step == self._saved_step:
            return  # no optimizer step since the last checkpoint: nothing to trace
        lr = self._lr_sum / self._lr_steps if self.learning_rate == "mean" else self._lr_last
        path = os.path.join(self.dirpath, f"tracin-epoch={trainer.current_epoch}-step={trainer.global_step}.pt")
        if trainer.is_global_zero:  # one writer; the weights are the same on every rank after the step
            os.makedirs(self.dirpath, exist_ok=True)
            save_tracin_checkpoint(pl_module, path, lr, epoch=trainer.current_epoch, global_step=trainer.global_step)
        self.checkpoints.append(path)
        self.learning_rates.append(float(lr))
        self._lr_sum, self._lr_steps, self._saved_step = 0.0, 0, trainer.global_step

    # ------------------------------------------------------------------------------------------------------------
    # Scoring
    # ------------------------------------------------------------------------------------------------------------
    def scorer(self, model: torch.nn.Module, **overrides: Any) -> TracInScorer:
        """A :class:`TracInScorer` over the checkpoints saved so far, with this callback's settings.

        ``overrides`` replace ``TracInScorer`` arguments (``method``, ``layers``, ``projection_dim``, ...).
        """
        if not self.checkpoints:
            raise RuntimeError("`TracIn` has saved no checkpoint yet: train first (or lower the cadence).")
        kwargs: dict[str, Any] = {
            "loss_fn": LOSSES[self.loss],
            "method": self.method,
            "layers": self.layers,
            "projection_dim": self.projection_dim,
            "seed": self.seed,
            "batch_size": self.batch_size,
            "show_progress": self.show_progress,
        }
        kwargs.update(overrides)
        return TracInScorer(model, self.checkpoints, **kwargs)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.score_on_train_end or not self.checkpoints:
            return
        dataset = self._train_dataset(trainer)
        trainer.strategy.barrier("tracin-checkpoints")  # every rank reads what rank 0 wrote
        scorer = self.scorer(pl_module)
        self.final_losses = scorer.losses(dataset)  # before the checkpoints are loaded (they are restored anyway)
        self.scores = scorer.self_influence(dataset)
        if trainer.is_global_zero:
            self.report = write_report(
                os.path.join(self.dirpath, "report"),
                self.scores,
                dataset,
                top_n=self.top_n,
                columns={"final_loss": self.final_losses},
                image_shape=self.image_shape,
                title=f"Most self-influential of {len(self.scores)} training examples (TracInCP,"
                f" {len(self.checkpoints)} checkpoints)",
            )
            rank_zero_info(f"TracIn: self-influence of {len(self.scores)} training examples; report: {self.report[0]}")
        trainer.strategy.barrier("tracin-report")

    @staticmethod
    def _train_dataset(trainer: pl.Trainer) -> Dataset:
        loaders = trainer.train_dataloader
        if isinstance(loaders, DataLoader):
            return loaders.dataset
        raise MisconfigurationException(
            "`TracIn(score_on_train_end=True)` scores the training dataloader's dataset and needs a single"
            f" DataLoader, got {type(loaders).__name__}; score on demand with `TracIn.scorer(model)` instead."
        )

    # ------------------------------------------------------------------------------------------------------------
    # State
    # ------------------------------------------------------------------------------------------------------------
    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "checkpoints": list(self.checkpoints),
            "learning_rates": list(self.learning_rates),
            "lr_sum": self._lr_sum,
            "lr_steps": self._lr_steps,
            "lr_last": self._lr_last,
            "saved_step": self._saved_step,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.checkpoints = list(state_dict["checkpoints"])
        self.learning_rates = list(state_dict["learning_rates"])
        self._lr_sum = float(state_dict["lr_sum"])
        self._lr_steps = int(state_dict["lr_steps"])
        self._lr_last = state_dict["lr_last"]
        self._saved_step = int(state_dict["saved_step"])
