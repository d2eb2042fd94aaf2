"""Two-level DiLoCo: dense data parallelism inside a replica group (a node), periodic synchronization across groups.

As DiLoCo (Douillard et al. 2023, arXiv 2311.08105) is run at scale (INTELLECT-1, arXiv 2412.01152: data
parallelism inside a node, DiLoCo across nodes): the ranks of a node average their gradients at every inner step over
the fast intra-node link, so they hold identical replicas, and only the rare outer exchange crosses the slow link
between nodes.

Since the ranks of a group hold the same pseudo-gradient, the mean over groups equals the mean over all ranks; the
outer exchange computes it hierarchically, the way that puts the fewest bytes on the slow link
(:class:`~lightning_gradcomp.diloco.exchange.OuterExchange`): rank ``j`` of each group all-reduces the ``j``-th of
``k`` shards of the pseudo-gradient with rank ``j`` of every other group (its *peers*), then the group all-gathers the
shards over the fast link.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_gradcomp.engine.comm import Comm

#: what ``DiLoCo(replica_group=...)`` accepts, in words (the error message's)
ACCEPTED = 'None (every rank its own replica), "node" (the ranks of a node), or an integer >= 1 (ranks per group)'


def check_replica_group(value: Any, error: type[Exception]) -> None:
    """Refuse what :data:`ACCEPTED` does not name, in one line."""
    ok = value is None or value == "node" or (isinstance(value, int) and not isinstance(value, bool) and value >= 1)
    if not ok:
        raise error(f"Expected `replica_group` to be {ACCEPTED}, got {value!r}.")


@dataclass
class ReplicaGroups:
    """This rank's place in the two levels.

    Attributes:
        size: ranks per replica group (``k``); the groups are runs of consecutive global ranks, as Lightning numbers
            the ranks of a node.
        count: replica groups (``G``, the number of DiLoCo workers).
        index: this rank's index in its group.
        group: this rank's replica group (dense all-reduce of the gradients at every inner step).
        peers: the ranks with this rank's index in every group (the outer exchange's all-reduce).
    """

    size: int
    count: int
    index: int
    group: Any
    peers: Any


def replica_groups_for(
    replica_group: int | str | None, world_size: int, num_nodes: int, rank: int, error: type[Exception]
) -> ReplicaGroups | None:
    """The process groups ``DiLoCo(replica_group=...)`` asks for (``None`` when every rank is its own replica).

    ``"node"``: ``world_size / num_nodes`` ranks per group (Lightning numbers a node's ranks consecutively).

    Raises:
        error: If the group size does not divide ``world_size``.
    """
    if replica_group is None:
        return None
    size = group_size(replica_group, world_size, num_nodes, error)
    if size == 1 or not (dist.is_available() and dist.is_initialized()):
        return None
    return build_replica_groups(size, world_size, rank)


def group_size(replica_group: int | str, world_size: int, num_nodes: int, error: type[Exception]) -> int:
    """Ranks per replica group: ``world_size / num_nodes`` for ``"node"``, else ``replica_group`` itself.

    Raises:
        error: If it does not divide ``world_size``.
    """
    size = world_size // num_nodes if replica_group == "node" else int(replica_group)
    if world_size % size:
        raise error(
            f"Expected `replica_group` to divide the {world_size} processes into equal groups, got {size} ranks per"
            " group."
        )
    return size


def build_replica_groups(size: int, world_size: int, rank: int) -> ReplicaGroups:
    """Create the process groups (a collective call: every rank creates every group, in the same order)."""
    count = world_size // size
    group = peers = None
    for g in range(count):
        created = dist.new_group(list(range(g * size, (g + 1) * size)))
        if rank // size == g:
            group = created
    for j in range(size):
        created = dist.new_group(list(range(j, world_size, size)))
        if rank % size == j:
            peers = created
    return ReplicaGroups(size=size, count=count, index=rank % size, group=group, peers=peers)


def dtype_groups(tensors: Sequence[Tensor]) -> list[list[int]]:
    """Indices of ``tensors`` grouped by dtype and device, in order of first appearance: one flat tensor per group."""
    groups: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.dtype, t.device), []).append(i)
    return list(groups.values())


def average_in_group(params: Sequence[Tensor], buffers: Sequence[Tensor], comm: Comm) -> None:
    """Dense data parallelism inside the group ``comm`` spans: the mean of the gradients and floating-point buffers.

    One all-reduce per dtype and device (:func:`dense_tensors`); averaging the buffers (BatchNorm's running
    statistics) keeps the group's replicas identical at every step.
    """
    tensors = dense_tensors(params, buffers)
    with torch.no_grad():
        flats = flatten_by_dtype(tensors)
        for _, flat in flats:
            comm.mean([flat]).wait()
        unflatten_into(tensors, flats)


def dense_tensors(params: Sequence[Tensor], buffers: Sequence[Tensor]) -> list[Tensor]:
    """What dense data parallelism averages: the parameters' gradients, then the floating-point buffers.

    A parameter without a gradient on this rank gets zeros (and then the mean), so that every rank sends the same
    layout and ends with the same gradients.
    """
    grads = []
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grads.append(p.grad)
    return [*grads, *(b for b in buffers if b.is_floating_point())]


def flatten_by_dtype(tensors: Sequence[Tensor]) -> list[tuple[list[int], Tensor]]:
    """``tensors`` as one flat copy per dtype and device (:func:`dtype_groups`), each with the indices it holds."""
    return [(indices, torch.cat([tensors[i].flatten() for i in indices])) for indices in dtype_groups(tensors)]


def views_of(tensors: Sequence[Tensor], flats: Sequence[tuple[list[int], Tensor]]) -> list[Tensor]:
    """Each flat of :func:`flatten_by_dtype` cut back into views shaped as the tensors it was made from."""
    views: list[Tensor] = list(tensors)  # every entry replaced below
    for indices, flat in flats:
        for i, piece in zip(indices, flat.split([tensors[i].numel() for i in indices]), strict=True):
            views[i] = piece.view_as(tensors[i])
    return views


def unflatten_into(tensors: Sequence[Tensor], flats: Sequence[tuple[list[int], Tensor]]) -> None:
    """Copy each flat of :func:`flatten_by_dtype` back into the tensors it was made from."""
    for indices, flat in flats:
        for i, piece in zip(indices, flat.split([tensors[i].numel() for i in indices]), strict=True):
            tensors[i].copy_(piece.view_as(tensors[i]))


def averaging_in(
    closure: Callable[[], Any], params: Sequence[Tensor], buffers: Sequence[Tensor], comm: Comm
) -> Callable[[], Any]:
    """``closure`` (the forward and backward), then :func:`average_in_group` over ``comm``'s ranks."""

    def run() -> Any:
        output = closure()
        average_in_group(params, buffers, comm)
        return output

    return run
