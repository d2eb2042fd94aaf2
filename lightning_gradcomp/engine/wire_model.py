"""Each compressor's declared byte model: what one rank sends and receives per bucket, at any world size.

The model is read from the requests a compressor's :meth:`~lightning_gradcomp.compressors.Compressor.exchange`
yields, not from a declared collective: :func:`traced_wire_bytes` runs the real driver
(:func:`~lightning_gradcomp.engine.driver.issue_all`: error feedback, the non-finite flag, every round) on
:class:`MirroredRanks`, a world of ``n`` ranks that all hold the same tensor, whose collectives complete at once and
count what each moves with :mod:`lightning_gradcomp.engine.wire`, the formulas the telemetry counts with (as the mean
over ranks, where ranks differ: a broadcast's source, an all-to-all's destinations). So any exchange,
one of all-reduces, all-gathers, all-to-alls, broadcasts or a mix of them, is covered by the requests it yields, and
the figure equals what the telemetry logs for ranks holding that tensor. Where payload sizes depend on the data
(Zen's non-zeros), the model holds for the tensor it is given (by default a seeded Gaussian, which
no real gradient is: pass one). The last round's decoding is skipped, so the model costs about one encoding even at
thousands of ranks.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_gradcomp.engine import driver, wire
from lightning_gradcomp.engine.comm import Comm, ReduceOpName
from lightning_gradcomp.engine.context import BucketContext, Layer, ResidualBuffers
from lightning_gradcomp.engine.split import relayout, split_layers, split_wire_bytes
from lightning_gradcomp.engine.telemetry import Telemetry

__all__ = ["MirroredRanks", "bucket_wire_bytes", "traced_wire_bytes"]


class MirroredRanks:
    """A :class:`~lightning_gradcomp.engine.comm.CollectiveBackend` of ``world_size`` ranks holding what this one does.

    Every collective completes at once with the result it would have in such a world (a sum is ``n`` times the
    tensor, a gather ``n`` copies of it, an all-to-all brings this rank's own chunk for itself from every rank) and
    adds what a rank moves to :attr:`moved`, a broadcast as the mean over ranks (:func:`wire.broadcast_mean`).
    """

    def __init__(self, world_size: int, rank: int = 0) -> None:
        self.world_size, self.rank = world_size, rank
        self.moved = wire.Wire()

    @staticmethod
    def _done(value: Tensor) -> torch.futures.Future[Tensor]:
        future: torch.futures.Future[Tensor] = torch.futures.Future()
        future.set_result(value)
        return future

    def all_reduce(self, tensor: Tensor, round: int, op: ReduceOpName) -> torch.futures.Future[Tensor]:
        """``n`` times ``tensor`` for a sum, ``tensor`` for a max."""
        self.moved += wire.all_reduce(tensor.numel() * tensor.element_size(), self.world_size)
        if op == "sum" and tensor.dtype != torch.bool and not tensor.is_sparse:
            tensor.mul_(self.world_size)
        return self._done(tensor)

    def all_gather(self, tensor: Tensor, round: int) -> torch.futures.Future[Tensor]:
        """``n`` copies of ``tensor`` (one expanded view)."""
        self.moved += wire.all_gather(tensor.numel() * tensor.element_size(), self.world_size)
        return self._done(tensor.unsqueeze(0).expand(self.world_size, *tensor.shape))

    def broadcast(self, tensor: Tensor, src: int, round: int) -> torch.futures.Future[Tensor]:
        """``tensor`` itself."""
        self.moved += wire.broadcast_mean(tensor.numel() * tensor.element_size(), self.world_size)
        return self._done(tensor)

    def all_to_all(
        self, tensor: Tensor, send_splits: Sequence[int], recv_splits: Sequence[int], round: int
    ) -> torch.futures.Future[Tensor]:
        """From every rank, this rank's own chunk for itself (cut or padded with zeros to the expected size).

        Counted as the mean over ranks: each sends every chunk but its own, ``(n - 1) / n`` of the buffer on average
        (every rank sends the same chunks, so each receives ``n - 1`` copies of the one destined to it).
        """
        moved = (self.world_size - 1) * tensor.numel() * tensor.element_size() / self.world_size
        self.moved += wire.Wire(moved, moved)
        start = sum(send_splits[: self.rank])
        own = tensor[start : start + send_splits[self.rank]]
        out = torch.zeros(sum(recv_splits), dtype=tensor.dtype, device=tensor.device)
        at = 0
        for count in recv_splits:
            kept = min(count, own.numel())
            out[at : at + kept] = own[:kept]
            at += count
        return self._done(out)


def _as_layers(layers: Sequence[Layer] | int) -> tuple[Layer, ...]:
    if isinstance(layers, int):
        return (Layer("flat", 0, torch.Size([layers])),)
    return relayout(layers)


def traced_wire_bytes(
    compressor: driver.Reducible,
    layers: Sequence[Layer] | int,
    world_size: int,
    *,
    error_feedback: bool,
    tensor: Tensor | None = None,
    step: int = 0,
    seed: int = 0,
) -> wire.Wire:
    """What one rank sends and receives (mean over ranks) when ``compressor`` reduces ``layers`` over ``world_size``.

    Runs a copy of ``compressor`` (its state stays as it was) through the driver on :class:`MirroredRanks`.

    Args:
        compressor: the compressor, as the hook runs it on the bucket (after ``bucket_compressor``).
        layers: the layers it compresses, or a number of elements (one flat layer).
        world_size: the number of ranks.
        error_feedback: whether the driver keeps a residual (it decides whether the non-finite flag travels).
        tensor: the flat gradient (its dtype counts); default: a seeded standard Gaussian in float32.
        step: the optimizer step (methods whose exchange changes with it: LGC's stages, warm-ups).
        seed: the seed shared by the ranks.
    """
    laid = _as_layers(layers)
    numel = sum(layer.numel for layer in laid)
    if tensor is None:
        tensor = torch.randn(numel, generator=torch.Generator().manual_seed(seed))
    else:
        tensor = tensor.detach().reshape(-1).clone()
    backend = MirroredRanks(world_size)
    comm = Comm(backend, Telemetry(), tensor.device)
    ctx = BucketContext(
        index=laid[0].index,
        step=step,
        rank=0,
        world_size=world_size,
        layers=laid,
        dtype=tensor.dtype,
        device=tensor.device,
        seed=seed,
        comm=comm,
    )
    memory = ResidualBuffers(torch.zeros_like(tensor)) if error_feedback else None
    driver.issue_all(copy.deepcopy(compressor), tensor, ctx, memory)
    return backend.moved


def bucket_wire_bytes(
    compressor: driver.Splittable,
    layers: Sequence[Layer],
    world_size: int,
    *,
    min_compress_numel: int = 1024,
    error_feedback: bool | None = None,
    tensor: Tensor | None = None,
    dtype: torch.dtype = torch.float32,
    step: int = 0,
) -> wire.Wire:
    """What one rank moves (mean over ranks) for a whole DDP bucket, as the hook reduces it.

    The bucket is split as the hook splits it (:func:`~lightning_gradcomp.engine.split.split_layers`) and priced by
    :func:`~lightning_gradcomp.engine.split.split_wire_bytes`: the layers the compressor takes by its
    :meth:`~lightning_gradcomp.compressors.Compressor.wire_bytes`, the others as one dense ring all-reduce.

    Args:
        compressor: the strategy's compressor (its ``bucket_compressor`` for ``layers`` runs the bucket).
        layers: the bucket's layers, with their offsets in ``tensor``.
        world_size: the number of ranks.
        min_compress_numel: the strategy's: smaller layers go dense.
        error_feedback: the strategy's (``None``: the compressor's default).
        tensor: the bucket's flat gradient (its compressed layers are handed to the model); default: a Gaussian.
        dtype: the gradient's dtype without ``tensor``.
        step: the optimizer step.
    """
    split = split_layers(layers, compressor, min_compress_numel)
    return split_wire_bytes(split, world_size, error_feedback=error_feedback, tensor=tensor, dtype=dtype, step=step)
