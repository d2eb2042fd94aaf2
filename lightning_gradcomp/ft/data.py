"""Each replica group of a fault-tolerant run reads its own part of the training data.

Lightning's distributed sampler splits a job's data over the job's ranks; the groups of a fault-tolerant run are
separate jobs, so with the same seed every group would read the same batches, and DiLoCo's average of their
pseudo-gradients would be one worker's training at several times the cost. :func:`sampler_split` widens the split to
every rank of every group (group ``g``'s ranks take parts ``g * world_size`` to ``g * world_size + world_size - 1``),
and :func:`unsplit_warning` names a training loader that Lightning's sampler cannot reach. Validation data is
split over the group's own ranks only, so that every group's validation metrics cover the whole set.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from torch.utils.data import DataLoader, DistributedSampler, IterableDataset

from lightning_gradcomp.ft.config import TorchFT

__all__ = ["sampler_split", "unsplit_warning"]

_BY_HAND = (
    " Split it by hand: give each rank `DistributedSampler(dataset, **trainer.strategy.distributed_sampler_kwargs)`"
    " (its part over every group and rank), or shard the stream by those `rank` and `num_replicas`."
)


def sampler_split(config: TorchFT | None, rank: int, world_size: int) -> dict[str, int]:
    """The ``num_replicas`` and ``rank`` of the distributed sampler of rank ``rank`` of a job of ``world_size``.

    Args:
        config: the run's fault tolerance (``None``: a plain job, split over its own ranks only).
        rank: this process's rank in its job (its group).
        world_size: the job's (the group's) number of processes.

    Returns:
        ``{"num_replicas": world_size * groups, "rank": group * world_size + rank}`` when the group's name is an
        integer below :attr:`TorchFT.groups`, else the job's own split.
    """
    index = config.group_index if config is not None else None
    if config is None or index is None:
        return {"num_replicas": world_size, "rank": rank}
    return {"num_replicas": world_size * config.groups, "rank": index * world_size + rank}


def unsplit_warning(config: TorchFT | None, loaders: Any, world_size: int) -> str | None:
    """Why this group may read the same training batches as the other groups, or None when its data is split.

    Args:
        config: the run's fault tolerance (``None``: nothing to say).
        loaders: the trainer's ``train_dataloader`` (a loader, or a sequence or mapping of them).
        world_size: the group's number of processes.
    """
    if config is None or config.groups < 2:
        return None
    if config.group_index is None:
        return (
            f"TorchFT: group '{config.name}' reads the same training data as the other groups: its name is not an"
            f" integer in [0, {config.groups}). Name the groups 0 to {config.groups - 1} (REPLICA_GROUP_ID), or set"
            " `num_groups`, to have Lightning's sampler split the data over them."
        )
    expected = world_size * config.groups
    for loader in _flatten(loaders):
        if not isinstance(loader, DataLoader):
            continue
        if isinstance(loader.dataset, IterableDataset):
            why = "an IterableDataset, which Lightning's sampler does not split"
        elif isinstance(loader.sampler, DistributedSampler) and loader.sampler.num_replicas == expected:
            continue
        else:  # Lightning installs its sampler unless told not to, or the loader has a DistributedSampler already
            why = "`use_distributed_sampler=False`, or a sampler of its own"
        return (
            f"TorchFT: group '{config.name}''s training loader is not split over the {config.groups} groups ({why}):"
            " every group may train on the same batches." + _BY_HAND
        )
    return None


def _flatten(loaders: Any) -> Iterable[Any]:
    if isinstance(loaders, Mapping):
        return [leaf for value in loaders.values() for leaf in _flatten(value)]
    if isinstance(loaders, Sequence) and not isinstance(loaders, (str, bytes)):
        return [leaf for value in loaders for leaf in _flatten(value)]
    return [loaders]
