"""The hook's state in checkpoints: inside the checkpoint when every rank's is the same, else each rank's in its file.

``CompressedDDP`` calls :func:`save_compression_state` and :func:`restore_compression_state` from its
``save_checkpoint`` and ``load_checkpoint``. The layout is :mod:`lightning_gradcomp.runtime.rank_state`'s. Without
error-feedback residuals or other state of a rank's own (``Identity``, ``FP16``, ``BF16``, a compressor without error
feedback whose state every rank shares), the state goes into the one file rank 0 writes, ``checkpoint["gradcomp"]``;
otherwise every rank writes its own into the checkpoint directory, and ``checkpoint["gradcomp"]`` only says so. Either
way rank 0's file is as large as plain ``DDPStrategy``'s plus the shared state, whatever the number of ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_gradcomp.ddp.hook import CompressionState
from lightning_gradcomp.runtime.rank_state import entry_folder, load_rank_state, save_entry

__all__ = ["CHECKPOINT_KEY", "restore_compression_state", "save_compression_state"]

CHECKPOINT_KEY = "gradcomp"


def save_compression_state(
    state: CompressionState,
    checkpoint: dict[str, Any],
    filepath: _PATH,
    checkpoint_io: CheckpointIO,
    rank: int,
    world_size: int,
    barrier: Callable[[str], None],
    device: torch.device,
    storage_options: Any | None = None,
) -> bool:
    """Put this rank's state into ``checkpoint``, or into its own file of the checkpoint at ``filepath`` (every rank).

    Returns whether the checkpoint is a directory of per-rank files (the same answer on every rank). Residuals make a
    rank's state its own; without them the ranks compare their states (one small collective).
    """
    step = int(checkpoint.get("global_step", 0))
    own = {**state.state_dict(), "global_step": step}
    args = (checkpoint_io, filepath, CHECKPOINT_KEY, own, bool(own["residuals"]), rank, world_size, barrier, device)
    plan = save_entry(*args, storage_options=storage_options)
    checkpoint[CHECKPOINT_KEY] = {"world_size": world_size, "step": step, **({} if plan.per_rank else {"state": own})}
    return plan.per_rank


def restore_compression_state(
    state: CompressionState,
    checkpoint: Mapping[str, Any],
    checkpoint_path: _PATH,
    checkpoint_io: CheckpointIO,
    rank: int,
    world_size: int,
) -> None:
    """Restore this rank's state saved with ``checkpoint`` (loaded from ``checkpoint_path``); call on every rank.

    State every rank shared (inside the checkpoint): restored on any number of ranks. Per-rank files saved by as many
    ranks: each rank gets its own state back; by another number of ranks: the step and the compressor's state (rank
    0's) carry over, the per-rank error-feedback residuals start empty, with a warning. No state (a plain
    ``DDPStrategy`` checkpoint) or missing files: everything starts empty but the step, with a warning.
    """
    saved = checkpoint.get(CHECKPOINT_KEY)
    if saved is None:
        why = "The checkpoint holds no CompressedDDP state (it was not written by CompressedDDP)"
        _start_empty(state, checkpoint, why)
        return
    if "state" in saved:
        state.load_state_dict(saved["state"])
        return
    saved_world_size = int(saved["world_size"])
    same_size = saved_world_size == world_size
    own = load_rank_state(checkpoint_path, CHECKPOINT_KEY, rank, checkpoint_io) if same_size else None
    # on another world size every rank reads rank 0's file, for the state every rank shares
    shared = own if own is not None else load_rank_state(checkpoint_path, CHECKPOINT_KEY, 0, checkpoint_io)
    if shared is None or shared.state.get("global_step") != saved["step"] or (same_size and own is None):
        _start_empty(
            state,
            checkpoint,
            f"The per-rank CompressedDDP state of {checkpoint_path} is missing or older"
            f" than the checkpoint (each rank's file belongs in {entry_folder(checkpoint_path)})",
        )
        return
    _restore(state, own.state if own is not None else None, shared.state, saved_world_size, world_size)


def _restore(
    state: CompressionState, own: dict[str, Any] | None, shared: dict[str, Any], saved_world_size: int, world_size: int
) -> None:
    if own is not None:
        state.load_state_dict(own)
        return
    rank_zero_warn(
        f"The checkpoint's compressor state was saved by {saved_world_size} processes, this run has {world_size}: the"
        " step and the compressor's state carry over (rank 0's), the per-rank error-feedback residuals cannot be"
        " mapped to the new ranks and start empty."
    )
    state.load_state_dict({**shared, "residuals": {}})


def _start_empty(state: CompressionState, checkpoint: Mapping[str, Any], why: str) -> None:
    if "loops" not in checkpoint:  # weights only: no training state was expected
        return
    state.step = int(checkpoint.get("global_step", 0))  # the optimizer steps taken (DGC's warm-up, shared seeds)
    rank_zero_warn(f"{why}: error-feedback residuals and compressor state start empty.")
