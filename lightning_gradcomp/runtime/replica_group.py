"""What a Lightning strategy does on Lightning's side when its job is one replica group of a fault-tolerant run.

:class:`ReplicaGroupStrategy` holds the strategy's ``fault_tolerance`` (a :class:`~lightning_gradcomp.TorchFT`, or
``None`` for a plain job) and, with it, gives each process its share of the cores of the groups on its machine
(:mod:`~lightning_gradcomp.ft.threads`) and each group its own part of the training data
(:mod:`~lightning_gradcomp.ft.data`). Without it, every hook is the plain strategy's. It comes first among a
strategy's bases, before the Lightning strategy it adds to (``DDPStrategy``'s or ``ModelParallelStrategy``'s).
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_gradcomp.ft.config import TorchFT
from lightning_gradcomp.ft.data import sampler_split, unsplit_warning
from lightning_gradcomp.ft.threads import share_cores

__all__ = ["ReplicaGroupStrategy"]


class ReplicaGroupStrategy(ParallelStrategy):
    """A Lightning strategy whose job may be one replica group of a fault-tolerant run.

    A subclass sets :attr:`fault_tolerance` in its constructor, and lists this class before its Lightning base.
    """

    #: the run's fault tolerance (None: a plain job, every hook as the plain strategy's)
    fault_tolerance: TorchFT | None = None
    num_nodes: int  # the Lightning strategy's (DDPStrategy's, ModelParallelStrategy's)
    num_processes: int

    @override
    def setup_environment(self) -> None:
        """With ``fault_tolerance``, this process takes its share of the cores of the groups on this machine."""
        share_cores(self.fault_tolerance, self.num_processes, rank_zero_info)
        super().setup_environment()

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """The split over this job's ranks; for training data with ``fault_tolerance``, over every group's too."""
        return group_split(self)

    @override
    def on_train_start(self) -> None:
        """With ``fault_tolerance``, warn when the training data is not split over the groups."""
        super().on_train_start()
        warn_unsplit(self)


def group_split(strategy: Any) -> dict[str, int]:
    """A fault-tolerant DiLoCo strategy's ``distributed_sampler_kwargs``: over every group for training data.

    Lightning reads the property when it sets up each loader; while it sets up validation data ``trainer.training``
    is off, and the split is the job's own.
    """
    trainer = getattr(strategy.lightning_module, "_trainer", None)
    training = trainer is not None and trainer.training
    return sampler_split(strategy.fault_tolerance if training else None, strategy.global_rank, strategy.world_size)


def warn_unsplit(strategy: Any) -> None:
    """Warn once, on rank 0 at the start of training, when :func:`unsplit_warning` finds the data unsplit."""
    trainer = strategy.lightning_module.trainer
    line = unsplit_warning(strategy.fault_tolerance, trainer.train_dataloader, strategy.world_size)
    if line is not None:
        rank_zero_warn(line)
