"""DiLoCo's training state in checkpoints: the shared state in the checkpoint, each rank's own in a file beside it.

DiLoCo's state has two parts (Douillard et al. 2023, arXiv 2311.08105, Algorithm 1). theta_global, the outer
optimizer's state and the phase in the round are the same on every rank: they go into the checkpoint rank 0 writes
(``checkpoint["diloco"]``; its ``state_dict`` holds theta_global too, for inference). Every rank's local parameters
and buffers, its inner optimizer state, its pseudo-gradient in flight and its compressor's error-feedback residuals
differ between ranks: each rank writes them into a file of its own beside the checkpoint
(:mod:`lightning_gradcomp.runtime.rank_state`), so rank 0's checkpoint is as large with 64 ranks as with 2, and no
rank's state passes through rank 0's memory.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_gradcomp.diloco.round import Round
from lightning_gradcomp.runtime.rank_state import load_rank_state, rank_state_dir, save_rank_state

__all__ = [
    "CHECKPOINT_KEY",
    "load_own_state",
    "load_shared_exchange_state",
    "own_state",
    "restart_from_global",
    "restore_own_state",
    "save_diloco_state",
    "with_theta_global",
]

CHECKPOINT_KEY = "diloco"


def save_diloco_state(
    checkpoint: dict[str, Any],
    filepath: _PATH,
    shared: dict[str, Any],
    own: dict[str, Any],
    rank: int,
    world_size: int,
    barrier: Callable[[str], None],
) -> None:
    """Write this rank's ``own`` state beside ``filepath`` and put the ``shared`` state into ``checkpoint``.

    Call it on every rank. ``barrier`` (the strategy's) holds every rank until all have written: rank 0 writes the
    checkpoint after it, so a rank that failed before writing leaves the previous checkpoint in place, never one whose
    rank files are missing or stale.
    """
    step = int(checkpoint.get("global_step", 0))
    save_rank_state(filepath, CHECKPOINT_KEY, {**own, "global_step": step}, rank, world_size)
    barrier("DiLoCo.save_checkpoint")
    checkpoint[CHECKPOINT_KEY] = {"world_size": world_size, "step": step, **shared}


def load_own_state(
    checkpoint: Mapping[str, Any], checkpoint_path: _PATH, rank: int, world_size: int
) -> dict[str, Any] | None:
    """This rank's own state saved with ``checkpoint`` (loaded from ``checkpoint_path``), or ``None``.

    ``None`` when the checkpoint holds no DiLoCo state, was saved by another number of ranks, or this rank's file is
    missing or belongs to another checkpoint; the last two with a warning: every rank then starts from theta_global.
    """
    section = checkpoint.get(CHECKPOINT_KEY)
    if section is None:
        return None
    saved_world_size = int(section["world_size"])
    if saved_world_size != world_size:
        rank_zero_warn(
            f"DiLoCo: the checkpoint was saved by {saved_world_size} processes, this run has {world_size}:"
            " theta_global, the outer optimizer's state and the phase in the round carry over; every rank's own"
            " parameters (and compressor residuals) cannot be mapped to the new ranks and are reset to theta_global,"
            " with rank 0's inner optimizer state."
        )
        return None
    own = load_rank_state(checkpoint_path, CHECKPOINT_KEY, rank)
    if own is None or own.state.get("global_step") != section["step"]:
        rank_zero_warn(
            f"DiLoCo: the per-rank state of {checkpoint_path} is missing or older than the checkpoint (it belongs in"
            f" {rank_state_dir(checkpoint_path)}): every rank's own parameters are reset to theta_global, with rank 0's"
            " inner optimizer state."
        )
        return None
    return own.state


def load_shared_exchange_state(checkpoint: Mapping[str, Any], checkpoint_path: _PATH) -> dict[str, Any] | None:
    """Rank 0's compressor state and exchange counter, without its residuals (for a run on another number of ranks).

    ``None`` if the checkpoint has no compressor state or rank 0's file cannot be read from here.
    """
    section = checkpoint.get(CHECKPOINT_KEY)
    if section is None:
        return None
    saved = load_rank_state(checkpoint_path, CHECKPOINT_KEY, 0)
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
    round.copy_to()
    round.restore_buffers()


def with_theta_global(
    state: dict[str, Any], module: nn.Module, params: Sequence[Tensor], buffers: Sequence[Tensor], round: Round
) -> dict[str, Any]:
    """``state`` (the module's state dict) with theta_global and the buffers of the last sync in place of the rank's."""
    floats = [b for b in buffers if b.is_floating_point()]
    shared = {id(p): g for p, g in zip(params, round.params)}
    shared.update({id(b): g for b, g in zip(floats, round.buffers)})
    for name, value in module.state_dict(keep_vars=True).items():
        if id(value) in shared and name in state:
            state[name] = shared[id(value)].detach().clone().to(state[name].device)
    return state
