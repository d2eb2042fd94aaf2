"""Zen's sparse all-reduce: hash-partitioned push (all-to-all), sum at the owner, pull (all-gather); and the selector.

Wang, Xu, Xi, Wang, Shrivastava & Ng, "ZEN: Empowering Distributed Training with Sparsity-driven Data
Synchronization", OSDI 2025 (arXiv:2309.13254). Every rank holds a sparse flat tensor of ``N`` elements, given as
``(indices, values)``; every flat index ``i`` has one *owner* rank, ``owner(i) = hash(i) * n >> 32`` with a seeded
32-bit hash, so owners receive about ``1 / n`` of the non-zeros whatever their positions (the paper's balanced
parallelism). The sum, in four rounds on the round groups of :mod:`lightning_gradcomp.engine.comm`:

0. **counts**: every rank all-gathers how many of its non-zeros each owner gets (``n`` int32); this round also
   carries the non-finite flag. The counts are then read on the host (``tolist``): the one place where the sizes
   must be known to the host, because ``all_to_all_single`` takes its split sizes as Python integers. It runs in the
   callback that issues round 1 (a collective's thread), never on the autograd thread.
1. **push**: ``all_to_all_single`` of the (index, value) rows, grouped by owner (a stable sort by owner: exact and
   collision-free, unlike the artifact's GPU hash table). The owner sums what it received in rank order, in the
   gradient's precision or float32 if that is wider (bf16 and fp16 are summed in float32, rounded once).
2. **sizes**: every owner all-gathers the size of its union of indices (one int32), read on the host for the same
   reason (the pull's sizes).
3. **pull**: every owner's indices and sums are all-gathered (padded to the largest owner). An owner sends its
   indices as an int32 list, or as a bitmap over the indices it can own (``P_p``, fixed by the hash) when that is
   smaller (``ceil(|P_p| / 8) < 4 M_p`` bytes; the paper's hash bitmap, chosen per owner from the exchanged sizes).

Every rank then writes the owners' sums into one dense tensor: partitions are disjoint, so nothing is added twice and
every rank holds bitwise the same sum. What differs from the authors' artifact, on purpose: index 0 is sent (the
artifact marks empty hash slots with 0 and drops it); there are no racy inserts (a sort, not a hash table); the bitmap
map is the partition map itself (the artifact's two maps disagree unless ``N % n == 0``); sums are float32 for half
precision (the artifact sums in bf16); each round is asynchronous (the artifact waits inside the hook).
"""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import numpy as np
import torch
from torch import Tensor

from lightning_gradcomp.compressors.base import BucketContext, Compressor, derive_seed
from lightning_gradcomp.compressors.ops.packing import flat_nonzero, nonzero_mask, pack_bits, unpack_bits
from lightning_gradcomp.engine.requests import AllGather, AllGatherV, AllReduce, AllToAll

__all__ = [
    "TRANSPORTS",
    "Path",
    "costs",
    "owner_of",
    "owner_map",
    "sparse_sum",
    "sparse_transport_sum",
]

Path = Literal["none", "dense", "allgather", "zen"]
#: Zen's transports for a sparsifier: always Zen, or the selector's choice per bucket and step (dense, the all-gather
#: of pairs or Zen).
TRANSPORTS = ("zen", "zen-auto")
#: Rounds of a Zen reduction (counts, push, sizes, pull).
ZEN_ROUNDS = 4
_M32 = 0xFFFFFFFF
_CACHE_SIZE = 4


def _hash32(x: Tensor, seed: int) -> Tensor:
    """MurmurHash3's 32-bit finaliser of ``x ^ seed`` (int64 arithmetic, masked to 32 bits; vectorised)."""
    h = (x ^ (x >> 32) ^ seed) & _M32
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _M32  # int64 products wrap modulo 2**64: the low 32 bits stay exact
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _M32
    return h ^ (h >> 16)


def owner_of(indices: Tensor, world_size: int, seed: int) -> Tensor:
    """The owner rank of every flat index (int64): ``hash(i) * n >> 32``, uniform over ranks and data-independent."""
    return (_hash32(indices.long(), seed & _M32) * world_size) >> 32


