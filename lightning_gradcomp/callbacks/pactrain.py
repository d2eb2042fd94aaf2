"""``PacTrain``: prune gradually by magnitude and all-reduce only the surviving gradient entries.

Wang, Wu, Li & Kutscher, "PacTrain: Pruning and Adaptive Sparse Gradient Compression for Efficient Collective
Communication in Distributed Deep Learning", arXiv:2505.18563 (2025). The callback drives the training; the pruning
schedule and masks are in :mod:`lightning_gradcomp.transforms.pactrain`, where what was and was not taken from the
paper is written down.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor, nn
from typing_extensions import override

from lightning_gradcomp.compressors.base import Compressor
from lightning_gradcomp.compressors.masked import MaskedCompressor, Masks
from lightning_gradcomp.ddp.strategy import CompressedDDP
from lightning_gradcomp.transforms.pactrain import (
    Granularity,
    Schedule,
    Scope,
    magnitude_masks,
    prunable_parameters,
    sparsity_at,
)
from lightning_gradcomp.validation import check_bool, check_choice, check_int, check_number, check_positive_int

_MiscError = MisconfigurationException


class PacTrain(Callback):
    """Prune gradually by magnitude and all-reduce only the surviving gradient entries ("PacTrain-style").

    Installs a :class:`~lightning_gradcomp.compressors.MaskedCompressor` around the strategy's compressor, so only the
    weights that survive pruning have their gradients sent (``density x`` the dense bytes with the default
    ``Identity``), and whatever compressor ``CompressedDDP`` was given is applied to those (PacTrain's adaptive sparse
    compression). Masks are recomputed at the schedule's steps from the weights, which are equal on every rank, and
    checked to be bitwise equal on every rank (a CRC32 per mask, compared by an all-reduce). Masks and the schedule
    position are checkpointed. Logs ``pactrain/sparsity`` (pruned fraction of the prunable weights) every step.

    Only the paper's abstract could be read; everything beyond it (the pruning schedule, the masks, what is pruned)
    is this package's choice, not checked against the paper, and each choice is an argument (see
    :mod:`lightning_gradcomp.transforms.pactrain`).

    Args:
        sparsity: final fraction of each prunable layer's weights that is pruned, in [0, 1).
        start_step: optimizer step of the first pruning (masks are updated at the start of that step).
        end_step: step at which ``sparsity`` is reached (``== start_step``: one-shot pruning).
        frequency: steps between mask updates.
        initial_sparsity: the schedule's sparsity at ``start_step``.
        schedule: ``"cubic"`` (Zhu & Gupta) or ``"linear"``.
        granularity: ``"element"`` (unstructured) or ``"channel"`` (whole output channels / rows, by L2 norm).
        scope: ``"layer"`` (every layer at ``sparsity``) or ``"global"`` (one magnitude threshold for all layers;
            element granularity only).
        exclude: ``fnmatch`` patterns of parameter names never pruned (biases and normalisation layers never are).
        dense_threshold: layers whose mask keeps more than this fraction are sent without compaction (masked).
        check_masks: verify with a collective that masks are equal on every rank whenever they change.

    Raises:
        MisconfigurationException: If an argument is out of range, or (in ``setup``) the strategy is not
            ``CompressedDDP``.

    Example::

        >>> from lightning.pytorch import Trainer
        >>> from lightning_gradcomp import CompressedDDP, PacTrain
        >>> trainer = Trainer(accelerator="cpu", devices=2, strategy=CompressedDDP(),
        ...                   callbacks=[PacTrain(sparsity=0.9, start_step=100, end_step=1000, frequency=100)])
    """

    def __init__(
        self,
        sparsity: float = 0.9,
        start_step: int = 0,
        end_step: int = 1000,
        frequency: int = 100,
        initial_sparsity: float = 0.0,
        schedule: Schedule = "cubic",
        granularity: Granularity = "element",
        scope: Scope = "layer",
        exclude: Sequence[str] = (),
        dense_threshold: float = 0.9,
        check_masks: bool = True,
    ) -> None:
        check_number(sparsity, "sparsity", low=0, high=1, high_open=True, error=_MiscError)
        check_number(initial_sparsity, "initial_sparsity", low=0, high=sparsity, error=_MiscError)
        check_int(start_step, "start_step", low=0, error=_MiscError)
        check_int(end_step, "end_step", low=start_step, error=_MiscError)
        check_positive_int(frequency, "frequency", error=_MiscError)
        check_choice(schedule, "schedule", ("cubic", "linear"), error=_MiscError)
        check_choice(granularity, "granularity", ("element", "channel"), error=_MiscError)
        check_choice(scope, "scope", ("layer", "global"), error=_MiscError)
        if scope == "global" and granularity == "channel":
            raise MisconfigurationException(
                "`scope` can be 'global' only with `granularity='element'`, got granularity='channel'."
            )
        if isinstance(exclude, str) or not all(isinstance(p, str) for p in exclude):
            raise MisconfigurationException(f"Expected `exclude` to be a list of name patterns, got {exclude!r}.")
        check_number(dense_threshold, "dense_threshold", low=0, high=1, error=_MiscError)
        check_bool(check_masks, "check_masks", error=_MiscError)
        self.sparsity = float(sparsity)
        self.start_step, self.end_step, self.frequency = start_step, end_step, frequency
        self.initial_sparsity = float(initial_sparsity)
        self.schedule, self.granularity, self.scope = schedule, granularity, scope
        self.exclude = list(exclude)
        self.dense_threshold = float(dense_threshold)
        self.check_masks = check_masks
        self.masks = Masks()
        self.last_update: int | None = None  # the step of the last mask update (the schedule position)
        self._inner: Compressor | None = None

    # ------------------------------------------------------------------------------------------------------------
    # The schedule
    # ------------------------------------------------------------------------------------------------------------
    def is_update_step(self, step: int) -> bool:
        """Whether masks are recomputed at ``step``."""
        if not self.start_step <= step <= self.end_step:
            return False
        return (step - self.start_step) % self.frequency == 0 or step == self.end_step

    def target_sparsity(self, step: int) -> float:
        """The schedule's sparsity at ``step``."""
        return sparsity_at(step, self.sparsity, self.start_step, self.end_step, self.initial_sparsity, self.schedule)

    @property
    def current_sparsity(self) -> float:
        """The pruned fraction of all prunable weights under the current masks."""
        total = sum(self.masks[name].numel() for name in self.masks)
        return 1.0 - sum(self.masks.kept(name) for name in self.masks) / total if total else 0.0

    # ------------------------------------------------------------------------------------------------------------
    # Lightning hooks
    # ------------------------------------------------------------------------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        strategy = CompressedDDP.require(trainer, self)
        if not isinstance(strategy.compressor, MaskedCompressor):
            self._inner = strategy.compressor
            strategy.compressor = MaskedCompressor(self._inner, self.masks, self.dense_threshold)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if len(self.masks):  # restored from a checkpoint: check and apply them
            self.masks.to(pl_module.device)
            self._verify(trainer)
            self._apply(pl_module)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if step != self.last_update and self.is_update_step(step):
            self.update_masks(trainer, pl_module, step)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # after the optimizer step: momentum or weight decay may have moved pruned weights; they stay exactly zero
        self._apply(pl_module)
        if len(self.masks):
            pl_module.log("pactrain/sparsity", self.current_sparsity, on_step=True, on_epoch=False, batch_size=1)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit" and self._inner is not None:
            CompressedDDP.require(trainer, self).compressor, self._inner = self._inner, None

    # ------------------------------------------------------------------------------------------------------------
    # Masks
    # ------------------------------------------------------------------------------------------------------------
    def update_masks(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int) -> None:
        """Recompute the masks for ``step``'s target sparsity, apply them, and check every rank has the same."""
        target = self.target_sparsity(step)
        weights = prunable_parameters(pl_module, self.exclude)
        masks = magnitude_masks(weights, target, self.masks, self.granularity, self.scope)
        self.masks.update(masks)
        self.last_update = step
        self._verify(trainer)
        self._apply(pl_module)
        self._zero_optimizer_state(trainer, weights)
        rank_zero_info(
            f"PacTrain: step {step}: target sparsity {target:.4f}, {self.current_sparsity:.4f} of"
            f" {sum(w.numel() for w in weights.values()):,} prunable weights pruned ({len(weights)} layers)."
        )

    @torch.no_grad()
    def _apply(self, pl_module: nn.Module) -> None:
        if not len(self.masks):
            return
        for name, p in pl_module.named_parameters():
            if self.masks.partial(name):
                p.mul_(self.masks[name])

    @torch.no_grad()
    def _zero_optimizer_state(self, trainer: pl.Trainer, weights: Mapping[str, Tensor]) -> None:
        """Zero the per-weight optimizer state (momentum, Adam's moments) of pruned weights, so it cannot move them."""
        for optimizer in trainer.optimizers:
            for name, p in weights.items():
                state = optimizer.state.get(p, {})
                for value in state.values():
                    if isinstance(value, Tensor) and value.shape == p.shape:
                        value.mul_(self.masks[name])

    def _verify(self, trainer: pl.Trainer) -> None:
        if not self.check_masks:
            return
        names = sorted(self.masks)
        # the masks' version and names travel with the masks: the same set, updated as often, on every rank
        tensors = [
            torch.tensor([self.masks.version, zlib.crc32("\0".join(names).encode())]),
            *(self.masks[n] for n in names),
        ]
        if not CompressedDDP.require(trainer, self).identical_on_all_ranks(tensors):
            raise RuntimeError(
                "PacTrain: the pruning masks differ between ranks (their weights were not equal); refusing to"
                " compact gradients with different masks."
            )

    # ------------------------------------------------------------------------------------------------------------
    # Checkpoints
    # ------------------------------------------------------------------------------------------------------------
    @override
    def state_dict(self) -> dict[str, Any]:
        return {"format": 1, "last_update": self.last_update, "masks": self.masks.state_dict()}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.last_update = state_dict["last_update"]
        self.masks.load_state_dict(state_dict["masks"])  # in place: the installed compressor holds this object
