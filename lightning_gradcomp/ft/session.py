"""One rank's place in a fault-tolerant run: torchft's ``Manager``, the quorum of a sync, the commit vote, the heal.

torchft's protocol (pytorch/torchft, ``docs/protocol.rst``): at each step every replica group asks the lighthouse for
a quorum; the lighthouse answers once every group of the previous quorum is back, or, when one stopped heartbeating,
once enough are (at least ``min_replicas`` and more than half of those alive). A group whose step is behind the
quorum's highest heals: it receives a live peer's state (here over the quorum's own process group, torchft's
``PGTransport``: no extra port). After the step's collectives each group votes (``should_commit``); a failure
anywhere in the group votes to discard, and a group that committed less than the others heals at the next quorum.

:class:`Session` wraps that for DiLoCo: it builds the ``Manager`` (with ``init_sync=False``: identical seeds must
give the paper's first round, not a copy of one group), turns torchft's errors into ones that name the fix, and
keeps what the round needs to know about a quorum (:class:`Quorum`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
from torch import Tensor

from lightning_gradcomp.ft.collectives import RoundGroups, TorchFTCollectives
from lightning_gradcomp.ft.config import TorchFT, import_torchft

import_torchft()
from torchft.checkpointing.pg_transport import PGTransport  # noqa: E402 (after the Rust log's level is set)
from torchft.manager import Manager  # noqa: E402

__all__ = ["LighthouseUnreachableError", "NoQuorumError", "Quorum", "Session"]

log = logging.getLogger(__name__)


class LighthouseUnreachableError(RuntimeError):
    """No lighthouse answered at the configured address within ``connect_timeout``."""


class NoQuorumError(RuntimeError):
    """No quorum formed within ``quorum_timeout``."""


@dataclass
class Quorum:
    """What one quorum told this rank.

    Attributes:
        members: replica groups in the quorum (the process group's size).
        peer_state: the state a live peer sent this group to heal from (``None``: not behind).
        reconfigured: the process group was rebuilt (the members changed, or one failed to commit).
        errored: the quorum's set-up failed here (its process group, or the transfer of a heal).
        seconds: how long the quorum took.
        step: torchft's step (rounds committed) after the quorum.
    """

    members: int
    peer_state: dict[str, Any] | None
    reconfigured: bool
    errored: bool
    seconds: float
    step: int


class Session:
    """torchft's ``Manager`` for one rank of a replica group, and the collectives over its process groups.

    Args:
        config: the run's settings.
        rank: this rank in its replica group (a Lightning job's global rank).
        world_size: the ranks of the replica group.
        store: ``(host, port)`` of the replica group's rendezvous store (the job's ``MASTER_ADDR``/``MASTER_PORT``;
            torchft builds the quorum's process group through one member's store).
        rounds: process groups per quorum (the outer exchange's rounds).
        state_dict: what this group sends a peer that heals from it (called on torchft's quorum thread while the
            training thread waits for the quorum).

    Raises:
        LighthouseUnreachableError: If no lighthouse answers within ``config.connect_timeout``.
    """

    def __init__(
        self,
        config: TorchFT,
        *,
        rank: int,
        world_size: int,
        store: tuple[str, int],
        rounds: int,
        state_dict: Callable[[], dict[str, Any]],
    ) -> None:
        self.config = config
        timeout = timedelta(seconds=config.timeout)
        self.groups = RoundGroups(timeout, rounds)
        self._received: dict[str, Any] | None = None
        transport = PGTransport(self.groups, timeout=timeout, device=torch.device("cpu"))
        try:
            self.manager = Manager(
                pg=self.groups,
                load_state_dict=self._receive,
                state_dict=state_dict,
                min_replica_size=config.min_replicas,
                use_async_quorum=False,
                timeout=timeout,
                quorum_timeout=timedelta(seconds=config.quorum_timeout),
                connect_timeout=timedelta(seconds=config.connect_timeout),
                rank=rank,
                world_size=world_size,
                store_addr=store[0],
                store_port=store[1],
                lighthouse_addr=config.lighthouse,
                replica_id=config.name,
                hostname=config.hostname,
                checkpoint_transport=transport,
                init_sync=False,
            )
        except RuntimeError as error:
            if "failed to connect" not in str(error):
                raise
            raise LighthouseUnreachableError(
                f"TorchFT: no lighthouse answered at {config.lighthouse} within {config.connect_timeout:g} s: start"
                " one with `lightning-gradcomp lighthouse --min-replicas N --port P` (or torchft's"
                " `torchft_lighthouse`), or check `TorchFT(lighthouse=...)` / TORCHFT_LIGHTHOUSE."
            ) from error
        self.collectives = TorchFTCollectives(self.groups, self.manager, timeout)

    def _receive(self, state: dict[str, Any]) -> None:
        # torchft calls this on the training thread inside start_quorum; the round applies it when it is ready to
        self._received = state

    @property
    def step(self) -> int:
        """The syncs this group has committed (or healed to): torchft's step."""
        return int(self.manager.current_step())

    def load_step(self, state: dict[str, int]) -> None:
        """Restore torchft's step from a checkpoint (:meth:`step_state`), before the first quorum."""
        self.manager.load_state_dict(state)

    def step_state(self) -> dict[str, int]:
        """The step and committed batches of torchft, for a checkpoint."""
        return dict(self.manager.state_dict())

    def quorum(self) -> Quorum:
        """Ask the lighthouse for this sync's quorum and wait for it (and for a heal's transfer, if behind).

        Raises:
            NoQuorumError: If none formed within ``quorum_timeout`` (too few groups alive, or the lighthouse gone).
        """
        self._received = None
        self.groups.reconfigured = False
        start = time.perf_counter()
        try:
            self.manager.start_quorum(timeout=timedelta(seconds=self.config.quorum_timeout))
        except Exception as error:
            cause = str(error).splitlines()[0][:200] if str(error) else type(error).__name__
            raise NoQuorumError(
                f"TorchFT: replica group '{self.config.name}' got no quorum within {self.config.quorum_timeout:g} s"
                f" at its step {self.step} (are at least min_replicas={self.config.min_replicas} groups running,"
                f" and the lighthouse at {self.config.lighthouse}?): {cause}"
            ) from error
        self.collectives.follow()
        return Quorum(
            members=self.groups.members,
            peer_state=self._received,
            reconfigured=self.groups.reconfigured,
            errored=self.manager.errored() is not None,
            seconds=time.perf_counter() - start,
            step=self.step,
        )

    def all_gather(self, row: Tensor) -> Tensor | None:
        """Every member's ``row`` (a small CPU tensor), in replica rank order; ``None`` if the collective failed."""
        gathered = self.collectives.all_gather(row, 0).wait()
        return None if self.manager.errored() is not None else gathered

    def errored(self) -> bool:
        """Whether a collective or the quorum's set-up failed since the quorum."""
        return self.manager.errored() is not None

    def should_commit(self, ok: bool, reason: str = "") -> bool:
        """The replica group's vote on this sync: ``False`` if it failed anywhere in the group or ``ok`` is not."""
        if not ok:
            self.manager.report_error(RuntimeError(reason or "the sync failed on this rank"))
        return bool(self.manager.should_commit(timeout=timedelta(seconds=self.config.timeout)))

    def close(self) -> None:
        """Stop the manager's server (heartbeats end: the lighthouse drops this group) and the process groups."""
        try:
            self.manager.shutdown(wait=False)
        finally:
            self.groups.abort(errored=False)
