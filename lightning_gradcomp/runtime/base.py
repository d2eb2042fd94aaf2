"""What both strategies add to Lightning's ``DDPStrategy``: a monitor, a launcher naming a failed rank, a clean exit.

``CompressedDDP`` and ``DiLoCo`` are both ``DDPStrategy`` subclasses, and on Lightning's side they do the same things
around their own work: add their monitor callback when fitting starts, swap Lightning's ``popen`` launcher for one
that stops every rank when one fails and names it (:mod:`lightning_gradcomp.runtime.faults`), note a rank's own
failure for that report, release the extra process groups and hand the collectives' threads the GIL before the
interpreter exits (:mod:`lightning_gradcomp.engine.collectives`), and remove each rank's own state files with a
checkpoint (:mod:`lightning_gradcomp.runtime.rank_state`). :class:`GradcompStrategy` does these once.
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
from lightning_gradcomp.runtime.rank_state import remove_rank_states

__all__ = ["GradcompStrategy"]


class GradcompStrategy(DDPStrategy):
    """Lightning's ``DDPStrategy`` with what both of this package's strategies do on Lightning's side.

    A subclass names its :attr:`monitor_callback` and its :attr:`label`, and says which process groups carry extra
    round groups (:meth:`round_group_bases`) and what it lets go of at teardown (:meth:`release_state`).

    Args:
        monitor: add a :attr:`monitor_callback` when fitting starts, unless the trainer has one.
        **kwargs: passed to :class:`~lightning.pytorch.strategies.DDPStrategy`.
    """

    #: the callback that logs the strategy's ``gradcomp/*`` metrics
    monitor_callback: ClassVar[type[Callback]]
    #: the strategy's name, which starts its launcher's messages and its errors
    label: ClassVar[str]

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

    @override
    def remove_checkpoint(self, filepath: _PATH) -> None:
        """Remove the checkpoint (rank 0) and, on every rank, the state that rank saved beside it."""
        super().remove_checkpoint(filepath)
        remove_rank_states(filepath, self.global_rank)
