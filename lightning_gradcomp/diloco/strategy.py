"""``DiLoCo``: periodic synchronization for slow links, as a Lightning strategy on ``torch.distributed``.

DiLoCo (Douillard et al. 2023, "DiLoCo: Distributed Low-Communication Training of Language Models", arXiv 2311.08105)
and Streaming DiLoCo (Douillard et al. 2025, arXiv 2501.18512). Each worker trains its own replica with the module's
optimizer (the inner optimizer) and exchanges nothing for ``sync_every`` steps; then the workers average the
pseudo-gradient ``theta_global - theta_local`` and an outer optimizer steps the shared parameters theta_global.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.overrides.distributed import _sync_module_states
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_gradcomp.compressors.base import Compressor
from lightning_gradcomp.diloco.arguments import (
    ARGUMENTS,
    check_arguments,
    check_fit,
    check_merge,
    check_schedule,
)
from lightning_gradcomp.diloco.checkpoint import (
    CHECKPOINT_KEY,
    load_own_state,
    load_shared_exchange_state,
    own_state,
    restore,
    save_diloco_state,
    with_theta_global,
)
from lightning_gradcomp.diloco.defaults import AUTO, auto_sync_every
from lightning_gradcomp.diloco.elastic import membership_for
from lightning_gradcomp.diloco.front_door import RoundFrontDoor
from lightning_gradcomp.diloco.monitor import OuterMonitor
from lightning_gradcomp.diloco.preflight import (
    describe_optimizer,
    few_outer_steps,
    low_outer_lr,
    one_worker,
    stale_weights,
)
from lightning_gradcomp.diloco.round import OuterOptimizerCallable, Round
from lightning_gradcomp.engine.collectives import side_group
from lightning_gradcomp.ft.config import TorchFT
from lightning_gradcomp.runtime.arguments import unwrapped_strategy_kwargs
from lightning_gradcomp.runtime.base import GradcompStrategy
from lightning_gradcomp.runtime.sigterm import SigtermGate
from lightning_gradcomp.validation import check_bool, check_choice

log = logging.getLogger(__name__)

_MiscError = MisconfigurationException

SIGTERM_CHECKS = ("sync", "step")  # DiLoCo's ``sigterm_check``: once per sync period, or at every step as Lightning


class _RoundCheckpoints(RoundFrontDoor, GradcompStrategy):
    """The checkpoint side of DiLoCo's front door: theta_global in ``state_dict``, the rest in ``checkpoint["diloco"]``.

    A base of :class:`DiLoCo` only (its ``__init__`` sets the attributes declared here).
    """

    _round: Round
    _attached: bool
    _restored: Mapping[str, Any] | None  # the checkpoint's DiLoCo section, applied at setup
    _own: dict[str, Any] | None  # this rank's own state read with the checkpoint, applied at setup
    _shared_exchange: dict[str, Any] | None  # rank 0's compressor state, on another world size
    _local: list[Tensor] | None  # this rank's parameters and buffers while validation runs on theta_global
    sync_every: int | str
    fragments: int

    def _params(self) -> list[Tensor]:
        return [p for p in self._module().parameters() if p.requires_grad]

    def _buffers(self) -> list[Tensor]:
        return list(self._module().buffers())

    def _evaluated(self) -> list[Tensor]:
        return [*self._params(), *self._buffers()]

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The module's state dict with theta_global (and the buffers of the last sync) in place of this rank's own."""
        state = super().lightning_module_state_dict()
        if not self._attached:
            return state
        return with_theta_global(state, self._module(), self._params(), self._buffers(), self._round)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        """Save like DDPStrategy, with the outer state in ``checkpoint["diloco"]`` and each rank's own in its file.

        Lightning calls this on every rank and writes the checkpoint on rank 0 only; the checkpoint is a directory,
        in which every rank writes its local parameters, inner optimizer state and residuals
        (:mod:`lightning_gradcomp.diloco.checkpoint`). A weights-only checkpoint, with no ``"loops"``, carries no
        training state: one file, as DDPStrategy's.
        """
        per_rank = False
        if self._attached and "loops" in checkpoint:
            shared = {"sync_every": self.sync_every, "fragments": self.fragments, "outer": self._round.state_dict()}
            own = own_state(self._round, self._local or [*self._params(), *self._buffers()], self.optimizers)
            where = (self.checkpoint_io, self.global_rank, self.world_size, self.barrier, self.root_device)
            per_rank = save_diloco_state(checkpoint, filepath, shared, own, *where, storage_options)
        self.write_checkpoint(checkpoint, filepath, per_rank, storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Load like DDPStrategy, and read this rank's own state saved with the checkpoint (when fitting)."""
        checkpoint = super().load_checkpoint(checkpoint_path, *args, **kwargs)
        self._own = self._shared_exchange = None
        trainer = getattr(self.lightning_module, "_trainer", None)
        if trainer is not None and trainer.state.fn == TrainerFn.FITTING and "loops" in checkpoint:
            where = (self.checkpoint_io, self.global_rank, self.world_size)
            self._own = load_own_state(checkpoint, checkpoint_path, *where, warn=rank_zero_warn)
            if self._own is None and self._round.exchange.compressor is not None:
                self._shared_exchange = load_shared_exchange_state(checkpoint, checkpoint_path, self.checkpoint_io)
        return checkpoint

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Load theta_global (the checkpoint's ``state_dict``); the rest of DiLoCo's state is applied at setup.

        A checkpoint restored in the middle of ``fit``, after setup (the learning-rate finder restores the one it
        saved before its search), has the rest applied at once: the round, theta_global and this rank's own state.
        """
        super().load_model_state_dict(checkpoint, strict=strict)
        section = checkpoint.get(CHECKPOINT_KEY)
        trainer = getattr(self.lightning_module, "_trainer", None)
        if section is not None and trainer is not None and trainer.state.fn != TrainerFn.FITTING:
            outer = section["outer"]
            note = stale_weights(outer["phase"], outer["pending"] is not None, checkpoint=True)
            if note is not None:
                rank_zero_info(note)
        if section is None and "loops" in checkpoint:
            rank_zero_info(
                "DiLoCo: the checkpoint was not written by DiLoCo (no 'diloco' state): its weights become"
                " theta_global, every rank starts a new round from them with the checkpoint's optimizer state,"
                " and the outer optimizer starts afresh."
            )
        self._restored = section
        if self._attached and section is not None:
            self._resume_from(section)
            self._restored = None

    def _resume_from(self, section: Mapping[str, Any]) -> None:
        tensors = [*self._params(), *self._buffers()]
        restore(self._round, section, self._own, tensors, self.root_device, self._shared_exchange, rank_zero_warn)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Load this rank's own inner optimizer state (Lightning's ``optimizer_states`` holds rank 0's only)."""
        if self._own is not None:
            checkpoint = {**checkpoint, "optimizer_states": self._own["optimizer_states"]}
        super().load_optimizer_state_dict(checkpoint)
        self._own = self._shared_exchange = None


class DiLoCo(_RoundCheckpoints):
    """DiLoCo: inner steps on each worker with no communication, an outer step on the averaged pseudo-gradient.

    Each worker steps the module's own optimizer (the inner optimizer, e.g. AdamW) and LR schedulers on its local
    gradients; nothing crosses the wire between syncs (the model is not wrapped in ``DistributedDataParallel``). Every
    ``sync_every`` optimizer steps the workers average the pseudo-gradient ``theta_global - theta_local`` (theta_global:
    the parameters every worker started the round from) with one all-reduce, the outer optimizer steps theta_global
    with ``.grad`` set to that average, every worker is set to the new theta_global, and the floating-point buffers
    training changed (BatchNorm's running statistics; not a constant mask) are averaged.

    After ``fit`` every rank holds theta_global (a partial last round ends with an outer step). Validation during
    ``fit`` runs on theta_global, and a checkpoint's ``state_dict`` holds it; the outer state goes into
    ``checkpoint["diloco"]`` and each rank's own state into a file of its own in the checkpoint directory, so a run
    resumes bit for bit, also in the middle of a round. A pseudo-gradient that is not finite on some rank skips that
    outer step: every worker goes back to theta_global, non-finite inner optimizer state is forgotten, and the skip is
    logged and counted. A rank that fails ends every rank, with an error that names it.

    Args:
        sync_every: inner optimizer steps per round (``H``; 500 in the paper). ``"auto"`` (the default, and what
            ``Trainer(strategy="diloco")`` gives): about 60 outer steps over the run, from the Trainer's
            ``max_steps`` or epochs, at most 500 (:func:`~lightning_gradcomp.diloco.defaults.auto_sync_every`).
        outer_optimizer: builds the outer optimizer from theta_global's tensors: a callable such as
            ``functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)`` (the paper's), or what
            LightningCLI passes for an ``OptimizerCallable``. Default: Nesterov ``SGD(lr=0.5, momentum=0.5)`` (chosen
            by measurement, docs/diloco.md; the paper's is lr 0.7, momentum 0.9). The bare class ``torch.optim.SGD``
            is built with those settings, and a line says so; another bare class is refused.
        fragments: Streaming DiLoCo: the model is cut into this many fragments of consecutive parameters, synced in
            turn every ``sync_every / fragments`` steps, so that each is synced once per ``sync_every`` steps and the
            peak traffic is ``1 / fragments`` of the model. Must divide ``sync_every``.
        overlap_steps: Streaming DiLoCo: a fragment's exchange runs in the background during this many inner steps,
            and its outer step is applied then. At most ``sync_every / fragments`` (equal: the exchange is applied
            one period late, when the next one starts: the one-outer-step delay of eager updates).
        merge: how the fragment's local work during the overlap is kept when its outer step is applied (only with
            ``overlap_steps``). ``"mix"`` (the default; Streaming DiLoCo, arXiv 2501.18512): the fragment becomes
            ``mixing_factor * local + (1 - mixing_factor) * theta_global``. ``"eager"`` (eager updates, Kale et al.
            2025, arXiv 2502.12996): while the exchange is in flight the fragment trains from the outer step of its
            own estimate of the average (its own pseudo-gradient's share plus the others' from its previous
            exchange), and when the average arrives it is moved by the difference between the true outer step and
            that estimate's, keeping every inner step.
        mixing_factor: Streaming DiLoCo's mixing factor with ``merge="mix"``, in ``[0, 1)`` (default 0.5, chosen by
            measurement; 0 replaces the local work by theta_global, torchft's default).
        offload: keep theta_global and the outer optimizer's state in CPU memory.
        replica_group: two levels: dense data parallelism inside groups of ranks (their gradients averaged at every
            inner step), DiLoCo across the groups. ``"node"``: the ranks of a node; an integer: that many consecutive
            ranks (must divide the number of processes); ``None``: every rank is its own replica.
        monitor: add an :class:`~lightning_gradcomp.callbacks.OuterMonitor` (logs ``gradcomp/*`` every optimizer
            step and a summary line at the end of ``fit``) unless the trainer has one.
        compressor: average the pseudo-gradient through this compressor, with each rank's error feedback kept
            across outer steps (``None``: a plain all-reduce); see "Compressing the outer exchange" in the docs.
        sigterm_check: when the ranks agree on a SIGTERM that rank 0 received (Lightning broadcasts rank 0's flag
            on the default group, then every rank stops). ``"sync"``: once per sync period (every
            ``sync_every / fragments`` steps, when no exchange is in flight), so that inner steps cross no wire;
            ``"step"``: at every step, as Lightning does, at the cost of one round trip of the link per step.
        fault_tolerance: a :class:`~lightning_gradcomp.TorchFT`: this Lightning job is one replica group of a run
            whose outer exchange goes through torchft, which survives groups that die and heals those that (re)join
            (docs/fault_tolerance.md). ``None``: every rank of this job is a worker, and a failed rank ends them all.
        **kwargs: passed to :class:`~lightning.pytorch.strategies.DDPStrategy` (``process_group_backend``,
            ``timeout``, ``start_method``, ...).

    Raises:
        MisconfigurationException: If an argument is out of range or of the wrong type, or a keyword is not
            DDPStrategy's own (``DistributedDataParallel``'s arguments have no effect here); when fitting starts, if
            ``configure_optimizers`` returns more than one optimizer or the model has fewer parameter tensors than
            ``fragments``.

    Example::

        >>> from lightning.pytorch import Trainer
        >>> from lightning_gradcomp import DiLoCo
        >>> trainer = Trainer(accelerator="cpu", devices=2, strategy=DiLoCo(sync_every=100))
    """

    strategy_name = "diloco"
    monitor_callback = OuterMonitor
    label = "DiLoCo"
    checkpoint_key = CHECKPOINT_KEY

    def __init__(
        self,
        sync_every: int | str = AUTO,
        outer_optimizer: OuterOptimizerCallable | type[Optimizer] | None = None,
        fragments: int = 1,
        overlap_steps: int = 0,
        merge: str | None = None,
        mixing_factor: float | None = None,
        offload: bool = False,
        replica_group: int | str | None = None,
        monitor: bool = True,
        compressor: Compressor | None = None,
        sigterm_check: str = "sync",
        fault_tolerance: TorchFT | None = None,
        **kwargs: Any,
    ) -> None:
        check_arguments(sync_every, outer_optimizer, fragments, overlap_steps, replica_group, compressor, _MiscError)
        membership = membership_for(fault_tolerance, replica_group, rank_zero_info, _MiscError)
        self.merge, self.mixing_factor = check_merge(overlap_steps, merge, mixing_factor, _MiscError)
        self.sigterm_check = check_choice(sigterm_check, "sigterm_check", SIGTERM_CHECKS, error=_MiscError)
        check_bool(offload, "offload", error=_MiscError)
        check_bool(monitor, "monitor", error=_MiscError)
        super().__init__(monitor=monitor, **unwrapped_strategy_kwargs(self.label, ARGUMENTS, kwargs))
        self.replica_group = replica_group
        self.fault_tolerance = fault_tolerance
        self._start_round(sync_every, outer_optimizer, fragments, overlap_steps, offload, compressor, membership)
        self._restored = self._own = self._shared_exchange = None
        self._sigterm_gate = SigtermGate()  # Lightning's per-step SIGTERM broadcast, run once a sync period

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register ``"diloco"`` (unless the registry already has that name: a user's own entry is kept)."""
        if cls.strategy_name not in strategy_registry:
            strategy_registry.register(
                cls.strategy_name, cls, description="DiLoCo: periodic synchronization with an outer optimizer"
            )

    # ------------------------------------------------------------------------------------------------------------
    # Setup: no DDP wrapper, rank 0's model everywhere, theta_global taken
    # ------------------------------------------------------------------------------------------------------------
    @override
    def configure_ddp(self) -> None:
        """Start every replica from rank 0's parameters and buffers, as DDP's wrapper would, but do not wrap.

        Without the wrapper no gradient is all-reduced and no buffer is broadcast on a step.
        """
        assert isinstance(self.model, pl.LightningModule)
        _sync_module_states(self.model)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        """DDPStrategy's setup (without the wrapper), then theta_global and, when resuming, this rank's own state."""
        super().setup(trainer)
        if trainer.state.fn != TrainerFn.FITTING:
            return
        params = self._params()
        check_fit(len(self.optimizers), len(params), self.fragments, _MiscError)
        round = self._round
        total = float(trainer.estimated_stepping_batches)
        auto = auto_sync_every(total, self.fragments, self.overlap_steps)
        self.sync_every = round.sync_every = auto if self._sync_every_arg == AUTO else int(self._sync_every_arg)
        check_schedule(round.sync_every, self.fragments, self.overlap_steps, _MiscError)
        if dist.is_available() and dist.is_initialized() and self.world_size > 1:
            # the outer exchange on a group of its own: on the default group, an exchange overlapped with inner steps
            # would hold up the broadcast Lightning's loop issues there at every step (engine.collectives.side_group)
            round.process_group = side_group()
        round.attach(params, self._buffers(), *self._names(), job=self._job(trainer))
        self._attached = True
        if self.sigterm_check == "sync" and self.world_size > 1:
            self._sigterm_gate.install(trainer, self._checks_sigterm_now)
        if self._restored is not None:
            self._resume_from(self._restored)
        self._restored = None
        self._stale_noted = False
        rank_zero_info(_setup_line(self, self._params()))
        fix = None if self._sync_every_arg == AUTO else auto
        outer_steps = few_outer_steps(total, round.sync_every, fix, getattr(trainer, "callbacks", ()))
        assert round.optimizer is not None
        workers = round.membership.workers_at_setup(self.world_size)  # None: counted at the first sync
        alone = one_worker(workers) if workers is not None else None
        for line in (self._outer_note, low_outer_lr(round.optimizer), alone, outer_steps):
            if line is not None:
                rank_zero_warn(line)

    def _checks_sigterm_now(self) -> bool:
        """Whether the coming step takes Lightning's SIGTERM broadcast: in dense steps always, else once a period.

        Once a period is the step right after the period's exchange completed: ``overlap_steps`` steps after it
        started (at once without overlap), so the broadcast never queues behind an exchange on the link.
        """
        return not self._attached or self.synchronous or self._round.checks_sigterm_now()

    def _names(self) -> tuple[list[str], list[str]]:
        module = self._module()
        params = [n for n, p in module.named_parameters() if p.requires_grad]
        return params, [n for n, b in module.named_buffers() if b.is_floating_point()]

    # ------------------------------------------------------------------------------------------------------------
    # The inner step and the sync
    # ------------------------------------------------------------------------------------------------------------
    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        """The inner optimizer's step on this rank's own gradients; every ``sync_every / fragments`` steps a sync.

        With ``replica_group``, the gradients are first averaged inside the group (after the closure's backward, before
        gradient clipping and the step, where DDP would have averaged them). While :attr:`synchronous`, over every
        rank, and theta_global follows the synchronized model (a round in progress is closed first).
        """
        if not (self._attached and self._module().trainer.state.fn == TrainerFn.FITTING):
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        step = functools.partial(super().optimizer_step, optimizer, model=model, **kwargs)
        scaled = getattr(self.precision_plugin, "scaler", None) is not None  # fp16's scaler skips a bad step itself
        output, due = self._round.inner_step(closure, step, self.optimizers, self.synchronous, finite_only=not scaled)
        if due is not None:  # the sync starts here, one frame above the exchange
            self._round.send(due, self.optimizers)
        return output

    @override
    def round_group_bases(self) -> Sequence[Any]:
        """The outer exchange's group, when a compressor made round groups over it."""
        if self._round.exchange.compressor is None or self._round.membership.owns_round_groups():
            return ()
        return [self._round.process_group or dist.group.WORLD]

    @override
    def release_state(self) -> None:
        """Lightning's per-step SIGTERM broadcast back, and the state read for a resume dropped.

        The round stays readable (``outer_state``) for inspection after ``fit``.
        """
        self._sigterm_gate.remove()
        self._round.membership.close()
        self._attached = False
        self._local = None
        self._own = self._shared_exchange = None
        log.debug("DiLoCo: %d outer steps, %d skipped", self._round.syncs, self._round.skipped)


def _setup_line(strategy: DiLoCo, params: list[Tensor]) -> str:
    """The line DiLoCo logs once set up: what is synced, how often, by which outer optimizer, over how many ranks."""
    processes = strategy.outer_state.membership.describe(strategy.world_size)
    streaming = f" in {strategy.fragments} fragments" if strategy.fragments > 1 else ""
    auto = " ('auto')" if strategy._sync_every_arg == AUTO else ""
    overlap = ""
    if strategy.overlap_steps:
        merge = "eager" if strategy.merge == "eager" else f"mixing factor {strategy.mixing_factor:g}"
        overlap = f", each exchange overlapped with {strategy.overlap_steps} inner steps ({merge})"
    optimizer = strategy.outer_state.optimizer
    outer = describe_optimizer(optimizer) if optimizer is not None else "none"
    return (
        f"DiLoCo: {sum(p.numel() for p in params):,} parameters synced{streaming} every {strategy.sync_every}{auto}"
        f" optimizer steps{overlap} (outer optimizer {outer}); {processes}."
    )
