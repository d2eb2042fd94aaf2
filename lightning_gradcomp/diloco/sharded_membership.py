"""Plain DiLoCo's membership over FSDP2-sharded replica groups: rank ``j`` of every group exchanges shard ``j``.

As torchft, prime and PCCL run DiLoCo (Douillard et al. 2023, arXiv 2311.08105) over sharded groups: the outer state
is each rank's local shards, and the pseudo-gradient of shard ``j`` is averaged among the ranks that hold shard ``j``
in every group (the round's process group). Every group contributes to every sync, as in
:class:`~lightning_gradcomp.diloco.membership.Membership`; what changes is the vote, agreed over the replica group (one
shard whose average is not finite skips the outer step on every shard, or theta_global would be stepped in part), and
the dense step, HSDP's (FSDP2's reduce-scatter inside the group, then the gradient shards averaged across groups).

With fault tolerance each Lightning job is one sharded group, and every rank's torchft manager works over the same-shard
group (:class:`ShardedTorchFTMembership`): torchft's recovery is per rank, so rank ``j`` of a (re)starting group heals
shard ``j`` from rank ``j`` of a live group, and its commit vote is agreed over the group's ranks by torchft itself.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from lightning_gradcomp.diloco.elastic import TorchFTMembership
from lightning_gradcomp.diloco.membership import DIVERGED, Job, Membership, Participation, Place
from lightning_gradcomp.diloco.replicas import ReplicaGroups, flatten_by_dtype, unflatten_into
from lightning_gradcomp.engine.collectives import TorchCollectives
from lightning_gradcomp.ft.config import TorchFT

__all__ = [
    "PeerCollectives",
    "ShardedMembership",
    "ShardedTorchFTMembership",
    "gradient_shards",
    "sharded_membership_for",
]


def gradient_shards(params: Sequence[Tensor]) -> list[Tensor]:
    """The local shards of ``params``' gradients (FSDP2's, reduce-scattered inside the group); zeros where none."""
    grads = []
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grads.append(p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad)
    return grads


class PeerCollectives(TorchCollectives):
    """The engine's collectives over this rank's same-shard group, whose later rounds' groups every rank makes.

    ``torch.distributed.new_group`` is a call on every rank with the same ranks; ``TorchCollectives.ensure_rounds``
    makes its group over its own ranks only, which differ here between ranks (each its own shard's peers), so every
    rank makes every same-shard group's round groups, in the same order, and keeps its own.

    Args:
        process_group: this rank's same-shard group.
        peer_sets: the ranks of every same-shard group.
    """

    def __init__(self, process_group: Any, peer_sets: Sequence[Sequence[int]]) -> None:
        super().__init__(process_group)
        self._peer_sets = [list(ranks) for ranks in peer_sets]
        self._mine = dist.get_process_group_ranks(process_group)

    def ensure_rounds(self, rounds: int) -> None:
        """Make round groups until ``rounds`` rounds have one (a call on every rank, in the same order)."""
        while len(self._groups) < rounds:
            for ranks in self._peer_sets:
                created = dist.new_group(ranks=ranks)
                if ranks == self._mine and isinstance(created, dist.ProcessGroup):
                    self._groups.append(created)


class ShardedMembership(Membership):
    """Every replica group of FSDP2 shards contributes; the verdict is agreed over the shards of a group.

    Attributes:
        group: the replica group's own process group (the vote's).
        peer_sets: the ranks of every same-shard group (``j, j + S, j + 2S, ...``).
        groups, group_size: the replica groups and their shards.
        params: the module's trained parameters (DTensors: a dense step averages their gradients' shards).
    """

    def __init__(self) -> None:
        super().__init__()
        self.group: Any = None
        self.peer_sets: list[list[int]] = []
        self.group_count = self.group_size = self.tensor_parallel = 1
        self.params: Callable[[], Sequence[Tensor]] = list
        self._device = torch.device("cpu")

    def shard_over(
        self, group: Any, groups: int, group_size: int, params: Callable[[], Sequence[Tensor]], tensor_parallel: int = 1
    ) -> None:
        """The replica groups as the front door set them up: this one's process group, their count and size (ranks)."""
        self.group, self.group_count, self.group_size, self.params = group, groups, group_size, params
        self.tensor_parallel = tensor_parallel
        self.peer_sets = [list(range(j, groups * group_size, group_size)) for j in range(group_size)]

    def bind(self, round: Any, job: Job, device: Any) -> None:
        """The exchange over the same-shard group; a compressor's later rounds on groups every rank makes."""
        self.round, self._device = round, device
        if not job.distributed:
            return
        backend = None
        compressor = round.exchange.compressor
        if compressor is not None and round.process_group is not None:
            backend = PeerCollectives(round.process_group, self.peer_sets)
            backend.ensure_rounds(compressor.rounds)
        round.exchange.attach(device, round.process_group, None, backend)

    def vote(self, part: Participation, reason: str) -> str:
        """This shard's verdict, agreed over the replica group: any shard's divergence skips the sync everywhere."""
        why = super().vote(part, reason)
        flag = torch.tensor([0.0 if why else 1.0], device=self._device)
        if self.group is not None:
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        return why or ("" if bool(flag.item() > 0) else DIVERGED)

    def dense_average(self, params: Sequence[Tensor], buffers: Sequence[Tensor], finite_only: bool) -> bool:
        """HSDP's step: each gradient shard (reduce-scattered inside the group) averaged over the same-shard ranks."""
        comm = self.round.exchange.world if self.round is not None else None
        if comm is None:
            return True
        grads = gradient_shards(self.params())
        with torch.no_grad():
            flats = flatten_by_dtype(grads)
            for _, flat in flats:
                comm.mean([flat]).wait()
            unflatten_into(grads, flats)
        return True

    def workers_at_setup(self, world_size: int) -> int | None:
        """The replica groups."""
        return self.group_count

    def describe(self, world_size: int) -> str:
        """The setup line's words: groups of shards."""
        shards = f"{self.group_size // self.tensor_parallel} FSDP2 shards"
        tensor = f" x {self.tensor_parallel} tensor-parallel ranks" if self.tensor_parallel > 1 else ""
        return f"{world_size} processes: {self.group_count} replica groups of {shards}{tensor}"


