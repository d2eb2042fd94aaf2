"""A compressor on DiLoCo's outer exchange: the pseudo-gradient averaged through the compressor contract.

SparseLoCo (Sarfi et al. 2025, arXiv 2508.15706), INTELLECT-1 (Jaghouar et al. 2024, arXiv 2412.01152) and Streaming
DiLoCo (Douillard et al. 2025, arXiv 2501.18512) compress the pseudo-gradient ``theta_global - theta_local`` before it
is averaged; SparseLoCo keeps each worker's compression error and adds it to the next round's pseudo-gradient (error
feedback over outer steps). :class:`OuterExchange` does this with the package's compressors, on the same path as
the communication hook: the pseudo-gradient of one dtype is laid out as a bucket (a flat tensor and its
:class:`~lightning_gradcomp.compressors.Layer` entries, so layer-wise compressors such as PowerSGD see matrices), the
layers the compressor takes go through :meth:`Compressor.reduce <lightning_gradcomp.compressors.Compressor.reduce>`
(the driver forms ``x = g + e`` and settles ``e = x - sent`` from what the exchange declares), the rest are
all-reduced densely, and every state change (the residual, the compressor's own) is staged and committed only when
the whole average is finite on every rank.

The commit happens when the average is waited for, not when the collectives complete: while an exchange is in
flight (Streaming DiLoCo's overlap) the residual and the compressor's state are still those of before it, which is
what a checkpoint saves and what a resume sends the same contribution from again.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_gradcomp.compressors.base import BucketContext, Compressor, Layer
from lightning_gradcomp.engine.collectives import TorchCollectives
from lightning_gradcomp.engine.comm import CollectiveBackend, Comm, when_all
from lightning_gradcomp.engine.context import ddp_scale_
from lightning_gradcomp.engine.error_feedback import ErrorFeedback
from lightning_gradcomp.engine.requests import StepUpdates
from lightning_gradcomp.engine.staging import to_cpu
from lightning_gradcomp.engine.telemetry import Telemetry
from lightning_gradcomp.engine.wire_model import relayout

__all__ = ["OuterExchange", "OuterRound"]


def _gather(flat: Tensor, layers: Sequence[Layer]) -> Tensor:
    """The elements of ``layers`` in ``flat``, consecutive (a copy: the outer exchange runs once per round)."""
    return torch.cat([layer.flat(flat) for layer in layers])


def _scatter(flat: Tensor, layers: Sequence[Layer], values: Tensor) -> None:
    for layer, piece in zip(layers, values.split([layer.numel for layer in layers])):
        layer.flat(flat).copy_(piece)


class OuterRound:
    """One outer exchange in flight; :meth:`wait` commits its staged state (if finite) and returns the averages."""

    def __init__(
        self,
        flats: list[Tensor],
        futures: list[torch.futures.Future],
        updates: StepUpdates,
        on_done: Callable[[], None],
    ) -> None:
        self._flats, self._futures, self._updates, self._on_done = flats, futures, updates, on_done

    def wait(self) -> list[Tensor]:
        """The averaged pseudo-gradients (written into the tensors that were sent), the round's state committed."""
        for future in self._futures:
            future.wait()
        if self._flats:
            # one verdict for the whole round: a NaN in a densely averaged layer also leaves the residual as it was
            sums = torch.stack([flat.sum(dtype=torch.float64).cpu() for flat in self._flats])
            self._updates.observe(torch.isfinite(sums).all())
        self._updates.commit()
        self._on_done()
        return self._flats


