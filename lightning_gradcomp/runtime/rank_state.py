"""Checkpoints whose state may differ between ranks: one entry in the checkpoint folder, each rank writing its own part.

A Lightning checkpoint is one file that rank 0 writes. State that differs between ranks (error-feedback residuals, a
rank's local weights and inner optimizer state in periodic synchronization) would have to be gathered into rank 0's
memory to go into it, which grows with the number of ranks. So when a checkpoint is saved, the ranks first compare
their own state (:func:`plan_entry`, one small collective):

- the same on every rank (no rank holds state of its own: ``Identity``, ``FP16``, a configuration without error
  feedback): one file at the checkpoint's path, what ``DDPStrategy`` writes, the shared state inside it;
- not the same: a directory at the checkpoint's path, as Lightning's sharded checkpoints are, with Lightning's
  checkpoint (rank 0's, as large as ``DDPStrategy``'s whatever the number of ranks) and every rank's own file, each
  written by its rank, none through rank 0::

      epoch=3.ckpt/
          checkpoint.ckpt       # Lightning's checkpoint (rank 0)
          gradcomp.rank0.pt     # what rank 0 saved under the key "gradcomp"
          gradcomp.rank1.pt     # what rank 1 saved, written by rank 1

Either way the checkpoint is one entry, which ``ModelCheckpoint`` keeps, links, rotates and removes, and which
``Trainer(ckpt_path=...)`` loads. Every file is written, read and removed through the strategy's ``CheckpointIO``, so a
user's own (an asynchronous one, a remote store) applies to all of them. A strategy calls :func:`save_entry` on every
rank in its ``save_checkpoint`` (and :func:`make_room_for_file` on rank 0 before writing one file),
:func:`checkpoint_file` and :func:`load_rank_state` in its ``load_checkpoint``, and :func:`remove_entry` in its
``remove_checkpoint``.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from lightning.fabric.plugins import CheckpointIO, TorchCheckpointIO
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.fabric.utilities.types import _PATH
from torch import Tensor

from lightning_gradcomp.engine.collectives import gather_rows

__all__ = [
    "CHECKPOINT_FILE",
    "RankState",
    "checkpoint_file",
    "entry_folder",
    "holds_rank_files",
    "load_rank_state",
    "make_room_for_file",
    "plan_entry",
    "rank_state_path",
    "remove_entry",
    "save_entry",
    "save_rank_state",
    "state_checksum",
]

#: the layout of a rank's file (what :func:`save_rank_state` writes around the state)
FORMAT = 1
#: Lightning's checkpoint inside a checkpoint directory
CHECKPOINT_FILE = "checkpoint.ckpt"


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


@dataclass(frozen=True)
class EntryPlan:
    """How a checkpoint is laid out (the same answer on every rank; :func:`plan_entry`).

    Attributes:
        per_rank: a directory with every rank's own file; ``False``: one file, the state shared inside it.
        clear_first: rank 0 removes what is at the path (a file, or a link) before the other ranks write into it.
    """

    per_rank: bool
    clear_first: bool


def state_checksum(state: Any) -> int:
    """A 64-bit checksum of ``state``: its nesting, its tensors' dtypes, shapes and bytes, other values' ``repr``."""
    digest = hashlib.blake2b(digest_size=8)

    def visit(value: Any) -> None:
        if isinstance(value, Tensor):
            tensor = value.detach().to("cpu").contiguous().reshape(-1)
            digest.update(f"T{tensor.dtype}{tuple(value.shape)}".encode())
            digest.update(tensor.view(torch.uint8).numpy().tobytes())
        elif isinstance(value, Mapping):
            digest.update(b"{")
            for key, item in value.items():
                visit(key)
                visit(item)
            digest.update(b"}")
        elif isinstance(value, (list, tuple)):
            digest.update(b"[")
            for item in value:
                visit(item)
            digest.update(b"]")
        else:
            digest.update(repr(value).encode())

    visit(state)
    return int.from_bytes(digest.digest(), "little", signed=True)


def _is_link(path: str) -> bool:
    return "file" in get_filesystem(path).protocol and os.path.islink(path)


def plan_entry(state: Any, own: bool, filepath: _PATH, rank: int, device: torch.device) -> EntryPlan:
    """Whether any rank's ``state`` differs from the others' (a collective: call it on every rank).

    Args:
        state: this rank's state, compared by :func:`state_checksum` unless ``own``.
        own: this rank knows its state is its own (error-feedback residuals, say): no checksum is taken.
        filepath: the checkpoint's path; rank 0 says whether a file or a link is there, in the way of a directory.
        rank: this rank's global rank.
        device: where the collective's tensor lives (the process group's device).
    """
    path = str(filepath)
    fs = get_filesystem(path)
    blocked = rank == 0 and (_is_link(path) or fs.isfile(path))
    row = torch.tensor([int(own), 0 if own else state_checksum(state), int(blocked)], dtype=torch.int64, device=device)
    rows = gather_rows(row).cpu()
    per_rank = bool(rows[:, 0].any()) or bool((rows[:, 1] != rows[0, 1]).any())
    return EntryPlan(per_rank=per_rank, clear_first=per_rank and bool(rows[0, 2]))


def holds_rank_files(path: _PATH) -> bool:
    """Whether the checkpoint at ``path`` is a directory of Lightning's checkpoint and per-rank files."""
    return get_filesystem(str(path)).isdir(str(path))


