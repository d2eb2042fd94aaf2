"""Every layer's top-k by magnitude in a bucket, selected at once: a segmented sort, not a loop over the layers.

Top-k sparsifiers keep each layer's ``k`` largest ``|x|`` (Aji & Heafield, 2017; Stich et al., 2018; Lin et al.,
2018; Chen et al., 2020). One ``torch.topk`` per layer costs a few operators per layer, each a kernel launch on a GPU,
so ResNet-50's layers cost hundreds of launches per bucket. Here a bucket's elements are ordered, with one *stable*
sort, by their layer and then by decreasing magnitude (an int64 key: the layer above the complemented bits of the
magnitude as an fp32): every layer's elements end up together, in its own order of decreasing magnitude, and the
first ``k`` of each are its top-k, read at positions that depend only on the layout (:func:`layer_topk`). One sort and
a few gathers per bucket, whatever the number of layers, and no host read: the path a GPU takes.

On the CPU a sort of millions of elements costs tens of milliseconds, so layers large enough to pay for it are first
narrowed down to candidates: every such layer's ``want``-th largest magnitude in a random sample of its elements
(positions fixed per layer size, drawn once per layout) bounds its k-th largest from below when at least ``k`` of the
layer's elements exceed it (the sampled threshold of DGC, Lin et al., 2018). Only the candidates are sorted. A layer
that has fewer than ``k`` candidates (rare: a sample is sized to hold about 1.5 k of them) takes all its elements
instead, in one more round for all such layers at once. The candidates' number is read on the host, which costs
nothing on the CPU.

The selected set is each layer's ``k`` largest magnitudes, exactly (NaN counts as the largest, as ``torch.topk`` has
it). Where magnitudes tie at a layer's k-th value, the elements with the lowest indices are kept: both paths select
the same elements, on every device and at any place in any bucket (a layer's selection depends on its elements only).
``torch.topk`` breaks such ties in an order of its own.
"""

from __future__ import annotations

import itertools
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from lightning_gradcomp.compressors.ops.packing import flat_nonzero, numpy_floats
from lightning_gradcomp.compressors.ops.segments import LayoutCache
from lightning_gradcomp.engine.context import Layer

__all__ = ["layer_topk"]

#: Layers below this many elements are sorted whole on the CPU: a sample would not narrow them down by much.
SAMPLED_MIN_NUMEL = 4096
_SAMPLE_MIN = 8192  # elements sampled per layer at least
_SAMPLE_HITS = 64  # the sample is sized to hold about this many elements of the top-k


@dataclass(frozen=True)
class _Samples:
    """The sampled layers' sample positions (fixed per layout), and which of their largest bounds the top-k."""

    layers: Tensor  # int64 [s]: the sampled layers
    positions: Tensor  # int64 [s, width]: the sample's positions in the flat tensor (padding: the layer's first)
    padding: Tensor  # bool [s, width]: which positions are padding
    want: Tensor  # int64 [s, 1]: the column of the bound among the row's largest, in decreasing order
    widest: int  # the largest ``want`` (columns of the row-wise top-k)


@dataclass(frozen=True)
class _Plan:
    """A layout's index tensors: where every layer's top-k sits once the elements are ordered."""

    count: int
    numel: int  # the layers' elements
    positions: Tensor | None  # int64 [numel]: where they lie in the flat tensor when not back to back (else None)
    total: int  # the selected elements, sum of k
    ends: Tensor  # int64 [layers]: every layer's end in the flat tensor
    ks: Tensor  # int64 [layers]
    lengths: Tensor  # int64 [layers]
    sizes: np.ndarray  # the layers' lengths on the host (NumPy's repeat)
    within: Tensor  # int64 [total]: 0 .. k - 1 for every layer, layer after layer
    tops: Tensor  # int64 [total]: where every layer's top-k sits once all elements are ordered (its start + within)
    samples: _Samples | None  # CPU only: the layers narrowed down by a sample first


