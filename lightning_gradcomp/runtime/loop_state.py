"""Lightning's training state of a replica group, as a healing group takes it from a live peer.

A group that (re)joins a run continues from a peer's place, so that ``global_step``, the epoch, ``max_steps``,
checkpoints' names and the logs mean the same on every group: the loops' progress counters, the inner optimizers'
state (with their parameter groups' learning rates: a joiner that kept its own would train with a stale one, the
trap torchtitan PR #4598 fixed), the learning-rate schedulers and the precision plugin's state (a gradient scaler).

The peer's state is taken where it stands inside its optimizer step, and the healing group loads it inside its own
optimizer step, at the same point of Lightning's loop: what Lightning does after the step (counting it, stepping the
schedulers) then happens identically on both. Only the counters are loaded, never a loop's other state: the data
loaders' position stays the group's own (each group reads its own data).

An inner optimizer's state of sharded parameters (FSDP2's DTensors) travels as each rank's local shards: the peer a
rank heals from holds the same shards (rank ``j`` of every group holds shard ``j``), and the shards become DTensors
again on the healing rank's own parameters.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.loops.loop import _Loop
from lightning.pytorch.loops.progress import _BaseProgress
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

__all__ = ["load_training_state", "training_state"]


def training_state(trainer: pl.Trainer) -> dict[str, Any]:
    """The fit loop's counters, the inner optimizers', the schedulers' and the precision plugin's state."""
    return {
        "loops": _progress(trainer.fit_loop),
        "optimizers": [_local_state(optimizer.state_dict()) for optimizer in trainer.strategy.optimizers],
        "schedulers": [config.scheduler.state_dict() for config in trainer.lr_scheduler_configs],
        "precision": trainer.precision_plugin.state_dict(),
    }


def load_training_state(trainer: pl.Trainer, state: dict[str, Any]) -> None:
    """Load :func:`training_state` of a peer into ``trainer`` (same model, optimizers and schedulers).

    Raises:
        ValueError: If the peer has another number of optimizers or schedulers.
    """
    optimizers, configs = trainer.strategy.optimizers, trainer.lr_scheduler_configs
    if len(state["optimizers"]) != len(optimizers) or len(state["schedulers"]) != len(configs):
        raise ValueError(
            f"The peer has {len(state['optimizers'])} optimizers and {len(state['schedulers'])} schedulers, this"
            f" group {len(optimizers)} and {len(configs)}."
        )
    _load_progress(trainer.fit_loop, state["loops"])
    for optimizer, saved in zip(optimizers, state["optimizers"]):
        optimizer.load_state_dict(_sharded_state(optimizer, saved))
    for config, saved in zip(configs, state["schedulers"]):
        config.scheduler.load_state_dict(saved)
    trainer.precision_plugin.load_state_dict(state["precision"])


def _local_state(state: dict[str, Any]) -> dict[str, Any]:
    """An optimizer's ``state_dict`` with every DTensor replaced by its local shard."""
    local = {
        index: {key: value.to_local() if isinstance(value, DTensor) else value for key, value in entry.items()}
        for index, entry in state["state"].items()
    }
    return {**state, "state": local}


def _sharded_state(optimizer: Optimizer, state: dict[str, Any]) -> dict[str, Any]:
    """:func:`_local_state`'s inverse on ``optimizer``'s own parameters.

    A local shard shaped as a DTensor parameter's becomes a DTensor laid out as that parameter (the peer's rank held
    the same shard).
    """
    params = [p for group in optimizer.param_groups for p in group["params"]]
    sharded = {}
    for index, entry in state["state"].items():
        p = params[index]
        if isinstance(p, DTensor):
            entry = {key: _as_parameter(value, p) for key, value in entry.items()}
        sharded[index] = entry
    return {**state, "state": sharded}


def _as_parameter(value: Any, p: DTensor) -> Any:
    if not isinstance(value, Tensor) or isinstance(value, DTensor) or value.shape != p.to_local().shape:
        return value  # a scalar (Adam's step) or a value of another shape stays as it is
    return DTensor.from_local(value, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())


def _progress(loop: _Loop, prefix: str = "") -> dict[str, Any]:
    """Every progress counter of ``loop`` and of the loops inside it, by dotted name; and the stepped batches."""
    found: dict[str, Any] = {}
    for name, value in vars(loop).items():
        if isinstance(value, _BaseProgress):
            found[prefix + name] = value.state_dict()
        elif isinstance(value, _Loop):
            found.update(_progress(value, f"{prefix}{name}."))
    if hasattr(loop, "_batches_that_stepped"):  # the training epoch loop's count for the loggers' step
        found[prefix + "_batches_that_stepped"] = loop._batches_that_stepped
    return found


def _load_progress(loop: _Loop, state: dict[str, Any], prefix: str = "") -> None:
    for name, value in vars(loop).items():
        key = prefix + name
        if isinstance(value, _BaseProgress) and key in state:
            value.load_state_dict(state[key])
        elif isinstance(value, _Loop):
            _load_progress(value, state, f"{key}.")
    if prefix + "_batches_that_stepped" in state:
        loop._batches_that_stepped = state[prefix + "_batches_that_stepped"]  # type: ignore[attr-defined]
