"""``CompressedDDP``: Lightning's DDP strategy with gradient compression inside DDP's communication hook."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import MisconfigurationException, _augment_message
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_gradcomp.compressors.base import Compressor, Layer
from lightning_gradcomp.compressors.identity import Identity
from lightning_gradcomp.ddp.arguments import AUTO, check_backend, check_compressor, check_kwargs, check_refused
from lightning_gradcomp.ddp.checkpoint import CHECKPOINT_KEY, restore_compression_state, save_compression_state
from lightning_gradcomp.ddp.checks import (
    error_feedback_growth_warning,
    optimizer_momentum_warning,
    sparse_gradient_warning,
)
from lightning_gradcomp.ddp.hook import CompressionState, compression_hook
from lightning_gradcomp.ddp.monitor import CompressionMonitor
from lightning_gradcomp.ddp.names import register_presets
from lightning_gradcomp.engine.collectives import identical_on_all_ranks
from lightning_gradcomp.optim.fused import FusedOptimizer, bind_fused_optimizer
from lightning_gradcomp.runtime.base import GradcompStrategy
from lightning_gradcomp.runtime.model_transform import CHECKPOINT_KEY as _TRANSFORMS_KEY
from lightning_gradcomp.runtime.model_transform import ModelTransform, carry_schedule
from lightning_gradcomp.validation import check_bool, check_int

log = logging.getLogger(__name__)

#: torch's error when a parameter got no gradient, and the fix that keeps compression
_UNUSED_PARAMETERS = ".*Expected to have finished reduction in the prior iteration.*"
_UNUSED_PARAMETERS_ADVICE = (
    "It looks like your LightningModule has parameters that were not used in producing the loss returned by"
    " training_step. If this is intentional, enable the detection of unused parameters in DDP with"
    " `strategy=CompressedDDP(..., find_unused_parameters=True)` (in a recipe: `find_unused_parameters: true` in the"
    " strategy's init_args). `DDPStrategy(find_unused_parameters=True)` would train without compression."
)
_MiscError = MisconfigurationException


def _check_error_feedback(compressor: Compressor, error_feedback: bool | None) -> None:
    """The compressor's own check of the strategy's ``error_feedback``, raised as the strategy's exception type."""
    try:
        compressor.check_error_feedback(error_feedback)
    except ValueError as err:
        raise MisconfigurationException(f"{compressor!r} with `error_feedback={error_feedback!r}`: {err}") from err


def _warn_if_error_feedback_grows(compressor: Compressor, error_feedback: bool | None) -> None:
    message = error_feedback_growth_warning(compressor, error_feedback)
    if message is not None:
        rank_zero_warn(message)


def _warn_if_sparse_gradients_skip(compressor: Compressor, module: Any) -> None:
    message = sparse_gradient_warning(compressor, module) if module is not None else None
    if message is not None:
        rank_zero_warn(message)


def _warn_if_optimizer_momentum(compressor: Compressor, optimizers: Any) -> None:
    message = optimizer_momentum_warning(compressor, optimizers)
    if message is not None:
        rank_zero_warn(message)