class OuterExchange:
    """A compressor, each rank's error-feedback residuals and the collectives of DiLoCo's outer exchange.

    Args:
        compressor: how the pseudo-gradient's layers it takes are averaged (the rest are all-reduced densely).
        error_feedback: keep each rank's compression error across outer steps and add it to the next round's
            pseudo-gradient; ``None``: the compressor's default (on for biased compressors).
        min_compress_numel: layers with fewer elements are averaged densely (see ``Compressor.compresses``).
        seed: the seed of the randomness shared by all ranks.
    """

    def __init__(
        self,
        compressor: Compressor,
        *,
        error_feedback: bool | None = None,
        min_compress_numel: int = 1024,
        seed: int = 0,
    ) -> None:
        compressor.check_error_feedback(error_feedback)
        self.compressor = compressor
        self.error_feedback = error_feedback
        self.min_compress_numel = min_compress_numel
        self.seed = seed
        self.telemetry = Telemetry()
        self.residuals = ErrorFeedback()
        self.step = 0  # outer exchanges applied: the step compressors draw their shared randomness from
        self.last_bytes = (0, 0)  # (sent, received) by the last exchange waited for, as its collectives count them
        self._comm: Comm | None = None

    def attach(self, device: torch.device, process_group: Any = None, backend: CollectiveBackend | None = None) -> None:
        """Bind to the collectives (on every rank at the same point: the compressor's round groups are made here)."""
        if backend is None:
            collectives = TorchCollectives(process_group)
            collectives.ensure_rounds(self.compressor.rounds)
            backend = collectives
        self._comm = Comm(backend, self.telemetry, device)

    @property
    def attached(self) -> bool:
        """Whether :meth:`attach` bound it to collectives."""
        return self._comm is not None

    def average(self, flats: Sequence[Tensor], layouts: Sequence[tuple[Layer, ...]]) -> OuterRound:
        """Start averaging each flat pseudo-gradient (laid out as its ``layouts`` entry); the averages overwrite them.

        Every rank must call it with the same layouts, in the same order.
        """
        if self._comm is None:
            raise RuntimeError("OuterExchange.attach must be called before the first outer exchange.")
        updates = StepUpdates()
        futures = [self._average_one(flat, layers, updates) for flat, layers in zip(flats, layouts, strict=True)]

        def count() -> None:
            # the counter moves when the exchange is applied: one in flight is sent again on resume with its own step
            self.step += 1
            stats = self.telemetry.pop_step()
            self.last_bytes = (stats.bytes_sent, stats.bytes_received) if stats is not None else (0, 0)

        return OuterRound(list(flats), futures, updates, count)

    def _context(self, layers: tuple[Layer, ...], like: Tensor, updates: StepUpdates) -> BucketContext:
        comm = self._comm
        assert comm is not None
        return BucketContext(index=layers[0].index, step=self.step, rank=comm.rank, world_size=comm.world_size,
                             layers=layers, dtype=like.dtype, device=like.device, seed=self.seed, comm=comm,
                             updates=updates)  # fmt: skip

    def _average_one(self, flat: Tensor, layers: tuple[Layer, ...], updates: StepUpdates) -> torch.futures.Future:
        comm = self._comm
        assert comm is not None
        self.telemetry.add_bucket(flat.numel() * flat.element_size())
        compressor = self.compressor.bucket_compressor(layers)
        chosen = [layer for layer in layers if compressor.compresses(layer, self.min_compress_numel)]
        others = [layer for layer in layers if not compressor.compresses(layer, self.min_compress_numel)]
        compressed, dense = relayout(chosen), relayout(others)
        tensor = _gather(flat, chosen) if chosen else None
        dense_tensor = _gather(flat, others) if others else None
        index = layers[0].index  # the group's first parameter: unique per fragment and dtype, stable across resumes
        memory = self.residuals.prepare(index, compressed, tensor, dense, dense_tensor,
                                        keep=compressor.resolve_error_feedback(self.error_feedback))  # fmt: skip
        futures = []
        if dense_tensor is not None:
            averaged = comm.all_reduce((ddp_scale_(dense_tensor, comm.world_size),)).then(lambda fut: fut.value()[0])
            if compressor.has_dense_update:
                ctx = self._context(dense, dense_tensor, updates)

                def finish_dense(fut: torch.futures.Future, ctx: BucketContext = ctx) -> Tensor:
                    average = fut.value()
                    compressor.finish_dense(average, ctx)
                    return average

                averaged = averaged.then(finish_dense)
            futures.append(averaged.then(lambda fut: _scatter(flat, others, fut.value())))
        if tensor is not None:
            reduced = compressor.reduce(tensor, self._context(compressed, tensor, updates), memory)
            futures.append(reduced.then(lambda fut: _scatter(flat, chosen, fut.value())))
        return when_all(futures, flat.device)

    # ------------------------------------------------------------------------------------------------------------
    # State: this rank's own (the residuals differ between ranks)
    # ------------------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This rank's residuals (per parameter), the compressor's own state and the exchange counter."""
        compressor = to_cpu(self.compressor.state_dict())  # a compressor may hand out its live buffers
        return {"residuals": self.residuals.state_dict(), "compressor": compressor, "step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (residuals are laid out again at the next exchange)."""
        self.residuals.load_state_dict(state["residuals"])
        self.compressor.load_state_dict(state["compressor"])
        self.step = state["step"]
