"""What :class:`~lightning_gradcomp.callbacks.AutoCompression` measures: the step's timeline, the link, each codec.

- :class:`StepRecord`: one calibration step as the hook recorded it (:meth:`CompressionState.start_recording`), and
  :func:`summarise`, which turns several into the planner's :class:`~lightning_gradcomp.auto.timeline.Bucket` and
  :class:`~lightning_gradcomp.auto.timeline.Timing`;
- :func:`probe_link`: dense all-reduces of a few sizes on the real process group, fitted to ``alpha`` and ``beta``;
- :func:`measure_codecs` and :func:`codec_cost`: each candidate on the step's real bucket gradients, through the real
  hook on simulated ranks in this process (no communication; bytes from each candidate's declared byte model,
  :meth:`Compressor.wire_bytes <lightning_gradcomp.compressors.Compressor.wire_bytes>`, at the real world size).
"""

from __future__ import annotations

import copy
import os
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from lightning_gradcomp.auto.timeline import (
    DENSE,
    Bucket,
    Cost,
    Link,
    Timing,
    allreduce_equivalent,
    exposed_tail,
    fit_link,
    predict,
)
from lightning_gradcomp.compressors import Compressor
from lightning_gradcomp.compressors.base import Layer, check_gradient_dtypes
from lightning_gradcomp.ddp.hook import CompressionState
from lightning_gradcomp.ddp.simulation import SimulatedHook
from lightning_gradcomp.engine.telemetry import BucketRecord, StepStats
from lightning_gradcomp.engine.wire_model import bucket_wire_bytes

__all__ = [
    "CODEC_TIMED_RUNS",
    "PROBE_REPEATS",
    "PROBE_SIZES",
    "StepRecord",
    "codec_cost",
    "dense_costs",
    "last_layout",
    "measure_codecs",
    "model_options",
    "outer_costs",
    "outer_payloads",
    "probe_link",
    "summarise",
    "timed_buckets",
]

#: all-reduce sizes (bytes) timed to fit the link, each ``PROBE_REPEATS`` times; the first (one element) gives the
#: latency, the others the bandwidth
PROBE_SIZES = (4, 64 * 1024, 1024 * 1024, 4 * 1024 * 1024)
PROBE_REPEATS = 3
#: timed runs of each candidate on each bucket after one warm-up run; the fastest counts (a run on a loaded machine
#: can be an outlier: a single timed run once read TopK-10 % 3.7x slower than the next calibration did)
CODEC_TIMED_RUNS = 2


@dataclass(frozen=True)
class StepRecord:
    """One measured step, in seconds.

    Attributes:
        forward: the forward pass (from the batch's start to the backward's).
        backward: the backward call (until the optimizer step starts).
        optimizer: the optimizer step, to the end of the batch.
        step: the whole step.
        buckets: each bucket's record, its times counted from the backward's start (``finished`` always set).
    """

    forward: float
    backward: float
    optimizer: float
    step: float
    buckets: tuple[BucketRecord, ...]

    @classmethod
    def from_times(
        cls, start: float, backward: float, optimizer: float, end: float, recorded: Sequence[BucketRecord]
    ) -> StepRecord:
        """The step from its host times (``perf_counter``) and what the hook recorded.

        A bucket whose reduction never reported finishing counts as finished at ``end``.
        """
        buckets = tuple(
            BucketRecord(r.entered - backward, r.layers, r.numel, (r.finished or end) - backward) for r in recorded
        )
        return cls(backward - start, optimizer - backward, end - optimizer, end - start, buckets)

    @property
    def layout(self) -> list[tuple[str, ...]]:
        """The layers of each bucket, in the order DDP reduced them."""
        return [bucket.layers for bucket in self.buckets]


def last_layout(records: Sequence[StepRecord]) -> list[StepRecord]:
    """The records with the bucket layout of the last one (DDP may rebuild its buckets during a calibration)."""
    layout = records[-1].layout
    return [r for r in records if r.layout == layout]


def summarise(records: Sequence[StepRecord]) -> tuple[list[Bucket], Timing, float]:
    """The buckets (median ready times, no costs yet), the step's fixed parts and the median step time.

    ``records`` share one bucket layout (:func:`last_layout`).
    """
    buckets = []
    for b, last in enumerate(records[-1].buckets):
        ready = statistics.median(r.buckets[b].entered for r in records)
        buckets.append(Bucket(ready=ready, numel=last.numel, layers=last.layers, costs={}))
    backward_end = max(bucket.ready for bucket in buckets) if buckets else 0.0
    # after the last reduction finished, the backward call still copies the averages into the gradients
    tails = [r.backward - max([_finished(b) for b in r.buckets] + [b.entered for b in r.buckets]) for r in records]
    timing = Timing(
        forward=statistics.median(r.forward for r in records),
        backward_end=backward_end,
        optimizer=statistics.median(r.optimizer for r in records),
        tail=max(0.0, statistics.median(tails)),
    )
    return buckets, timing, statistics.median(r.step for r in records)