def by_owner(owners: Tensor, world_size: int) -> Tensor:
    """The permutation that sorts ``owners`` (ranks below ``world_size``) stably: ``torch.sort(..., stable=True)``.

    The same permutation (a stable sort's is unique), faster on the CPU: there NumPy's stable sort of the owners
    narrowed to ``uint8`` or ``uint16`` is a radix sort, 4-5x faster than torch's on 0.56M owners (one thread).
    """
    if owners.device.type == "cpu" and world_size <= 2**16:
        narrow = owners.numpy().astype(np.uint8 if world_size <= 2**8 else np.uint16)
        return torch.from_numpy(np.argsort(narrow, kind="stable"))
    return torch.sort(owners, stable=True).indices


@dataclass(frozen=True)
class OwnerMap:
    """Every index's owner and every owner's indices, for one tensor length, world size and seed.

    Attributes:
        owners: the owner of every index ``0 .. N-1`` (int64).
        order: the indices sorted by owner, ascending within each owner (``P_0, P_1, ...`` one after the other).
        sizes: ``|P_p|`` for every owner.
    """

    owners: Tensor
    order: Tensor
    sizes: tuple[int, ...]

    def indices_of(self, owner: int) -> Tensor:
        """``P_p``: the indices ``owner`` can own, ascending (what its bitmap is over)."""
        start = sum(self.sizes[:owner])
        return self.order[start : start + self.sizes[owner]]

    @functools.cached_property
    def positions(self) -> Tensor:
        """Every index's place in its owner's ``P_p`` (int64): the bit that stands for it in the owner's bitmap.

        Built on first use (the bitmap pull), ``8 N`` bytes. A lookup here is one read per index, where a binary
        search of ``P_p`` missed the cache at every step (``searchsorted``: 45 ms for 0.95M indices in a 3.2M
        ``P_p``, against about 6 ms; ``benchmarks/codec.py --compressors zen --row-density 0.05``).
        """
        within = torch.cat([torch.arange(size, device=self.order.device) for size in self.sizes])
        return torch.empty_like(self.order).index_copy_(0, self.order, within)


_MAPS: OrderedDict[tuple, OwnerMap] = OrderedDict()
_MAPS_LOCK = threading.Lock()  # rounds run on the collectives' threads


def owner_map(numel: int, world_size: int, seed: int, device: torch.device) -> OwnerMap:
    """The :class:`OwnerMap` of ``numel`` indices, computed once, cached.

    The last 4 lengths are kept: ``16 N`` bytes each, ``24 N`` once a bitmap pull has used its positions.
    """
    key = (numel, world_size, seed, str(device))
    with _MAPS_LOCK:
        cached = _MAPS.get(key)
        if cached is not None:
            _MAPS.move_to_end(key)
            return cached
    owners = owner_of(torch.arange(numel, device=device), world_size, seed)
    order = by_owner(owners, world_size)
    sizes = tuple(torch.bincount(owners, minlength=world_size).tolist())  # once per length, not per step
    built = OwnerMap(owners, order, sizes)
    with _MAPS_LOCK:
        _MAPS[key] = built
        while len(_MAPS) > _CACHE_SIZE:
            _MAPS.popitem(last=False)
    return built


def zen_seed(ctx: BucketContext) -> int:
    """The hash seed: the run's shared seed, fixed over steps (so the partition and its bitmaps are too)."""
    return derive_seed(ctx.seed, 0x2E7) & _M32


def _index_dtype(numel: int) -> torch.dtype:
    return torch.int32 if numel < 2**31 else torch.int64


def _count(owners: Tensor, weights: Tensor | None, n: int, device: torch.device) -> Tensor:
    """How many entries each owner gets (int32), by a scatter: no host synchronisation (``bincount`` syncs on CUDA)."""
    src = torch.ones_like(owners) if weights is None else weights.to(torch.int64)
    return torch.zeros(n, dtype=torch.int64, device=device).scatter_add_(0, owners, src).to(torch.int32)


