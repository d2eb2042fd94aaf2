"""Per-rank state beside a Lightning checkpoint: each rank writes and reads its own file, none goes through rank 0.

A Lightning checkpoint is one file that rank 0 writes. State that differs between ranks (error-feedback residuals, a
rank's local weights and inner optimizer state in periodic synchronization) would have to be gathered into rank 0's
memory to go into it, which grows with the number of ranks. Here every rank saves its own state dictionary into a
folder beside the checkpoint file, named after it::

    epoch=3.ckpt                    # Lightning's checkpoint (rank 0)
    epoch=3.ckpt.ranks/
        gradcomp.rank0.pt           # what rank 0 saved under the key "gradcomp"
        gradcomp.rank1.pt           # what rank 1 saved, written by rank 1

The checkpoint file stays a plain Lightning checkpoint (``Trainer(ckpt_path=...)``, ``DDPStrategy`` and
``ModelCheckpoint`` handle it as any other), and the folder's name never looks like a checkpoint to Lightning's
``ckpt_path="last"`` search (its suffix is not ``.ckpt``). A strategy calls :func:`save_rank_state` on every rank in
its ``save_checkpoint``, :func:`load_rank_state` in its ``load_checkpoint`` and :func:`remove_rank_states` in its
``remove_checkpoint``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from lightning.fabric.utilities.cloud_io import _atomic_save, get_filesystem
from lightning.fabric.utilities.cloud_io import _load as load_file
from lightning.fabric.utilities.types import _PATH

__all__ = ["RankState", "load_rank_state", "rank_state_dir", "rank_state_path", "remove_rank_states", "save_rank_state"]

#: the layout of a rank's file (what :func:`save_rank_state` writes around the state)
FORMAT = 1
_SUFFIX = ".ranks"


@dataclass(frozen=True)
class RankState:
    """A state dictionary one rank saved with a checkpoint.

    Attributes:
        state: what the rank passed to :func:`save_rank_state`.
        rank: the global rank that saved it.
        world_size: how many ranks the run that saved it had.
    """

    state: dict[str, Any]
    rank: int
    world_size: int


def _resolved(checkpoint_path: _PATH) -> str:
    """The checkpoint's path with a local symbolic link followed (``ModelCheckpoint(save_last="link")``'s last)."""
    path = str(checkpoint_path)
    fs = get_filesystem(path)
    return os.path.realpath(path) if "file" in fs.protocol else path


def rank_state_dir(checkpoint_path: _PATH) -> str:
    """The folder that holds the per-rank files of the checkpoint at ``checkpoint_path``."""
    return _resolved(checkpoint_path) + _SUFFIX


def rank_state_path(checkpoint_path: _PATH, key: str, rank: int) -> str:
    """The file in which ``rank`` keeps its state ``key`` for the checkpoint at ``checkpoint_path``."""
    if not key or "/" in key or "." in key:
        raise ValueError(f"Expected `key` to be a non-empty name without '/' or '.', got {key!r}.")
    return os.path.join(rank_state_dir(checkpoint_path), f"{key}.rank{rank}.pt")


def save_rank_state(checkpoint_path: _PATH, key: str, state: dict[str, Any], rank: int, world_size: int) -> str:
    """Save this rank's ``state`` under ``key`` beside the checkpoint at ``checkpoint_path``; return the file's path.

    Call it on the rank that owns ``state`` (every rank for its own), when the checkpoint is saved. The file is written
    whole or not at all (a temporary file renamed into place), so a rank that reads it never sees half of it.

    Args:
        checkpoint_path: the Lightning checkpoint's path (the file rank 0 writes; it need not exist yet).
        key: a name for the state (one file per key and rank), such as ``"gradcomp"``.
        state: what to save (picklable; tensors are best on the CPU).
        rank: this rank's global rank.
        world_size: the number of ranks of the run.
    """
    path = rank_state_path(checkpoint_path, key, rank)
    get_filesystem(path).makedirs(os.path.dirname(path), exist_ok=True)
    _atomic_save({"format": FORMAT, "rank": rank, "world_size": world_size, "state": state}, path)
    return path


def load_rank_state(checkpoint_path: _PATH, key: str, rank: int) -> RankState | None:
    """What ``rank`` saved under ``key`` with the checkpoint at ``checkpoint_path``; ``None`` if it saved nothing.

    A run that resumes on more ranks than saved the checkpoint finds no file for its extra ranks; they may read another
    rank's (rank 0's, say) for the state every rank shares. Tensors load on the CPU.
    """
    path = rank_state_path(checkpoint_path, key, rank)
    if not get_filesystem(path).exists(path):
        return None
    saved = load_file(path, map_location="cpu", weights_only=False)
    if saved.get("format") != FORMAT:
        raise ValueError(f"{path} holds per-rank state of format {saved.get('format')!r}; this version reads {FORMAT}.")
    return RankState(state=saved["state"], rank=int(saved["rank"]), world_size=int(saved["world_size"]))


def remove_rank_states(checkpoint_path: _PATH, rank: int) -> None:
    """Remove what ``rank`` saved beside the checkpoint at ``checkpoint_path`` (every key), and the folder once empty.

    Call it on every rank when the checkpoint is removed (a strategy's ``remove_checkpoint``): each rank removes its own
    files, so that ranks on other machines, which may not share a file system, remove theirs too.
    """
    folder = rank_state_dir(checkpoint_path)
    fs = get_filesystem(folder)
    if not fs.isdir(folder):
        return
    for path in fs.ls(folder, detail=False):
        if str(path).endswith(f".rank{rank}.pt"):
            fs.rm(path)
    try:
        if not fs.ls(folder, detail=False):
            fs.rmdir(folder)
    except (FileNotFoundError, OSError):  # another rank emptied and removed it first, or is still writing
        pass
