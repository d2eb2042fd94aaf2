"""PacTrain-style training: gradual magnitude pruning, and gradients all-reduced compacted to the surviving entries.

Wang, Wu, Li & Kutscher, "PacTrain: Pruning and Adaptive Sparse Gradient Compression for Efficient Collective
Communication in Distributed Deep Learning", arXiv:2505.18563 (2025). Only its abstract could be read: active pruning
makes weights and gradients sparse; since all workers know the sparsity pattern, gradients can be compressed in an
all-reduce compatible way. Everything else here is this package's reading of it ([inferred]) and every such choice
is an argument:

* the pruning is gradual magnitude pruning (Zhu & Gupta, "To prune, or not to prune", 2017): from ``start_step`` to
  ``end_step``, every ``frequency`` steps, the sparsity follows ``s_t = s_f + (s_0 - s_f) (1 - p)^3`` with
  ``p = (t - start) / (end - start)`` (or linearly), and each layer keeps its largest-magnitude weights (or whole
  output channels / rows of largest L2 norm); pruned weights never come back;
* biases and normalisation layers are not pruned; pruned weights are zero after every optimizer step (re-masked
  after each step, and the optimizer's per-weight state of pruned weights is zeroed when they are pruned);
* gradients go through :class:`~lightning_gradcomp.compressors.MaskedCompressor`: only the surviving entries are
  gathered into a compact buffer and all-reduced (no indices), then scattered back; the strategy's compressor is
  stacked on the compact buffer; layers denser than ``dense_threshold`` are not compacted.
"""

from __future__ import annotations

import fnmatch
import zlib
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor, nn
from typing_extensions import override

from lightning_gradcomp.compressors.base import Compressor
from lightning_gradcomp.compressors.masked import MaskedCompressor, Masks
from lightning_gradcomp.strategy import CompressedDDP
from lightning_gradcomp.validation import check_bool, check_choice, check_int, check_number, check_positive_int

_NORMS = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm, nn.LocalResponseNorm, nn.RMSNorm)
Schedule = Literal["cubic", "linear"]
Granularity = Literal["element", "channel"]
Scope = Literal["layer", "global"]
_MiscError = MisconfigurationException


def sparsity_at(
    step: int, final: float, start: int, end: int, initial: float = 0.0, schedule: Schedule = "cubic"
) -> float:
    """The target sparsity at ``step`` (0 before ``start``, ``final`` from ``end`` on)."""
    if step < start:
        return 0.0
    if step >= end:
        return final
    progress = (step - start) / (end - start)
    if schedule == "cubic":
        return final + (initial - final) * (1.0 - progress) ** 3
    return initial + (final - initial) * progress


def prunable_parameters(module: nn.Module, exclude: Sequence[str] = ()) -> dict[str, nn.Parameter]:
    """Parameters pruning applies to: >= 2-D, trainable, not of a normalisation layer, not matching ``exclude``."""
    skipped = {id(p) for m in module.modules() if isinstance(m, _NORMS) for p in m.parameters(recurse=False)}
    return {
        name: p
        for name, p in module.named_parameters()
        if p.dim() >= 2 and p.requires_grad and id(p) not in skipped
        and not any(fnmatch.fnmatchcase(name, pattern) for pattern in exclude)
    }  # fmt: skip


def _keep(n: int, sparsity: float) -> int:
    return max(1, n - int(sparsity * n))


def magnitude_masks(
    weights: Mapping[str, Tensor],
    sparsity: float,
    previous: Mapping[str, Tensor] | Masks | None = None,
    granularity: Granularity = "element",
    scope: Scope = "layer",
) -> dict[str, Tensor]:
    """Masks keeping the largest-magnitude weights (``"element"``) or rows of largest L2 norm (``"channel"``).

    ``scope="layer"`` prunes every layer to ``sparsity``; ``"global"`` (elements only) keeps the largest magnitudes of
    all layers together. Entries pruned in ``previous`` stay pruned (they rank below every survivor). Every layer
    keeps at least one entry (row).
    """
    scores: dict[str, Tensor] = {}
    for name, w in weights.items():
        score = w.detach().abs().float()
        if granularity == "channel":
            score = score.reshape(w.shape[0], -1).norm(dim=1)
        if previous is not None and name in previous:
            kept = previous[name].to(score.device)
            if granularity == "channel":
                kept = kept.reshape(w.shape[0], -1).any(dim=1)
            score = torch.where(kept.reshape(score.shape), score, torch.full_like(score, -1.0))
        scores[name] = score.reshape(-1)
    if scope == "global":
        flat = torch.cat(list(scores.values()))
        keep = _keep(flat.numel(), sparsity)
        chosen = torch.zeros(flat.numel(), dtype=torch.bool, device=flat.device)
        chosen[torch.topk(flat, keep, sorted=False).indices] = True
        out, offset = {}, 0
        for name, w in weights.items():
            mask = chosen[offset : offset + w.numel()].reshape(w.shape)
            offset += w.numel()
            if not mask.any():
                mask.view(-1)[scores[name].argmax()] = True
            out[name] = mask
        return out
    out = {}
    for name, w in weights.items():
        score = scores[name]
        chosen = torch.zeros(score.numel(), dtype=torch.bool, device=score.device)
        chosen[torch.topk(score, _keep(score.numel(), sparsity), sorted=False).indices] = True
        out[name] = chosen.reshape(w.shape[0], *([1] * (w.dim() - 1))).expand(w.shape).clone() if (
            granularity == "channel") else chosen.reshape(w.shape)  # fmt: skip
    return out


class PacTrain(Callback):
    """Prune gradually by magnitude and all-reduce only the surviving gradient entries ("PacTrain-style").

    Installs a :class:`~lightning_gradcomp.compressors.MaskedCompressor` around the strategy's compressor, so only the
    weights that survive pruning have their gradients sent (``density x`` the dense bytes with the default
    ``Identity``), and whatever compressor ``CompressedDDP`` was given is applied to those (PacTrain's adaptive sparse
    compression). Masks are recomputed at the schedule's steps from the weights, which are equal on every rank, and
    checked to be bitwise equal on every rank (a CRC32 per mask, compared by an all-reduce). Masks and the schedule
    position are checkpointed. Logs ``pactrain/sparsity`` (pruned fraction of the prunable weights) every step.

    Everything beyond the paper's abstract is [inferred] (see the module docstring); the choices are arguments.

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
            trainer.strategy.compressor, self._inner = self._inner, None

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
        tensors = [torch.tensor([self.masks.version, zlib.crc32("\0".join(names).encode())]), *(
            self.masks[n] for n in names)]  # fmt: skip
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
