"""``LightningModule.load_from_checkpoint`` reads a checkpoint directory: the Lightning checkpoint inside it.

A checkpoint whose ranks hold state of their own is a directory (:mod:`lightning_gradcomp.runtime.rank_state`).
Lightning's ``load_from_checkpoint`` of a module or a data module opens its path as one file, which fails on a
directory; it needs only the weights and hyperparameters, all of them in the directory's ``checkpoint.ckpt``. So the
function it reads checkpoints with, ``lightning.pytorch.core.saving.pl_load``, is wrapped once, when this package's
strategies are imported: a checkpoint directory is read as its ``checkpoint.ckpt``, and every other path (a file, a
URL, an open file) goes to Lightning's function as before. Without this package imported, give Lightning the file
inside the directory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch.core.saving as saving

from lightning_gradcomp.runtime.rank_state import checkpoint_file, holds_rank_files

__all__ = ["install_directory_loading"]


def install_directory_loading() -> None:
    """Have ``load_from_checkpoint`` read a checkpoint directory as its ``checkpoint.ckpt`` (again: a no-op)."""
    original = saving.pl_load
    if getattr(original, "_gradcomp_directories", False):
        return

    def load(path_or_url: Any, *args: Any, **kwargs: Any) -> Any:
        # an http(s) URL is never a directory, and asking its file system would be a request
        local_or_fsspec = isinstance(path_or_url, (str, Path)) and not str(path_or_url).startswith("http")
        if local_or_fsspec and holds_rank_files(path_or_url):
            path_or_url = checkpoint_file(path_or_url)
        return original(path_or_url, *args, **kwargs)

    load._gradcomp_directories = True  # type: ignore[attr-defined]
    saving.pl_load = load