def checkpoint_file(path: _PATH) -> str:
    """Lightning's checkpoint of the entry at ``path``: the file itself, or the one inside a checkpoint directory.

    Raises:
        FileNotFoundError: If ``path`` is a directory without Lightning's checkpoint in it (another kind of directory,
            or one whose rank 0 did not finish writing).
    """
    if not holds_rank_files(path):
        return str(path)
    inside = os.path.join(str(path), CHECKPOINT_FILE)
    if not get_filesystem(inside).exists(inside):
        raise FileNotFoundError(
            f"{path} is a directory without {CHECKPOINT_FILE}: not a checkpoint of CompressedDDP or DiLoCo, or one"
            " whose rank 0 did not finish writing it."
        )
    return inside


def entry_folder(checkpoint_path: _PATH) -> str:
    """The directory of the entry whose checkpoint is at ``checkpoint_path`` (the entry, or the file inside it)."""
    path = str(checkpoint_path)
    return os.path.dirname(path) if os.path.basename(path) == CHECKPOINT_FILE else path


def rank_state_path(checkpoint_path: _PATH, key: str, rank: int) -> str:
    """The file in which ``rank`` keeps its state ``key`` in the checkpoint at ``checkpoint_path``."""
    if not key or "/" in key or "." in key:
        raise ValueError(f"Expected `key` to be a non-empty name without '/' or '.', got {key!r}.")
    return os.path.join(entry_folder(checkpoint_path), f"{key}.rank{rank}.pt")


def save_rank_state(
    checkpoint_path: _PATH,
    key: str,
    state: dict[str, Any],
    rank: int,
    world_size: int,
    checkpoint_io: CheckpointIO | None = None,
    storage_options: Any | None = None,
) -> str:
    """Write this rank's ``state`` under ``key`` into the checkpoint directory at ``checkpoint_path``; its file's path.

    Written by ``checkpoint_io`` (the strategy's; Lightning's ``TorchCheckpointIO`` if not given, which writes a file
    whole or not at all).
    """
    path = rank_state_path(checkpoint_path, key, rank)
    saved = {"format": FORMAT, "rank": rank, "world_size": world_size, "state": state}
    (checkpoint_io or TorchCheckpointIO()).save_checkpoint(saved, path, storage_options=storage_options)
    return path


