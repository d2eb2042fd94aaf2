"""Who takes part in DiLoCo's syncs: the membership policy the round asks at every sync.

DiLoCo (Douillard et al. 2023, arXiv 2311.08105) averages the workers' pseudo-gradients at every sync. Who those
workers are is a policy, as torchft's ``DiLoCo`` has one code path whether or not groups come and go: the
:class:`~lightning_gradcomp.diloco.round.Round` writes the sync once and asks its :class:`Membership`

- at the group's first step, whether it trains, takes part in a dense step, or joins the others at a sync
  (:meth:`Membership.first_step`);
- at every sync, who takes part and over how many the mean is taken (:meth:`Membership.enter`);
- after the exchange, whether the sync commits (:meth:`Membership.vote`), and what a discarded one logs;
- when this group is behind the others, how it heals (inside :meth:`Membership.enter`).

:class:`Membership` itself is the static policy of plain DiLoCo: every worker contributes to every sync, a sync
commits when its average is finite, and a failed collective ends the run (as ``DDPStrategy`` does). Fault tolerance on
torchft is the dynamic one (:class:`~lightning_gradcomp.diloco.elastic.TorchFTMembership`).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
from torch import Tensor

from lightning_gradcomp.diloco.replicas import (
    build_replica_groups,
    dense_tensors,
    flatten_by_dtype,
    group_size,
    unflatten_into,
)

__all__ = ["DIVERGED", "Job", "LoopState", "Membership", "Participation", "Place", "Start"]

#: why a sync does not commit when its average is not finite: a rank's inner steps diverged (the round's skip)
DIVERGED = "the average is not finite"


class Start(enum.Enum):
    """What a replica group's first optimizer step is."""

    TRAIN = "train"  #: an inner step as any other (a new run, a resume, plain DiLoCo)
    DENSE = "dense"  #: a part in the dense step the others are at (DenseWarmup's), healed first
    AT_SYNC = "at_sync"  #: no step of its own: it healed and takes part in the sync the others are at


@dataclass(frozen=True)
class Place:
    """Where a group is in DiLoCo's schedule as it asks who takes part.

    Attributes:
        fragment: the fragment whose sync it is at (``None``: not at a sync).
        dense: at a dense step (DenseWarmup's) instead.
    """

    fragment: int | None = None
    dense: bool = False

    #: the code a dense step travels as among the members (fragments are 0, 1, ...)
    DENSE_CODE = -1

    def code(self) -> int | None:
        """The integer the members compare (``None``: starting, at no place)."""
        return self.DENSE_CODE if self.dense else self.fragment

    @classmethod
    def of(cls, code: int | None) -> Place:
        """The place a :meth:`code` names."""
        return cls(dense=True) if code == cls.DENSE_CODE else cls(fragment=code)

    def __str__(self) -> str:
        if self.dense:
            return "a dense step"
        return "starting" if self.fragment is None else f"the sync of fragment {self.fragment}"


@dataclass
class Participation:
    """Who takes part in one sync, as this group acts on it.

    Attributes:
        place: where the group at the highest step is (the sync this group takes part in).
        contributes: whether this group's pseudo-gradient counts in the average (a healing one sends zeros).
        contributors: how many count (the mean's divisor); members: how many take part (the collectives' size).
        failed: why this sync cannot commit here (``""``: it can).
        skip: no member runs the exchange (every member saw the same reason not to): nothing waits for a peer.
    """

    place: Place
    contributes: bool = True
    contributors: int = 1
    members: int = 1
    failed: str = ""
    skip: bool = False

    @property
    def scale(self) -> float:
        """What turns the mean over the members into the mean over the contributors."""
        return self.members / max(self.contributors, 1)


@dataclass(frozen=True)
class LoopState:
    """The front door's training state of its loop, taken for a peer that heals and loaded when this group heals."""

    take: Callable[[], dict[str, Any]] = dict
    load: Callable[[dict[str, Any]], None] = lambda state: None


@dataclass(frozen=True)
class Job:
    """This rank's place in its launch, as the front door knows it.

    Attributes:
        rank: its global rank; world_size: the launch's ranks; num_nodes: its nodes.
        store: ``(host, port)`` of the launch's rendezvous store.
        group: the process group of the outer exchange over every rank (``None``: the default, or one rank).
        loop: the front door's loop state, for a heal.
    """

    rank: int = 0
    world_size: int = 1
    num_nodes: int = 1
    store: tuple[str, int] = ("127.0.0.1", 0)
    group: Any = None
    loop: LoopState = field(default_factory=LoopState)

    @property
    def distributed(self) -> bool:
        """Whether the collectives run (torch.distributed initialized)."""
        return dist.is_available() and dist.is_initialized()


