"""DiLoCo's training state in checkpoints: the shared state in the checkpoint, each rank's own in a file of its own.

DiLoCo's state has two parts (Douillard et al. 2023, arXiv 2311.08105, Algorithm 1). theta_global, the outer
optimizer's state and the phase in the round are the same on every rank: they go into the checkpoint rank 0 writes
(``checkpoint["diloco"]``; its ``state_dict`` holds theta_global too, for inference). Every rank's local parameters
and buffers, its inner optimizer state, its pseudo-gradient in flight and its compressor's error-feedback residuals
differ between ranks: the checkpoint is a directory, into which each rank writes them in a file of its own
(:mod:`lightning_gradcomp.runtime.rank_state`), so rank 0's checkpoint is as large with 64 ranks as with 2, and no
rank's state passes through rank 0's memory. In the rare run where they are the same on every rank (a stateless inner
optimizer, saved right after a sync), they go into the one file instead.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_gradcomp.diloco.round import Round
from lightning_gradcomp.runtime.rank_state import entry_folder, load_rank_state, save_entry

__all__ = [
    "CHECKPOINT_KEY",
    "load_own_state",
    "load_shared_exchange_state",
    "own_state",
    "restart_from_global",
    "restore",
    "restore_own_state",
    "save_diloco_state",
    "with_theta_global",
]

CHECKPOINT_KEY = "diloco"


def save_diloco_state(
    checkpoint: dict[str, Any],
    filepath: str | Path,
    shared: dict[str, Any],
    own: dict[str, Any],
    checkpoint_io: Any,
    rank: int,
    world_size: int,
    barrier: Callable[[str], None],
    device: torch.device,
    storage_options: Any | None = None,
) -> bool:
    """Put the ``shared`` state into ``checkpoint``, and this rank's ``own`` into its file of the checkpoint directory.

    Call it on every rank. Returns whether the checkpoint is a directory of per-rank files (the same on every rank):
    ``own`` is compared between ranks unless it surely differs (inner optimizer state, an exchange in flight or
    residuals); where it is the same everywhere it goes into ``checkpoint`` instead.
    """
    step = int(checkpoint.get("global_step", 0))
    own = {**own, "global_step": step}
    surely_own = _surely_own(own)
    args = (checkpoint_io, filepath, CHECKPOINT_KEY, own, surely_own, rank, world_size, barrier, device)
    plan = save_entry(*args, storage_options=storage_options)
    checkpoint[CHECKPOINT_KEY] = {"world_size": world_size, "step": step, **shared}
    if not plan.per_rank:
        checkpoint[CHECKPOINT_KEY]["own"] = own
    return plan.per_rank


def _surely_own(own: Mapping[str, Any]) -> bool:
    """Whether ``own`` holds what a rank always has of its own, without comparing its parameters between ranks."""
    optimizer_state = any(state.get("state") for state in own["optimizer_states"])
    exchange = own["exchange"]
    return optimizer_state or own["contribution"] is not None or bool(exchange["residuals"])


def load_own_state(
    checkpoint: Mapping[str, Any],
    checkpoint_path: str | Path,
    checkpoint_io: Any,
    rank: int,
    world_size: int,
    warn: Callable[[str], Any] = warnings.warn,
) -> dict[str, Any] | None:
    """This rank's own state saved with ``checkpoint`` (loaded from ``checkpoint_path``), or ``None``.

    The state every rank shared (inside the checkpoint) on any number of ranks. ``None`` when the checkpoint holds no
    DiLoCo state, its per-rank files were saved by another number of ranks, or this rank's file is missing or belongs
    to another checkpoint; the last two with a warning: every rank then starts from theta_global.
    """
    section = checkpoint.get(CHECKPOINT_KEY)
    if section is None:
        return None
    if "own" in section:
        return section["own"]
    saved_world_size = int(section["world_size"])
    if saved_world_size != world_size:
        warn(
            f"DiLoCo: the checkpoint was saved by {saved_world_size} processes, this run has {world_size}:"
            " theta_global, the outer optimizer's state and the phase in the round carry over; every rank's own"
            " parameters (and compressor residuals) cannot be mapped to the new ranks and are reset to theta_global,"
            " with rank 0's inner optimizer state."
        )
        return None
    own = load_rank_state(checkpoint_path, CHECKPOINT_KEY, rank, checkpoint_io)
    if own is None or own.state.get("global_step") != section["step"]:
        warn(
            f"DiLoCo: the per-rank state of {checkpoint_path} is missing or older than the checkpoint (each rank's file"
            f" belongs in {entry_folder(checkpoint_path)}): every rank's own parameters are reset to theta_global, with"
            " rank 0's inner optimizer state."
        )
        return None
    return own.state


def load_shared_exchange_state(
    checkpoint: Mapping[str, Any], checkpoint_path: str | Path, checkpoint_io: Any
) -> dict[str, Any] | None:
    """Rank 0's compressor state and exchange counter, without its residuals (for a run on another number of ranks).

    ``None`` if the checkpoint has no compressor state or rank 0's file cannot be read from here.
    """
    section = checkpoint.get(CHECKPOINT_KEY)
    if section is None:
        return None
    saved = load_rank_state(checkpoint_path, CHECKPOINT_KEY, 0, checkpoint_io)
    exchange = saved.state.get("exchange") if saved is not None else None
    return {**exchange, "residuals": {}} if exchange is not None else None


def own_state(round: Round, tensors: Sequence[Tensor], optimizers: Sequence[Optimizer]) -> dict[str, Any]:
    """This rank's own training state, on the CPU.

    Its parameters and buffers (``tensors``), its inner optimizers' state, its pseudo-gradient in flight (sent again on
    resume) and its exchange's residuals.
    """
    return {
        "tensors": [t.detach().to("cpu", copy=True) for t in tensors],
        "optimizer_states": [o.state_dict() for o in optimizers],
        **round.own_state(),
    }


def restore_own_state(
    round: Round, shared: dict[str, Any], own: dict[str, Any], tensors: Sequence[Tensor], device: torch.device
) -> None:
    """Resume exactly: the round, this rank's parameters and buffers (``tensors``, the model's), its residuals.

    The exchange that was in flight is sent again, with the same values.
    """
    round.load_state_dict(shared)
    with torch.no_grad():
        for mine, saved in zip(tensors, own["tensors"], strict=True):
            mine.copy_(saved)
    round.load_own_state(own, device)


def restart_from_global(
    round: Round, shared: dict[str, Any], new_round: bool, shared_exchange: dict[str, Any] | None
) -> None:
    """Every rank from the saved theta_global and outer state, without its own state (none can be mapped to it).

    The round goes on at the saved phase (``new_round``: a new one starts), without the exchange that was in flight;
    ``shared_exchange`` (rank 0's compressor state without residuals), if given, is loaded.
    """
    state = {**shared, "dirty": [False] * len(round.dirty), "pending": None}
    if new_round:
        state["phase"] = 0
    round.load_state_dict(state)
    if round.exchange.compressor is not None and shared_exchange is not None:
        round.exchange.load_state_dict(shared_exchange)
    round.weights_of().copy_to()
    round.weights_of().restore_buffers()


def restore(
    round: Round,
    section: Mapping[str, Any],
    own: dict[str, Any] | None,
    tensors: Sequence[Tensor],
    device: torch.device,
    shared_exchange: dict[str, Any] | None,
    warn: Callable[[str], Any] = warnings.warn,
) -> None:
    """Resume from a checkpoint's ``"diloco"`` section: exactly with this rank's ``own`` state, else from theta_global.

    A checkpoint of another schedule (``sync_every``, ``fragments``) starts a new round from its theta_global, with a
    warning; one without this rank's own state (another world size) goes on at its phase from theta_global.
    """
    same_schedule = section["sync_every"] == round.sync_every and section["fragments"] == round.fragments
    if same_schedule and own is not None:
        restore_own_state(round, section["outer"], own, tensors, device)
        return
    if not same_schedule:
        warn(
            f"DiLoCo: the checkpoint synced every {section['sync_every']} steps in {section['fragments']}"
            f" fragments, this run every {round.sync_every} in {round.fragments}: a new round starts from"
            " its theta_global."
        )
    restart_from_global(round, section["outer"], not same_schedule, shared_exchange)


def with_theta_global(
    state: dict[str, Any], module: nn.Module, params: Sequence[Tensor], buffers: Sequence[Tensor], round: Round
) -> dict[str, Any]:
    """``state`` (the module's state dict) with theta_global and the buffers of the last sync in place of the rank's."""
    floats = [b for b in buffers if b.is_floating_point()]
    shared = {id(p): g for p, g in zip(params, round.params)}
    shared.update({id(b): g for b, g in zip(floats, round.weights_of().buffers)})
    for name, value in module.state_dict(keep_vars=True).items():
        if id(value) in shared and name in state:
            state[name] = shared[id(value)].detach().clone().to(state[name].device)
    return state