class CompressedDDP(GradcompStrategy):
    """DDP strategy that averages gradients through a pluggable :class:`~lightning_gradcomp.Compressor`.

    The compressor runs inside DDP's communication hook, bucket by bucket, overlapped with the backward pass; every
    payload goes through a ``torch.distributed`` collective. Works on CPU/gloo (where Lightning's own
    ``DDPStrategy`` silently skips communication hooks) and on CUDA/NCCL, on one or several nodes.

    An optimizer from :mod:`lightning_gradcomp.optim.fused` (``FusedSGD``, ``FusedAdaLomo``) returned by
    ``configure_optimizers`` is applied inside the hook, bucket by bucket, once each bucket's average is ready (see
    :meth:`setup_optimizers`).

    Args:
        compressor: how gradients are compressed. Defaults to :class:`~lightning_gradcomp.compressors.Identity`
            (plain DDP averaging). ``"auto"``: :class:`~lightning_gradcomp.callbacks.AutoCompression` with its
            defaults, added to the trainer's callbacks when fitting unless it has one (it starts dense, measures, and
            compresses only the buckets where it pays).
        error_feedback: keep each rank's compression error and add it to the next step's gradient. ``None`` (the
            default) turns it on for biased compressors (top-k, PowerSGD, ...) and off for unbiased ones.
        min_compress_numel: layers with fewer elements (and all 1-D layers: biases, normalisation weights) are
            averaged densely, unless the compressor treats every element alike (Identity, FP16, BF16).
        seed: seed of the randomness shared by all ranks (random-k indices, PowerSGD's initial query).
        monitor: add a :class:`~lightning_gradcomp.callbacks.CompressionMonitor` (logs ``gradcomp/*`` every step)
            unless the trainer already has one.
        reset_state_after: after this many consecutive steps that were not finite on every rank, forget every
            rank's error-feedback residuals and the compressor's state (momenta, warm starts), as at the start of
            training, so that state which makes every later step non-finite cannot stall training where plain DDP
            would go on (docs/concepts.md, "Non-finite gradients"); ``None``: never. An integer >= 1.
        ddp_comm_state: refused: the hook's state is built from the arguments above.
        ddp_comm_hook: refused: CompressedDDP registers its own hook; choose a ``compressor`` instead.
        ddp_comm_wrapper: refused: compose by choosing a compressor (``FP16``, ``BF16``) instead.
        model_averaging_period: refused: post-local SGD averaging needs torch's own ``PostLocalSGDState`` hook.
        **kwargs: passed to :class:`~lightning.pytorch.strategies.DDPStrategy` (``process_group_backend``,
            ``timeout``, ``start_method``, ...) and from there to ``DistributedDataParallel`` (``static_graph``,
            ``gradient_as_bucket_view``, ``bucket_cap_mb``, ``find_unused_parameters``, ...).

    Raises:
        MisconfigurationException: If an argument, or one passed on in ``**kwargs``, is out of range, misspelt (the
            closest valid name is suggested) or refused (the ``ddp_comm_*`` hook arguments, ``model_averaging_period``,
            DDP's ``mixed_precision``: see :mod:`lightning_gradcomp.ddp.arguments`); before the process group is
            created, if ``process_group_backend`` is not a backend torch knows then (third-party ones registered with
            ``torch.distributed.Backend.register_backend`` included), or is ``"nccl"`` and the run is not on CUDA.

    Example::

        >>> from lightning.pytorch import Trainer
        >>> from lightning_gradcomp import CompressedDDP
        >>> from lightning_gradcomp.compressors import PowerSGD
        >>> trainer = Trainer(accelerator="cpu", devices=2, strategy=CompressedDDP(compressor=PowerSGD(rank=2)))
    """

    strategy_name = "compressed_ddp"
    monitor_callback = CompressionMonitor
    label = "CompressedDDP"
    checkpoint_key = CHECKPOINT_KEY
    #: the callback ``compressor="auto"`` adds (``AutoCompression``); the package's root sets it, since the callbacks
    #: sit above the strategy, which never imports them
    auto_callback: ClassVar[type[Callback] | None] = None

    def __init__(
        self,
        compressor: Compressor | Literal["auto"] | None = None,
        error_feedback: bool | None = None,
        min_compress_numel: int = 1024,
        seed: int = 0,
        monitor: bool = True,
        reset_state_after: int | None = 3,
        ddp_comm_state: object | None = None,
        ddp_comm_hook: Callable | None = None,
        ddp_comm_wrapper: Callable | None = None,
        model_averaging_period: int | None = None,
        **kwargs: Any,
    ) -> None:
        # named here (not left in **kwargs) so that they are refused, and so that LightningCLI, which passes every
        # parameter it resolves with its default, can still follow **kwargs into DDPStrategy and DDP
        hooks = {"ddp_comm_state": ddp_comm_state, "ddp_comm_hook": ddp_comm_hook, "ddp_comm_wrapper": ddp_comm_wrapper}
        check_refused({**hooks, "model_averaging_period": model_averaging_period})
        check_compressor(compressor, allow_auto=True)
        self._auto = isinstance(compressor, str) and compressor == AUTO  # AutoCompression is added in connect
        chosen = compressor if isinstance(compressor, Compressor) else Identity()
        check_bool(error_feedback, "error_feedback", allow_none=True, error=_MiscError)
        _check_error_feedback(chosen, error_feedback)
        check_int(min_compress_numel, "min_compress_numel", low=0, error=_MiscError)
        check_int(seed, "seed", error=_MiscError)
        check_bool(monitor, "monitor", error=_MiscError)
        check_int(reset_state_after, "reset_state_after", low=1, allow_none=True, error=_MiscError)
        check_kwargs(kwargs, own=list(inspect.signature(CompressedDDP.__init__).parameters))
        super().__init__(monitor=monitor, **kwargs)
        self._fused: FusedOptimizer | None = None
        self._failed = False  # training ended with an exception (on_exception): teardown lets the collectives settle
        self._ddp_group: dist.ProcessGroup | None = None
        self._state = CompressionState(
            chosen,
            error_feedback=error_feedback,
            min_compress_numel=min_compress_numel,
            seed=seed,
            reset_state_after=reset_state_after,
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
        _check_error_feedback(check_compressor(compressor), self._state.error_feedback)  # type: ignore[arg-type]
        if isinstance(self.model, DistributedDataParallel):  # set up: the gradients' dtypes are final
            self._check_gradient_dtypes(compressor)
            _warn_if_error_feedback_grows(compressor, self._state.error_feedback)  # setup warns for the first one
            _warn_if_sparse_gradients_skip(compressor, self.lightning_module)
        self._state.compressor = compressor
        _warn_if_optimizer_momentum(compressor, self.optimizers)

    @property
    def compression_enabled(self) -> bool:
        """When ``False``, gradients are averaged densely (as plain DDP); error-feedback residuals are paid into it."""
        return self._state.enabled

    @compression_enabled.setter
    def compression_enabled(self, enabled: bool) -> None:
        self._state.enabled = check_bool(enabled, "compression_enabled", error=_MiscError)

    @property
    def compression_state(self) -> CompressionState:
        """The hook's state: compressor, switches, residuals and telemetry."""
        return self._state

    @property
    def ddp_process_group(self) -> dist.ProcessGroup | None:
        """The group DDP averages over (``process_group=``'s, ``device_mesh=``'s) once wrapped; ``None``: the world."""
        return self._ddp_group

    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        """Register ``compressed_ddp`` and its presets (:mod:`lightning_gradcomp.ddp.names`).

        As Lightning's own strategies do, except that a name already in ``strategy_registry`` (a user's own entry) is
        left as it is.
        """
        register_presets(cls, strategy_registry)

    @staticmethod
    def require(trainer: pl.Trainer, who: object) -> CompressedDDP:
        """``trainer.strategy`` if it is a ``CompressedDDP``; for callbacks that drive the compression.

        Args:
            trainer: the trainer whose strategy is checked.
            who: the callback (or other object) that needs the strategy, named in the error.

        Raises:
            MisconfigurationException: If the trainer's strategy is not a ``CompressedDDP``.
        """
        if not isinstance(trainer.strategy, CompressedDDP):
            raise MisconfigurationException(
                f"`{type(who).__name__}` requires `Trainer(strategy=CompressedDDP(...))`,"
                f" got `{type(trainer.strategy).__name__}`."
            )
        return trainer.strategy

    # ------------------------------------------------------------------------------------------------------------
    # Lightning hooks
    # ------------------------------------------------------------------------------------------------------------
    @override
    def connect(self, model: pl.LightningModule) -> None:
        """Connect the model and add the monitor; for ``compressor="auto"``, add :attr:`auto_callback` likewise.

        When fitting, each is added unless the trainer has one (:class:`GradcompStrategy` adds the monitor).
        """
        super().connect(model)
        trainer = getattr(model, "_trainer", None)
        auto = type(self).auto_callback
        if not self._auto or auto is None or trainer is None or trainer.state.fn != TrainerFn.FITTING:
            return
        if not any(isinstance(cb, auto) for cb in trainer.callbacks):
            trainer.callbacks.append(auto())

    @override
    def setup_environment(self) -> None:
        """Refuse an unknown backend, or NCCL without CUDA, before the process group is created; then set up.

        Checked here rather than at construction: a strategy may be built on a machine that does not train (a login
        node checking a config), but the process group is created on the training machine, with the accelerator
        known.
        """
        backend = self._process_group_backend
        check_backend(backend)
        if backend == "nccl" and (self.root_device.type != "cuda" or not torch.cuda.is_available()):
            raise MisconfigurationException(
                f"`process_group_backend='nccl'` needs CUDA devices, but this run trains on"
                f" {self.root_device.type!r} (CUDA available: {torch.cuda.is_available()}). Use 'gloo' for CPU"
                " training, or leave `process_group_backend` unset to let Lightning choose."
            )
        super().setup_environment()

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        """DDPStrategy's setup, plus warnings when fitting.

        One if the compressor and the optimizer both apply momentum, one if error feedback is on where its residual
        can grow without bound (:meth:`Compressor.error_feedback_growth`), one if the compressor's update of densely
        averaged layers skips the model's sparse gradients
        (:func:`~lightning_gradcomp.ddp.checks.sparse_gradient_warning`).
        """
        super().setup(trainer)
        if trainer.state.fn == TrainerFn.FITTING:
            _warn_if_optimizer_momentum(self._state.compressor, self.optimizers)
            _warn_if_error_feedback_grows(self._state.compressor, self._state.error_feedback)
            _warn_if_sparse_gradients_skip(self._state.compressor, self.lightning_module)

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        """Lightning's optimizers; a fused optimizer (``FusedSGD``, ``FusedAdaLomo``) is checked and bound to the hook.

        Bound, it updates each bucket's parameters as soon as the bucket's average is ready, and its ``step`` only
        runs Lightning's closure (see :mod:`lightning_gradcomp.optim.fused`).

        Raises:
            MisconfigurationException: If the fused optimizer cannot be honoured by this run (another optimizer, a
                missing parameter, fp16 with a gradient scaler, gradient accumulation, ``gradient_clip_val``).
        """
        super().setup_optimizers(trainer)
        self._unbind_fused()
        scaler = getattr(self.precision_plugin, "scaler", None)
        self._fused = bind_fused_optimizer(self.optimizers, trainer, self._module(), scaler)
        if self._fused is not None:
            self._state.after_reduce = self._fused.bind()

    def _unbind_fused(self) -> None:
        if self._fused is not None:
            self._fused.unbind()
        self._fused = None
        self._state.after_reduce = None

    @override
    def configure_ddp(self) -> None:
        """Wrap the model in DDP and register the compression hook (on every device type), then log the plan.

        The compressor first checks the gradients' dtypes (:meth:`Compressor.check_gradient_dtype`), before DDP is
        built: the precision plugin has converted the model by now.
        """
        self._check_gradient_dtypes(self._state.compressor)
        super().configure_ddp()  # wraps the model; DDPStrategy's own hook registration has nothing to register
        assert isinstance(self.model, DistributedDataParallel)
        self._ddp_group = self.model.process_group  # the hook's collectives run in DDP's own group
        self._state.attach(self.model, process_group=self._ddp_group)
        # registered on every device type: on CPU/gloo too, unlike DDPStrategy._register_ddp_hooks
        self.model.register_comm_hook(self._state, compression_hook)
        rank_zero_info(_describe(self._module(), self._state, self.world_size))

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Create the process groups a newly switched compressor needs (every rank is here together).

        The compression step is the hook's own count of gradient synchronisations (restored from checkpoints): with
        gradient accumulation DDP synchronises once per optimizer step, so it equals ``trainer.global_step``.
        """
        super().on_train_batch_start(batch, batch_idx)
        self._state.ensure_rounds()

    def identical_on_all_ranks(self, tensors: Sequence[torch.Tensor]) -> bool:
        """Whether ``tensors`` are bitwise equal on every rank (a collective: call it on every rank).

        For the transforms that rebuild or mask the model from equal replicas (see ``process_groups``).
        """
        return self.world_size == 1 or identical_on_all_ranks(tensors, self.root_device)

    # ------------------------------------------------------------------------------------------------------------
    # A model whose structure changed during fit (Pufferfish's factorization)
    # ------------------------------------------------------------------------------------------------------------
    def rewrap_model(self, keep_lr_schedule: bool = True) -> None:
        """Wrap the LightningModule in a new ``DistributedDataParallel`` after its parameters changed, mid-fit.

        Call it on every rank at the same point, between steps (a callback's ``on_train_epoch_start``, for example),
        after replacing submodules. It drops the old DDP wrapper and its autograd hooks, wraps the module again (DDP
        broadcasts rank 0's parameters and buffers, so every replica starts equal), registers the communication hook
        again (a hook can be registered only once per DDP object), keeps the error-feedback residuals of parameters
        that still exist, and rebuilds the optimizers and LR schedulers with ``configure_optimizers`` (optimizer
        state such as momentum starts afresh, as Pufferfish's code does when it re-creates its optimizer).

        Args:
            keep_lr_schedule: carry each scheduler's position (and each parameter group's hyper-parameters, such as
                the current learning rate) over to the rebuilt ones, so the schedule goes on where it was instead of
                starting again. Needs the same number of optimizers, schedulers and parameter groups as before.
        """
        module = self._module()
        trainer = module.trainer
        old_ddp = self.model
        old_optimizers, old_schedulers = list(self.optimizers), list(self.lr_scheduler_configs)
        if isinstance(old_ddp, DistributedDataParallel) and hasattr(old_ddp, "_remove_autograd_hooks"):
            # the reducer's hooks sit on parameters the new wrapper shares; they must not fire twice
            old_ddp._remove_autograd_hooks()
        module.zero_grad(set_to_none=True)  # no gradient may still be a view into the old wrapper's buckets
        self.model = module
        self.model_to_device()
        self.configure_ddp()
        self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        _optimizers_to_device(self.optimizers, self.root_device)
        if keep_lr_schedule:
            carry_schedule(old_optimizers, self.optimizers, old_schedulers, self.lr_scheduler_configs)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Rebuild any transformed model structure recorded in the checkpoint, then load the weights into it.

        Args:
            checkpoint: the loaded checkpoint dictionary.
            strict: passed to ``Module.load_state_dict``.
        """
        # a transformed structure (a factorized model) must exist before its weights load into it
        structures = checkpoint.get(_TRANSFORMS_KEY, {})
        for callback in self._transforms():
            callback.restore_structure(self._module(), structures.get(callback.state_key))
        super().load_model_state_dict(checkpoint, strict=strict)

    def _transforms(self) -> list[ModelTransform]:
        return _transforms(getattr(self.lightning_module, "_trainer", None))

    @override
    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        if type(self._launcher) is _MultiProcessingLauncher and self._start_method != "popen":
            self._launcher = _Launcher(self, start_method=self._start_method)

    @override
    def round_group_bases(self) -> Sequence[Any]:
        """The group DDP averages over: the compressors' later rounds have groups of their own over its ranks."""
        return [self.ddp_process_group or dist.group.WORLD]

    @override
    def release_state(self) -> None:
        """Unbind a fused optimizer and let go of the hook's collectives and future chains (the state stays)."""
        self._unbind_fused()
        self._state.detach(failed=self._failed)
        self._failed = False

    @override
    def on_exception(self, exception: BaseException) -> None:
        """DDPStrategy's message fixes, plus a note of this rank's own failure for the main process's report.

        An unused parameter gets the advice to pass ``find_unused_parameters=True`` to CompressedDDP: Lightning's own
        advice names ``DDPStrategy``, which would train without compression.
        """
        _augment_message(exception, pattern=_UNUSED_PARAMETERS, new_message=_UNUSED_PARAMETERS_ADVICE)
        super().on_exception(exception)
        self._failed = True

    # ------------------------------------------------------------------------------------------------------------
    # Checkpoints: the compressor state inside the checkpoint, or each rank's in its own file of a checkpoint directory
    # ------------------------------------------------------------------------------------------------------------
    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        """Save like DDPStrategy, with the compressor state; a directory if ranks hold state of their own.

        Without per-rank state (error-feedback residuals, say) the checkpoint is the one file DDPStrategy writes, the
        compressor state inside it; with it, a directory at ``filepath``, in which every rank writes its own and rank
        0 Lightning's checkpoint (see :mod:`lightning_gradcomp.ddp.checkpoint`,
        :mod:`lightning_gradcomp.runtime.rank_state`). Call on every rank, as Lightning does.
        """
        structures = {cb.state_key: cb.structure_state() for cb in self._transforms()}
        if any(state is not None for state in structures.values()):
            checkpoint[_TRANSFORMS_KEY] = structures  # also in weights-only checkpoints: they need the structure too
        per_rank = False
        if "loops" in checkpoint:  # a weights-only checkpoint (no "loops") carries no training state
            where = (self.checkpoint_io, self.global_rank, self.world_size, self.barrier, self.root_device)
            per_rank = save_compression_state(self._state, checkpoint, filepath, *where, storage_options)
        self.write_checkpoint(checkpoint, filepath, per_rank, storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Load like DDPStrategy (a file, or a checkpoint directory), and restore this rank's compressor state."""
        checkpoint = super().load_checkpoint(checkpoint_path, *args, **kwargs)
        where = (self.checkpoint_io, self.global_rank, self.world_size)
        restore_compression_state(self._state, checkpoint, checkpoint_path, *where)
        return checkpoint

    # ------------------------------------------------------------------------------------------------------------
    # Helpers
    # ------------------------------------------------------------------------------------------------------------
    def _check_gradient_dtypes(self, compressor: Compressor) -> None:
        try:
            self._state.check_gradient_dtypes(self._module() if self.model is None else self.model, compressor)
        except ValueError as err:
            raise MisconfigurationException(f"`compressor` does not fit this model's gradients: {err}") from err


def _describe(module: pl.LightningModule, state: CompressionState, world_size: int) -> str:
    """The setup line: what the compressor compresses, whether error feedback is on, how many processes."""
    compressor = state.compressor
    total = compressed = total_numel = compressed_numel = 0
    for i, (name, p) in enumerate(module.named_parameters()):
        if not p.requires_grad:
            continue
        total += 1
        total_numel += p.numel()
        if compressor.compresses(Layer(name, i, p.shape), state.min_compress_numel):
            compressed += 1
            compressed_numel += p.numel()
    ef = "on" if state.uses_error_feedback() else "off"
    rest = "; the rest are averaged densely" if compressed < total else ""
    processes = "1 process" if world_size == 1 else f"{world_size} processes"
    return (
        f"CompressedDDP: {compressor!r} compresses {compressed} of {total} parameter tensors"
        f" ({compressed_numel:,} of {total_numel:,} elements{rest});"
        f" error feedback {ef}; {processes}."
    )


def _transforms(trainer: pl.Trainer | None) -> list[ModelTransform]:
    callbacks: list[pl.Callback] = getattr(trainer, "callbacks", [])  # set at init, undeclared on Trainer
    return [cb for cb in callbacks if isinstance(cb, ModelTransform)]


class _Launcher(_MultiProcessingLauncher):
    """Lightning's spawn/fork launcher that also brings a changed model structure back to the main process.

    Lightning copies rank 0's final weights into the main process's module with ``strict=False``; without the
    structure rebuilt first, a factorized model's factors would be dropped and its old layers silently kept.
    """

    @override
    def get_extra_results(self, trainer: pl.Trainer) -> dict[str, Any]:
        extra = super().get_extra_results(trainer)
        extra[_TRANSFORMS_KEY] = {cb.state_key: cb.structure_state() for cb in _transforms(trainer)}
        return extra

    @override
    def _recover_results_in_main_process(self, worker_output: Any, trainer: pl.Trainer) -> None:
        structures = (worker_output.extra or {}).get(_TRANSFORMS_KEY, {})
        for callback in _transforms(trainer):
            callback.restore_structure(trainer.lightning_module, structures.get(callback.state_key))
        super()._recover_results_in_main_process(worker_output, trainer)