class Membership:
    """Plain DiLoCo's membership: every worker contributes to every sync (the static policy).

    A subclass overrides the methods whose docstrings say what changes with it; the round calls each of them at the
    same point whatever the policy.

    Args:
        replica_group: two levels (``DiLoCo(replica_group=...)``): dense data parallelism inside groups of this many
            ranks (``"node"``: a node's), DiLoCo across the groups.

    Attributes:
        resumes_in_flight: an exchange in flight at a checkpoint is sent again on resume (its members are still there).
        discarded: syncs discarded (a failure during them; never in plain DiLoCo).
    """

    resumes_in_flight = True

    def __init__(self, replica_group: int | str | None = None, error: type[Exception] = ValueError) -> None:
        self.replica_group, self.error = replica_group, error
        self.round: Any = None  # the Round that bound it (the round imports this module, not the other way)
        self.discarded = 0

    def bind(self, round: Any, job: Job, device: Any) -> None:
        """Attach ``round``'s exchange to the collectives of ``job`` (on every rank at the same point)."""
        self.round = round
        if self.replica_group is not None:
            size = group_size(self.replica_group, job.world_size, job.num_nodes, self.error)
            if size > 1 and job.distributed:
                round.replicas = build_replica_groups(size, job.world_size, job.rank)
        if job.distributed:
            round.exchange.attach(device, round.process_group, round.replicas)

    def first_step(self, closure: Callable[[], Any], optimizers: Sequence[Any]) -> Start:
        """What this optimizer step is (a dynamic policy joins the run at the first; it may run ``closure``)."""
        return Start.TRAIN

    def enter(self, place: Place) -> Participation:
        """Who takes part in the sync (or dense step) at ``place``; every worker, contributing."""
        workers = self.round.exchange.workers if self.round is not None else 1
        return Participation(place, contributors=workers, members=workers)

    def vote(self, part: Participation, reason: str) -> str:
        """Whether the sync commits: ``""`` to commit, else why not (``reason``: this group's own, or ``""``)."""
        return part.failed or reason

    def discard(self, part: Participation, why: str) -> None:
        """Count and log a sync that did not commit for ``why`` (a failure, not this group's own divergence)."""
        self.discarded += 1

    def dense_average(self, params: Sequence[Tensor], buffers: Sequence[Tensor], finite_only: bool) -> bool:
        """A dense step's mean of the gradients and floating-point buffers over every rank; whether to step.

        As ``DDPStrategy``: one all-reduce per dtype, and the step is taken whatever the values.
        """
        assert self.round is not None
        comm = self.round.exchange.world
        if comm is None or comm.world_size == 1:
            return True
        tensors = dense_tensors(params, buffers)
        flats = flatten_by_dtype(tensors)
        for _, flat in flats:
            comm.mean([flat]).wait()
        unflatten_into(tensors, flats)
        return True

    @property
    def groups(self) -> int:
        """The launches whose workers average together (1: this one's ranks are all of them)."""
        return 1

    def workers_at_setup(self, world_size: int) -> int | None:
        """The workers the preflight counts before training (``None``: known only at the first sync)."""
        return self.round.replicas.count if self.round is not None and self.round.replicas is not None else world_size

    def describe(self, world_size: int) -> str:
        """The setup line's words for the workers."""
        processes = "1 process" if world_size == 1 else f"{world_size} processes"
        replicas = self.round.replicas if self.round is not None else None
        if replicas is not None:
            processes += f": {replicas.count} replicas of {replicas.size} ranks, dense data parallelism inside each"
        return processes

    def summary(self) -> str:
        """What the end-of-fit summary adds to the syncs and skips."""
        return ""

    def metrics(self) -> dict[str, float]:
        """The ``gradcomp/*`` values the monitor logs for this policy."""
        return {}

    def owns_round_groups(self) -> bool:
        """Whether the compressor's round groups are this policy's to close (not the strategy's)."""
        return False

    def state_dict(self) -> dict[str, Any]:
        """The policy's own checkpointed state."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (a checkpoint of another policy's run carries none of it)."""

    def close(self) -> None:
        """Leave the run at the end of ``fit``."""