# ------------------------------------------------------------------------------------------------------------------
# The cost model (bytes received per rank) and the selector
# ------------------------------------------------------------------------------------------------------------------
def costs(
    counts: Sequence[Sequence[int]], numel: int, union: int, index_bytes: int, value_bytes: int
) -> dict[str, float]:
    """Bytes the busiest rank receives for one bucket, per path (the selector's formula; see docs/zen.md).

    With ``n`` ranks, ``m_r`` non-zeros on rank ``r`` (``counts[r][p]`` of them owned by ``p``), ``M`` non-zeros in
    the sum (``union``), ``N = numel`` and ``s = index_bytes + value_bytes``:

    * ``dense`` (ring all-reduce): ``2 (n - 1) / n * N * value_bytes``;
    * ``allgather`` (pairs padded to the largest rank): ``(n - 1) * max_r m_r * s``;
    * ``zen``: push ``max_p sum_{r != p} counts[r][p] * s`` plus pull ``(n - 1) * (M / n) * s``;
    * ``zen-bitmap``: the pull's indices as bitmaps: ``(n - 1) * (N / (8 n) + (M / n) * value_bytes)``.

    Latency (Zen's four rounds against one) is not modelled: buckets are large enough for bandwidth to dominate.
    """
    n = len(counts)
    s = index_bytes + value_bytes
    largest = max((sum(row) for row in counts), default=0)
    push = max((sum(counts[r][p] for r in range(n) if r != p) for p in range(n)), default=0) * s
    return {
        "dense": 2 * (n - 1) / n * numel * value_bytes,
        "allgather": (n - 1) * largest * s,
        "zen": push + (n - 1) * union / n * s,
        "zen-bitmap": push + (n - 1) * (numel / (8 * n) + union / n * value_bytes),
    }


def choose(counts: Sequence[Sequence[int]], numel: int, union: int, index_bytes: int, value_bytes: int) -> Path:
    """The path with the fewest bytes received by the busiest rank (:func:`costs`; ties: dense, all-gather, Zen)."""
    c = costs(counts, numel, union, index_bytes, value_bytes)
    zen = min(c["zen"], c["zen-bitmap"])  # Zen picks the smaller index encoding per owner by itself
    best = min(c["dense"], c["allgather"], zen)
    if c["dense"] == best:
        return "dense"
    return "allgather" if c["allgather"] == best else "zen"


# ------------------------------------------------------------------------------------------------------------------
# The reduction
# ------------------------------------------------------------------------------------------------------------------
@dataclass
class SparseInput:
    """One rank's sparse tensor as the reduction sees it.

    Attributes:
        counts: non-zeros per owner (int32, ``n``), computed without a host synchronisation.
        rows: returns ``(indices, values)`` sorted by owner (stable), called after the counts are known.
        dense: returns the tensor densely (the dense path all-reduces it).
    """

    counts: Tensor
    rows: Callable[[], tuple[Tensor, Tensor]]
    dense: Callable[[], Tensor]


def pairs_input(indices: Tensor, values: Tensor, ctx: BucketContext, out: Tensor) -> SparseInput:
    """A :class:`SparseInput` from flat ``indices`` (distinct) and their ``values``."""
    owners = owner_of(indices, ctx.world_size, zen_seed(ctx))
    counts = _count(owners, None, ctx.world_size, indices.device)

    def rows() -> tuple[Tensor, Tensor]:
        order = by_owner(owners, ctx.world_size)
        return indices.index_select(0, order).to(_index_dtype(ctx.numel)), values.index_select(0, order)

    def dense() -> Tensor:
        return out.zero_().index_copy_(0, indices.long(), values.to(out.dtype))

    return SparseInput(counts, rows, dense)


def tensor_input(tensor: Tensor, ctx: BucketContext, dense_above: float | None = None) -> SparseInput:
    """A :class:`SparseInput` of the non-zeros of the dense ``tensor`` (NaNs count as non-zeros).

    ``dense_above``: a number of non-zeros above which the caller's path is the dense all-reduce whatever the other
    ranks hold (Zen's fallback). On the CPU, where reading a count on the host costs nothing, a rank above it
    reports all its non-zeros under owner 0 and splits nothing: every path rule reads only the rows' totals then
    (:meth:`~lightning_gradcomp.compressors.zen.Zen.path`), so every rank decides as with the true split. Below it,
    the non-zeros are found once, for the counts and the rows, and only their owners are read and counted. On other
    devices the counts are a scatter over the owners of all ``N`` indices, which reads nothing on the host.
    """
    if tensor.device.type == "cpu":
        return _cpu_tensor_input(tensor, ctx, dense_above)
    omap = owner_map(ctx.numel, ctx.world_size, zen_seed(ctx), tensor.device)
    counts = _count(omap.owners, tensor != 0, ctx.world_size, tensor.device)

    def rows() -> tuple[Tensor, Tensor]:
        # nonzero() sizes its output on the host: this runs after the counts' host read, off the autograd thread
        indices = flat_nonzero(tensor)
        return _rows_by_owner(tensor, indices, omap.owners.index_select(0, indices), ctx)

    return SparseInput(counts, rows, lambda: tensor)


