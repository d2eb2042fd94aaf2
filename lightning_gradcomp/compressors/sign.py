"""Sign compressors, one bit per element on the wire: signSGD with majority vote (and Signum), EF-signSGD, 1-bit SGD."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Sequence
from typing import ClassVar

import torch
from torch import Tensor

from lightning_gradcomp.compressors.base import BucketContext, Collective, Layer, LayerBuffers, Payload
from lightning_gradcomp.compressors.ops.packing import (
    INT_OF_SIZE,
    above,
    lookup_rows,
    lookup_uint,
    pack_bits,
    pack_uint,
    unpack_bits,
)
from lightning_gradcomp.compressors.ops.segments import segments_of
from lightning_gradcomp.compressors.transports.two_phase import ShardedExchange, check_transport
from lightning_gradcomp.engine.requests import AllGather, Exchange
from lightning_gradcomp.validation import check_momentum

_WIRE_SCALE = torch.float32  # per-layer scales travel as fp32, whatever the gradient's dtype
_NO_ERROR_FEEDBACK = (
    "SignSGD's majority vote is not an average of compressed gradients, so error feedback has nothing to carry; pass"
    " `error_feedback=None` or `False` to CompressedDDP, or use EFSignSGD (scaled signs with error feedback)."
)


def _out(ctx: BucketContext, out: Tensor | None) -> Tensor:
    return ctx.output(out)


def _accumulator(dtype: torch.dtype) -> torch.dtype:
    """Sums in at least fp32 (half-precision sums of a large layer overflow)."""
    return torch.promote_types(dtype, torch.float32)


_BYTE_BITS: dict[torch.device, Tensor] = {}


def _byte_bits(device: torch.device) -> Tensor:
    """The 256 x 8 table of the bits of every byte value (bit ``j`` of byte ``b`` at ``[b, j]``), as bools."""
    table = _BYTE_BITS.get(device)
    if table is None:
        table = _BYTE_BITS[device] = _combination_bits(1, 8, device)[:, 0]
    return table


def _combination_bits(ranks: int, width: int, device: torch.device) -> Tensor:
    """The bits of every code of ``ranks * width`` bits as ``[code, rank, element]`` bools (bit ``r width + j``)."""
    codes = torch.arange(1 << (ranks * width), device=device)
    shifts = torch.arange(ranks * width, device=device).view(ranks, width)
    return ((codes.view(-1, 1, 1) >> shifts) & 1).bool()


def _signs_into(packed: Tensor, ctx: BucketContext, positive: Tensor, negative: Tensor, out: Tensor) -> Tensor:
    """Write ``positive[l]`` where a bit of layer ``l`` is set and ``negative[l]`` elsewhere (bits as ``pack_bits``).

    Decoded a byte at a time: each layer's 256 x 8 table of values (``where(bits of b, positive, negative)`` for
    every byte value ``b``) is looked up with the packed bytes as row indices, so one pass reads a byte and writes 8
    values, with no bool tensor in between. ``torch.where`` over unpacked bits costs about 20 times as much on the
    CPU, with the same values: the table holds ``positive[l]`` or ``negative[l]`` themselves, nothing is computed.
    Every layer's table is looked up in one call (:func:`_layer_lookup`), whatever the number of layers.
    """
    tables = torch.where(_byte_bits(packed.device), positive.view(-1, 1, 1), negative.view(-1, 1, 1))

    def exact(positions: Tensor, layer: Tensor) -> Tensor:
        bits = _bits_at(packed, positions)
        return torch.where(bits, positive.index_select(0, layer), negative.index_select(0, layer))

    return _layer_lookup(tables, packed.int(), ctx, out, exact)


def _bits_at(packed: Tensor, positions: Tensor) -> Tensor:
    """The bits of elements ``positions`` of ``pack_bits``' packing, as bools."""
    return ((packed.index_select(0, positions >> 3).long() >> (positions & 7)) & 1).bool()


