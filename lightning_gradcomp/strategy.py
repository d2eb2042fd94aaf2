"""``CompressedDDP``: Lightning's DDP strategy with gradient compression inside DDP's communication hook."""

from __future__ import annotations

import logging
from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_gradcomp.compressors.base import Compressor, Layer
from lightning_gradcomp.compressors.identity import Identity
from lightning_gradcomp.hook import CompressionState, compression_hook

log = logging.getLogger(__name__)

_REFUSED = {
    "ddp_comm_hook": "CompressedDDP registers its own communication hook; pass `compressor=` instead",
    "ddp_comm_state": "the hook's state is built from `compressor=`, `error_feedback=` and `seed=`",
    "ddp_comm_wrapper": "compose by choosing a compressor (e.g. FP16, BF16) instead of wrapping a hook",
    "model_averaging_period": "post-local SGD model averaging needs torch's PostLocalSGDState hook, which"
    " CompressedDDP replaces",
}
_CHECKPOINT_KEY = "gradcomp"


def _check_compressor(compressor: Any) -> Compressor:
    if not isinstance(compressor, Compressor):
        raise MisconfigurationException(
            "`compressor` must be a lightning_gradcomp compressor (an instance of"
            " `lightning_gradcomp.Compressor`, e.g. `PowerSGD(rank=2)` or `TopK(ratio=0.01)`),"
            f" got {compressor!r} of type {type(compressor).__name__}."
        )
    return compressor


def optimizer_momentum_warning(compressor: Compressor, optimizers: Any) -> str | None:
    """A warning if ``compressor`` applies momentum itself (DGC) and an optimizer does too, else ``None``."""
    if not getattr(compressor, "optimizer_momentum_conflicts", False):
        return None
    for optimizer in optimizers or ():
        for group in getattr(optimizer, "param_groups", ()):
            momentum = group.get("momentum", 0)
            if isinstance(momentum, (int, float)) and momentum > 0:
                return (
                    f"{type(compressor).__name__} applies momentum itself (momentum correction), but the optimizer"
                    f" {type(optimizer).__name__} has momentum={momentum}: momentum is applied twice. Use"
                    " `torch.optim.SGD(params, lr, momentum=0)` with this compressor."
                )
    return None


def _warn_if_optimizer_momentum(compressor: Compressor, optimizers: Any) -> None:
    message = optimizer_momentum_warning(compressor, optimizers)
    if message is not None:
        rank_zero_warn(message)


