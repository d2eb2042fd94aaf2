"""The two-phase exchange of sparse selections: pairs to the owners of their indices, the owners' re-selections to all.

A sparsifier whose ranks select different indices (TopK, DGC) all-gathers its pairs: every rank receives the other
``N - 1`` selections, so its bytes grow with the world size and pass a dense ring all-reduce's at about ``N = 1 /
(2 ratio)`` (``N = 64`` for 1 % of fp32 pairs). This exchange keeps them about two selections whatever ``N``, the shape
of :mod:`~lightning_gradcomp.compressors.transports.two_phase` with the sparse partition of Zen
(:mod:`~lightning_gradcomp.compressors.transports.hashed_sum`):

1. **push** (all-to-all): every flat index of the bucket has an owner, ``owner(i) = hash(i) N >> 32`` (Zen's seeded
   hash: each owner gets about ``1 / N`` of any selection, wherever its indices are). A rank sends the owner ``p``
   its selected pairs owned by ``p`` as ``(position in p's indices, value)``, in a row of fixed size ``C = min(k,
   ceil(2 k / N))`` slots for a selection of ``k`` pairs (twice the mean share); unused slots carry the value 0 at
   position 0 (adding zero changes nothing), so sizes never depend on the data and nothing is read on the host.
   Pairs beyond an owner's ``C`` slots (the hash sends about ``k / N`` with a spread of ``sqrt(k / N)``) are not
   sent: error feedback keeps them, as it keeps every unselected element, and sends them at a later step;
2. **reduce at the owner**: the owner sums the rows in rank order in fp32 (or wider) into its own indices, divides
   by ``N``, adds what it still owes from its last re-selection (error feedback at the owner: its state), and
   re-selects the ``k_2 = ceil(k / N)`` largest magnitudes of its indices; what it does not send it keeps;
3. **pull** (all-gather): the owners' ``k_2`` pairs, which every rank writes into one dense tensor (owners' indices
   are disjoint): bitwise the same average on every rank.

Bytes per rank, each way: ``(N - 1) / N (N C + k_2) s`` for pairs of ``s`` bytes (an int32 position and a value in
the gradient's dtype), about ``3 (N - 1) / N k s`` against the all-gather's ``(N - 1) P_1``. ``transport="auto"``
takes whichever moves fewer bytes (:func:`two_phase_wire`, counted with :mod:`lightning_gradcomp.engine.wire`), a
decision on the host from the layout and the world size alone.
"""

from __future__ import annotations

import dataclasses
import math
import threading

import torch
from torch import Tensor

from lightning_gradcomp.compressors.base import BucketContext, Compressor, Layer
from lightning_gradcomp.compressors.ops.segments import LayoutCache
from lightning_gradcomp.compressors.transports.hashed_sum import by_owner, owner_map, zen_seed
from lightning_gradcomp.compressors.transports.two_phase import next_owner_residuals
from lightning_gradcomp.engine import wire
from lightning_gradcomp.engine.requests import AllGather, AllToAll, Exchange, SentAt

__all__ = [
    "SPARSE_TRANSPORTS",
    "Routed",
    "SparseShards",
    "owner_exchange",
    "route_pairs",
    "two_phase_wire",
]

#: The transports of TopK and DGC: the byte-wise choice (``"auto"``), the all-gather of pairs, this exchange, and Zen
#: (always, or its own selector per bucket and step).
SPARSE_TRANSPORTS = ("auto", "allgather", "two_phase", "zen", "zen-auto")
_SLACK = 2  # an owner's row holds twice its mean share of a rank's pairs
_POSITION = torch.int32


def capacity(selected: int, world_size: int) -> int:
    """Slots of one row of the push: ``min(k, ceil(2 k / N))`` for ``k`` selected pairs."""
    return min(selected, math.ceil(_SLACK * selected / world_size))


def reselected(selected: int, world_size: int) -> int:
    """Pairs an owner re-selects and all-gathers: ``ceil(k / N)``."""
    return math.ceil(selected / world_size)