def _layer_lookup(
    tables: Tensor, rows: Tensor, ctx: BucketContext, out: Tensor, exact: Callable[[Tensor, Tensor], Tensor]
) -> Tensor:
    """``out``'s elements from layer ``l``'s ``tables[l]`` (``[layer, row, width]``), by the groups' ``rows``.

    One lookup for every layer: the tables are stacked, and each group of ``width`` elements reads the rows of the
    layer its first element is in (its row index offset by that layer's). The few elements of groups that a layer
    boundary crosses took the wrong layer's value; ``exact(positions, layers)`` gives theirs, written over them.
    """
    count, size, width = tables.shape
    groups = segments_of(ctx.layers, out.device).groups(width)
    indices = torch.add(rows[: groups.group_layer.numel()], groups.group_layer, alpha=size)
    whole = ctx.numel // width * width
    if whole == ctx.numel:
        lookup_rows(tables.reshape(count * size, width), indices, out.view(-1, width))
    else:
        covering = lookup_rows(tables.reshape(count * size, width), indices, tables.new_empty(indices.numel(), width))
        out.copy_(covering.view(-1)[: ctx.numel])
    if groups.fix_positions.numel():
        out.index_copy_(0, groups.fix_positions, exact(groups.fix_positions, groups.fix_layer))
    return out


def _rank_codes(packed: Sequence[Tensor], width: int) -> Tensor:
    """For every group of ``width`` consecutive elements, every rank's ``width`` bits side by side (uint8).

    Rank ``r``'s bit of element ``width * i + j`` is bit ``r * width + j`` of code ``i``; ``width`` divides 8, and
    ``len(packed) * width <= 8``. One rank's codes are its bytes. Two ranks' are formed elementwise: code ``2 i`` holds
    both ranks' low nibbles of byte ``i``, code ``2 i + 1`` their high nibbles (six byte-wide operations, about 60 %
    of the time of two lookups and an OR on the CPU: ``python benchmarks/torch_ops.py``, pair ``codes``). More ranks'
    are looked up (:func:`_looked_up_codes`).
    """
    if len(packed) == 1:
        return packed[0].view(-1)
    if len(packed) == 2 and width == 4:
        low, high = packed[0].view(-1), packed[1].view(-1)
        return torch.stack([(low & 15) | (high << 4), (low >> 4) | (high & 0xF0)], dim=1).view(-1)
    return _looked_up_codes(packed, width)


def _looked_up_codes(packed: Sequence[Tensor], width: int) -> Tensor:
    """:func:`_rank_codes` for any number of ranks, by one lookup and one OR per rank over the packed bytes.

    A packed byte of rank ``r`` holds the bits of ``8 // width`` groups; a 256-row table spreads them to their place
    in those groups' codes (the row's bytes read as one integer), with no tensor of a byte per element in between.
    """
    per = 8 // width
    device = packed[0].device
    byte = torch.arange(256, device=device).view(-1, 1)
    groups = torch.arange(per, device=device) * width
    codes = None
    for r, bits in enumerate(packed):
        spread = (((byte >> groups) & ((1 << width) - 1)) << (r * width)).to(torch.uint8)  # [byte, group]
        looked = lookup_rows(spread, bits.int(), spread.new_empty(bits.numel(), per)).view(INT_OF_SIZE[per])
        codes = looked if codes is None else codes.bitwise_or_(looked)  # OR a byte's groups at once
    assert codes is not None
    return codes.view(torch.uint8).view(-1)


