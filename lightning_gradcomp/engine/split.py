"""The one split of a flat tensor between a compressor and the dense all-reduce, its reduction and its bytes.

Both strategies average flat tensors through a compressor: ``CompressedDDP``'s hook one DDP bucket per call,
DiLoCo's outer exchange one pseudo-gradient per dtype per round. Either way the tensor holds consecutive layers; the
compressor for those layers (:meth:`Compressor.bucket_compressor <lightning_gradcomp.compressors.Compressor.
bucket_compressor>`) takes some of them (:meth:`~lightning_gradcomp.compressors.Compressor.compresses`: by default
matrices above ``min_compress_numel`` elements), and the rest are all-reduced densely, as plain DDP averages them.
:func:`split_layers` makes that plan once per layout; :func:`reduce_split` runs it:

1. gather the compressed layers and the dense ones into one contiguous tensor each (views where they already are);
2. lay the error-feedback residuals out for both (:meth:`ErrorFeedback.prepare
   <lightning_gradcomp.engine.error_feedback.ErrorFeedback.prepare>`);
3. all-reduce the dense part, scaled by ``1 / n`` before the sum as DDP's reducer scales it (so it is bitwise plain
   DDP's), then the compressor's update of densely averaged layers (DGC's momentum, signSGD's sign);
4. reduce the compressed part through the compressor's exchange (:func:`~lightning_gradcomp.engine.driver.reduce`);
5. scatter both averages back into the flat tensor, one future for the whole.

:func:`split_wire_bytes` prices the same plan, so the byte model is the plan the reduction runs.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from lightning_gradcomp.engine import wire
from lightning_gradcomp.engine.comm import Comm, when_all
from lightning_gradcomp.engine.context import BucketContext, GradientRuns, Layer, ddp_scale_
from lightning_gradcomp.engine.driver import Splittable
from lightning_gradcomp.engine.error_feedback import ErrorFeedback
from lightning_gradcomp.engine.requests import StepUpdates

__all__ = ["Reduction", "Split", "reduce_dense", "reduce_split", "relayout", "split_layers", "split_wire_bytes"]

Runs = tuple[tuple[int, int], ...]


def relayout(layers: Sequence[Layer]) -> tuple[Layer, ...]:
    """``layers`` laid side by side from offset 0, as their gathered tensor holds them."""
    offsets = itertools.accumulate((layer.numel for layer in layers), initial=0)
    return tuple(Layer(layer.name, layer.index, layer.shape, offset) for layer, offset in zip(layers, offsets))


def _runs(layers: Sequence[Layer]) -> Runs:
    """The ``[start, end)`` ranges of the flat tensor that ``layers`` cover, adjacent layers merged."""
    runs: list[list[int]] = []
    for layer in layers:
        if runs and runs[-1][1] == layer.offset:
            runs[-1][1] = layer.offset + layer.numel
        else:
            runs.append([layer.offset, layer.offset + layer.numel])
    return tuple((start, end) for start, end in runs)


@dataclass(frozen=True)
class Split:
    """How one layout of a flat tensor is split between the compressor and the dense all-reduce.

    It also owns the buffers its layers are gathered into, reused every call: on the CPU a fresh allocation of a
    bucket-sized tensor every step costs page faults (glibc maps and unmaps chunks near its 32 MB threshold) that
    exceed the copy itself.

    Attributes:
        every: every layer, with its offset in the flat tensor.
        compressed: the layers the compressor takes, laid out as their gathered tensor holds them.
        dense: the others, likewise.
        compressed_runs: the ranges of the flat tensor that hold the compressed layers.
        dense_runs: the same for the dense ones.
        numel: the flat tensor's elements.
        compressor: the compressor that reduces these layers (``bucket_compressor``'s answer for them).
        compressor_key: its :meth:`plan_key` when the split was made: a changed key means a new split.
    """

    every: tuple[Layer, ...]
    compressed: tuple[Layer, ...]
    dense: tuple[Layer, ...]
    compressed_runs: Runs
    dense_runs: Runs
    numel: int
    compressor: Splittable = field(compare=False)
    compressor_key: tuple = ()
    buffers: dict[str, Tensor] = field(default_factory=dict, compare=False)

    @property
    def whole(self) -> bool:
        """Whether the compressor takes the whole tensor (nothing to gather or scatter)."""
        return not self.dense and self.compressed_runs == ((0, self.numel),)

    def runs(self, part: str) -> Runs:
        """The ranges of the flat tensor that hold the ``"dense"`` or ``"compressed"`` layers."""
        return self.dense_runs if part == "dense" else self.compressed_runs

    def gather(self, flat: Tensor, part: str, *, fill: bool = True) -> Tensor:
        """The ``"dense"`` or ``"compressed"`` layers of ``flat``, contiguous: a view if they are, else a copy.

        With ``fill=False`` a layout of several runs gets the split's buffer unfilled (the driver gathers into it, see
        :class:`~lightning_gradcomp.engine.context.GradientRuns`).
        """
        runs = self.runs(part)
        if len(runs) == 1:
            start, end = runs[0]
            return flat[start:end]
        out = self.buffers.get(part)
        if out is None or out.dtype != flat.dtype or out.device != flat.device:
            size = sum(end - start for start, end in runs)
            out = self.buffers[part] = torch.empty(size, dtype=flat.dtype, device=flat.device)
        if not fill:
            return out
        return torch.cat([flat[start:end] for start, end in runs], out=out)

    def scatter(self, flat: Tensor, compressed: Tensor | None, dense: Tensor | None) -> Tensor:
        """Write the averaged parts back into ``flat`` (views of it are left as they are); ``flat``."""
        for values, runs in ((compressed, self.compressed_runs), (dense, self.dense_runs)):
            if values is None:
                continue
            offset = 0
            for start, end in runs:
                target = flat[start:end]
                if target.data_ptr() != values[offset:].data_ptr():
                    target.copy_(values[offset : offset + end - start])
                offset += end - start
        return flat


def split_layers(layers: Sequence[Layer], compressor: Splittable, min_compress_numel: int) -> Split:
    """The split of a flat tensor holding ``layers`` (at their offsets) between ``compressor`` and the dense all-reduce.

    Raises:
        RuntimeError: If the layers do not tile the tensor from offset 0.
    """
    every = tuple(layers)
    numel = sum(layer.numel for layer in every)
    if every and (every[0].offset != 0 or any(a.offset + a.numel != b.offset for a, b in zip(every, every[1:]))):
        raise RuntimeError(f"Expected layers laid side by side from offset 0, got offsets {[x.offset for x in every]}.")
    runner = compressor.bucket_compressor(every)
    compressed = [layer for layer in every if runner.compresses(layer, min_compress_numel)]
    dense = [layer for layer in every if not runner.compresses(layer, min_compress_numel)]
    return Split(
        every=every,
        compressed=relayout(compressed),
        dense=relayout(dense),
        compressed_runs=_runs(compressed),
        dense_runs=_runs(dense),
        numel=numel,
        compressor=runner,
        compressor_key=runner.plan_key(),
    )


@dataclass(frozen=True)
class Reduction:
    """What one reduction of a flat tensor reads besides the tensor: where it runs, and whose state it changes.

    Attributes:
        comm: the collectives (bytes counted in their telemetry).
        residuals: this rank's error-feedback memory.
        updates: the state changes of this step or round, committed only if it is finite on every rank.
        index: the flat tensor's identity for the residuals and the compressor's per-bucket state (DDP's bucket
            index; DiLoCo's first parameter of the fragment and dtype).
        step: the step (or outer step) the compressor draws its shared randomness from.
        seed: the seed shared by the ranks.
    """

    comm: Comm
    residuals: ErrorFeedback
    updates: StepUpdates
    index: int
    step: int
    seed: int

    def context(self, layers: tuple[Layer, ...], like: Tensor) -> BucketContext:
        """The compressor's view of ``layers`` (gathered into a tensor like ``like``)."""
        comm = self.comm
        return BucketContext(
            index=self.index,
            step=self.step,
            rank=comm.rank,
            world_size=comm.world_size,
            layers=layers,
            dtype=like.dtype,
            device=like.device,
            seed=self.seed,
            comm=comm,
            updates=self.updates,
        )


def all_reduce_dense(
    tensor: Tensor, layers: tuple[Layer, ...], compressor: Splittable, reduction: Reduction
) -> torch.futures.Future[Tensor]:
    """Plain averaging of ``tensor``, then the compressor's dense update (DGC's momentum, signSGD's sign).

    Scaled by the reciprocal of the world size before the sum, as DDP's reducer scales a bucket without a hook:
    at world sizes that are not powers of two, ``x * (1 / n)`` and ``x / n`` round differently, and this way the
    dense layers are bitwise plain DDP's at every world size (torch's ``allreduce_hook`` divides, and is not).
    """
    comm = reduction.comm
    averaged = comm.all_reduce((ddp_scale_(tensor, comm.world_size),)).then(lambda fut: fut.value()[0])
    if not compressor.has_dense_update:
        return averaged
    ctx, updates = reduction.context(layers, tensor), reduction.updates

    def finish(fut: torch.futures.Future[Tensor]) -> Tensor:
        average = fut.value()
        # the average is the same on every rank, and a NaN anywhere reaches it: no flag needs to travel; the
        # step's own updates, captured at issue time: this callback may run after the next step began
        updates.observe(torch.isfinite(torch.sum(average, dtype=torch.float64)))
        compressor.finish_dense(average, ctx)
        return average

    return averaged.then(finish)


def reduce_dense(flat: Tensor, split: Split, reduction: Reduction) -> torch.futures.Future[Tensor]:
    """Average all of ``flat`` densely (a dense warm-up), paying into it any error-feedback residual still owed."""
    reduction.comm.telemetry.add_bucket(flat.numel() * flat.element_size())
    reduction.residuals.prepare(reduction.index, (), None, split.every, flat, keep=False)
    return all_reduce_dense(flat, split.every, split.compressor, reduction)


def reduce_split(
    flat: Tensor, split: Split, reduction: Reduction, *, error_feedback: bool | None
) -> torch.futures.Future[Tensor]:
    """Average ``flat`` over the ranks as ``split`` says; the averages overwrite ``flat``, the future returns it.

    ``error_feedback``: the strategy's setting (``None``: the compressor's default).
    """
    reduction.comm.telemetry.add_bucket(flat.numel() * flat.element_size())
    compressor = split.compressor
    keep = compressor.resolve_error_feedback(error_feedback)
    # with error feedback, several runs of compressed layers are gathered by the driver, in the pass that adds the
    # residual (GradientRuns); without it a debt may be paid into the gathered tensor first
    in_runs = keep and len(split.compressed_runs) > 1
    dense = split.gather(flat, "dense") if split.dense else None
    tensor = split.gather(flat, "compressed", fill=not in_runs) if split.compressed else None
    memory = reduction.residuals.prepare(reduction.index, split.compressed, tensor, split.dense, dense, keep=keep)
    futures = [] if dense is None else [all_reduce_dense(dense, split.dense, compressor, reduction)]
    if tensor is None:
        return futures[0].then(lambda fut: split.scatter(flat, None, fut.value()))
    runs = GradientRuns(flat, split.compressed_runs) if in_runs else None
    reduced = compressor.reduce(tensor, reduction.context(split.compressed, tensor), memory, runs)
    if split.whole:
        return reduced
    futures.append(reduced)

    def finish(fut: torch.futures.Future[list[Tensor]]) -> Tensor:
        values = fut.value()
        return split.scatter(flat, values[-1], values[0] if dense is not None else None)

    return when_all(futures, flat.device).then(finish)


def split_wire_bytes(
    split: Split,
    world_size: int,
    *,
    error_feedback: bool | None = None,
    tensor: Tensor | None = None,
    dtype: torch.dtype = torch.float32,
    step: int = 0,
) -> wire.Wire:
    """What one rank moves (mean over ranks) when :func:`reduce_split` reduces a tensor split as ``split``.

    The compressed layers count by the compressor's :meth:`~lightning_gradcomp.compressors.Compressor.wire_bytes`,
    the dense ones as one ring all-reduce.

    Args:
        split: the plan.
        world_size: the number of ranks.
        error_feedback: the strategy's (``None``: the compressor's default).
        tensor: the flat tensor (its compressed layers are handed to the byte model); default: a seeded Gaussian.
        dtype: the tensor's dtype without ``tensor``.
        step: the optimizer step.
    """
    dtype = dtype if tensor is None else tensor.dtype
    dense = sum(layer.numel for layer in split.dense)
    moved = wire.all_reduce(dense * dtype.itemsize, world_size) if dense else wire.Wire()
    if not split.compressed:
        return moved
    if tensor is None:
        numel = sum(layer.numel for layer in split.compressed)
        part = torch.randn(numel, generator=torch.Generator().manual_seed(0)).to(dtype)
    else:
        part = split.gather(tensor.reshape(-1), "compressed").clone()
    return moved + split.compressor.wire_bytes(
        split.compressed, world_size, error_feedback=error_feedback, tensor=part, step=step
    )
