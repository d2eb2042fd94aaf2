"""DiLoCo's outer exchange: the one place where a pseudo-gradient crosses the wire, on the engine's collectives.

Every outer step averages the workers' pseudo-gradients ``theta_global - theta_local`` (DiLoCo, Douillard et al.
2023, arXiv 2311.08105), one flat tensor per dtype and fragment. :class:`OuterExchange` does it in one of three ways,
all through :class:`~lightning_gradcomp.engine.comm.Comm`, so every byte is counted where the package counts bytes
(:class:`~lightning_gradcomp.engine.telemetry.Telemetry`):

- **plain**: each rank divides by the number of workers and the flat is all-reduced (the paper's mean);
- **two levels** (``DiLoCo(replica_group=...)``): rank ``j`` of each replica group all-reduces the ``j``-th shard with
  rank ``j`` of every other group, then the group all-gathers the shards over its fast link, so a group puts one
  model's ring all-reduce on the slow link in all (INTELLECT-1, Jaghouar et al. 2024, arXiv 2412.01152);
- **compressed** (``DiLoCo(compressor=...)``): the pseudo-gradient is split as a DDP bucket is
  (:mod:`lightning_gradcomp.engine.split`: the layers the compressor takes, the rest averaged densely), with each
  rank's error-feedback residual kept across outer steps (SparseLoCo, Sarfi et al. 2025, arXiv 2508.15706; Streaming
  DiLoCo's 4-bit exchange, Douillard et al. 2025, arXiv 2501.18512). Every state change (the residual, the
  compressor's own) is staged and committed only when the whole average is finite on every rank, when the exchange is
  waited for: while one is in flight (Streaming DiLoCo's overlap) the state is still that of before it, which is what a
  checkpoint saves and what a resume sends the same contribution from again.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_gradcomp.compressors.base import Compressor, Layer
from lightning_gradcomp.diloco.replicas import ReplicaGroups, flatten_by_dtype, views_of
from lightning_gradcomp.engine.collectives import TorchCollectives
from lightning_gradcomp.engine.comm import CollectiveBackend, Comm
from lightning_gradcomp.engine.error_feedback import ErrorFeedback
from lightning_gradcomp.engine.requests import StepUpdates
from lightning_gradcomp.engine.split import Reduction, Split, reduce_split, split_layers
from lightning_gradcomp.engine.staging import to_cpu
from lightning_gradcomp.engine.telemetry import Telemetry

__all__ = ["InFlight", "OuterExchange"]


class InFlight:
    """One outer exchange, possibly still on the wire; :meth:`wait` completes it once.

    Args:
        flats: the tensors that were sent; the averages overwrite them.
        futures: the collectives in flight.
        complete: run once they are done, with whether the exchange's state changes are kept.
        gather: run once they are done, before the averages are checked: puts them into ``flats`` (two levels).
    """

    def __init__(
        self,
        flats: list[Tensor],
        futures: list[torch.futures.Future],
        complete: Callable[[bool], None],
        gather: Callable[[], None] | None = None,
    ) -> None:
        self._flats, self._futures, self._complete, self._gather = flats, futures, complete, gather
        self._finite: bool | None = None
        self._completed = False

    def result(self) -> tuple[list[Tensor], bool]:
        """Wait for the collectives; the averages (in the tensors that were sent) and whether all are finite.

        One host read. The exchange's staged state is still that of before it until :meth:`complete`.
        """
        if self._finite is None:
            for future in self._futures:
                future.wait()
            if self._gather is not None:
                self._gather()
            self._finite = all_finite(self._flats)
        return self._flats, self._finite

    def complete(self, kept: bool) -> None:
        """Commit the exchange's staged state (``kept``) or drop it; once."""
        if not self._completed:
            self._completed = True
            self._complete(kept)

    def wait(self) -> tuple[list[Tensor], bool]:
        """:meth:`result`, then :meth:`complete` with whether the averages are finite."""
        averages, finite = self.result()
        self.complete(finite)
        return averages, finite


