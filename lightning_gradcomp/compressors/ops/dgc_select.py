"""DGC's sampled-threshold selection for every layer of a bucket at once: fixed-size slots, no host read.

Deep Gradient Compression (Lin et al., 2018, arXiv:1712.01887; the authors' code, synxlin/deep-gradient-compression)
selects per layer: the threshold is the smallest of the top ``ceil(samples ratio)`` of a sample of ``|v|`` (a strided
one from a random start, or uniform positions); every element at or above it is a candidate; more than 1.3 k
candidates: the exact top-k among them; fewer than 0.8 k: the threshold is lowered by 0.8 and the count repeated (at
most 10 times); at most ``k = ceil(ratio d)`` are kept, in index order. The reference reads the candidate count after
every threshold, and a loop over the layers issues a few operators per layer (each a kernel launch on a GPU).

Here every step of that rule is taken for the whole bucket in a fixed number of operators:

- the sample's random start (or its uniform positions) is drawn on the gradient's device, from a counter-based hash
  of the run's seed, the layer's stable index, the rank and the step (:mod:`~.random_subsets`): a layer's draws do
  not depend on its bucket;
- the samples of every layer lie back to back in one vector of a size fixed by the layout (a strided sample holds
  ``samples`` or ``samples + 1`` elements depending on its start: the last place is padded with 0, which never
  changes the ``ceil(samples ratio)``-th largest), and every layer's threshold is read from one batched top-k
  (:func:`~.layer_topk.layer_topk`);
- the counts at every threshold the loop may try (the sampled one lowered 0 to 10 times by 0.8, one rounding per
  lowering, as the loop rounds) come from one histogram of every element's level; the loop's decisions are taken on
  the device, per layer, from those counts;
- the candidates are ranked within their layer by a running count (a cumulative sum over the bucket less its value
  at the layer's start), and the first ``k`` of each layer go to its slots in index order; where the loop would take
  the exact top-k among more than 1.3 k candidates, that is the layer's top-k, taken for every layer at once by
  :func:`~.layer_topk.layer_topk` (ties at the k-th magnitude keep the lowest indices).

Every layer sends its ``k`` slots; a layer with fewer selected elements repeats its first selected index in the
unused slots, which carry the value 0.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_gradcomp.compressors.ops.layer_topk import layer_topk
from lightning_gradcomp.compressors.ops.random_subsets import draws, stream_key, streams, uniform_below
from lightning_gradcomp.compressors.ops.segments import LayoutCache
from lightning_gradcomp.engine.context import BucketContext, Layer

__all__ = [
    "LOWER_BOUND",
    "MAX_ADAPTATION_ITERS",
    "UPPER_BOUND",
    "layer_streams",
    "sample_plan",
    "sample_positions",
    "select_layers",
]

# the reference code's threshold adaptation (synxlin/deep-gradient-compression, dgc/compression.py)
UPPER_BOUND = 1.3  # more than 1.3 k candidates: exact top-k among them
LOWER_BOUND = 0.8  # fewer than 0.8 k: lower the threshold by this factor and count again
MAX_ADAPTATION_ITERS = 10
_LEVELS = MAX_ADAPTATION_ITERS + 2  # an element's level: how many of the 11 thresholds it reaches (0 to 11)
_SALT = 0x44474353  # DGC's sample streams, apart from any other compressor's


def sample_plan(numel: int, ratio: float, sample_ratio: float) -> tuple[int, int, int]:
    """``(num_samples, top_k_samples, stride)`` of the reference code for a layer of ``numel`` elements.

    The stride is ``32 j + 1`` stepped down by 8 until the strided sample holds at least ``max(ceil(sample_ratio
    numel), ceil(2 / ratio))`` elements; layers with at most ``ceil(2 / ratio)`` elements are not sampled.
    """
    if sample_ratio >= 1.0:
        return numel, math.ceil(numel * ratio), 1
    wanted = max(math.ceil(numel * sample_ratio), math.ceil(2 / ratio))
    if numel <= math.ceil(2 / ratio):
        return numel, math.ceil(numel * ratio), 1
    stride = math.ceil(numel / wanted / 32) * 32 + 1
    samples = numel // stride
    while samples < wanted:
        stride -= 8
        samples = numel // stride
    return samples, math.ceil(samples * ratio), stride


def layer_streams(ctx: BucketContext) -> Tensor:
    """Every layer's sample stream at this step and rank (int64, on ``ctx.device``): keyed by the layer's index."""
    keys = _KEYS.get(
        (tuple(layer.index for layer in ctx.layers), ctx.seed, ctx.rank, str(ctx.device)),
        lambda: torch.tensor(
            [stream_key(ctx.seed, layer.index, ctx.rank, _SALT) for layer in ctx.layers],
            dtype=torch.int64,
            device=ctx.device,
        ),
    )
    return streams(keys, ctx.step)


_KEYS: LayoutCache[Tensor] = LayoutCache()


def sample_positions(numel: int, ratio: float, sample_ratio: float, strided: bool, stream: Tensor) -> Tensor:
    """The positions of one layer's sample (int64), from its 0-d ``stream``: what :func:`select_layers` samples.

    The whole layer when it is not sampled; ``start::stride`` from a start drawn below the stride; or ``samples``
    uniform positions (with repeats). For the reference loop and tests: the strided sample's size is read here.
    """
    num_samples, _, stride = sample_plan(numel, ratio, sample_ratio)
    device = stream.device
    if num_samples == numel:
        return torch.arange(numel, device=device)
    if strided:
        start = uniform_below(draws(stream, torch.zeros((), dtype=torch.int64, device=device)), stride)
        return torch.arange(int(start), numel, stride, device=device)
    return uniform_below(draws(stream, torch.arange(num_samples, device=device)), numel)


@dataclass(frozen=True)
class _Plan:
    """A layout's fixed-size tensors (on the gradient's device)."""

    numel: int
    total: int  # slots, sum of k
    ks: Tensor  # int64 [L]
    lower: Tensor  # float64 [L]: 0.8 k
    upper: Tensor  # float64 [L]: 1.3 k
    sampled: Tensor  # bool [L]: the threshold came from a sample (the adaptation applies)
    lengths: Tensor  # int64 [L]
    starts: Tensor  # int64 [L]: each layer's first element in the bucket
    slot_starts: Tensor  # int64 [L]: each layer's first slot
    slot_layer: Tensor  # int64 [total]: each slot's layer
    within: Tensor  # int64 [total]: 0 .. k - 1 per layer
    fallback: Tensor  # int64 [total + 1]: each slot's layer's first element (and a dump slot)
    # the samples, back to back: entry e is counter ``counter[e]`` of layer ``sample_layer[e]``
    sample_layer: Tensor  # int64 [S]
    counter: Tensor  # int64 [S]
    sample_numel: Tensor  # int64 [S]: its layer's size
    sample_offset: Tensor  # int64 [S]: its layer's first element
    sample_stride: Tensor  # int64 [L]: 1 for a layer not sampled
    uniform: Tensor  # bool [S]: drawn uniformly (else strided)
    sample_layers: tuple[Layer, ...]  # every layer's sample as a segment of the sample vector
    sample_ks: tuple[int, ...]  # the top ``ceil(samples ratio)`` of each
    kth: Tensor  # int64 [L]: where each layer's smallest of them lies in layer_topk's answer


def _plan(
    layers: Sequence[Layer], ratios: Sequence[float], sample_ratio: float, strided: bool, device: torch.device
) -> _Plan:
    lengths = [layer.numel for layer in layers]
    starts = [0, *itertools.accumulate(lengths)][:-1]
    ks = [math.ceil(n * r) for n, r in zip(lengths, ratios)]
    slot_starts = [0, *itertools.accumulate(ks)][:-1]
    plans = [sample_plan(n, r, sample_ratio) for n, r in zip(lengths, ratios)]
    sampled = [samples < n for (samples, _, _), n in zip(plans, lengths)]
    # a strided sample holds `samples` or `samples + 1` elements, depending on its start: room for the larger
    widths = [samples + (s and strided) for (samples, _, _), s in zip(plans, sampled)]
    sample_starts = [0, *itertools.accumulate(widths)][:-1]
    sample_ks = [min(top, width) for (_, top, _), width in zip(plans, widths)]

    def on(values: list, dtype: torch.dtype = torch.int64) -> Tensor:
        return torch.tensor(values, dtype=dtype).to(device)

    def per_entry(values: list) -> Tensor:
        return torch.repeat_interleave(torch.tensor(values, dtype=torch.int64), torch.tensor(widths)).to(device)

    per_slot = torch.repeat_interleave(torch.arange(len(layers)), torch.tensor(ks))
    return _Plan(
        numel=sum(lengths),
        total=sum(ks),
        ks=on(ks),
        lower=on([LOWER_BOUND * k for k in ks], torch.float64),
        upper=on([UPPER_BOUND * k for k in ks], torch.float64),
        sampled=on(sampled, torch.bool),
        lengths=on(lengths),
        starts=on(starts),
        slot_starts=on(slot_starts),
        slot_layer=per_slot.to(device),
        within=torch.cat([torch.arange(k) for k in ks]).to(device),
        fallback=torch.cat([torch.tensor(starts).index_select(0, per_slot), torch.zeros(1, dtype=torch.int64)]).to(
            device
        ),
        sample_layer=per_entry(list(range(len(layers)))),
        counter=torch.cat([torch.arange(w) for w in widths]).to(device),
        sample_numel=per_entry(lengths),
        sample_offset=per_entry(starts),
        sample_stride=on([stride for _, _, stride in plans]),
        uniform=per_entry([int(s and not strided) for s in sampled]).bool(),
        sample_layers=tuple(
            Layer(f"sample{i}", i, torch.Size((w,)), at) for i, (w, at) in enumerate(zip(widths, sample_starts))
        ),
        sample_ks=tuple(sample_ks),
        kth=on(list(itertools.accumulate(sample_ks))).sub_(1),
    )


_PLANS: LayoutCache[_Plan] = LayoutCache()


def _plan_of(
    layers: Sequence[Layer], ratios: Sequence[float], sample_ratio: float, strided: bool, device: torch.device
) -> _Plan:
    key = (tuple(layer.numel for layer in layers), tuple(ratios), sample_ratio, strided, str(device))
    return _PLANS.get(key, lambda: _plan(layers, ratios, sample_ratio, strided, device))


def select_layers(
    bucket: Tensor,
    layers: Sequence[Layer],
    ratios: Sequence[float],
    streams_: Tensor,
    sample_ratio: float,
    strided: bool,
) -> tuple[Tensor, Tensor]:
    """Every layer's DGC selection in ``ceil(ratio d)`` slots, and which slots are used: no host read.

    Args:
        bucket: the flat tensor whose layers lie back to back from its start (``layers``, in order).
        layers: the layers.
        ratios: each layer's keep-ratio.
        streams_: each layer's sample stream (int64, :func:`layer_streams`).
        sample_ratio: the share of a layer sampled for its threshold (1: the exact threshold).
        strided: a strided sample from a random start (the reference code) rather than uniform positions.

    Returns:
        The selected flat indices (int64, ``sum(k)``), layer after layer, each layer's in increasing order and then
        its unused slots (which repeat its first selected index), and whether each slot is used.
    """
    plan = _plan_of(layers, ratios, sample_ratio, strided, bucket.device)
    numel = plan.numel
    magnitudes = bucket.abs()
    threshold = _sampled_thresholds(magnitudes, plan, streams_)
    ladder = [threshold]
    for _ in range(MAX_ADAPTATION_ITERS):  # as the loop lowers it: one rounding per step
        ladder.append(ladder[-1] * LOWER_BOUND)
    layer = torch.repeat_interleave(
        torch.arange(len(plan.sample_ks), device=bucket.device), plan.lengths, output_size=numel
    )
    level = _levels(magnitudes, layer, ladder)
    histogram = torch.zeros(len(plan.sample_ks) * _LEVELS, dtype=torch.int64, device=bucket.device)
    histogram.index_add_(0, level, torch.ones(1, dtype=torch.int64, device=bucket.device).expand(numel))
    # counts[l, j]: layer l's elements at or above its threshold lowered j times
    counts = histogram.view(-1, _LEVELS).flip(1).cumsum(1)[:, : len(ladder)]
    enough = counts[:, :-1] >= plan.lower.unsqueeze(1)
    stop = torch.where(enough.any(1), enough.int().argmax(1), MAX_ADAPTATION_ITERS).masked_fill_(~plan.sampled, 0)
    final = torch.stack(ladder, 1).gather(1, stop.unsqueeze(1)).squeeze(1)
    count = counts.gather(1, stop.unsqueeze(1)).squeeze(1)
    exact = plan.sampled & (stop < MAX_ADAPTATION_ITERS) & (count > plan.upper)
    # the candidates in index order, the first k of each layer to its slots (a running count within the layer)
    candidates = magnitudes >= final.index_select(0, layer)
    running = torch.cumsum(candidates, 0)
    before = torch.cat([running.new_zeros(1), running]).index_select(0, plan.starts)
    slot = running.add_((plan.slot_starts - before - 1).index_select(0, layer))
    slot_ends = (plan.slot_starts + plan.ks).index_select(0, layer)
    slot = torch.where(candidates & (slot < slot_ends), slot, plan.total)  # slot `total` takes the rest: dropped
    first = plan.fallback.clone().scatter_(0, slot, torch.arange(numel, device=bucket.device))[: plan.total]
    # more than 1.3 k candidates: the exact top-k among them, which is the layer's top-k (in index order)
    top = layer_topk(bucket, layers, [math.ceil(n * r) for n, r in zip((x.numel for x in layers), ratios)]).sort()
    first = torch.where(exact.index_select(0, plan.slot_layer), top.values, first)
    kept = torch.where(exact, plan.ks, torch.minimum(count, plan.ks))
    used = plan.within < kept.index_select(0, plan.slot_layer)
    repeated = first.index_select(0, plan.slot_starts).index_select(0, plan.slot_layer)
    return torch.where(used, first, repeated), used


def _levels(magnitudes: Tensor, layer: Tensor, ladder: list[Tensor]) -> Tensor:
    """``layer * 12 + `` how many of its layer's thresholds each ``|x|`` reaches (int64), exactly.

    Up to 32-bit floats, one search: a non-negative fp32 orders as its bits, so the key ``layer << 32 | bits(|x|)``
    orders the elements by layer, then magnitude, and its place among the thresholds' keys (each layer's 11, plus its
    magnitude 0, which every element of the layer reaches) counts the thresholds at or below it. fp64 compares with
    each threshold in turn.
    """
    if magnitudes.dtype == torch.float64:
        level = layer * _LEVELS
        for rung in ladder:
            level.add_(magnitudes >= rung.index_select(0, layer))
        return level
    floor = torch.zeros_like(ladder[0], dtype=torch.float32)
    rungs = torch.stack([floor, *(rung.float() for rung in ladder)], 1)  # [L, 12]: every rung at or above 0
    owner = torch.arange(rungs.shape[0], device=layer.device).unsqueeze(1) << 32
    bounds = (rungs.view(torch.int32).long() | owner).view(-1).sort().values
    key = magnitudes.float().view(torch.int32).long().bitwise_or_(layer << 32)
    return torch.searchsorted(bounds, key, right=True).sub_(1)


def _sampled_thresholds(magnitudes: Tensor, plan: _Plan, streams_: Tensor) -> Tensor:
    """Every layer's sampled threshold: the smallest of the top ``ceil(samples ratio)`` of its sample's ``|x|``."""
    stream = streams_.index_select(0, plan.sample_layer)
    start = uniform_below(draws(streams_, torch.zeros_like(streams_)), plan.sample_stride)  # 0 where not sampled
    strided = start.index_select(0, plan.sample_layer) + plan.counter * plan.sample_stride.index_select(
        0, plan.sample_layer
    )
    position = torch.where(plan.uniform, uniform_below(draws(stream, plan.counter), plan.sample_numel), strided)
    valid = position < plan.sample_numel  # a strided sample's last place, when its start leaves no room for it
    at = torch.minimum(position, plan.sample_numel - 1).add_(plan.sample_offset)
    sample = magnitudes.index_select(0, at).masked_fill_(~valid, 0)
    top = layer_topk(sample, plan.sample_layers, plan.sample_ks)
    return sample.index_select(0, top.index_select(0, plan.kth))