def _finished(record: BucketRecord) -> float:
    return record.finished if record.finished is not None else record.entered


def probe_link(device: torch.device, group: dist.ProcessGroup | None = None) -> Link:
    """Time dense all-reduces of :data:`PROBE_SIZES` on the real process group; fit ``alpha`` and ``beta``.

    A collective call: every rank of ``group`` calls it at the same point.
    """
    samples = []
    for nbytes in PROBE_SIZES:
        tensor = torch.zeros(max(1, nbytes // 4), dtype=torch.float32, device=device)
        times = []
        for _ in range(PROBE_REPEATS):
            dist.barrier(group=group)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            begin = time.perf_counter()
            dist.all_reduce(tensor, group=group)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - begin)
        samples.append((float(nbytes), statistics.median(times)))
    return fit_link(samples[1:], alpha=samples[0][1])


def dense_costs(buckets: Sequence[Bucket], params: Mapping[str, torch.Tensor]) -> list[Bucket]:
    """``buckets`` with the cost of a plain all-reduce (their gradients' bytes), the only cost known without timing."""
    return [
        Bucket(b.ready, b.numel, b.layers, {DENSE: Cost(0.0, 0.0, float(b.numel * _element_size(b, params)), 1)})
        for b in buckets
    ]


def timed_buckets(
    dense: Sequence[Bucket], link: Link, timing: Timing, margin: float, measure: str, options: Mapping[str, bool]
) -> list[int]:
    """The indices of the buckets whose candidates are worth timing.

    With ``measure="tail"`` only the buckets of the dense timeline's exposed tail
    (:func:`~lightning_gradcomp.auto.timeline.exposed_tail`): the planner never compresses a bucket before it, since
    one that finishes before an idle gap cannot shorten the step, and compressing a later bucket does not change that.
    None when the exposed time is at most ``margin`` of the step: compression cannot end a step before the backward
    pass does, so it could not gain the margin. On a fast link this is the last bucket or none, which keeps the
    calibration cheap. ``measure="all"``: every bucket.
    """
    if measure == "all":
        return list(range(len(dense)))
    prediction = predict(dense, [DENSE] * len(dense), link, timing, **options)
    if prediction.exposed <= margin * prediction.step:
        return []  # compression can at most remove the exposed time: it cannot gain the margin
    return list(range(exposed_tail(prediction, dense, link), len(dense)))


def measure_codecs(
    candidates: Mapping[str, Compressor],
    state: CompressionState,
    params: Mapping[str, torch.Tensor],
    dense: Sequence[Bucket],
    timed: Sequence[int],
    world_size: int,
) -> list[Bucket]:
    """``dense`` with each candidate's encode and decode time and payload bytes on the buckets ``timed``.

    A bucket's gradients are the parameters' current ones (random where a parameter has none), in their dtype, as
    the hook sees them; a candidate that refuses them (a cast and 16-bit gradients) is not offered for the bucket.
    """
    index = {name: i for i, name in enumerate(params)}
    out = list(dense)
    for b in timed:
        bucket = dense[b]
        layers, offset, grads = [], 0, []
        for name in bucket.layers:
            p = params.get(name)
            if p is None:
                continue
            layers.append(Layer(name, index[name], p.shape, offset))
            offset += p.numel()
            grads.append((p.grad if p.grad is not None else torch.randn_like(p)).detach().reshape(-1))
        flat = torch.cat(grads) if grads else torch.zeros(0)
        costs = dict(bucket.costs)
        for name, candidate in candidates.items():
            if name != DENSE and _takes(candidate, layers, params, state.min_compress_numel):
                costs[name] = codec_cost(candidate, state, tuple(layers), flat, world_size)
        out[b] = Bucket(bucket.ready, bucket.numel, bucket.layers, costs)
    return out


def codec_cost(
    candidate: Compressor, state: CompressionState, layers: tuple[Layer, ...], flat: torch.Tensor, world_size: int
) -> Cost:
    """One candidate on one bucket, through the real hook on simulated ranks in this process.

    The hook's own work (the gather and scatter of the compressed layers, the error-feedback staging, the finiteness
    guard and the commit) costs as much as a light codec's: timing only the compressor predicted PowerSGD up to 15 %
    too fast. Encode and decode are the compressor's own timed blocks on rank 0; the rest of the wall time per rank
    is the hook's and counts as encoding (it runs at the hook's call, on the autograd thread). The bytes are what
    the candidate's byte model says each rank moves for the bucket's gradient at ``world_size`` (whatever mix of
    collectives it yields), priced as the all-reduce that moves as many.
    """
    compressed = [layer for layer in layers if candidate.compresses(layer, state.min_compress_numel)]
    dense_numel = sum(layer.numel for layer in layers) - sum(layer.numel for layer in compressed)
    element = flat.element_size()
    if not compressed:
        return Cost(0.0, 0.0, float(flat.numel() * element), 1)
    states = [
        CompressionState(
            copy.deepcopy(candidate),
            error_feedback=state.error_feedback,
            min_compress_numel=state.min_compress_numel,
            seed=state.seed,
        )
        for _ in range(world_size)
    ]
    hook = SimulatedHook(states, layers)
    best: tuple[float, StepStats] | None = None
    for attempt in range(1 + CODEC_TIMED_RUNS):  # the first run allocates and warms up (PowerSGD's query)
        begin = time.perf_counter()
        hook.step([flat] * world_size)
        wall = time.perf_counter() - begin
        stats = states[0].telemetry.pop_step()
        for other in states[1:]:
            other.telemetry.pop_step()
        if stats is None:
            raise RuntimeError(f"Timing {candidate!r}: the simulated step recorded no telemetry.")
        if attempt and (best is None or wall < best[0]):
            best = (wall, stats)
    assert best is not None  # CODEC_TIMED_RUNS >= 1
    wall, stats = best
    encode, decode = stats.encode_ms / 1e3, stats.decode_ms / 1e3
    hook_s = max(0.0, wall / world_size - encode - decode)
    ranks = max(world_size, 2)  # one worker moves nothing: price the bytes as two would move them, like the dense cost
    moved = bucket_wire_bytes(
        candidate,
        layers,
        ranks,
        min_compress_numel=state.min_compress_numel,
        error_feedback=state.error_feedback,
        tensor=flat,
    )
    nbytes = allreduce_equivalent(moved, ranks)
    rounds = candidate.rounds + (1 if dense_numel else 0)
    return Cost(encode + hook_s, decode, float(nbytes), rounds)


#: the elements of the slice ``outer_costs`` times a payload's codec on (the model's own count scales the result)
OUTER_SLICE = 1 << 20


def outer_payloads() -> dict[str, Compressor | None]:
    """DiLoCo's outer payloads ``advise`` prices, by the names of :data:`~lightning_gradcomp.auto.periodic.PAYLOADS`."""
    from lightning_gradcomp.compressors import MinMax, SparseLoCo

    return {"fp32": None, "8-bit": MinMax(bits=8), "4-bit": MinMax(bits=4), "SparseLoCo": SparseLoCo()}


def outer_costs(numel: int, world_size: int, payloads: Mapping[str, Compressor | None]) -> dict[str, Cost]:
    """Each of DiLoCo's outer payloads for a model of ``numel`` parameters: its codec time and bytes per exchange.

    ``None`` is the plain fp32 all-reduce (no codec). A compressor is timed through the real hook (:func:`codec_cost`)
    on a random slice of at most :data:`OUTER_SLICE` elements, laid out as one matrix, and its times and bytes are
    scaled to ``numel`` (both grow linearly with the elements for the payloads priced: min-max quantization and
    SparseLoCo's top-k per chunk).
    """
    out = {}
    for name, compressor in payloads.items():
        if compressor is None:
            out[name] = Cost(0.0, 0.0, float(4 * numel), 1)
            continue
        rows = max(min(numel, OUTER_SLICE) // 1024, 1)
        flat = torch.randn(rows * 1024, generator=torch.Generator().manual_seed(0))
        layers = (Layer("model", 0, torch.Size((rows, 1024)), 0),)
        cost = codec_cost(compressor, CompressionState(compressor), layers, flat, world_size)
        scale = numel / flat.numel()
        out[name] = Cost(cost.encode * scale, cost.decode * scale, cost.nbytes * scale, cost.rounds)
    return out


def model_options(device: torch.device, workers: int) -> dict[str, bool]:
    """The timeline model's options for ``workers`` processes on this machine (see :func:`predict`)."""
    cpu = device.type == "cpu"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return {
        # the hook runs on the autograd thread: on the CPU encoding delays the rest of the backward pass
        "encode_blocks_backward": cpu,
        # fewer cores than the workers' compute threads plus a communication thread each: gloo's CPU work (and the
        # decoding) takes its share from the backward pass even when it overlaps
        "contended": cpu and cores < workers * (torch.get_num_threads() + 1),
    }


def _element_size(bucket: Bucket, params: Mapping[str, torch.Tensor]) -> int:
    """Bytes per element of ``bucket``'s gradients (a DDP bucket holds one dtype; 16-bit training halves them)."""
    for name in bucket.layers:
        if name in params:
            return params[name].dtype.itemsize
    return 4


def _takes(candidate: Compressor, layers: Sequence[Layer], params: Mapping[str, torch.Tensor], min_numel: int) -> bool:
    """Whether ``candidate`` accepts the gradients of ``layers`` (a cast refuses 16-bit ones).

    The planner is offered a candidate only for the buckets it accepts, so it never assigns one a bucket it refuses.
    """
    try:
        check_gradient_dtypes(candidate, [(layer, params[layer.name].dtype) for layer in layers], min_numel)
    except ValueError:
        return False
    return True