def two_phase_wire(selected: int, world_size: int, value_bytes: int) -> wire.Wire:
    """What one rank sends and receives in this exchange for ``selected`` pairs (values of ``value_bytes``).

    The push's rows (``N`` of :func:`capacity` slots, the one for itself not on the wire), then the owners' pull,
    whose two tensors travel packed, each padded to 8 bytes (the non-finite flag, 8 bytes more, is not counted here).
    """
    position_bytes = torch.empty((), dtype=_POSITION).element_size()
    row = capacity(selected, world_size) * (position_bytes + value_bytes)
    push = wire.all_to_all([row] * world_size, [row] * world_size, 0)
    keep = reselected(selected, world_size)
    pull = sum(-(-keep * width // 8) * 8 for width in (position_bytes, value_bytes))
    return push + wire.all_gather(pull, world_size)


@dataclasses.dataclass(frozen=True)
class Owners:
    """Zen's owner map of a bucket's flat indices on the bucket's device (:class:`~.transport.OwnerMap`).

    Attributes:
        owners: every index's owner (int64).
        positions: every index's place among its owner's indices (int64).
        order: the indices sorted by owner, ascending within each owner.
        sizes: how many indices each owner has (host integers).
        starts: where each owner's indices start in ``order`` (int64).
    """

    owners: Tensor
    positions: Tensor
    order: Tensor
    sizes: tuple[int, ...]
    starts: Tensor


_OWNERS: LayoutCache[Owners] = LayoutCache(size=4)
_OWNERS_LOCK = threading.Lock()  # rounds run on the collectives' threads


def device_owners(numel: int, world_size: int, seed: int, device: torch.device) -> Owners:
    """The owner map of ``numel`` indices, built on the CPU and copied to ``device`` once per layout (cached).

    Built on the CPU, where the owners' sizes are read on the host without waiting for a device.
    """

    def build() -> Owners:
        omap = owner_map(numel, world_size, seed, torch.device("cpu"))
        starts = torch.tensor((0, *omap.sizes[:-1]), dtype=torch.int64).cumsum(0)
        return Owners(
            omap.owners.to(device), omap.positions.to(device), omap.order.to(device), omap.sizes, starts.to(device)
        )

    with _OWNERS_LOCK:
        return _OWNERS.get((numel, world_size, seed, str(device)), build)


@dataclasses.dataclass(frozen=True)
class Routed:
    """One rank's pairs laid out for the push.

    Attributes:
        positions: ``N * C`` positions (int32), row ``p`` for owner ``p``.
        values: ``N * C`` values, aligned with ``positions``.
        sent: which of the selected pairs are in a row (the others stay owed), in the order they were given.
        slots: ``C``.
        selected: ``k``, the number of pairs given (fixed by the layout).
    """

    positions: Tensor
    values: Tensor
    sent: Tensor
    slots: int
    selected: int

    def declaration(self, indices: Tensor, values: Tensor) -> SentAt:
        """What went out of ``x``: the values of the pairs in a row (error feedback keeps the rest)."""
        return SentAt(indices, torch.where(self.sent, values, torch.zeros_like(values)))


def route_pairs(indices: Tensor, values: Tensor, ctx: BucketContext) -> Routed:
    """Lay out the ``k`` selected pairs (distinct flat ``indices``, or repeats with the value 0) by owner.

    A pair with the value 0 changes no sum, so it takes no slot (a fixed-size selection's unused slots). Within an
    owner the pairs keep their order (a stable sort), so the first ``C`` go: no host synchronisation.
    """
    n, k = ctx.world_size, indices.numel()
    omap = device_owners(ctx.numel, n, zen_seed(ctx), indices.device)
    slots = capacity(k, n)
    owners = omap.owners.index_select(0, indices).masked_fill_(values == 0, n)  # owner n: not sent
    order = by_owner(owners, n + 1).to(indices.device)
    ordered = owners.index_select(0, order)
    counts = torch.zeros(n + 1, dtype=torch.int64, device=indices.device).scatter_add_(
        0, owners, torch.ones_like(owners)
    )
    firsts = counts.cumsum(0).sub_(counts)
    within = torch.arange(k, device=indices.device).sub_(firsts.index_select(0, ordered))
    fits = (ordered < n) & (within < slots)
    slot = torch.where(fits, ordered * slots + within, n * slots)  # slot n C: a bin for what does not go
    picked = indices.index_select(0, order)
    positions = torch.zeros(n * slots + 1, dtype=_POSITION, device=indices.device)
    positions.index_copy_(0, slot, omap.positions.index_select(0, picked).to(_POSITION))
    row_values = torch.zeros(n * slots + 1, dtype=values.dtype, device=values.device)
    row_values.index_copy_(0, slot, values.index_select(0, order))
    sent = torch.empty_like(fits).index_copy_(0, order, fits)
    return Routed(positions[: n * slots], row_values[: n * slots], sent, slots, k)


def owner_exchange(compressor: Compressor, routed: Routed, ctx: BucketContext, out: Tensor) -> Exchange:
    """Push ``routed``, reduce and re-select at the owner, pull: the average over ranks in ``out`` (``yield from``)."""
    n = ctx.world_size
    omap = device_owners(ctx.numel, n, zen_seed(ctx), out.device)
    received = yield AllToAll((routed.positions, routed.values), (routed.slots,) * n, (routed.slots,) * n)
    keep = reselected(routed.selected, n)
    key = _owner_key(ctx, keep)
    total = torch.zeros(key.numel, dtype=torch.promote_types(ctx.dtype, torch.float32), device=out.device)
    for positions, values in received:  # rank order; a rank's positions are distinct but for zeros at 0
        total.index_add_(0, positions.long(), values.to(total.dtype))
    total.div_(n)
    residual = None
    if ctx.error_feedback:
        residual = compressor.layer_state("owner_residual").get(key, total)
        total.add_(residual)
    chosen = torch.topk(total.abs(), keep, sorted=False).indices
    chosen_values = total.index_select(0, chosen).to(ctx.dtype)
    if residual is not None:  # what the owner did not send, and the rounding of what it sent, stays owed
        owed = next_owner_residuals(compressor).get(key, total)
        owed.copy_(total).index_add_(0, chosen, chosen_values.to(total.dtype), alpha=-1)
        ctx.stage(residual, owed, swap=True)
    gathered = yield AllGather((chosen.to(_POSITION), chosen_values))
    positions = torch.stack([p for p, _ in gathered]).long()
    values = torch.stack([v for _, v in gathered]).reshape(-1)
    out.zero_().index_add_(0, _flat_indices(omap.order, omap.starts, positions), values.to(out.dtype))
    return out


def _flat_indices(order: Tensor, starts: Tensor, positions: Tensor) -> Tensor:
    """The flat indices of ``positions[p]`` in owner ``p``'s indices (rows in owner order).

    A position past an owner's indices (an owner with fewer than ``k_2`` of them) holds the value 0: it is clamped
    into the tensor, where adding zero changes nothing.
    """
    at = positions.add(starts[: positions.shape[0]].unsqueeze(1)).clamp_(max=order.numel() - 1)
    return order.index_select(0, at.reshape(-1))


def _owner_key(ctx: BucketContext, keep: int) -> Layer:
    """The layer the owner's residual is kept under: its indices, padded to at least ``k_2`` positions."""
    n = ctx.world_size
    size = device_owners(ctx.numel, n, zen_seed(ctx), ctx.device).sizes[ctx.rank]
    first = ctx.layers[0]
    return Layer(f"{first.name}/owned{ctx.rank}of{n}", first.index, torch.Size((max(size, keep),)))


class SparseShards:
    """The owner's side of a sparsifier with this exchange (a mixin before ``Compressor``): the decision, the debt."""

    transport: str

    def sparse_two_phase(self, ctx: BucketContext, selected: int, gather_nbytes: int) -> bool:
        """Whether this bucket goes by the two-phase exchange.

        ``"two_phase"`` from 2 ranks; ``"auto"`` where it moves fewer bytes per rank than the all-gather of
        ``gather_nbytes`` (a rank's payload, ``selected`` pairs): :func:`two_phase_wire` against
        :func:`lightning_gradcomp.engine.wire.all_gather`, a tie staying on the all-gather.
        """
        if ctx.world_size < 2 or self.transport not in ("two_phase", "auto"):
            return False
        if self.transport == "two_phase":
            return True
        value_bytes = torch.empty((), dtype=ctx.dtype).element_size()
        ours = two_phase_wire(selected, ctx.world_size, value_bytes).moved
        return ours < wire.all_gather(gather_nbytes, ctx.world_size).moved

    def owner_owed(self, ctx: BucketContext) -> Tensor:
        """What this rank, as an owner, still owes of ``ctx``'s bucket, at its flat indices (zeros elsewhere)."""
        owed = torch.zeros(ctx.numel, dtype=torch.promote_types(ctx.dtype, torch.float32), device=ctx.device)
        state = self.layer_state("owner_residual").state_dict()  # type: ignore[attr-defined]
        residual = state.get(f"{ctx.layers[0].name}/owned{ctx.rank}of{ctx.world_size}")
        if residual is not None:
            omap = device_owners(ctx.numel, ctx.world_size, zen_seed(ctx), ctx.device)
            start, size = sum(omap.sizes[: ctx.rank]), omap.sizes[ctx.rank]
            owed.index_add_(0, omap.order[start : start + size], residual[:size].to(owed.dtype))
        return owed
