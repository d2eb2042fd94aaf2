"""AdaComp's two-phase exchange: each rank's codes cut into shards for their owners, the owners' re-encoded sums.

The shape of :mod:`~lightning_gradcomp.compressors.transports.two_phase` (an all-to-all of compressed shards, a
reduction in fp32 at the owner, an all-gather of the owner's re-encoding), with AdaComp's own first encoding kept whole:
every rank selects over its real layers and bins (the paper's), then sends shard ``s`` of its codes, with every layer's
scale, to rank ``s``. The owner decodes its shard of every rank (each element takes its layer's scale), averages them in
rank order in fp32, adds what it still owes from its last re-encoding (error feedback at the owner, as the other
two-phase compressors keep it), and re-encodes its shard with AdaComp's rule: the pieces of layers that fall in the
shard are binned as their layers are (bins cut at the shard's edges), with ``H = 2 G`` (the owner has no latest
gradient).
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_gradcomp.compressors.ops.segments import segments_of
from lightning_gradcomp.compressors.transports.two_phase import shard_context, shard_numel
from lightning_gradcomp.engine.context import BucketContext, Layer

__all__ = ["ShardPlan", "shard_plan"]

_TRITS_PER_BYTE = 5
_CACHE_SIZE = 32


@dataclass(frozen=True)
class ShardPlan:
    """How a bucket's layers fall into ``world_size`` shards of ``size`` elements.

    Attributes:
        size: elements per shard (the last padded).
        code_bytes: bytes of one shard's codes, five to a byte.
        pieces: per shard, the pieces of layers in it (offsets relative to the shard), shaped as their layers are
            binned (the same number of dimensions).
        piece_layers: per shard, the layer of each piece (int64, on the bucket's device).
        most_pieces: the largest number of pieces of any shard (the owners' scales are padded to it).
    """

    size: int
    code_bytes: int
    pieces: tuple[tuple[Layer, ...], ...]
    piece_layers: tuple[Tensor, ...]
    most_pieces: int

    def valid(self, shard: int, numel: int) -> int:
        """Elements of ``shard`` inside the bucket (the rest is padding)."""
        return min(max(numel - shard * self.size, 0), self.size)


_PLANS: OrderedDict[tuple, ShardPlan] = OrderedDict()


def shard_plan(layers: Sequence[Layer], world_size: int, device: torch.device) -> ShardPlan:
    """The :class:`ShardPlan` of ``layers`` over ``world_size`` shards (cached per layout)."""
    key = (tuple((layer.offset, layer.numel, layer.ndim) for layer in layers), world_size, str(device))
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS[key] = _plan(layers, world_size, device)
        if len(_PLANS) > _CACHE_SIZE:
            _PLANS.popitem(last=False)
    return plan


def _plan(layers: Sequence[Layer], world_size: int, device: torch.device) -> ShardPlan:
    numel = sum(layer.numel for layer in layers)
    size = shard_numel(numel, world_size)
    pieces, piece_layers = [], []
    for shard in range(world_size):
        lo, hi = shard * size, min((shard + 1) * size, numel)
        mine, which = [], []
        for i, layer in enumerate(layers):
            start, stop = max(lo, layer.offset), min(hi, layer.offset + layer.numel)
            if start < stop:  # a piece shaped with its layer's number of dimensions: binned alike
                shape = torch.Size((stop - start, *([1] * (layer.ndim - 1))))
                mine.append(Layer(layer.name, layer.index, shape, start - lo))
                which.append(i)
        pieces.append(tuple(mine))
        piece_layers.append(torch.tensor(which, dtype=torch.int64, device=device))
    code_bytes = -(-size // _TRITS_PER_BYTE)
    return ShardPlan(size, code_bytes, tuple(pieces), tuple(piece_layers), max(len(p) for p in pieces))


def shard_scales(plan: ShardPlan, shard: int, scales: Tensor) -> Tensor:
    """Every element of ``shard`` (inside the bucket) given the scale of the piece it is in: ``scales`` per piece."""
    pieces = plan.pieces[shard]
    if not pieces:
        return scales.new_zeros(0)
    return segments_of(pieces, scales.device).expand(scales[: len(pieces)])


def owner_context(ctx: BucketContext, plan: ShardPlan, shard: int) -> BucketContext:
    """The owner's context for re-encoding ``shard``: its pieces as layers, in at least fp32."""
    dtype = torch.promote_types(ctx.dtype, torch.float32)
    return dataclasses.replace(ctx, layers=plan.pieces[shard], dtype=dtype)


def residual_key(ctx: BucketContext, shard: int) -> Layer:
    """The layer the owner's residual of ``shard`` is kept under (the name the other two-phase compressors use)."""
    return shard_context(ctx, shard, owner=True).layers[0]