def _cpu_tensor_input(tensor: Tensor, ctx: BucketContext, dense_above: float | None) -> SparseInput:
    """:func:`tensor_input` on the CPU: one mask, one count read on the host, the owners of the non-zeros only."""
    mask = nonzero_mask(tensor)
    total = int(torch.count_nonzero(mask))
    if dense_above is not None and total > dense_above:
        counts = torch.zeros(ctx.world_size, dtype=torch.int32)
        counts[0] = total

        def unsplit() -> tuple[Tensor, Tensor]:
            raise RuntimeError(f"Zen: this rank's {total} non-zeros were not split by owner (the path is dense).")

        return SparseInput(counts, unsplit, lambda: tensor)
    indices = flat_nonzero(mask)
    owners = owner_map(ctx.numel, ctx.world_size, zen_seed(ctx), tensor.device).owners.index_select(0, indices)
    counts = torch.bincount(owners, minlength=ctx.world_size).to(torch.int32)

    return SparseInput(counts, lambda: _rows_by_owner(tensor, indices, owners, ctx), lambda: tensor)


def _rows_by_owner(tensor: Tensor, indices: Tensor, owners: Tensor, ctx: BucketContext) -> tuple[Tensor, Tensor]:
    """The non-zeros at ``indices`` (whose owners are ``owners``) as ``(indices, values)`` grouped by owner, stably."""
    ordered = indices.index_select(0, by_owner(owners, ctx.world_size))
    return ordered.to(_index_dtype(ctx.numel)), tensor.index_select(0, ordered)


def sparse_sum(  # noqa: C901 (the four rounds read best in one place)
    local: SparseInput,
    ctx: BucketContext,
    out: Tensor,
    path_for: Callable[[list[list[int]]], Path],
    index_encoding: Literal["list", "bitmap", "auto"] = "auto",
    on_union: Callable[[int], None] | None = None,
) -> Any:
    """The sum over ranks of every rank's sparse tensor, as a generator of requests (``yield from`` it).

    Round 0 exchanges the counts; ``path_for(counts)`` (``counts[r][p]``: rank ``r``'s non-zeros owned by ``p``,
    the same on every rank) then picks the path: ``"none"`` (every rank is all zeros), ``"dense"`` (one all-reduce),
    ``"allgather"`` (the pairs, padded) or ``"zen"`` (rounds 1 to 3). Returns the sum (not the average) in ``out``.
    ``on_union`` receives the number of non-zero positions of the sum when it is known to the host for free (Zen).
    """
    gathered = yield AllGather((local.counts,))
    # host read (1 of 2): all_to_all_single and the padded all-gather need their split sizes as Python integers
    counts = [row.tolist() for (row,) in gathered]
    path = path_for(counts)
    if path == "none":
        return out.zero_()
    if path == "dense":
        (summed,) = yield AllReduce((local.dense(),))
        return summed if summed is out else out.copy_(summed)
    indices, values = local.rows()
    if path == "allgather":
        pairs = yield AllGatherV((indices, values), tuple(sum(row) for row in counts))
        out.zero_()
        for idx, val in pairs:  # rank order; indices distinct within a rank: deterministic on CUDA too
            out.index_add_(0, idx.long(), val.to(out.dtype))
        return out
    me = ctx.rank
    received = yield AllToAll((indices, values), tuple(counts[me]), tuple(row[me] for row in counts))
    union, sums = _owner_sum(received, values.dtype)
    sizes = yield AllGather((torch.tensor([union.numel()], dtype=torch.int32, device=out.device),))
    # host read (2 of 2): the pull's sizes
    unions = [int(size) for (size,) in sizes]
    if on_union is not None:
        on_union(sum(unions))
    bitmaps = _encodings(unions, ctx, index_encoding, union.dtype.itemsize, out.device)
    blob = _encode_pull(union, sums.to(ctx.dtype), bitmaps[me], ctx, out.device)
    nbytes = tuple(_pull_nbytes(p, u, b, ctx, union.dtype, out.device) for p, (u, b) in enumerate(zip(unions, bitmaps)))
    pulled = yield AllGatherV((blob,), nbytes)
    out.zero_()
    for owner, ((part,), size, bitmap) in enumerate(zip(pulled, unions, bitmaps)):
        idx, val = _decode_pull(part, owner, size, bitmap, ctx, union.dtype, out.device)
        out.index_copy_(0, idx, val)  # owners' indices are disjoint: every element is written once
    return out