def _sum_of_signs(
    payloads: Sequence[tuple[Tensor, Tensor, Tensor]], ctx: BucketContext, out: Tensor | None, divisor: int = 1
) -> Tensor:
    """The rank-order sum of every rank's ``positive[l]`` / ``negative[l]`` per set / clear bit, by table lookup.

    ``payloads`` holds, per rank, its packed bits (as ``pack_bits``) and its per-layer values for a set and a clear
    bit, in the output's dtype. What :meth:`Compressor.aggregate` forms by decoding every rank's payload and adding
    (``(v_0 + 0.0) + v_1 + ...``, ``+ 0.0`` turning a ``-0.0`` into ``+0.0``), with the same bits: an element's sum
    depends only on its bits on every rank, so each layer's table holds that sum, computed in the same order, for
    every combination of the bits of ``width = 8 // n`` consecutive elements on the ``n`` ranks (a power of two for
    ``n <= 8``; 4 elements at 2 ranks, 256 rows). One lookup then writes ``width`` elements of the
    average's numerator, where decoding and adding wrote and read the output about ``3 n - 1`` times. For at most 8
    ranks. With ``divisor`` the tables hold the sums divided by it (the average, with the bits of dividing the
    looked-up sums, without a pass over the output).
    """
    n = len(payloads)
    width = _group_width(n)
    out = ctx.output(out)
    is_set = _combination_bits(n, width, out.device)  # [combination, rank, element]
    positive = torch.stack([p for _, p, _ in payloads], dim=1)  # [layer, rank]
    negative = torch.stack([q for _, _, q in payloads], dim=1)
    values = torch.where(is_set, positive.view(-1, 1, n, 1), negative.view(-1, 1, n, 1))
    tables = values[:, :, 0] + 0.0
    for r in range(1, n):
        tables = tables + values[:, :, r]  # [layer, combination, element], summed in rank order
    if divisor != 1:
        tables = tables / divisor
    rows = _rank_codes([packed for packed, _, _ in payloads], width).int()

    def exact(positions: Tensor, layer: Tensor) -> Tensor:  # the tables' sums in the same order, element by element
        total = None
        for r, (packed, _, _) in enumerate(payloads):
            value = torch.where(
                _bits_at(packed, positions),
                positive[:, r].index_select(0, layer),
                negative[:, r].index_select(0, layer),
            )
            total = value + 0.0 if total is None else total + value
        assert total is not None
        return total / divisor if divisor != 1 else total

    return _layer_lookup(tables, rows, ctx, out, exact)


def _group_width(ranks: int) -> int:
    """Elements per lookup over 1 to 8 ranks' bits, all of them in one byte: ``8 // ranks`` (1, 2, 4 or 8)."""
    return 8 // ranks


