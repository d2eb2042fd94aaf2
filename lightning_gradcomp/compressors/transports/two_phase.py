"""The two-phase exchange: compressed shards to their owners (all-to-all), the owners' re-encoded sums (all-gather).

A compressor whose payloads cannot be summed on the wire (signs, quantized values with their own scales) exchanges
them by all-gather: every rank receives ``N - 1`` payloads, so its bytes grow with the world size and pass a dense
ring all-reduce's at ``N = 64 / bits`` per element. The two-phase exchange keeps them flat, the shape of ZeRO++'s
qgZ (Wang et al., 2023, arXiv:2306.10209), CGX (Markov et al., Middleware 2022) and THC (Li et al., NSDI 2024):

1. the bucket is cut into ``N`` shards of ``S = ceil(d / N)`` elements (the last padded with zeros); every rank
   compresses each shard on its own and sends shard ``s`` to rank ``s`` (one ``all_to_all`` of the packed payloads:
   ``(N - 1) / N`` of one encoding out and in);
2. each rank decodes the ``N`` payloads of its shard and reduces them in fp32 (their rank-order average, or for
   signSGD the exact majority vote), re-encodes the result and all-gathers it (``(N - 1) / N`` of the second
   encoding); every rank decodes every shard: bitwise the same tensor on every rank.

Bytes per rank, each way: ``(N - 1) / N (P_1 + P_2)`` for a rank's encoding of the bucket ``P_1`` and the owners'
re-encoding ``P_2``, against ``(N - 1) P_1`` for the all-gather. ``transport="auto"`` takes the two-phase exchange
where that is fewer bytes, ``N > 1 + P_2 / P_1`` (ties stay on the all-gather): ``N >= 3`` where both encodings are
alike, ``N >= 4`` for signSGD's vote (1 bit up, 2 bits down). A decision on the host from the world size alone.

**The second encoding's error.** The first encoding is each rank's own, declared to the driver as usual
(:class:`~lightning_gradcomp.engine.requests.SentValue`: error feedback's residual keeps ``x - sent``). The
owner's re-encoding of its shard loses something too. With error feedback on, the owner keeps that error as a
residual of its shard and adds it to the next step's shard before re-encoding (DeepSpeed's 1-bit Adam keeps the same
"server error"; Tang et al., "DoubleSqueeze", ICML 2019): over ``T`` steps what was applied plus every rank's residual
plus the owners' residuals equals the average gradient, the identity error feedback keeps with one encoding. The
owner's residual is this rank's state (:meth:`Compressor.layer_state`: checkpointed, reset, staged until the step is
finite on every rank). Without error feedback (QSGD, TernGrad: unbiased) the re-encoding is unbiased too, so the
aggregate stays unbiased with the variance of a second quantisation. signSGD's vote is re-encoded exactly (2 bits).

**What changes against the all-gather.** Each shard is compressed as one "layer" of ``S`` elements, so per-layer
scales (EF-signSGD's, 1-bit SGD's, MinMax's) become per-shard scales, and QSGD's norm buckets and TernGrad's scalers
are cut at shard boundaries: the fixed-size blocks ZeRO++ and CGX quantise, not the layers. Per-layer levels
(:meth:`Compressor.set_levels`) are refused with this transport.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor

from lightning_gradcomp.compressors.base import BucketContext, Compressor, Layer, LayerBuffers, Payload, derive_seed
from lightning_gradcomp.compressors.ops.packing import field_width, pack_uint, unpack_uint
from lightning_gradcomp.engine.requests import AllGather, AllToAll, Exchange, SentValue
from lightning_gradcomp.validation import check_choice

__all__ = [
    "TRANSPORTS",
    "ShardedExchange",
    "check_transport",
    "exact_sum",
    "next_owner_residuals",
    "owner_residuals",
    "shard_context",
    "shard_numel",
    "two_phase_bytes",
    "uses_two_phase",
]

#: The transports a quantizer or sign compressor accepts: its all-gather, the two-phase exchange, or the one of the
#: two that moves fewer bytes per rank at the world size.
TRANSPORTS = ("auto", "allgather", "two_phase")
_ALIGN = 8  # bytes: every payload tensor starts 8-byte aligned in the all-to-all's rows
_SALT = 0x7350  # keys the shards' layer indices (random draws) apart from real layers'


def check_transport(value: object) -> str:
    """One of :data:`TRANSPORTS`, or a one-line error naming ``transport``."""
    return str(check_choice(value, "transport", TRANSPORTS))


def shard_numel(numel: int, world_size: int) -> int:
    """Elements per shard: ``ceil(numel / world_size)`` (the last shard is padded with zeros)."""
    return -(-numel // world_size)


def uses_two_phase(transport: str, world_size: int, second_over_first: float) -> bool:
    """Whether ``transport`` runs the two-phase exchange at ``world_size``.

    ``"auto"``: when it moves fewer bytes per rank than the all-gather, ``(N - 1) / N (P_1 + P_2) < (N - 1) P_1``,
    that is ``N > 1 + P_2 / P_1`` with ``second_over_first = P_2 / P_1``.
    """
    if transport == "allgather" or world_size < 2:
        return False
    return transport == "two_phase" or world_size > 1 + second_over_first


def two_phase_bytes(first: float, second: float, world_size: int) -> float:
    """Bytes a rank sends (and receives) in the two-phase exchange for encodings of ``first`` and ``second`` bytes."""
    return (world_size - 1) / world_size * (first + second)


def exact_sum(values: Tensor, bits: int, ctx: BucketContext) -> Exchange:
    """Every rank's ``values`` (integers in ``[0, 2^bits)``), summed exactly by the two-phase exchange.

    Each rank sends shard ``s`` of its values, packed in ``bits`` bits, to rank ``s`` (all-to-all), which sums its
    shard in integers and all-gathers the sums packed in ``ceil(log2(n (2^bits - 1) + 1))`` bits: every rank then
    holds the same exact sums, ``(N - 1) / N`` of both packings per rank and direction. Shards are whole multiples of
    8 elements, so every packed shard is whole bytes and the shards' packings, concatenated, are the bucket's.

    Returns:
        The sums (int32, ``ctx.numel`` elements).
    """
    n, numel = ctx.world_size, ctx.numel
    size = -(-shard_numel(numel, n) // 8) * 8
    padded = torch.zeros(n * size, dtype=torch.uint8, device=values.device)
    padded[:numel].copy_(values)
    row = size * bits // 8
    received = yield AllToAll((pack_uint(padded, bits),), (row,) * n, (row,) * n)
    mine = unpack_uint(torch.cat([part for (part,) in received]), bits, n * size).view(n, size)
    sums = mine.sum(dim=0, dtype=torch.int32)  # integers: exact in any order
    width = field_width(n * ((1 << bits) - 1))
    # past 8 bits (more than 127 ranks of ternaries) the sums travel as 16-bit integers
    encoded = pack_uint(sums.to(torch.uint8), width) if width <= 8 else sums.to(torch.int16).view(torch.uint8)
    gathered = yield AllGather((encoded,))
    shards = torch.cat([part for (part,) in gathered])
    if width <= 8:
        return unpack_uint(shards, width, n * size)[:numel].int()
    return shards.view(torch.int16)[:numel].int()


def shard_context(ctx: BucketContext, shard: int, *, owner: bool) -> BucketContext:
    """The context of shard ``shard`` of ``ctx``'s bucket: one layer of ``S`` elements.

    ``owner``: the owner's view (its decoding, reduction and re-encoding), in at least fp32; otherwise a rank's own
    encoding, in the gradient's dtype. The layer's index keys its random draws (different for the two encodings).
    """
    n = ctx.world_size
    first = ctx.layers[0]
    layer = Layer(
        name=f"{first.name}/shard{shard}of{n}",
        index=derive_seed(_SALT, first.index, ctx.numel, n, shard, int(owner)) >> 2,
        shape=torch.Size((shard_numel(ctx.numel, n),)),
    )
    dtype = torch.promote_types(ctx.dtype, torch.float32) if owner else ctx.dtype
    return dataclasses.replace(ctx, layers=(layer,), dtype=dtype)


def _layout(payload: Payload) -> tuple[tuple[torch.dtype, torch.Size, int], ...]:
    """Each payload tensor's dtype, shape and bytes (rounded up to the alignment)."""
    return tuple((p.dtype, p.shape, -(-p.numel() * p.element_size() // _ALIGN) * _ALIGN) for p in payload)


def _to_bytes(payload: Payload) -> Tensor:
    """The payload's tensors as one row of bytes, each padded to 8 bytes (the all-to-all sends rows of bytes)."""
    parts = []
    for p in payload:
        raw = p.contiguous().reshape(-1).view(torch.uint8)
        pad = -raw.numel() % _ALIGN
        parts.append(torch.nn.functional.pad(raw, (0, pad)) if pad else raw)
    return torch.cat(parts)


def _from_bytes(row: Tensor, layout: tuple[tuple[torch.dtype, torch.Size, int], ...]) -> Payload:
    """Inverse of :func:`_to_bytes` (copies, so every tensor is aligned)."""
    out, at = [], 0
    for dtype, shape, nbytes in layout:
        size = shape.numel() * torch.empty((), dtype=dtype).element_size()
        out.append(row[at : at + size].clone().view(dtype).reshape(shape))
        at += nbytes
    return tuple(out)


class ShardedExchange(Compressor):
    """A compressor that can average by the two-phase exchange (``transport``), besides its all-gather.

    Subclasses set ``self.transport`` (:func:`check_transport`) and may refine the owner's steps:
    :meth:`reduce_shard` (default: the rank-order average of the decoded payloads, :meth:`average`),
    :meth:`encode_shard` / :meth:`decode_shard` (default: :meth:`compress` / :meth:`decompress`) and
    :attr:`second_over_first`, the bytes of the owner's encoding over a rank's (for ``"auto"``).
    """

    #: ``"allgather"``, ``"two_phase"`` or ``"auto"``, set by the subclass (:func:`check_transport`)
    transport: str
    #: Bytes of the owner's encoding of a shard over a rank's encoding of it (``"auto"``'s formula).
    second_over_first: ClassVar[float] = 1.0

    def __init__(self) -> None:
        super().__init__()
        self.layer_state("owner_residual")  # declared, so that a checkpoint's is loaded into a fresh compressor

    @property
    def rounds(self) -> int:
        """Two with the two-phase exchange (all-to-all, all-gather); the all-gather returns after its one round."""
        return 1 if self.transport == "allgather" else 2

    def two_phase(self, ctx: BucketContext) -> bool:
        """Whether this bucket is averaged by the two-phase exchange (decided from the world size alone).

        ``"auto"`` keeps the all-gather while per-layer levels are set: shards are not layers.
        """
        if self.transport == "auto" and self.layer_levels:
            return False
        return uses_two_phase(self.transport, ctx.world_size, self.second_over_first)

    def set_levels(self, levels: Mapping[str, Any]) -> None:
        """Per-layer levels (:meth:`Compressor.set_levels`); refused with ``transport="two_phase"``.

        Raises:
            ValueError: With ``transport="two_phase"``, which compresses shards, not layers.
        """
        if levels and self.transport == "two_phase" and self.level_attribute is not None:
            raise ValueError(
                f"{type(self).__name__}(transport='two_phase') compresses shards, not layers, so per-layer levels"
                " cannot apply; pass transport='auto' or 'allgather' to set them."
            )
        super().set_levels(levels)

    def reduce_shard(self, payloads: Sequence[Payload], ctx: BucketContext) -> Tensor:
        """The owner's reduction of every rank's payload of its shard (``ctx``: the owner's shard context)."""
        return self.average(payloads, ctx)

    def encode_shard(self, reduced: Tensor, ctx: BucketContext) -> Payload:
        """The owner's encoding of its reduced shard."""
        return self.compress(reduced, ctx)

    def decode_shard(self, payload: Payload, ctx: BucketContext, out: Tensor) -> Tensor:
        """Every rank's decoding of an owner's encoding."""
        return self.decompress(payload, ctx, out=out)

    def exchange(self, tensor: Tensor, ctx: BucketContext, out: Tensor) -> Exchange:
        """The all-gather exchange, or the two-phase exchange where :meth:`two_phase` says so."""
        if self.two_phase(ctx):
            return (yield from self._two_phase_exchange(tensor, ctx, out))
        return (yield from super().exchange(tensor, ctx, out))

    def _two_phase_exchange(self, tensor: Tensor, ctx: BucketContext, out: Tensor) -> Exchange:
        n, numel, me = ctx.world_size, ctx.numel, ctx.rank
        size = shard_numel(numel, n)
        padded = tensor
        if n * size != numel:
            padded = torch.zeros(n * size, dtype=tensor.dtype, device=tensor.device)
            padded[:numel].copy_(tensor)
        # phase 1: each shard compressed on its own, the shards to their owners
        shards = [shard_context(ctx, s, owner=False) for s in range(n)]
        payloads = [self.compress(padded[s * size : (s + 1) * size], shards[s]) for s in range(n)]
        if ctx.error_feedback:  # what went out of x: every shard as its owner will decode it
            sent = torch.empty(n * size, dtype=ctx.dtype, device=ctx.device)
            for s, payload in enumerate(payloads):
                self.decompress(payload, shards[s], out=sent[s * size : (s + 1) * size])
            yield SentValue(sent[:numel])
        layout = _layout(payloads[me])
        row = sum(nbytes for _, _, nbytes in layout)
        received = yield AllToAll((torch.cat([_to_bytes(p) for p in payloads]),), (row,) * n, (row,) * n)
        # phase 2: the owner reduces its shard in fp32, re-encodes it (keeping what that loses), all-gathers it
        owner = shard_context(ctx, me, owner=True)
        reduced = self.reduce_shard([_from_bytes(bytes_[0], layout) for bytes_ in received], owner)
        valid = min(max(numel - me * size, 0), size)  # the rest of the last shard is padding: kept at zero
        reduced[valid:] = 0
        residual = None
        if ctx.error_feedback:
            residual = self.layer_state("owner_residual").get(owner.layers[0], reduced)
            reduced.add_(residual)
        encoded = self.encode_shard(reduced, owner)
        if residual is not None:
            new = next_owner_residuals(self).get(owner.layers[0], reduced)
            torch.sub(reduced, self.decode_shard(encoded, owner, new), out=new)
            new[valid:] = 0
            ctx.stage(residual, new, swap=True)
        gathered = yield AllGather(encoded)
        result = torch.empty(n * size, dtype=owner.dtype, device=ctx.device)
        for s, payload in enumerate(gathered):
            self.decode_shard(payload, shard_context(ctx, s, owner=True), result[s * size : (s + 1) * size])
        return out.copy_(result[:numel])


def next_owner_residuals(compressor: Compressor) -> LayerBuffers:
    """Scratch for the owner's next residual (staged, swapped in at commit; not state)."""
    return compressor.__dict__.setdefault("_owner_next_residual", LayerBuffers())


def owner_residuals(compressors: Sequence[Compressor], ctx: BucketContext) -> Tensor:
    """What the owners still owe of ``ctx``'s bucket, every rank's shard in rank order (zeros where none is kept).

    Error feedback's identity with the two-phase exchange: the sum of the applied averages, plus the mean of the
    ranks' residuals, plus this, equals the sum of the average gradients. A compressor whose owners keep something
    else than a contiguous shard (the sparsifiers' owners) says what it owes with ``owner_owed(ctx)``.
    """
    n = len(compressors)
    size = shard_numel(ctx.numel, n)
    owed = torch.zeros(n * size, dtype=torch.promote_types(ctx.dtype, torch.float32), device=ctx.device)
    for rank, compressor in enumerate(compressors):
        own = getattr(compressor, "owner_owed", None)
        if own is not None:
            owed[: ctx.numel] += own(dataclasses.replace(ctx, rank=rank, world_size=n)).to(owed.dtype)
            continue
        name = shard_context(dataclasses.replace(ctx, world_size=n), rank, owner=True).layers[0].name
        state = compressor.state_dict().get("owner_residual", {})
        if name in state:
            owed[rank * size : (rank + 1) * size] = state[name]
    return owed[: ctx.numel]