def _owner_sum(received: Sequence[tuple[Tensor, Tensor]], dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """The union of the received indices (ascending) and their sums, added in rank order in float32 or wider."""
    acc_dtype = torch.promote_types(dtype, torch.float32)
    indices = torch.cat([idx for idx, _ in received])
    union, inverse = torch.unique(indices, sorted=True, return_inverse=True)
    sums = torch.zeros(union.numel(), dtype=acc_dtype, device=indices.device)
    at = 0
    for idx, val in received:  # one source at a time: its indices are distinct, so the additions are ordered
        sums.index_add_(0, inverse[at : at + idx.numel()], val.to(acc_dtype))
        at += idx.numel()
    return union.to(indices.dtype), sums


def _encodings(
    unions: list[int], ctx: BucketContext, index_encoding: str, index_bytes: int, device: torch.device
) -> list[bool]:
    """Whether each owner sends its indices as a bitmap over ``P_p`` (the same decision on every rank)."""
    if index_encoding == "list":
        return [False] * len(unions)
    if index_encoding == "auto" and max(unions) * index_bytes * 8 * 2 * ctx.world_size < ctx.numel:
        return [False] * len(unions)  # far from paying off: no need to build the owner map
    sizes = owner_map(ctx.numel, ctx.world_size, zen_seed(ctx), device).sizes
    if index_encoding == "bitmap":
        return [True] * len(unions)
    return [(size + 7) // 8 < u * index_bytes for u, size in zip(unions, sizes)]


def _value_offset(index_nbytes: int, ctx: BucketContext) -> int:
    width = torch.empty((), dtype=ctx.dtype).element_size()
    return -(-index_nbytes // width) * width  # values start aligned to their width


def _index_nbytes(
    union: int, bitmap: bool, owner: int, ctx: BucketContext, index_dtype: torch.dtype, device: torch.device
) -> int:
    if bitmap:
        return (owner_map(ctx.numel, ctx.world_size, zen_seed(ctx), device).sizes[owner] + 7) // 8
    return union * index_dtype.itemsize


def _pull_nbytes(
    owner: int, union: int, bitmap: bool, ctx: BucketContext, index_dtype: torch.dtype, device: torch.device
) -> int:
    """Bytes of ``owner``'s pull blob (known on every rank once the union sizes are)."""
    at = _value_offset(_index_nbytes(union, bitmap, owner, ctx, index_dtype, device), ctx)
    return at + union * torch.empty((), dtype=ctx.dtype).element_size()


def _encode_pull(union: Tensor, sums: Tensor, bitmap: bool, ctx: BucketContext, device: torch.device) -> Tensor:
    """One owner's pull blob: its indices (int list, or a bitmap over ``P_p``), then its sums."""
    if bitmap:
        omap = owner_map(ctx.numel, ctx.world_size, zen_seed(ctx), device)
        bits = torch.zeros(omap.sizes[ctx.rank], dtype=torch.bool, device=device)
        bits.index_fill_(0, omap.positions.index_select(0, union.long()), True)
        index_part = pack_bits(bits)
    else:
        index_part = union.contiguous().view(torch.uint8)
    at = _value_offset(index_part.numel(), ctx)
    blob = torch.zeros(at + sums.numel() * sums.element_size(), dtype=torch.uint8, device=device)
    blob[: index_part.numel()].copy_(index_part)
    blob[at:].copy_(sums.contiguous().view(torch.uint8))
    return blob


def _decode_pull(
    blob: Tensor,
    owner: int,
    union: int,
    bitmap: bool,
    ctx: BucketContext,
    index_dtype: torch.dtype,
    device: torch.device,
) -> tuple[Tensor, Tensor]:
    """``owner``'s indices (int64) and sums (``ctx.dtype``) from its pull blob."""
    index_nbytes = _index_nbytes(union, bitmap, owner, ctx, index_dtype, device)
    if bitmap:
        theirs = owner_map(ctx.numel, ctx.world_size, zen_seed(ctx), device).indices_of(owner)
        indices = theirs.index_select(0, flat_nonzero(unpack_bits(blob[:index_nbytes], theirs.numel())))
    else:
        indices = blob[:index_nbytes].clone().view(index_dtype).long()  # clone: a fresh, aligned buffer to view
    at = _value_offset(index_nbytes, ctx)
    values = blob[at:].clone().view(ctx.dtype)
    return indices, values


# ------------------------------------------------------------------------------------------------------------------
# Zen as the transport of a sparsifier (TopK, DGC, AdaComp)
# ------------------------------------------------------------------------------------------------------------------
def transport_rounds(transport: str, own: int) -> int:
    """Rounds of a sparsifier over ``transport`` (``own``: its rounds over its own all-gather).

    Zen's four over Zen; two (push, pull) where the two-phase exchange may run (``"two_phase"``, ``"auto"``).
    """
    if transport in TRANSPORTS:
        return ZEN_ROUNDS
    return max(own, 2) if transport in ("two_phase", "auto") else own


class SparseTransport:
    """The class facts of a sparsifier whose pairs travel over its ``transport`` (a mixin before ``Compressor``).

    Over ``"allgather"`` it takes its own rounds (``gather_rounds``); over ``"zen"`` and ``"zen-auto"`` Zen's four,
    whose first exchanges the sizes (they depend on the data); over the two-phase exchange two, of fixed sizes.
    """

    transport: str
    gather_rounds: ClassVar[int] = 1  # its rounds over its own all-gather
    gather_exchanges_sizes: ClassVar[bool] = False  # whether those exchange sizes too (AdaComp's counts)

    @property
    def rounds(self) -> int:
        """``gather_rounds`` over the all-gather; Zen's four otherwise."""
        return transport_rounds(self.transport, self.gather_rounds)

    @property
    def exchanges_sizes(self) -> bool:
        """Over Zen sizes depend on the data and are exchanged first (all-gather: ``gather_exchanges_sizes``)."""
        return self.gather_exchanges_sizes or self.transport in TRANSPORTS


def sparse_transport_sum(
    compressor: Compressor, transport: str, indices: Tensor, values: Tensor, ctx: BucketContext, out: Tensor
) -> Any:
    """The sum over ranks of every rank's ``(indices, values)`` over ``"zen"`` or ``"zen-auto"`` (``yield from`` it).

    ``"zen-auto"`` picks, per bucket and step, the path :func:`choose` finds cheapest from the exchanged counts and the
    union measured at the bucket's previous step (the overlap of the ranks' supports): a first step assumes the
    supports overlap fully, the most favourable case for Zen, and corrects itself once measured. The measured union is
    the compressor's state (``state_dict``: a resume chooses as the uninterrupted run does), staged like every state.
    """
    local = pairs_input(indices, values, ctx, out)
    if transport == "zen":
        return (yield from sparse_sum(local, ctx, out, lambda counts: "zen" if _any(counts) else "none"))
    memory = compressor.layer_state("zen_union")
    key = ctx.layers[0]
    known = memory.get(key, torch.zeros(1, dtype=torch.float64))
    index_bytes = _index_dtype(ctx.numel).itemsize
    value_bytes = values.element_size()
    seen: list[int] = []

    def path_for(counts: list[list[int]]) -> Path:
        if not _any(counts):
            return "none"
        pushed = [sum(row) for row in counts]
        # the union's share of everything pushed, as measured last time (0: not yet measured)
        share = float(known[0])  # a CPU tensor: no device synchronisation
        union = max(pushed) if share == 0 else min(max(max(pushed), round(share * sum(pushed))), ctx.numel)
        seen.append(sum(pushed))
        return choose(counts, ctx.numel, union, index_bytes, value_bytes)

    summed = yield from sparse_sum(local, ctx, out, path_for, on_union=seen.append)
    if len(seen) == 2:  # Zen measured the union exactly
        ctx.stage(known, torch.tensor([seen[1] / max(seen[0], 1)], dtype=torch.float64))
    elif seen and seen[0]:  # another path: the union is the sum's support (a cancellation to zero is rare)
        union = int(torch.count_nonzero(summed))  # host read, on the collective's thread
        ctx.stage(known, torch.tensor([union / seen[0]], dtype=torch.float64))
    return summed


def _any(counts: list[list[int]]) -> bool:
    return any(any(row) for row in counts)