def _look_up(table: Tensor, rows: Tensor, numel: int, target: Tensor) -> None:
    """The first ``numel`` elements of ``table[rows]`` (rows of ``width`` values, flattened) into ``target``."""
    width = table.shape[1]
    last = -(-numel // width)
    if numel % width == 0:  # whole groups: straight into the target
        lookup_rows(table, rows[:last], target.view(-1, width))
    else:  # the groups that cover the range, then its elements among them
        covering = lookup_rows(table, rows[:last], table.new_empty(last, width)).view(-1)
        target.copy_(covering[:numel])


class SignSGD(ShardedExchange):
    """signSGD with majority vote: every rank sends the sign of its gradient (1 bit), the update is the majority sign.

    Bernstein, Zhao, Azizzadenesheli & Anandkumar, "signSGD with Majority Vote is Communication Efficient and Fault
    Tolerant", ICLR 2019 (arXiv:1810.05291). Each rank sends ``sign(g)`` packed 8 per byte; the packed signs are
    all-gathered (a ring all-reduce of 1-bit values cannot carry their sum) and every rank takes the vote
    ``sign(sum_r sign(g_r))`` locally, in rank order, so every rank applies the same update. The "average" this
    compressor returns is that vote, in {-1, 0, +1} (0 on a tie, possible with an even number of ranks): the
    optimizer's learning rate is the step size of every coordinate, so it must be set for sign updates (typically
    100 to 1000 times smaller than for SGD), not reused from SGD.

    With ``momentum > 0`` it is Signum with majority vote: each rank keeps ``m <- momentum m + (1 - momentum) g`` per
    layer (local state, saved in :meth:`state_dict`) and sends ``sign(m)``.

    Every layer is signed, biases and normalisation weights too (as in the paper; sending a layer densely would give
    it a gradient-sized step instead of a sign step), so ``min_compress_numel`` does not apply. A zero coordinate
    votes +1 (one bit cannot encode 0). There is no error feedback: the vote is not an average of compressed
    gradients, so there is nothing to carry over, and forcing ``CompressedDDP(error_feedback=True)`` raises.

    While compression is off (a :class:`~lightning_gradcomp.callbacks.DenseWarmup`), the update is the sign of the
    exact average (of its Signum momentum), so the learning rate keeps its meaning of a per-coordinate step size.

    Payload per rank and step: ``ceil(d / 8)`` bytes for the ``d`` elements of a bucket.

    **Transport.** ``"allgather"``: every rank receives every rank's signs, ``(N - 1) d / 8`` bytes. ``"two_phase"``
    (:mod:`lightning_gradcomp.compressors.transports.two_phase`): each rank sends shard ``s`` of its signs to rank
    ``s``, which takes the exact vote of its shard (integer counts, any ``N``) and all-gathers it in 2 bits per element
    (a vote is -1, 0 or +1), ``(N - 1) / N * 3 d / 8`` bytes: the same vote, bitwise, and a flat 0.047 of a dense fp32
    ring all-reduce. The vote is re-encoded exactly, so there is no second error to account for. ``"auto"`` (the
    default): the two-phase exchange from 4 ranks on, where it moves fewer bytes.

    Args:
        momentum: Signum's momentum (0 gives signSGD), in [0, 1).
        transport: ``"auto"``, ``"allgather"`` or ``"two_phase"`` (above).

    Raises:
        ValueError: If ``momentum`` is not in [0, 1) or ``transport`` is unknown.

    Example::

        >>> from lightning_gradcomp.compressors import SignSGD
        >>> SignSGD(momentum=0.9)
        SignSGD(momentum=0.9, transport='auto')
    """

    collective: ClassVar[Collective] = "allgather"
    unbiased: ClassVar[bool] = False
    second_over_first: ClassVar[float] = 2.0  # 1 bit per sign up, 2 bits per vote down

    def __init__(self, momentum: float = 0.0, transport: str = "auto") -> None:
        super().__init__()
        self.momentum = check_momentum(momentum)
        self.transport = check_transport(transport)
        self._momenta = self.layer_state("momentum")  # Signum's m, per layer: this rank's own
        self._next_momenta = LayerBuffers()  # this step's m, staged until the step is known finite

    @property
    def default_error_feedback(self) -> bool:
        """Off: the majority vote has no error to feed back."""
        return False

    def check_error_feedback(self, enabled: bool | None) -> None:
        """Refuse error feedback: the majority vote is not an average of compressed gradients."""
        if self.resolve_error_feedback(enabled):
            raise ValueError(_NO_ERROR_FEEDBACK)

    def compresses(self, layer: Layer, min_numel: int) -> bool:
        """Every layer: each coordinate takes a sign step."""
        return True

    def compress(self, tensor: Tensor, ctx: BucketContext) -> Payload:
        """The signs of ``tensor``, packed 8 per byte (a zero counts as positive)."""
        return (pack_bits(above(tensor, 0, inclusive=True)),)

    def decompress(self, payload: Payload, ctx: BucketContext, out: Tensor | None = None) -> Tensor:
        """±1 per element."""
        ones = torch.ones(len(ctx.layers), dtype=ctx.dtype, device=ctx.device)
        return _signs_into(payload[0], ctx, ones, -ones, _out(ctx, out))

    def vote(self, payloads: list[Payload], ctx: BucketContext, out: Tensor | None = None) -> Tensor:
        """The majority sign, in {-1, 0, +1}, over every rank's packed signs.

        Up to 8 ranks, by one lookup per group of elements: the vote of an element depends only on its bits on every
        rank, so a table holds it for every combination of the ranks' bits of ``width`` consecutive elements (see
        :func:`_sum_of_signs`), and the output is written once; no per-element counts are formed.
        """
        n = len(payloads)
        if 0 < n <= 8:
            width = _group_width(n)
            counts = _combination_bits(n, width, ctx.device).sum(dim=1)  # [combination, element]: set bits
            table = (counts.to(ctx.dtype) * 2 - n).sign_()
            out = _out(ctx, out)
            _look_up(table, _rank_codes([bits for (bits,) in payloads], width).int(), ctx.numel, out)
            return out
        positives = torch.zeros(ctx.numel, dtype=torch.uint8 if n < 256 else torch.int32, device=ctx.device)
        for (bits,) in payloads:  # integer counts: exact in any order
            positives += unpack_bits(bits, ctx.numel)
        # count -> sign(2 count - n), by table lookup (one pass instead of an arithmetic chain); the table is made
        # on the device (a tensor built from a Python list would be a host-to-device copy: a sync on CUDA)
        table = (torch.arange(n + 1, dtype=ctx.dtype, device=ctx.device) * 2 - n).sign_()
        return torch.index_select(table, 0, positives.int(), out=_out(ctx, out))

    def accumulate(self, tensor: Tensor, ctx: BucketContext) -> Tensor:
        """Signum: ``m <- momentum m + (1 - momentum) g`` per layer, and ``m`` is what is signed."""
        if ctx.error_feedback:
            raise ValueError(_NO_ERROR_FEEDBACK)
        self._momentum_step(tensor, ctx)
        return tensor

    def _momentum_step(self, tensor: Tensor, ctx: BucketContext) -> None:
        if not self.momentum:
            return
        # the bucket at once: every layer's m is a view of one flat tensor (kept and saved per layer)
        m = self._momenta.flat(ctx.layers, tensor)
        new_m = self._next_momenta.flat(ctx.layers, tensor)  # reused every step: no allocation on the hook path
        torch.mul(tensor, 1.0 - self.momentum, out=new_m).add_(m, alpha=self.momentum)
        tensor.copy_(new_m)  # the new m is what is signed
        ctx.stage(m, new_m)  # copied at commit: a swap of storage would leave the layers' views behind

    def exchange(self, tensor: Tensor, ctx: BucketContext, out: Tensor) -> Exchange:
        """Signs all-gathered (or voted by shard owners); every rank holds the majority vote (nothing to declare)."""
        if self.two_phase(ctx):
            return (yield from self._two_phase_exchange(tensor, ctx, out))
        gathered = yield AllGather(self.compress(tensor, ctx))
        return self.vote(gathered, ctx, out=out)

    def reduce_shard(self, payloads: Sequence[Payload], ctx: BucketContext) -> Tensor:
        """The owner's exact majority vote of its shard."""
        return self.vote(list(payloads), ctx)

    def encode_shard(self, reduced: Tensor, ctx: BucketContext) -> Payload:
        """The vote in 2 bits per element (``vote + 1``: 0, 1 or 2), exact."""
        return (pack_uint(reduced.add(1).to(torch.uint8), 2),)

    def decode_shard(self, payload: Payload, ctx: BucketContext, out: Tensor) -> Tensor:
        """-1, 0 or +1 per element."""
        table = torch.arange(4, dtype=out.dtype, device=ctx.device).sub_(1)  # made on the device: no copy to it
        return lookup_uint(payload[0], 2, out.numel(), table, out)

    def finish_dense(self, average: Tensor, ctx: BucketContext) -> None:
        """Without compression: the sign of the exact average (of its momentum), a sign step all the same."""
        self._momentum_step(average, ctx)
        torch.sign(average, out=average)


class _TwoValuedSigns(ShardedExchange):
    """An all-gather compressor whose payload is packed bits and, per layer, a value for a set and for a clear bit.

    Its sum and average over up to 8 ranks are one table lookup per group of elements (:func:`_sum_of_signs`);
    subclasses say what each rank's two values are (:meth:`_signed`).

    Args:
        transport: ``"auto"`` (the default: the two-phase exchange from 3 ranks on, where it moves fewer bytes),
            ``"allgather"`` or ``"two_phase"`` (:mod:`lightning_gradcomp.compressors.transports.two_phase`: the shard
            owner averages, re-encodes with a scale per shard, and keeps the re-encoding's error when error feedback is
            on).

    Raises:
        ValueError: If ``transport`` is unknown.
    """

    def __init__(self, transport: str = "auto") -> None:
        super().__init__()
        self.transport = check_transport(transport)

    @staticmethod
    @abstractmethod
    def _signed(payloads: Sequence[Payload], ctx: BucketContext) -> list[tuple[Tensor, Tensor, Tensor]]:
        """Per rank: its packed bits and its per-layer values for a set and a clear bit, in the output's dtype."""

    def aggregate(self, payloads: Sequence[Payload], ctx: BucketContext, out: Tensor | None = None) -> Tensor:
        """The rank-order sum of the reconstructions, by one table lookup over every rank's bits (at most 8 ranks)."""
        if not payloads or len(payloads) > 8:
            return super().aggregate(payloads, ctx, out)
        return _sum_of_signs(self._signed(payloads, ctx), ctx, out)

    def average(self, payloads: Sequence[Payload], ctx: BucketContext, out: Tensor | None = None) -> Tensor:
        """The sum's tables divided by the world size: the bits of dividing the sum, one output pass fewer."""
        if not payloads or len(payloads) > 8:
            return super().average(payloads, ctx, out)
        return _sum_of_signs(self._signed(payloads, ctx), ctx, out, divisor=ctx.world_size)

    def nonfinite_witness(self, payload: Payload) -> Tensor:
        """The per-layer values, which the guard reads instead of the whole tensor.

        Each layer's are sums over all its elements (an L1 norm, and for 1-bit SGD a plain sum too), so a NaN or an
        infinity anywhere makes one of them non-finite.
        """
        return payload[1]


class EFSignSGD(_TwoValuedSigns):
    """EF-signSGD: scaled sign ``(||p||_1 / d) sign(p)`` per layer, with error feedback.

    Karimireddy, Rebjock, Stich & Jaggi, "Error Feedback Fixes SignSGD and other Gradient Compression Schemes", ICML
    2019 (arXiv:1901.09847). With error feedback, ``p = g + e``; each layer is sent as its signs (1 bit per element)
    and one fp32 scale, the mean absolute value of ``p``; ``e <- p - scale sign(p)``. Scales differ between ranks, so
    payloads are all-gathered and averaged. The paper puts the learning rate inside ``p = lr g + e``; here the
    optimizer applies it after averaging, which is the same for a constant learning rate (the compression is
    positively homogeneous) and keeps the residual in gradient units when the learning rate changes.

    Payload per layer of ``d`` elements: ``ceil(d / 8)`` bytes of signs (packed over the bucket) plus 4 bytes.

    Example::

        >>> from lightning_gradcomp.compressors import EFSignSGD
        >>> EFSignSGD()
        EFSignSGD(transport='auto')
    """

    collective: ClassVar[Collective] = "allgather"
    unbiased: ClassVar[bool] = False

    def compress(self, tensor: Tensor, ctx: BucketContext) -> Payload:
        """Packed signs and one fp32 scale (mean absolute value) per layer."""
        # mean |p| per layer, every layer's at once: rows that start at each layer's own start, so a layer's scale is
        # bitwise the same in any bucket (DDP rebuilds its buckets after the first step, and after a resume)
        segments = segments_of(ctx.layers, tensor.device)
        scales = segments.l1(tensor, _accumulator(ctx.dtype)) / segments.lengths
        return pack_bits(above(tensor, 0, inclusive=True)), scales.to(_WIRE_SCALE)

    def decompress(self, payload: Payload, ctx: BucketContext, out: Tensor | None = None) -> Tensor:
        """``scale * sign`` per layer."""
        packed, scales = payload
        scales = scales.to(ctx.dtype)
        return _signs_into(packed, ctx, scales, -scales, _out(ctx, out))

    @staticmethod
    def _signed(payloads: Sequence[Payload], ctx: BucketContext) -> list[tuple[Tensor, Tensor, Tensor]]:
        """Per rank: its packed bits and ``scale`` / ``-scale`` per layer, in the output's dtype."""
        signed = []
        for packed, scales in payloads:
            scales = scales.to(ctx.dtype)
            signed.append((packed, scales, -scales))
        return signed


class OneBit(_TwoValuedSigns):
    """1-bit SGD: one bit per element, reconstructed as the mean of the layer's positive or of its negative entries.

    Seide, Fu, Droppo, Li & Yu, "1-Bit Stochastic Gradient Descent and its Application to Data-Parallel Distributed
    Training of Speech DNNs", Interspeech 2014. With error feedback (``p = g + e``, which the paper introduced for
    this quantiser), every element is quantised at threshold 0 and reconstructed as the mean of the entries of its
    sign: ``mean(p[p >= 0])`` or ``mean(p[p < 0])``, two fp32 values per layer, chosen to minimise the squared error
    of the reconstruction given the signs; ``e <- p - reconstruction``. Payloads are all-gathered and averaged.

    The paper's CNTK implementation keeps the two values per *column* of each weight matrix; this implementation
    keeps them per layer (tensor), this package's choice (fewer scales on the wire); per-column reconstruction is not
    implemented.

    Payload per layer of ``d`` elements: ``ceil(d / 8)`` bytes of signs (packed over the bucket) plus 8 bytes.

    Example::

        >>> from lightning_gradcomp.compressors import OneBit
        >>> OneBit()
        OneBit(transport='auto')
    """

    collective: ClassVar[Collective] = "allgather"
    unbiased: ClassVar[bool] = False

    def compress(self, tensor: Tensor, ctx: BucketContext) -> Payload:
        """Packed signs and, per layer, the mean of its non-negative and of its negative entries (fp32)."""
        positive = above(tensor, 0, inclusive=True)
        acc = _accumulator(ctx.dtype)
        segments = segments_of(ctx.layers, tensor.device)
        # every layer's count (exact), sum and 1-norm at once, in rows aligned to each layer's start (a layer's values
        # do not depend on its bucket, see EFSignSGD); the sums of the positive and of the negative entries follow
        n_pos = segments.counts(positive)
        total = segments.sums(tensor, acc)
        magnitude = segments.l1(tensor, acc)
        # an empty group's mean is never used: clamping the count avoids 0 / 0
        positive_means = (magnitude + total) / 2 / n_pos.clamp(min=1)
        negative_means = (total - magnitude) / 2 / (segments.lengths - n_pos).clamp_(min=1)
        means = torch.stack([positive_means, negative_means], dim=1).view(-1)  # each layer's two side by side
        return pack_bits(positive), means.to(_WIRE_SCALE)

    def decompress(self, payload: Payload, ctx: BucketContext, out: Tensor | None = None) -> Tensor:
        """The positive mean where the bit is set, the negative mean elsewhere."""
        packed, means = payload
        means = means.to(ctx.dtype)
        return _signs_into(packed, ctx, means[0::2], means[1::2], _out(ctx, out))

    @staticmethod
    def _signed(payloads: Sequence[Payload], ctx: BucketContext) -> list[tuple[Tensor, Tensor, Tensor]]:
        """Per rank: its packed bits and its positive and negative means, in the output's dtype."""
        means = [(packed, m.to(ctx.dtype)) for packed, m in payloads]
        return [(packed, m[0::2], m[1::2]) for packed, m in means]
