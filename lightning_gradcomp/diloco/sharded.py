"""``ShardedDiLoCo``: DiLoCo for models that do not fit one device, over FSDP2-sharded replica groups.

DiLoCo (Douillard et al. 2023, arXiv 2311.08105) and Streaming DiLoCo (arXiv 2501.18512), each worker a replica group
of ``S`` processes sharding the model with FSDP2 (as INTELLECT-1, arXiv 2412.01152). A Lightning front door over
``ModelParallelStrategy`` driving the same :class:`~lightning_gradcomp.diloco.round.Round` as ``DiLoCo`` on each rank's
local shards, its exchange over the ranks holding the same shard in every group (:mod:`.sharded_mesh`).
"""

from __future__ import annotations

import functools
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies.model_parallel import _METADATA_FILENAME, _load_checkpoint
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.optim import Optimizer
from typing_extensions import override

from lightning_gradcomp.compressors.base import Compressor
from lightning_gradcomp.diloco.arguments import (
    check_arguments,
    check_fit,
    check_merge,
    check_schedule,
)
from lightning_gradcomp.diloco.defaults import AUTO, auto_sync_every
from lightning_gradcomp.diloco.front_door import RoundFrontDoor
from lightning_gradcomp.diloco.monitor import OuterMonitor
from lightning_gradcomp.diloco.preflight import few_outer_steps, low_outer_lr, one_worker
from lightning_gradcomp.diloco.round import OuterOptimizerCallable
from lightning_gradcomp.diloco.sharded_checkpoint import SECTION, ShardedCheckpoints
from lightning_gradcomp.diloco.sharded_membership import sharded_membership_for
from lightning_gradcomp.diloco.sharded_mesh import (
    GROUP_DIMS,
    announce,
    broadcast_from_first_group,
    build_mesh,
    check_refused,
    check_sharded_parameters,
    check_whole_matrix,
    checking_gradients,
    data_parallel_of,
    global_fragments,
    local_shards,
    named_trained,
    replica_process_group,
    sharded_group_size,
)
from lightning_gradcomp.engine.collectives import hand_off_gil, release_round_groups
from lightning_gradcomp.ft.threads import share_cores
from lightning_gradcomp.runtime.faults import ScriptLauncher, is_collective_failure, record_failure
from lightning_gradcomp.runtime.replica_group import group_split
from lightning_gradcomp.runtime.sigterm import SigtermGate
from lightning_gradcomp.validation import check_bool, check_choice

__all__ = ["ShardedDiLoCo"]

_MiscError = MisconfigurationException
_SIGTERM_CHECKS = ("sync", "step")


