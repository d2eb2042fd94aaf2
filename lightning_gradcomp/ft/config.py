"""``TorchFT``: what a replica group needs to take part in a fault-tolerant run, checked when it is built.

torchft (github.com/pytorch/torchft) coordinates replica groups through a *lighthouse*: each group's manager
heartbeats to it, asks it for a quorum (the groups that take part in a step), and heals from a live peer when it is
behind. This module holds only the settings and the import of torchft itself, so that building a ``DiLoCo`` without
fault tolerance never imports it, and a missing torchft is refused in one line.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from lightning_gradcomp.validation import check_int, check_number

__all__ = ["LIGHTHOUSE_ENV", "REPLICA_GROUP_ENV", "TorchFT", "import_torchft"]

#: where ``TorchFT(lighthouse=None)`` reads the lighthouse's address (torchft's own variable)
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
#: where ``TorchFT(replica_group_id=None)`` reads the group's name (torchft's examples' variable)
REPLICA_GROUP_ENV = "REPLICA_GROUP_ID"
_ADDRESS = re.compile(r"^https?://[^/\s]+:\d+/?$")


def import_torchft() -> ModuleType:
    """``import torchft``, with its Rust log at warnings unless ``RUST_LOG`` says otherwise.

    torchft logs every quorum and commit at INFO level from Rust (it reads ``RUST_LOG`` once, at import): a line per
    round in every group's output. ``RUST_LOG=info`` brings them back.

    Raises:
        ImportError: If torchft is not installed, naming the extra that installs it.
    """
    os.environ.setdefault("RUST_LOG", "warn")
    try:
        import torchft
    except ImportError as error:
        raise ImportError(
            "Fault tolerance needs torchft: `pip install 'lightning-gradcomp[ft]'` (torchft>=0.2, torch>=2.7)."
        ) from error
    return torchft


@dataclass(frozen=True)
class TorchFT:
    """Fault tolerance across replica groups, on torchft's lighthouse, quorum and reconfigurable process group.

    A *replica group* is one Lightning job (its own ``Trainer``, launched on its own); ``DiLoCo(fault_tolerance=
    TorchFT(...))`` makes its outer exchange go through torchft's ``Manager``: a quorum at every sync, the
    pseudo-gradient averaged over the groups that take part, a round discarded when one fails during it, and a group
    that (re)joins healed from a live peer before its first inner step (torchft's live recovery, README of
    pytorch/torchft; DiLoCo, Douillard et al. 2023, arXiv 2311.08105). See docs/fault_tolerance.md.

    Args:
        lighthouse: the lighthouse's address, ``http://HOST:PORT`` (``None``: the ``TORCHFT_LIGHTHOUSE`` variable).
        replica_group_id: this group's name, unique among the groups (``None``: the ``REPLICA_GROUP_ID`` variable).
            Groups are ranked by it, as strings, in the exchange.
        min_replicas: the fewest replica groups a round may commit with (torchft's ``min_replica_size``).
        start_replicas: the groups a new run, or a whole-job restart from checkpoints, waits for in its first
            quorum (``None``: ``min_replicas``), so that identical seeds give the paper's first round over all of
            them and resumed groups go on together; a group that comes later heals from them at their first sync.
        timeout: seconds for a collective, a commit vote or a heal's transfer before it counts as failed.
        quorum_timeout: seconds a group waits at a sync for the others (a joining group waits up to one round).
        connect_timeout: seconds to reach the lighthouse and the other groups' managers.
        hostname: the address the other groups reach this group's manager at (this machine's, on several).
        num_groups: the groups the training data is split over (``None``: ``start_replicas``, resolved). A group
            whose name is an integer ``g`` in ``[0, num_groups)`` reads part ``g`` of them (Lightning's distributed
            sampler splits the data over the groups, then over the ranks inside each; every group must have the same
            number of processes); a group with another name reads the same data as the others, and a warning says so.

    Raises:
        ValueError: If a value is out of range, the lighthouse or the group's name is given neither here nor in its
            variable, or ``num_groups`` is given and the group's name is not an integer below it.
    """

    lighthouse: str | None = None
    replica_group_id: str | int | None = None
    min_replicas: int = 1
    start_replicas: int | None = None
    timeout: float = 60.0
    quorum_timeout: float = 300.0
    connect_timeout: float = 30.0
    hostname: str = "127.0.0.1"
    num_groups: int | None = None

    def __post_init__(self) -> None:
        lighthouse = self.lighthouse if self.lighthouse is not None else os.environ.get(LIGHTHOUSE_ENV)
        if lighthouse is None:
            raise ValueError(
                f"Expected `lighthouse` to be an address 'http://HOST:PORT' or the {LIGHTHOUSE_ENV} variable set (start"
                " one with `lightning-gradcomp lighthouse --min-replicas N`), got None."
            )
        if not isinstance(lighthouse, str) or not _ADDRESS.match(lighthouse):
            raise ValueError(f"Expected `lighthouse` to be an address 'http://HOST:PORT', got {lighthouse!r}.")
        name: Any = self.replica_group_id if self.replica_group_id is not None else os.environ.get(REPLICA_GROUP_ENV)
        if name is None:
            raise ValueError(
                f"Expected `replica_group_id` to be a name unique among the groups or the {REPLICA_GROUP_ENV} variable"
                " set, got None."
            )
        if isinstance(name, bool) or not isinstance(name, (str, int)) or not str(name) or ":" in str(name):
            raise ValueError(f"Expected `replica_group_id` to be a non-empty name without ':', got {name!r}.")
        check_int(self.min_replicas, "min_replicas", low=1)
        check_int(self.start_replicas, "start_replicas", low=1, allow_none=True)
        for field in ("timeout", "quorum_timeout", "connect_timeout"):
            check_number(getattr(self, field), field, low=0.0, low_open=True)
        if not isinstance(self.hostname, str) or not self.hostname:
            raise ValueError(f"Expected `hostname` to be a non-empty host name or address, got {self.hostname!r}.")
        object.__setattr__(self, "lighthouse", lighthouse.rstrip("/"))
        object.__setattr__(self, "replica_group_id", str(name))
        check_int(self.num_groups, "num_groups", low=1, allow_none=True)
        if self.num_groups is not None and self.group_index is None:
            raise ValueError(
                f"Expected `replica_group_id` to be an integer in [0, {self.num_groups}) with `num_groups`"
                f"={self.num_groups} (the part of the data this group reads), got {name!r}."
            )

    @property
    def starting_replicas(self) -> int:
        """The groups a new run's first quorum needs (``start_replicas``, resolved)."""
        return self.start_replicas if self.start_replicas is not None else self.min_replicas

    @property
    def groups(self) -> int:
        """The groups the training data is split over (``num_groups``, resolved)."""
        return self.num_groups if self.num_groups is not None else self.starting_replicas

    @property
    def group_index(self) -> int | None:
        """The part of the training data this group reads: its name as an integer below :attr:`groups`, else None."""
        name = str(self.replica_group_id)
        if not (name.isascii() and name.isdecimal()) or int(name) >= self.groups:
            return None
        return int(name)

    @property
    def name(self) -> str:
        """This group's name (``replica_group_id``, resolved)."""
        return str(self.replica_group_id)