class CompressedDDP(DDPStrategy):
    """DDP strategy that averages gradients through a pluggable :class:`~lightning_gradcomp.Compressor`.

    The compressor runs inside DDP's communication hook, bucket by bucket, overlapped with the backward pass; every
    payload goes through a ``torch.distributed`` collective. Works on CPU/gloo (where Lightning's own
    ``DDPStrategy`` silently skips communication hooks) and on CUDA/NCCL, on one or several nodes.

    Args:
        compressor: how gradients are compressed. Defaults to :class:`~lightning_gradcomp.compressors.Identity`
            (plain DDP averaging).
        error_feedback: keep each rank's compression error and add it to the next step's gradient. ``None`` (the
            default) turns it on for biased compressors (top-k, PowerSGD, ...) and off for unbiased ones.
        min_compress_numel: layers with fewer elements (and all 1-D layers: biases, normalisation weights) are
            averaged densely, unless the compressor treats every element alike (Identity, FP16, BF16).
        seed: seed of the randomness shared by all ranks (random-k indices, PowerSGD's initial query).
        monitor: add a :class:`~lightning_gradcomp.callbacks.CompressionMonitor` (logs ``gradcomp/*`` every step)
            unless the trainer already has one.
        **kwargs: passed to :class:`~lightning.pytorch.strategies.DDPStrategy` (``process_group_backend``,
            ``timeout``, ``start_method``, ...) and from there to ``DistributedDataParallel`` (``static_graph``,
            ``gradient_as_bucket_view``, ``bucket_cap_mb``, ``find_unused_parameters``, ...).

    Raises:
        MisconfigurationException: If ``compressor`` is not a compressor, another argument is out of range, or
            ``ddp_comm_hook``, ``ddp_comm_state``, ``ddp_comm_wrapper`` or ``model_averaging_period`` is passed.

    Example::

        >>> from lightning.pytorch import Trainer
        >>> from lightning_gradcomp import CompressedDDP
        >>> from lightning_gradcomp.compressors import PowerSGD
        >>> trainer = Trainer(accelerator="cpu", devices=2, strategy=CompressedDDP(compressor=PowerSGD(rank=2)))
    """

    def __init__(
        self,
        compressor: Compressor | None = None,
        error_feedback: bool | None = None,
        min_compress_numel: int = 1024,
        seed: int = 0,
        monitor: bool = True,
        **kwargs: Any,
    ) -> None:
        for name, reason in _REFUSED.items():
            if name in kwargs:
                raise MisconfigurationException(f"CompressedDDP does not accept `{name}`: {reason}.")
        compressor = _check_compressor(Identity() if compressor is None else compressor)
        if error_feedback is not None and not isinstance(error_feedback, bool):
            raise MisconfigurationException(f"`error_feedback` must be None, True or False, got {error_feedback!r}.")
        if isinstance(min_compress_numel, bool) or not isinstance(min_compress_numel, int) or min_compress_numel < 0:
            raise MisconfigurationException(
                f"`min_compress_numel` must be an integer >= 0 (layers smaller than this are averaged densely),"
                f" got {min_compress_numel!r}."
            )
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise MisconfigurationException(f"`seed` must be an integer, got {seed!r}.")
        if not isinstance(monitor, bool):
            raise MisconfigurationException(f"`monitor` must be True or False, got {monitor!r}.")
        super().__init__(**kwargs)
        self._monitor = monitor
        self._state = CompressionState(
            compressor, error_feedback=error_feedback, min_compress_numel=min_compress_numel, seed=seed
        )

    # ------------------------------------------------------------------------------------------------------------
    # Switches for callbacks (set them on every rank, between steps)
    # ------------------------------------------------------------------------------------------------------------
    @property
    def compressor(self) -> Compressor:
        """The compressor in use; assign another between steps (on every rank) to switch methods."""
        return self._state.compressor

    @compressor.setter
    def compressor(self, compressor: Compressor) -> None:
        self._state.compressor = _check_compressor(compressor)
        _warn_if_optimizer_momentum(compressor, self.optimizers)

    @property
    def compression_enabled(self) -> bool:
        """When ``False``, gradients are averaged densely (as plain DDP); error-feedback residuals are paid into it."""
        return self._state.enabled

    @compression_enabled.setter
    def compression_enabled(self, enabled: bool) -> None:
        if not isinstance(enabled, bool):
            raise ValueError(f"`compression_enabled` must be True or False, got {enabled!r}.")
        self._state.enabled = enabled

    @property
    def compression_state(self) -> CompressionState:
        """The hook's state: compressor, switches, residuals and telemetry."""
        return self._state

    # ------------------------------------------------------------------------------------------------------------
    # Lightning hooks
    # ------------------------------------------------------------------------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        if trainer.state.fn == TrainerFn.FITTING:
            _warn_if_optimizer_momentum(self._state.compressor, self.optimizers)
        if trainer.state.fn == TrainerFn.FITTING and self._monitor:
            from lightning_gradcomp.callbacks.monitor import CompressionMonitor

            if not any(isinstance(cb, CompressionMonitor) for cb in trainer.callbacks):
                trainer.callbacks.append(CompressionMonitor())

    @override
    def configure_ddp(self) -> None:
        super().configure_ddp()  # wraps the model; DDPStrategy's own hook registration has nothing to register
        assert isinstance(self.model, DistributedDataParallel)
        self._state.attach(self.model, process_group=self._ddp_kwargs.get("process_group"))
        # registered on every device type: on CPU/gloo too, unlike DDPStrategy._register_ddp_hooks
        self.model.register_comm_hook(self._state, compression_hook)
        rank_zero_info(self._describe())

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        trainer = self.lightning_module.trainer
        # the step, not a count of hook calls: hooks fire only on the micro-step that synchronises
        self._state.step = trainer.global_step
        # a callback may have switched to a compressor with more rounds; all ranks are here together
        self._state.ensure_rounds()

    # ------------------------------------------------------------------------------------------------------------
    # Checkpoints: every rank's compressor state travels with the checkpoint
    # ------------------------------------------------------------------------------------------------------------
    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        # Lightning calls this on every rank and writes on rank 0 only, so the other ranks' residuals are gathered
        # here; a weights-only checkpoint (no "loops") carries no training state, on every rank alike
        if "loops" in checkpoint and dist.is_available() and dist.is_initialized():
            mine = self._state.state_dict()
            gathered: list[Any] | None = [None] * self.world_size if self.is_global_zero else None
            dist.gather_object(mine, gathered, dst=0)
            if self.is_global_zero:
                checkpoint[_CHECKPOINT_KEY] = {"format": 1, "world_size": self.world_size, "ranks": gathered}
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, *args: Any, **kwargs: Any) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, *args, **kwargs)
        saved = checkpoint.get(_CHECKPOINT_KEY)
        if saved is None:
            if "loops" in checkpoint:
                rank_zero_warn(
                    "The checkpoint holds no CompressedDDP state (it was not written by CompressedDDP):"
                    " error-feedback residuals and compressor state start empty."
                )
            return checkpoint
        if saved["world_size"] != self.world_size:
            rank_zero_warn(
                f"The checkpoint's compressor state was saved by {saved['world_size']} processes, this run has"
                f" {self.world_size}: per-rank error-feedback residuals cannot be mapped, so they and the"
                " compressor state start empty."
            )
            return checkpoint
        self._state.load_state_dict(saved["ranks"][self.global_rank])
        return checkpoint

    # ------------------------------------------------------------------------------------------------------------
    # Helpers
    # ------------------------------------------------------------------------------------------------------------
    def _describe(self) -> str:
        module = self.lightning_module
        compressor = self._state.compressor
        total = compressed = total_numel = compressed_numel = 0
        for i, (name, p) in enumerate(module.named_parameters()):
            if not p.requires_grad:
                continue
            total += 1
            total_numel += p.numel()
            if compressor.compresses(Layer(name, i, p.shape), self._state.min_compress_numel):
                compressed += 1
                compressed_numel += p.numel()
        ef = "on" if self._state.uses_error_feedback() else "off"
        return (
            f"CompressedDDP: {compressor!r} compresses {compressed} of {total} parameter tensors"
            f" ({compressed_numel:,} of {total_numel:,} elements; the rest are averaged densely);"
            f" error feedback {ef}; {self.world_size} processes."
        )