def save_entry(
    checkpoint_io: CheckpointIO,
    filepath: _PATH,
    key: str,
    state: dict[str, Any],
    own: bool,
    rank: int,
    world_size: int,
    barrier: Callable[[str], None],
    device: torch.device,
    storage_options: Any | None = None,
) -> EntryPlan:
    """Lay out the checkpoint at ``filepath``; if the ranks' ``state`` differs, each writes its own (on every rank).

    Returns the plan; the caller puts the shared state into Lightning's checkpoint (``state`` too when the plan is not
    per rank) and rank 0 writes it to :func:`checkpoint_file`'s path. Per rank, ``barrier`` holds every rank until all
    have written: rank 0 writes Lightning's checkpoint after it, so a rank that failed before writing leaves no
    checkpoint that looks whole with a file missing or stale (a stale one, of another step, is found out on loading).
    """
    plan = plan_entry(state, own, filepath, rank, device)
    path = str(filepath)
    if plan.clear_first:
        if rank == 0:
            _clear(checkpoint_io, path)
        barrier("gradcomp.save_entry.clear")
    if plan.per_rank:
        save_rank_state(path, key, state, rank, world_size, checkpoint_io, storage_options)
        barrier("gradcomp.save_entry")
    return plan


def make_room_for_file(checkpoint_io: CheckpointIO, path: _PATH) -> None:
    """Remove a checkpoint directory, or a link, at ``path``, where a one-file checkpoint is to go (rank 0 only).

    The other ranks write nothing into a one-file checkpoint: a rank on another machine keeps its files of the
    directory that was there, which a later checkpoint directory at the path overwrites.
    """
    path = str(path)
    if _is_link(path) or holds_rank_files(path):
        _clear(checkpoint_io, path)


def _clear(checkpoint_io: CheckpointIO, path: str) -> None:
    """Remove what is at ``path`` to make room for the other layout (a link goes, its target stays)."""
    if _is_link(path):
        os.remove(path)
    else:
        checkpoint_io.remove_checkpoint(path)


def load_rank_state(
    checkpoint_path: _PATH, key: str, rank: int, checkpoint_io: CheckpointIO | None = None
) -> RankState | None:
    """What ``rank`` saved under ``key`` in the checkpoint at ``checkpoint_path``; ``None`` if it saved nothing there.

    ``checkpoint_path`` is the entry or Lightning's checkpoint inside it; ``checkpoint_io`` the strategy's (Lightning's
    ``TorchCheckpointIO`` if not given). A run that resumes on more ranks than saved the checkpoint finds no file for
    its extra ranks; they may read another rank's (rank 0's, say) for the state every rank shares. Tensors load where
    they were saved (the CPU).
    """
    path = rank_state_path(checkpoint_path, key, rank)
    if not get_filesystem(path).exists(path):
        return None
    saved = (checkpoint_io or TorchCheckpointIO()).load_checkpoint(path, weights_only=False)
    if saved.get("format") != FORMAT:
        raise ValueError(f"{path} holds per-rank state of format {saved.get('format')!r}; this version reads {FORMAT}.")
    return RankState(state=saved["state"], rank=int(saved["rank"]), world_size=int(saved["world_size"]))


def remove_entry(checkpoint_io: CheckpointIO, path: _PATH, key: str, rank: int) -> None:
    """Remove the checkpoint directory at ``path`` (call on every rank); a link to one is removed, not its target.

    Each rank removes its own file, so that ranks on other machines, which may not share a file system, remove theirs
    too; rank 0 also Lightning's checkpoint; then the directory goes with the last file (whichever rank that is: each
    removes it once its own files are gone, which fails while another's are there).
    """
    path = str(path)
    if _is_link(path):
        if rank == 0:
            os.remove(path)
        return
    mine = [rank_state_path(path, key, rank)] + ([os.path.join(path, CHECKPOINT_FILE)] if rank == 0 else [])
    fs = get_filesystem(path)
    for file in mine:
        if fs.exists(file):
            checkpoint_io.remove_checkpoint(file)
    # fails while another rank's files are there (that rank removes it), or once another rank removed it
    with contextlib.suppress(OSError, ValueError):
        fs.rmdir(path)
