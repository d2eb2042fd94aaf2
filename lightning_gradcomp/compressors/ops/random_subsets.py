"""Random draws made with tensor operators on the gradient's device: the same bits on every device, no host sync.

A counter-based generator: draw ``j`` of a stream is a hash of ``(stream key, j)``, so every draw is one elementwise
operator over a tensor of counters, on whatever device the counters live, and a layer's draws depend only on its own
key (derived from the run's seed, the step and the layer's stable index), not on the bucket it sits in. The hash is
``lowbias32`` (Chris Wellons' hash prospector), a bijection of 32-bit integers, computed in int64 with every product
below ``2^63`` (no overflow, so CPU and CUDA give the same bits).

:func:`shared_subsets` draws a uniformly random ``k``-subset of every layer of a bucket in a fixed number of
operators and fixed-size tensors (RandomK's shared indices): ``m >= k`` draws with replacement, of which the first
``k`` distinct ones in draw order are kept (drawing with replacement and skipping repeats *is* sampling without
replacement, so the subset is uniform).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_gradcomp.compressors.ops.draws import lowbias32_
from lightning_gradcomp.engine.context import Layer, derive_seed

__all__ = ["draws", "hash32", "shared_subsets", "stream_key", "streams", "uniform_below"]

_M32 = 0xFFFFFFFF
_CACHE_SIZE = 32


def hash32(x: Tensor) -> Tensor:
    """``lowbias32`` of every element of the int64 ``x`` (values in ``[0, 2^32)``): a bijection, well mixed."""
    return lowbias32_(x.to(torch.int32)).to(torch.int64) & _M32  # int32 wraps: the same 32-bit patterns


def stream_key(*parts: int) -> int:
    """A 32-bit stream key from integers (the run's seed, the step, a layer's index, a rank...)."""
    return derive_seed(*parts) & _M32


def _lowbias32(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def streams(keys: Tensor, step: int) -> Tensor:
    """The streams of ``keys`` at ``step``: both hashed, so that no two (key, step) pairs share a stream by design."""
    return hash32(keys ^ _lowbias32(_lowbias32(step & _M32) ^ 0x9E3779B9))


def draws(stream: Tensor | int, counters: Tensor) -> Tensor:
    """Draw ``counters[i]`` of ``stream`` (one per counter, or one for all): 32-bit values in int64."""
    return hash32(hash32(counters) ^ stream)


def uniform_below(bits: Tensor, n: Tensor | int) -> Tensor:
    """Integers in ``[0, n)`` from 32-bit draws: ``(bits n) >> 32`` (a bias below ``n / 2^32``; ``n < 2^31``)."""
    return (bits * n) >> 32


@dataclass(frozen=True)
class _SubsetPlan:
    """The fixed-size tensors of one layout: one entry per draw, or per slot."""

    keys: Tensor  # each draw's layer key (int64, 32 bits)
    counters: Tensor  # each draw's number within its layer
    sizes: Tensor  # each draw's layer size
    offsets: Tensor  # each draw's layer offset
    keep: Tensor  # each draw's layer's k
    enumerated: Tensor  # whether the layer's "draws" are its elements in turn (k > n / 2) rather than drawn
    hashed_order: Tensor  # whether they are ranked by a hash (k < n) rather than taken in turn (k = n)
    lengths: Tensor  # draws per layer
    starts: Tensor  # each layer's first draw
    slot_starts: Tensor  # each layer's first slot
    fallback: Tensor  # each slot's value if its layer fell short (its layer's offset), plus the dump slot
    any_hashed_order: bool
    draws: int
    slots: int


def _plan(layers: Sequence[Layer], counts: Sequence[int], keys: Sequence[int], device: torch.device) -> _SubsetPlan:
    per_layer = []
    for layer, k, key in zip(layers, counts, keys):
        n = layer.numel
        if n >= 2**31:
            raise ValueError(f"Random subsets need layers below 2^31 elements; {layer.name!r} has {n}.")
        if 2 * k > n:  # every element once, ranked by a hash (or kept whole when k >= n)
            per_layer.append((n, k, key, n, True, k < n))
        else:  # draws with replacement; the margin covers the expected k^2 / (2n) repeats many times over
            per_layer.append((n, k, key, k + 32 + int(2 * k * k / n), False, False))
    lengths = [m for *_, m, _, _ in per_layer]
    starts = [0, *list(_cumulative(lengths))[:-1]]
    slot_starts = [0, *list(_cumulative(counts))[:-1]]

    def per_draw(values: Sequence[int], dtype: torch.dtype = torch.int64) -> Tensor:
        return torch.tensor(values, dtype=dtype).repeat_interleave(torch.tensor(lengths, dtype=torch.int64))

    counters = torch.cat([torch.zeros(0, dtype=torch.int64), *(torch.arange(m, dtype=torch.int64) for m in lengths)])
    slots = sum(counts)
    fallback = torch.tensor([layer.offset for layer in layers], dtype=torch.int64).repeat_interleave(
        torch.tensor(list(counts), dtype=torch.int64)
    )
    return _SubsetPlan(
        keys=per_draw(keys).to(device),
        counters=counters.to(device),
        sizes=per_draw([n for n, *_ in per_layer]).to(device),
        offsets=per_draw([layer.offset for layer in layers]).to(device),
        keep=per_draw(list(counts)).to(device),
        enumerated=per_draw([e for *_, e, _ in per_layer], torch.bool).to(device),
        hashed_order=per_draw([h for *_, h in per_layer], torch.bool).to(device),
        lengths=torch.tensor(lengths, dtype=torch.int64, device=device),
        starts=torch.tensor(starts, dtype=torch.int64, device=device),
        slot_starts=torch.tensor(slot_starts, dtype=torch.int64, device=device),
        fallback=torch.cat([fallback, torch.zeros(1, dtype=torch.int64)]).to(device),
        any_hashed_order=any(h for *_, h in per_layer),
        draws=sum(lengths),
        slots=slots,
    )


def _cumulative(values: Sequence[int]) -> list[int]:
    out, total = [], 0
    for v in values:
        total += v
        out.append(total)
    return out


_PLANS: OrderedDict[tuple, _SubsetPlan] = OrderedDict()


def _segment_ranks(flags: Tensor, plan: _SubsetPlan) -> Tensor:
    """For every draw, how many ``flags`` are set in its layer's draws up to and including it (int64)."""
    total = torch.cumsum(flags, 0, dtype=torch.int64)
    before = torch.cat([total.new_zeros(1), total]).index_select(0, plan.starts)
    return total - torch.repeat_interleave(before, plan.lengths, output_size=plan.draws)


