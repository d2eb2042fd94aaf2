"""The engine's collectives on torchft's reconfigurable process group: a failure is reported, never raised or waited.

:class:`TorchFTCollectives` is :class:`~lightning_gradcomp.engine.comm.CollectiveBackend` over torchft's
``ProcessGroupGloo``, which torchft's ``Manager`` reconfigures at every quorum to span the replica groups that take
part (one such group per rank index of a replica group). Every collective goes through torchft's
``Manager.wrap_future``: an error (a peer that died mid-exchange: "Connection closed by peer") or a collective that
outlives the timeout is reported to the manager, whose next ``should_commit`` then votes to discard the step, and the
future completes with the tensor as it was, so nothing waits forever and nothing raises into the training loop.
After the first error every later collective of the step completes at once (torchft's own rule for
``Manager.allreduce``).

A compressor whose reduction takes several dependent rounds issues round ``k`` on a group of its own (why: see
:mod:`lightning_gradcomp.engine.comm`); :class:`RoundGroups` is torchft's process group for round 0 and configures one
more per later round at every quorum, each under its own prefix of the same rendezvous store.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
from torch import Tensor
from torch.distributed.distributed_c10d import (
    AllgatherOptions,
    AllreduceOptions,
    AllToAllOptions,
    BroadcastOptions,
    ReduceOp,
)

from lightning_gradcomp.engine.comm import ReduceOpName
from lightning_gradcomp.ft.config import import_torchft

import_torchft()
from torchft.process_group import ProcessGroupGloo  # noqa: E402 (after the Rust log's level is set)

__all__ = ["RoundGroups", "TorchFTCollectives"]


class RoundGroups(ProcessGroupGloo):
    """torchft's reconfigurable gloo process group, with one more such group for each later round of a compressor.

    torchft's ``Manager`` calls :meth:`configure` whenever the quorum changes; every group is configured then, the
    later ones under ``/round{k}`` of the quorum's store prefix.

    Args:
        timeout: gloo's timeout for every collective and for the rendezvous.
        rounds: the rounds of the outer exchange's reduction (``Compressor.rounds``; 1 for a plain mean).

    Attributes:
        replica_rank: this group's rank in the current quorum.
        quorum_id: the lighthouse's id of the current quorum.
        reconfigured: set at each reconfiguration (the caller clears it).
    """

    def __init__(self, timeout: timedelta, rounds: int = 1) -> None:
        super().__init__(timeout=timeout)
        self._later = [ProcessGroupGloo(timeout=timeout) for _ in range(rounds - 1)]
        self.replica_rank = 0
        self.quorum_id: int | None = None
        self.reconfigured = False

    def configure(
        self,
        store_addr: str,
        replica_id: str,
        rank: int,
        world_size: int,
        quorum_id: int | None = None,
        group_rank: int | None = None,
        group_world_size: int | None = None,
        global_ranks: list[int] | None = None,
    ) -> None:
        """Rebuild every round's group over the quorum's replica groups (torchft calls this at a new quorum)."""
        super().configure(
            store_addr, replica_id, rank, world_size, quorum_id, group_rank, group_world_size, global_ranks
        )
        for k, group in enumerate(self._later, start=1):
            group.configure(
                f"{store_addr}/round{k}",
                replica_id,
                rank,
                world_size,
                quorum_id,
                group_rank,
                group_world_size,
                global_ranks,
            )
        self.replica_rank, self.quorum_id, self.reconfigured = rank, quorum_id, True

    def abort(self, errored: bool = True) -> None:
        """Abort every round's group."""
        for group in self._later:
            group.abort(errored=errored)
        super().abort(errored=errored)

    def round_group(self, round: int) -> ProcessGroupGloo:
        """The group round ``round`` runs on."""
        if round > len(self._later):
            raise RuntimeError(f"The outer exchange issued round {round}; only {len(self._later) + 1} have a group.")
        return self if round == 0 else self._later[round - 1]

    @property
    def members(self) -> int:
        """Replica groups in the current quorum (1 before the first)."""
        return self.size() if self._pg is not None else 1


class TorchFTCollectives:
    """:class:`~lightning_gradcomp.engine.comm.CollectiveBackend` on torchft: failures reported to the manager.

    Args:
        groups: the process groups, reconfigured by ``manager`` at each quorum.
        manager: torchft's ``Manager`` of this rank (its ``wrap_future`` and ``report_error``).
        timeout: how long one collective may take before it counts as failed.

    Attributes:
        rank: this replica group's rank in the current quorum; world_size: the groups in it (:meth:`follow` sets
            both after each quorum).
    """

    def __init__(self, groups: RoundGroups, manager: Any, timeout: timedelta) -> None:
        self._groups = groups
        self._manager = manager
        self._timeout = timeout
        self.rank = 0
        self.world_size = 1

    def follow(self) -> None:
        """Take the current quorum's rank and size (after a quorum)."""
        self.rank, self.world_size = self._groups.replica_rank, self._groups.members

    def all_reduce(self, tensor: Tensor, round: int, op: ReduceOpName) -> torch.futures.Future[Tensor]:
        """Reduce ``tensor`` in place across the quorum (a failure leaves it as it is and is reported)."""
        options = AllreduceOptions()
        options.reduceOp = ReduceOp.SUM if op == "sum" else ReduceOp.MAX
        return self._issue(lambda group: group.allreduce([tensor], options), tensor, round)

    def all_gather(self, tensor: Tensor, round: int) -> torch.futures.Future[Tensor]:
        """Gather ``tensor`` from every replica group into a ``(world_size, *tensor.shape)`` tensor."""
        out = torch.zeros((self.world_size, *tensor.shape), dtype=tensor.dtype, device=tensor.device)
        return self._issue(
            lambda group: group.allgather([list(out.unbind(0))], [tensor], AllgatherOptions()), out, round
        )

    def broadcast(self, tensor: Tensor, src: int, round: int) -> torch.futures.Future[Tensor]:
        """Broadcast ``tensor`` from the group of rank ``src`` in place."""
        options = BroadcastOptions()
        options.rootRank, options.rootTensor = src, 0
        return self._issue(lambda group: group.broadcast([tensor], options), tensor, round)

    def all_to_all(
        self, tensor: Tensor, send_splits: Sequence[int], recv_splits: Sequence[int], round: int
    ) -> torch.futures.Future[Tensor]:
        """An all-to-all with variable splits (1-D tensors), as ``all_to_all_single``."""
        out = torch.zeros(sum(recv_splits), dtype=tensor.dtype, device=tensor.device)
        return self._issue(
            lambda group: group.alltoall_base(out, tensor, list(recv_splits), list(send_splits), AllToAllOptions()),
            out,
            round,
        )

    def _issue(self, start: Any, result: Tensor, round: int = 0) -> torch.futures.Future[Tensor]:
        """Start a collective on round ``round``'s group; its future resolves to ``result`` whatever happens."""
        if self._manager.errored() is None:
            try:
                work = start(self._groups.round_group(round))
                future = work.get_future().then(lambda fut: _value_then(fut, result))
                return self._manager.wrap_future(future, result, timeout=self._timeout)
            except Exception as error:  # noqa: BLE001 (a broken group fails the step, not the run)
                self._manager.report_error(error)
        done: torch.futures.Future[Tensor] = torch.futures.Future()
        done.set_result(result)
        return done


def _value_then(fut: torch.futures.Future, result: Tensor) -> Tensor:
    fut.value()  # re-raises a failed collective, for wrap_future to report
    return result