class ShardedTorchFTMembership(TorchFTMembership):
    """Fault tolerance on torchft over a job that is one group of FSDP2 shards: rank ``j`` exchanges shard ``j``.

    :class:`~lightning_gradcomp.diloco.elastic.TorchFTMembership` with one torchft manager per rank, as torchft runs
    DiLoCo with HSDP (one process group per group rank): the round's tensors are already this rank's shards, so the
    exchange takes them whole (no shard of a flat copy as with dense groups), and a dense step is HSDP's, each
    gradient shard averaged over the quorum.

    Attributes:
        params: the module's trained parameters (DTensors: a dense step averages their gradients' shards).
    """

    def __init__(self, config: Any, info: Callable[[str], Any] = print, error: type[Exception] = ValueError) -> None:
        super().__init__(config, info, error)
        self.params: Callable[[], Sequence[Tensor]] = list

    def shard_over(
        self, group: Any, groups: int, group_size: int, params: Callable[[], Sequence[Tensor]], tensor_parallel: int = 1
    ) -> None:
        """This job is the one group here; a dense step averages the gradient shards of ``params``."""
        self.params = params

    def _replicas(self, job: Job, world_size: int) -> ReplicaGroups | None:
        return None  # this rank's tensors are its shards; its torchft process group holds the same-shard ranks

    def dense_average(self, params: Sequence[Tensor], buffers: Sequence[Tensor], finite_only: bool) -> bool:
        """HSDP's step across the groups in the quorum: each gradient shard averaged over the contributors, a vote."""
        part = self.enter(Place(dense=True))
        grads = gradient_shards(self.params())
        return self._quorum_mean(part, grads, len(grads), finite_only)

    def workers(self, world_size: int) -> str:
        """This job's processes: the group's shards."""
        return f"{world_size} processes: 1 replica group of {world_size} FSDP2 shards"


def sharded_membership_for(
    fault_tolerance: Any, info: Callable[[str], Any], error: type[Exception]
) -> ShardedMembership | ShardedTorchFTMembership:
    """The policy ``ShardedDiLoCo(fault_tolerance=...)`` asks for.

    Raises:
        error: If ``fault_tolerance`` is neither ``None`` nor a ``TorchFT``.
    """
    if fault_tolerance is None:
        return ShardedMembership()
    if not isinstance(fault_tolerance, TorchFT):
        raise error(
            "Expected `fault_tolerance` to be lightning_gradcomp.TorchFT(lighthouse=..., replica_group_id=...) or"
            f" None, got {fault_tolerance!r}."
        )
    return ShardedTorchFTMembership(fault_tolerance, info=info, error=error)