def shared_subsets(
    layers: Sequence[Layer], counts: Sequence[int], keys: Sequence[int], step: int, device: torch.device
) -> Tensor:
    """A uniformly random ``counts[i]``-subset of every layer, as flat indices sorted per layer (int64, ``device``).

    ``keys[i]`` is layer ``i``'s stream key (:func:`stream_key` of the seed and its stable index): its subset depends
    on that key, the step, its size and its count only. A layer keeping more than half its elements ranks all of them
    by a hash instead of drawing. Every tensor has a size fixed by the layout; should a layer find fewer than ``k``
    distinct draws (less likely than ``2^-32`` at the margin drawn), its remaining slots repeat its first element.
    """
    cache_key = (tuple((layer.offset, layer.numel) for layer in layers), tuple(counts), tuple(keys), str(device))
    plan = _PLANS.get(cache_key)
    if plan is None:
        plan = _PLANS[cache_key] = _plan(layers, counts, keys, device)
        if len(_PLANS) > _CACHE_SIZE:
            _PLANS.popitem(last=False)
    else:
        _PLANS.move_to_end(cache_key)
    if plan.draws == 0:
        return torch.zeros(0, dtype=torch.int64, device=device)
    bits = draws(streams(plan.keys, step), plan.counters)
    local = torch.where(plan.enumerated, plan.counters, uniform_below(bits, plan.sizes))
    positions = local + plan.offsets
    if plan.any_hashed_order:  # those layers' elements in the order of their hashes; the others in draw order
        rank = torch.where(plan.hashed_order, bits, plan.counters) + (plan.offsets << 32)
        positions = positions.index_select(0, torch.argsort(rank, stable=True))
    # the first occurrence (in draw order) of every position
    ordered, perm = torch.sort(positions, stable=True)
    first = torch.ones_like(ordered, dtype=torch.bool)
    torch.ne(ordered[1:], ordered[:-1], out=first[1:])
    first_in_draw_order = torch.empty_like(first).scatter_(0, perm, first)
    kept = first_in_draw_order & (_segment_ranks(first_in_draw_order, plan) <= plan.keep)
    kept_sorted = kept.index_select(0, perm)
    # sorted by position, each layer's draws stay contiguous (a layer's positions lie in its range): slots in order
    slot = _segment_ranks(kept_sorted, plan) - 1
    slot += torch.repeat_interleave(plan.slot_starts, plan.lengths, output_size=plan.draws)
    target = torch.where(kept_sorted, slot, plan.slots)
    return plan.fallback.clone().scatter_(0, target, ordered)[: plan.slots]