def all_finite(tensors: Sequence[Tensor]) -> bool:
    """Whether every element of ``tensors`` is finite (one host read for all of them)."""
    if not tensors:
        return True
    sums = torch.stack([t.sum(dtype=torch.float64).cpu() for t in tensors])
    return bool(torch.isfinite(sums).all())


class OuterExchange:
    """The average over the workers of DiLoCo's pseudo-gradients and buffers, and its counters.

    Args:
        compressor: average the layers it takes through it, with error feedback across outer steps; ``None``: a
            plain mean.
        error_feedback: keep each rank's compression error and add it to the next round's pseudo-gradient;
            ``None``: the compressor's default (on for biased compressors).
        min_compress_numel: layers with fewer elements are averaged densely (see ``Compressor.compresses``).
        seed: the seed of the randomness shared by all ranks.

    Attributes:
        telemetry: where the collectives count what they move.
        bytes_sent: what this rank has put on the wire for outer exchanges and buffer averages, in all.
        bytes_received: what it has taken off the wire, likewise.
        step: outer exchanges completed (the step compressors draw their shared randomness from).
    """

    def __init__(
        self,
        compressor: Compressor | None = None,
        *,
        error_feedback: bool | None = None,
        min_compress_numel: int = 1024,
        seed: int = 0,
    ) -> None:
        if compressor is not None:
            compressor.check_error_feedback(error_feedback)
        self.compressor = compressor
        self.error_feedback = error_feedback
        self.min_compress_numel = min_compress_numel
        self.seed = seed
        self.telemetry = Telemetry()
        self.residuals = ErrorFeedback()
        self.step = 0
        self.bytes_sent = 0
        self.bytes_received = 0
        self.replicas: ReplicaGroups | None = None
        self._comm: Comm | None = None  # over every worker (with replicas: the peers of this rank's index)
        self._group: Comm | None = None  # with replicas: this rank's replica group
        #: over every rank, counted as the outer loop's (a synchronous step: DenseWarmup's dense phase)
        self.world: Comm | None = None
        #: with replicas: the group's dense data parallelism at every inner step, counted apart (its fast link)
        self.in_group: Comm | None = None
        self._splits: dict[int, Split] = {}

    def attach(
        self,
        device: torch.device,
        process_group: Any = None,
        replicas: ReplicaGroups | None = None,
        backend: CollectiveBackend | None = None,
    ) -> None:
        """Bind to the collectives (on every rank at the same point: process groups are made here)."""
        self.replicas = replicas
        if backend is None:
            collectives = TorchCollectives(process_group)
            if self.compressor is not None:
                collectives.ensure_rounds(self.compressor.rounds)
            backend = collectives
        self.world = self._comm = Comm(backend, self.telemetry, device)
        if replicas is not None:
            if replicas.peers is not None:  # else the peers' collectives are ``backend``'s (torchft's, across jobs)
                self._comm = Comm(TorchCollectives(replicas.peers), self.telemetry, device)
            self._group = Comm(TorchCollectives(replicas.group), self.telemetry, device)
            self.in_group = Comm(TorchCollectives(replicas.group), Telemetry(), device)
        self.telemetry.world_size = self.world.world_size

    @property
    def workers(self) -> int:
        """The workers (replicas) whose pseudo-gradients are averaged: 1 before :meth:`attach` or without a group."""
        return self._comm.world_size if self._comm is not None else 1

    @property
    def comm(self) -> Comm:
        """The collectives over the workers (available after :meth:`attach`)."""
        if self._comm is None:
            raise RuntimeError("OuterExchange.attach must be called before the first outer exchange.")
        return self._comm

    # ------------------------------------------------------------------------------------------------------------
    # The exchange
    # ------------------------------------------------------------------------------------------------------------
    def start(self, flats: list[Tensor], layouts: Sequence[tuple[Layer, ...]]) -> InFlight:
        """Start averaging each flat pseudo-gradient (laid out as its ``layouts`` entry); the averages overwrite them.

        Every rank must call it with the same layouts, in the same order.
        """
        if self._comm is None:  # no process group (a run of one process without torch.distributed): the mean is it
            return InFlight(flats, [], lambda finite: None)
        comm, updates = self._comm, StepUpdates()
        futures: list[torch.futures.Future] = []
        for flat, layers in zip(flats, layouts, strict=True):
            if self.compressor is not None:
                # index: the group's first parameter, unique per fragment and dtype, stable across resumes
                reduction = Reduction(comm, self.residuals, updates, layers[0].index, self.step, self.seed)
                split = self._split(layers)
                futures.append(reduce_split(flat, split, reduction, error_feedback=self.error_feedback))
            elif self.replicas is not None:
                futures.append(self._shard_all_reduce(flat))
            else:
                futures.append(comm.mean([flat]))

        def complete(finite: bool) -> None:
            updates.observe(torch.tensor(finite))
            updates.commit()
            self.step += 1
            self.count()

        # with two levels the averages reach ``flats`` in the gather: they are checked after it, not this rank's own
        gather = (lambda: self._gather_shards(flats, futures)) if self.replicas is not None else None
        return InFlight(flats, futures, complete, gather)

    def average(self, tensors: Sequence[Tensor]) -> list[Tensor]:
        """The plain mean over the workers of ``tensors`` (the buffers: BatchNorm's statistics), at once, as copies.

        One flat tensor per dtype and device. It changes no compressor state and does not count as an outer exchange.
        """
        grouped = flatten_by_dtype([t.detach() for t in tensors])
        flats = [flat for _, flat in grouped]
        if self._comm is None:
            pass  # no process group: the mean of one worker
        elif self.replicas is not None:
            futures = [self._shard_all_reduce(flat) for flat in flats]
            torch.futures.wait_all(futures)
            self._gather_shards(flats, futures)
        elif flats:
            self.comm.mean(flats).wait()
        self.count()
        return views_of(tensors, grouped)

    def count(self) -> None:
        """Add what the collectives counted since the last count to :attr:`bytes_sent` and :attr:`bytes_received`."""
        stats = self.telemetry.pop_step()
        if stats is not None:
            self.bytes_sent += stats.bytes_sent
            self.bytes_received += stats.bytes_received

    def _split(self, layers: tuple[Layer, ...]) -> Split:
        """The split of a pseudo-gradient of ``layers``, cached per layout while the compressor's levels hold."""
        assert self.compressor is not None
        key = layers[0].index
        split = self._splits.get(key)
        if split is None or split.every != layers or split.compressor_key != self.compressor.plan_key():
            split = self._splits[key] = split_layers(layers, self.compressor, self.min_compress_numel)
        return split

    def _shard_all_reduce(self, flat: Tensor) -> torch.futures.Future:
        """With replica groups: this rank's shard of ``flat``, averaged with its peers (the slow link)."""
        assert self.replicas is not None
        k, comm = self.replicas.size, self.comm
        shard = torch.nn.functional.pad(flat, (0, (-flat.numel()) % k)).view(k, -1)[self.replicas.index].clone()
        return comm.mean([shard], workers=self.replicas.count)

    def _gather_shards(self, flats: list[Tensor], futures: list[torch.futures.Future]) -> None:
        """With replica groups: every shard's average gathered inside the group (the fast link) into ``flats``."""
        assert self._group is not None
        gathered = [self._group.all_gather(future.value()) for future in futures]
        for flat, future in zip(flats, gathered):
            rows = future.wait()
            flat.copy_(torch.cat([row[0] for row in rows])[: flat.numel()])

    # ------------------------------------------------------------------------------------------------------------
    # State: this rank's own (the residuals differ between ranks)
    # ------------------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This rank's residuals (per parameter), the compressor's own state and the exchange counter."""
        compressor = to_cpu(self.compressor.state_dict()) if self.compressor is not None else None
        return {"residuals": self.residuals.state_dict(), "compressor": compressor, "step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (residuals are laid out again at the next exchange)."""
        self.residuals.load_state_dict(state["residuals"])
        if self.compressor is not None and state["compressor"] is not None:
            self.compressor.load_state_dict(state["compressor"])
        self.step = state["step"]