def _plan(layers: Sequence[Layer], ks: Sequence[int], device: torch.device) -> _Plan:
    lengths = [layer.numel for layer in layers]
    starts = [0, *itertools.accumulate(lengths)][:-1]  # in the layers' elements, back to back
    compact = all(layer.offset - layers[0].offset == start for layer, start in zip(layers, starts))
    ks = [min(k, n) for k, n in zip(ks, lengths)]
    within = torch.cat([torch.arange(k, dtype=torch.int64) for k in ks])
    firsts = torch.repeat_interleave(torch.tensor(starts, dtype=torch.int64), torch.tensor(ks), output_size=sum(ks))
    as_tensor = lambda values: torch.tensor(values, dtype=torch.int64, device=device)  # noqa: E731
    apart = None if compact else torch.cat([torch.arange(n) + layer.offset for layer, n in zip(layers, lengths)])
    return _Plan(
        count=len(layers),
        numel=starts[-1] + lengths[-1],
        positions=None if apart is None else apart.to(device),
        total=sum(ks),
        ends=as_tensor([s + n for s, n in zip(starts, lengths)]),
        ks=as_tensor(ks),
        lengths=as_tensor(lengths),
        sizes=np.array(lengths, dtype=np.int64),
        within=within.to(device),
        tops=(firsts + within).to(device),
        samples=_samples(starts, lengths, ks, device) if device.type == "cpu" else None,
    )


