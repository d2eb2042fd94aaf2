"""The hook's state in checkpoints: each rank's in a file of its own beside the checkpoint, never gathered to rank 0.

``CompressedDDP`` calls :func:`save_compression_state` and :func:`restore_compression_state` from its
``save_checkpoint`` and ``load_checkpoint``. The files are :mod:`lightning_gradcomp.runtime.rank_state`'s; the
checkpoint itself only says that they exist (``checkpoint["gradcomp"]``), so rank 0's checkpoint is as large as plain
``DDPStrategy``'s whatever the number of ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_gradcomp.ddp.hook import CompressionState
from lightning_gradcomp.runtime.rank_state import load_rank_state, rank_state_dir, save_rank_state

__all__ = ["CHECKPOINT_KEY", "restore_compression_state", "save_compression_state"]

CHECKPOINT_KEY = "gradcomp"


def save_compression_state(
    state: CompressionState,
    checkpoint: dict[str, Any],
    filepath: _PATH,
    rank: int,
    world_size: int,
    barrier: Callable[[str], None],
) -> None:
    """Write this rank's state beside ``filepath`` and record in ``checkpoint`` that it is there (call on every rank).

    ``barrier`` (the strategy's) holds every rank until all have written: rank 0 writes the checkpoint after it, so a
    rank that failed before writing leaves the previous checkpoint in place, never one with a missing or stale file.
    """
    step = int(checkpoint.get("global_step", 0))
    save_rank_state(filepath, CHECKPOINT_KEY, {**state.state_dict(), "global_step": step}, rank, world_size)
    barrier("CompressedDDP.save_checkpoint")
    checkpoint[CHECKPOINT_KEY] = {"world_size": world_size, "step": step}


def restore_compression_state(
    state: CompressionState, checkpoint: Mapping[str, Any], checkpoint_path: _PATH, rank: int, world_size: int
) -> None:
    """Restore this rank's state saved with ``checkpoint`` (loaded from ``checkpoint_path``); call on every rank.

    Saved by as many ranks: each rank gets its own state back. Saved by another number of ranks: the step and the
    compressor's state (rank 0's) carry over, the per-rank error-feedback residuals start empty, with a warning. No
    state (a plain ``DDPStrategy`` checkpoint) or missing files: everything starts empty but the step, with a warning.
    """
    saved = checkpoint.get(CHECKPOINT_KEY)
    if saved is None:
        why = "The checkpoint holds no CompressedDDP state (it was not written by CompressedDDP)"
        _start_empty(state, checkpoint, why)
        return
    saved_world_size = int(saved["world_size"])
    same_size = saved_world_size == world_size
    own = load_rank_state(checkpoint_path, CHECKPOINT_KEY, rank) if same_size else None
    # on another world size every rank reads rank 0's file, for the state every rank shares
    shared = own if own is not None else load_rank_state(checkpoint_path, CHECKPOINT_KEY, 0)
    if shared is None or shared.state.get("global_step") != saved["step"] or (same_size and own is None):
        _start_empty(
            state,
            checkpoint,
            f"The per-rank CompressedDDP state of {checkpoint_path} is missing or older"
            f" than the checkpoint (it belongs in {rank_state_dir(checkpoint_path)})",
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