class ShardedDiLoCo(RoundFrontDoor, ModelParallelStrategy):
    """DiLoCo across replica groups whose ranks shard the model with FSDP2 (``ModelParallelStrategy``) inside.

    Replica group ``g`` is the ``S`` consecutive ranks ``g*S .. g*S+S-1``. The module's ``configure_model`` applies
    ``fully_shard`` over ``self.device_mesh["data_parallel"]``, here the group's own mesh (with tensor parallelism
    over ``["tensor_parallel"]`` first, ``S * T`` ranks): an inner step crosses no group boundary. Every
    ``sync_every`` steps each rank averages the pseudo-gradient of its own shards (no all-gather) with the ranks
    holding the same shards in the other groups, and steps its shards of theta_global:
    the outer state is ``8 P / S`` bytes per rank for Nesterov SGD, not ``8 P``. Every rank reads its own part of the
    data; validation during ``fit`` and a checkpoint's weights are theta_global, as with ``DiLoCo``.

    Args:
        sync_every: inner optimizer steps per round (``H``), or ``"auto"`` (about 60 outer steps, at most 500).
        outer_optimizer: builds the outer optimizer from theta_global's shards (element-wise optimizers), e.g.
            ``functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)``; default as ``DiLoCo``'s.
        fragments: Streaming DiLoCo's fragments of consecutive parameters, cut by the whole parameters' sizes.
        overlap_steps: Streaming DiLoCo's overlap of a fragment's exchange with inner steps.
        merge: the overlap's merge, ``"mix"`` or ``"eager"`` (as ``DiLoCo``'s).
        mixing_factor: the ``"mix"`` merge's share of local work.
        offload: keep this rank's shards of theta_global and of the outer optimizer's state in CPU memory.
        compressor: average the pseudo-gradient through an element- or block-wise compressor (``MinMax``,
            ``SparseLoCo``, ...), run on this rank's shard; ones that need whole matrices are refused.
        replica_group: ranks per replica group ``S * T``: ``"node"`` or an integer dividing the world size.
        monitor: add an :class:`~lightning_gradcomp.callbacks.OuterMonitor` unless the trainer has one.
        sigterm_check: ``"sync"`` (Lightning's SIGTERM broadcast once a sync period) or ``"step"``.
        fault_tolerance: a :class:`~lightning_gradcomp.TorchFT`: this Lightning job is one replica group of FSDP2
            shards in a run whose outer exchange goes through torchft (rank ``j`` of every group exchanges shard
            ``j``); a group that dies costs the others at most one round, and one that (re)starts heals shard by
            shard from a live group (docs/fault_tolerance.md). ``replica_group`` is then the whole job.
        data_parallel_size: ``"auto"`` or ``S``: FSDP2's shards inside a group (``replica_group / T``).
        tensor_parallel_size: ``"auto"`` (1) or ``T``: the ranks of a group that the module's tensor parallelism
            spans (``parallelize_module`` over ``self.device_mesh["tensor_parallel"]``, then ``fully_shard``); the
            group is ``S * T`` ranks. 1 with ``fault_tolerance``.
        save_distributed_checkpoint: ``True`` (a distributed-checkpoint folder); ``False`` is refused.
        process_group_backend, timeout: as ``ModelParallelStrategy``'s.

    Raises:
        MisconfigurationException: If an argument is out of range or of the wrong type (one line naming it, what is
            accepted and what was given); when fitting starts, if a trained parameter is not sharded on the group's
            own mesh, ``configure_optimizers`` returns more than one optimizer, or ``replica_group`` does not divide
            the processes.

    Example::

        >>> from lightning.pytorch import Trainer
        >>> from lightning_gradcomp import ShardedDiLoCo
        >>> trainer = Trainer(accelerator="cpu", devices=4, strategy=ShardedDiLoCo(sync_every=100, replica_group=2))
    """

    strategy_name = "diloco_sharded"

    def __init__(
        self,
        sync_every: int | str = AUTO,
        outer_optimizer: OuterOptimizerCallable | type[Optimizer] | None = None,
        fragments: int = 1,
        overlap_steps: int = 0,
        merge: str | None = None,
        mixing_factor: float | None = None,
        offload: bool = False,
        compressor: Compressor | None = None,
        replica_group: int | str = "node",
        monitor: bool = True,
        sigterm_check: str = "sync",
        fault_tolerance: Any = None,
        data_parallel_size: Literal["auto"] | int = "auto",
        tensor_parallel_size: Literal["auto"] | int = "auto",
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        check_arguments(sync_every, outer_optimizer, fragments, overlap_steps, None, compressor, _MiscError)
        check_whole_matrix(compressor)
        sizes = (data_parallel_size, tensor_parallel_size)
        check_refused(replica_group, fault_tolerance, compressor, sizes, save_distributed_checkpoint)
        self._members = sharded_membership_for(fault_tolerance, rank_zero_info, _MiscError)
        self.merge, self.mixing_factor = check_merge(overlap_steps, merge, mixing_factor, _MiscError)
        self.sigterm_check = check_choice(sigterm_check, "sigterm_check", _SIGTERM_CHECKS, error=_MiscError)
        check_bool(offload, "offload", error=_MiscError)
        self._monitor = check_bool(monitor, "monitor", error=_MiscError)
        super().__init__(
            data_parallel_size, tensor_parallel_size, save_distributed_checkpoint, process_group_backend, timeout
        )
        self.tensor_parallel = 1 if tensor_parallel_size == "auto" else int(tensor_parallel_size)
        self.replica_group = replica_group
        self.fault_tolerance = fault_tolerance
        self._start_round(sync_every, outer_optimizer, fragments, overlap_steps, offload, compressor, self._members)
        self._checkpoints = ShardedCheckpoints(self._round)
        self._gradients_checked = False
        self._sigterm_gate = SigtermGate()
        self.groups = self.group_size = 1

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register ``"diloco_sharded"`` (unless the registry already has that name: a user's own entry is kept)."""
        if cls.strategy_name not in strategy_registry:
            strategy_registry.register(cls.strategy_name, cls, description="DiLoCo over FSDP2-sharded replica groups")

    @property
    def group_mesh(self) -> DeviceMesh:
        """The replica group's own mesh: ``data_parallel`` (FSDP2's), with ``tensor_parallel`` when ``T > 1``."""
        return self.device_mesh[GROUP_DIMS[1:] if self.tensor_parallel > 1 else GROUP_DIMS[1]]

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Every FSDP2 rank reads its own part of the data, the ranks of a tensor-parallel block the same part.

        ``ModelParallelStrategy``'s split would repeat the data in every group.
        """
        split = group_split(self)  # with fault tolerance, training data is split over every group's ranks too
        return {key: value // self.tensor_parallel for key, value in split.items()}

    # ------------------------------------------------------------------------------------------------------------
    # Lightning's side: launcher, monitor, mesh
    # ------------------------------------------------------------------------------------------------------------
    @override
    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        if type(self._launcher) is _SubprocessScriptLauncher and self.cluster_environment is not None:
            environment = self.cluster_environment  # stops every rank when one fails, and names it
            self._launcher = ScriptLauncher(environment, self.num_processes, self.num_nodes, label="ShardedDiLoCo")

    @override
    def connect(self, model: pl.LightningModule) -> None:
        """Connect the model; when fitting, add an ``OuterMonitor`` unless the trainer has one (before ``setup``)."""
        super().connect(model)
        trainer = getattr(model, "_trainer", None)
        if trainer is None or trainer.state.fn != TrainerFn.FITTING or not self._monitor:
            return
        if not any(isinstance(cb, OuterMonitor) for cb in trainer.callbacks):
            trainer.callbacks.append(OuterMonitor())

    @override
    def setup_environment(self) -> None:
        """Start the processes, then the ``(G, S, T)`` mesh of :data:`GROUP_DIMS` (a group's: its last two)."""
        share_cores(self.fault_tolerance, self.num_processes, rank_zero_info)
        ParallelStrategy.setup_environment(self)
        self._setup_distributed()
        fault_tolerant = self.fault_tolerance is not None
        self.group_size = sharded_group_size(self.replica_group, self.world_size, self.num_nodes, fault_tolerant)
        self.groups = self.world_size // self.group_size
        tensor = self.tensor_parallel
        self._data_parallel_size = data_parallel_of(self.group_size, self._data_parallel_size, tensor)
        self._tensor_parallel_size = tensor
        self._device_mesh = build_mesh(self.root_device.type, self.groups, self._data_parallel_size, tensor)
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._device_mesh

    @override
    def on_exception(self, exception: BaseException) -> None:
        """Note this rank's own failure for the launcher's report (a failed collective is another rank's fault)."""
        super().on_exception(exception)
        if not is_collective_failure(exception):
            record_failure(self.global_rank, exception)

    # ------------------------------------------------------------------------------------------------------------
    # Setup: the group's shards checked, every group from group 0's, theta_global taken
    # ------------------------------------------------------------------------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        """``ModelParallelStrategy``'s setup, then (when fitting) the round attached to this rank's local shards."""
        super().setup(trainer)
        if trainer.state.fn != TrainerFn.FITTING:
            return
        named = named_trained(self._module())
        check_fit(len(self.optimizers), len(named), self.fragments, _MiscError)
        check_sharded_parameters(named, self.group_mesh)
        round = self._round
        total = float(trainer.estimated_stepping_batches)
        auto = auto_sync_every(total, self.fragments, self.overlap_steps)
        self.sync_every = round.sync_every = auto if self._sync_every_arg == AUTO else int(self._sync_every_arg)
        check_schedule(round.sync_every, self.fragments, self.overlap_steps, _MiscError)
        peers = self.device_mesh["diloco"].get_group()
        shards, buffers = local_shards([p for _, p in named]), list(self._module().buffers())
        broadcast_from_first_group(shards, buffers, peers)
        round.process_group = peers
        group = replica_process_group(self.device_mesh)
        self._members.shard_over(group, self.groups, self.group_size, self._trained, self.tensor_parallel)
        buffer_names = [n for n, b in self._module().named_buffers() if b.is_floating_point()]
        round.attach(shards, buffers, [n for n, _ in named], buffer_names, self._job(trainer))
        round.fragment_params = global_fragments([p for _, p in named], self.fragments)
        self._attached, self._gradients_checked, self._stale_noted = True, False, False
        if self.sigterm_check == "sync" and self.world_size > 1:
            self._sigterm_gate.install(trainer, self._checks_sigterm_now)
        self._checkpoints.setup(self, named)
        outer_steps = few_outer_steps(total, round.sync_every, None if self._sync_every_arg == AUTO else auto)
        assert round.optimizer is not None
        workers = self._members.workers_at_setup(self.world_size)  # None: counted at the first sync
        alone = one_worker(workers) if workers is not None else None
        notes = (self._outer_note, low_outer_lr(round.optimizer), alone, outer_steps)
        announce(self, sum(p.numel() for _, p in named), notes)

    def _trained(self) -> list[Tensor]:
        """The module's trained parameters (DTensors), as the membership's dense step reads them."""
        return [p for _, p in named_trained(self._module())]

    def _module(self) -> pl.LightningModule:
        if self.lightning_module is None:
            raise RuntimeError("ShardedDiLoCo has no LightningModule yet: it is connected by the Trainer.")
        return self.lightning_module

    def _checks_sigterm_now(self) -> bool:
        return not self._attached or self.synchronous or self._round.checks_sigterm_now()

    def _evaluated(self) -> list[Tensor]:
        """This rank's local shards and the module's buffers (what validation swaps for theta_global)."""
        return [*local_shards([p for _, p in named_trained(self._module())]), *self._module().buffers()]

    # ------------------------------------------------------------------------------------------------------------
    # The inner step and the sync
    # ------------------------------------------------------------------------------------------------------------
    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        """The inner step (FSDP2 inside the group); every ``sync_every / fragments`` steps a sync of the shards.

        While :attr:`synchronous` the gradient shards are also averaged across groups (HSDP's step), and
        theta_global follows the synchronized model (a round in progress is closed first).
        """
        if not (self._attached and self._module().trainer.state.fn == TrainerFn.FITTING):
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        if not self._gradients_checked:
            closure = checking_gradients(closure, named_trained(self._module()))
            self._gradients_checked = True
        step = functools.partial(super().optimizer_step, optimizer, model=model, **kwargs)
        output, due = self._round.inner_step(closure, step, self.optimizers, self.synchronous)
        if due is not None:  # the sync starts here, one frame above the exchange
            self._round.send(due, self.optimizers)
        return output

    # ------------------------------------------------------------------------------------------------------------
    # Checkpoints (sharded_checkpoint): theta_global as the weights, the outer state as DTensors in the DCP folder
    # ------------------------------------------------------------------------------------------------------------
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The module's sharded state dict with theta_global in place of this rank's own shards."""
        state = super().lightning_module_state_dict()
        return self._checkpoints.with_theta_global(state) if self._attached else state

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        """``ModelParallelStrategy``'s folder, with the outer state and each group's own state as DTensors in it."""
        if self._attached and "loops" in checkpoint and storage_options is None:
            self._checkpoints.save(checkpoint, filepath, self._local)
            return
        super().save_checkpoint(checkpoint, filepath, storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        """Load the weights (theta_global), then, when fitting, the round and each group's own state.

        A folder of another strategy (``ModelParallelStrategy``'s) is loaded as that strategy loads it, and its
        weights become theta_global.
        """
        path = Path(self.broadcast(checkpoint_path))
        if not (self._attached and (path / _METADATA_FILENAME).is_file()):
            return super().load_checkpoint(checkpoint_path, weights_only)
        if SECTION not in torch.load(path / _METADATA_FILENAME, weights_only=weights_only):
            checkpoint = super().load_checkpoint(checkpoint_path, weights_only)
        else:  # the inner optimizer state is the round's per-group tensors, not Lightning's `optimizer_0`
            strict = self._module().strict_loading
            checkpoint = _load_checkpoint(path, {"state_dict": self.model}, strict=strict, weights_only=weights_only)
        self._checkpoints.restore(checkpoint, path)
        return checkpoint

    @override
    def teardown(self) -> None:
        """``ModelParallelStrategy``'s teardown, then the SIGTERM broadcast back and the compressor's round groups."""
        super().teardown()
        self._sigterm_gate.remove()
        self._round.membership.close()
        self._attached = False
        self._local = None
        if dist.is_available() and dist.is_initialized():
            compressed = self._round.exchange.compressor is not None and not self._members.owns_round_groups()
            if compressed and self._round.process_group is not None:
                release_round_groups(self._round.process_group)
            hand_off_gil()
