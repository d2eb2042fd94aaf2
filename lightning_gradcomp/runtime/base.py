"""What both strategies add to Lightning's ``DDPStrategy``: a monitor, a launcher naming a failed rank, a clean exit.

``CompressedDDP`` and ``DiLoCo`` are both ``DDPStrategy`` subclasses, and on Lightning's side they do the same things
around their own work: add their monitor callback when fitting starts, swap Lightning's ``popen`` launcher for one
that stops every rank when one fails and names it (:mod:`lightning_gradcomp.runtime.faults`), note a rank's own
failure for that report, release the extra process groups and hand the collectives' threads the GIL before the
interpreter exits (:mod:`lightning_gradcomp.engine.collectives`), and write, find and remove a checkpoint that may be
a directory of per-rank files (:mod:`lightning_gradcomp.runtime.rank_state`; ``load_from_checkpoint`` reads one
through :mod:`lightning_gradcomp.runtime.module_loading`). :class:`GradcompStrategy` does these once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from lightning_gradcomp.engine.collectives import hand_off_gil, release_round_groups
from lightning_gradcomp.runtime.faults import ScriptLauncher, is_collective_failure, record_failure
from lightning_gradcomp.runtime.module_loading import install_directory_loading
from lightning_gradcomp.runtime.rank_state import (
    CHECKPOINT_FILE,
    checkpoint_file,
    holds_rank_files,
    make_room_for_file,
    remove_entry,
)

__all__ = ["GradcompStrategy"]

# a checkpoint of these strategies may be a directory, which Lightning's load_from_checkpoint must then read too
install_directory_loading()


class GradcompStrategy(DDPStrategy):
    """Lightning's ``DDPStrategy`` with what both of this package's strategies do on Lightning's side.

    A subclass names its :attr:`monitor_callback`, its :attr:`label` and its :attr:`checkpoint_key`, says which process
    groups carry extra round groups (:meth:`round_group_bases`) and what it lets go of at teardown
    (:meth:`release_state`), and has its ``save_checkpoint`` end with :meth:`write_checkpoint`.

    Args:
        monitor: add a :attr:`monitor_callback` when fitting starts, unless the trainer has one.
        **kwargs: passed to :class:`~lightning.pytorch.strategies.DDPStrategy`.
    """

    #: the callback that logs the strategy's ``gradcomp/*`` metrics
    monitor_callback: ClassVar[type[Callback]]
    #: the strategy's name, which starts its launcher's messages and its errors
    label: ClassVar[str]
    #: the key of the strategy's state in its checkpoints, and the name of each rank's file in a checkpoint directory
    checkpoint_key: ClassVar[str]

    def __init__(self, monitor: bool = True, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._monitor = monitor

    def _module(self) -> pl.LightningModule:
        if self.lightning_module is None:
            raise RuntimeError(f"{self.label} has no LightningModule yet: it is connected by the Trainer.")
        return self.lightning_module

    @override
    def connect(self, model: pl.LightningModule) -> None:
        """Connect the model; when fitting, add the strategy's monitor unless the trainer has one.

        Added here, not in ``setup``: Lightning calls the callbacks' ``setup`` between ``connect`` and the strategy's
        ``setup``, so a callback appended in ``setup`` would never have its own ``setup`` called.
        """
        super().connect(model)
        trainer = getattr(model, "_trainer", None)
        if trainer is None or trainer.state.fn != TrainerFn.FITTING or not self._monitor:
            return
        if not any(isinstance(cb, self.monitor_callback) for cb in trainer.callbacks):
            trainer.callbacks.append(self.monitor_callback())

    @override
    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        if type(self._launcher) is _SubprocessScriptLauncher and self.cluster_environment is not None:
            # stops every rank when one fails, and names it (see lightning_gradcomp.runtime.faults)
            environment = self.cluster_environment
            self._launcher = ScriptLauncher(environment, self.num_processes, self.num_nodes, label=self.label)

    @override
    def on_exception(self, exception: BaseException) -> None:
        """Note this rank's own failure for the main process's report (a failed collective is another rank's fault)."""
        super().on_exception(exception)
        if not is_collective_failure(exception):
            record_failure(self.global_rank, exception)

    def round_group_bases(self) -> Sequence[Any]:
        """The process groups whose extra round groups this strategy made (released at teardown)."""
        return ()

    def release_state(self) -> None:
        """Let go, at teardown, of what holds the collectives (hooks, futures, bound optimizers)."""

    @override
    def teardown(self) -> None:
        """DDPStrategy's teardown, then the strategy's own release, its round groups, and the GIL to torch's threads.

        Released here, on the main thread while the interpreter is alive: left to interpreter finalisation, a gloo
        worker thread touching a Python object then aborts the process at exit (see
        ``engine.collectives.release_round_groups`` and ``engine.collectives.hand_off_gil``).
        """
        super().teardown()
        self.release_state()
        if dist.is_available() and dist.is_initialized():
            for group in self.round_group_bases():
                release_round_groups(group)
            hand_off_gil()  # the collectives' threads finish with their Python objects now, not at exit

    def write_checkpoint(
        self, checkpoint: dict[str, Any], filepath: _PATH, per_rank: bool, storage_options: Any | None = None
    ) -> None:
        """Rank 0 writes Lightning's checkpoint: the file at ``filepath``, or the one in its directory if ``per_rank``.

        Call it on every rank, after the ranks' own files are written (:func:`~lightning_gradcomp.runtime.rank_state.
        save_entry`). Through ``DDPStrategy.save_checkpoint``: the strategy's ``CheckpointIO`` writes it.
        """
        target = f"{str(filepath).rstrip('/')}/{CHECKPOINT_FILE}" if per_rank else filepath
        if not per_rank and self.is_global_zero:
            make_room_for_file(self.checkpoint_io, filepath)
        super().save_checkpoint(checkpoint, target, storage_options=storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Load Lightning's checkpoint of the entry at ``checkpoint_path``, a file or a directory of per-rank files."""
        return super().load_checkpoint(checkpoint_file(checkpoint_path), *args, **kwargs)

    @override
    def remove_checkpoint(self, filepath: _PATH) -> None:
        """Remove the checkpoint: a file as ``DDPStrategy`` does (rank 0), a directory on every rank, each its files."""
        if holds_rank_files(filepath):
            remove_entry(self.checkpoint_io, filepath, self.checkpoint_key, self.global_rank)
        else:
            super().remove_checkpoint(filepath)