def _samples(starts: list[int], lengths: list[int], ks: list[int], device: torch.device) -> _Samples | None:
    """The sample of every layer a sample narrows down, or ``None`` when no layer is worth it."""
    chosen, rows, wants = [], [], []
    for i, (start, n, k) in enumerate(zip(starts, lengths, ks)):
        if n < SAMPLED_MIN_NUMEL or 2 * k > n:  # small, or most of it is kept: about all of it would be candidates
            continue
        size = min(n, max(_SAMPLE_MIN, _SAMPLE_HITS * n // k))
        # ~1.5x the expected share of the sample (plus slack), so that the candidates cover k with high probability
        wants.append(min(size, math.ceil(1.5 * k * size / n) + 8))
        # random positions (a strided sample aliases with the structure of convolution gradients)
        rows.append(torch.randint(0, n, (size,), generator=torch.Generator().manual_seed(n)) + start)
        chosen.append(i)
    if not chosen:
        return None
    width = max(row.numel() for row in rows)
    padding = torch.arange(width) >= torch.tensor([row.numel() for row in rows]).view(-1, 1)
    positions = torch.stack([torch.nn.functional.pad(row, (0, width - row.numel()), value=int(row[0])) for row in rows])
    return _Samples(
        layers=torch.tensor(chosen, dtype=torch.int64, device=device),
        positions=positions.to(device),
        padding=padding.to(device),
        want=(torch.tensor(wants, dtype=torch.int64) - 1).view(-1, 1).to(device),
        widest=max(wants),
    )


_PLANS: LayoutCache[_Plan] = LayoutCache()


def _plan_of(layers: Sequence[Layer], ks: Sequence[int], device: torch.device) -> _Plan:
    key = (tuple((layer.offset, layer.numel) for layer in layers), tuple(ks), str(device))
    return _PLANS.get(key, lambda: _plan(layers, ks, device))


def layer_topk(tensor: Tensor, layers: Sequence[Layer], ks: Sequence[int]) -> Tensor:
    """The flat indices of every layer's ``ks[i]`` largest ``|tensor|`` (all of it when ``k`` is the layer's size).

    Args:
        tensor: the flat bucket (1-D); ``layers`` lie in it back to back, from the first layer's offset.
        layers: the layers, offsets increasing without gaps.
        ks: how many elements each layer keeps.

    Returns:
        int64 indices into ``tensor`` (``sum(ks)`` of them), layer after layer; within a layer, by decreasing
        magnitude, ties in increasing index order.
    """
    plan = _plan_of(layers, ks, tensor.device)
    if plan.positions is not None:  # layers apart: selected among their elements gathered back to back
        return plan.positions.index_select(0, _select(tensor.index_select(0, plan.positions), plan))
    base = layers[0].offset
    picked = _select(tensor.narrow(0, base, plan.numel), plan)
    return picked.add_(base) if base else picked


def _select(bucket: Tensor, plan: _Plan) -> Tensor:
    """:func:`layer_topk` of layers that lie back to back from the start of ``bucket``."""
    if plan.samples is not None:
        picked = _sampled(bucket, plan, plan.samples)
        if picked is not None:
            return picked
    return _by_layer(bucket.abs(), None, plan).index_select(0, plan.tops)


def _by_layer(magnitudes: Tensor, positions: Tensor | None, plan: _Plan) -> Tensor:
    """``positions`` (increasing; ``None``: all) ordered layer by layer, each layer's by decreasing ``magnitudes``.

    Equal magnitudes stay in increasing index order (stable sorts). Up to 32-bit floats, one sort of an int64 key:
    the layer above the bits of the magnitude as an fp32 (non-negative floats order as their bits; NaN's above
    infinity's), complemented so that larger magnitudes come first; fp64 magnitudes are sorted, then their layers.
    """
    where = torch.arange(plan.numel, device=magnitudes.device) if positions is None else positions
    layer = torch.searchsorted(plan.ends, where, right=True)
    if magnitudes.dtype != torch.float64:
        bits = magnitudes.float().view(torch.int32)
        key = layer.mul_(1 << 31).add_(0x7FFFFFFF).sub_(bits)
        order = torch.sort(key, stable=True).indices
        return order if positions is None else positions.index_select(0, order)
    ranked = torch.sort(magnitudes, descending=True, stable=True).indices
    return where.index_select(0, ranked.index_select(0, torch.sort(layer.index_select(0, ranked), stable=True).indices))


def _sampled(bucket: Tensor, plan: _Plan, samples: _Samples) -> Tensor | None:
    """The top-k through sampled bounds (CPU), or ``None`` when every layer would be a candidate."""
    sample = bucket.index_select(0, samples.positions.view(-1)).view_as(samples.positions).abs()
    sample.masked_fill_(samples.padding, -1.0)
    largest = torch.topk(sample, samples.widest, dim=1, sorted=True).values
    bounds = torch.full((plan.count,), -math.inf, dtype=bucket.dtype, device=bucket.device)
    bounds.index_copy_(0, samples.layers, largest.gather(1, samples.want).view(-1))
    for _ in range(2):  # a second round only when some layer has too few candidates: it takes all its elements
        candidates = _candidates(bucket, bounds, plan)
        layer = torch.searchsorted(plan.ends, candidates, right=True)
        counts = torch.bincount(layer, minlength=plan.count)
        short = counts < plan.ks
        if not bool(short.any()):  # a host read: free on the CPU, where this path runs
            ordered = _by_layer(bucket.index_select(0, candidates).abs_(), candidates, plan)
            starts = torch.cumsum(counts, 0).sub_(counts)
            at = torch.repeat_interleave(starts, plan.ks, output_size=plan.total).add_(plan.within)
            return ordered.index_select(0, at)
        bounds.masked_fill_(short, -math.inf)
    return None


_SCRATCH = threading.local()


def _scratch(size: int, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """Buffers for ``|x|`` and the mask, kept per thread, size and dtype.

    A fresh array of a bucket's size costs its page faults on every step, more than the pass that fills it.
    """
    kept: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]] = _SCRATCH.__dict__.setdefault("kept", {})
    found = kept.get((size, dtype.str))
    if found is None:
        if len(kept) >= 4:  # a few bucket sizes: the most recent only
            kept.clear()
        found = kept[(size, dtype.str)] = (np.empty(size, dtype=dtype), np.empty(size, dtype=np.bool_))
    return found


def _candidates(bucket: Tensor, bounds: Tensor, plan: _Plan) -> Tensor:
    """The positions whose magnitude is not at or below its layer's bound (NaN is a candidate), in increasing order.

    Through NumPy where it reads the tensor (its ``repeat`` and comparisons are single passes; torch's
    ``repeat_interleave`` gathers through an index of every element).
    """
    if numpy_floats(bucket, bounds):
        values = bucket.detach().numpy()
        magnitudes, mask = _scratch(values.size, values.dtype)
        np.abs(values, out=magnitudes)
        np.less_equal(magnitudes, np.repeat(bounds.numpy(), plan.sizes), out=mask)
        return flat_nonzero(torch.from_numpy(np.logical_not(mask, out=mask)))
    expanded = torch.repeat_interleave(bounds, plan.lengths, output_size=plan.numel)
    return flat_nonzero(torch.le(bucket.abs(), expanded).logical_not_())
