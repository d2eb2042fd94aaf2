"""Unbiased stochastic quantisers: QSGD (levels per bucket norm) and TernGrad (ternary values, shared scaler)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, ClassVar, Literal

import numpy as np
import torch
from torch import Tensor

from lightning_gradcomp.compressors.base import BucketContext, Collective, Compressor, Layer, Payload
from lightning_gradcomp.compressors.ops.draws import uniform_draws
from lightning_gradcomp.compressors.ops.packing import (
    field_planes,
    field_width,
    lookup_uint,
    numpy_floats,
    pack_fields,
    pack_uint,
    packed_nbytes,
    signbit,
    unpack_fields,
    unpack_uint,
    words_needed,
)
from lightning_gradcomp.compressors.ops.segments import segments_of
from lightning_gradcomp.compressors.transports.two_phase import ShardedExchange, check_transport, exact_sum, shard_numel
from lightning_gradcomp.engine import wire
from lightning_gradcomp.engine.requests import AllGather, AllReduce, Exchange, SentValue
from lightning_gradcomp.validation import check_choice, check_int, check_number, check_positive_int

_WIRE = torch.float32  # norms and scalers travel as fp32
_MAX_LEVELS = 127  # the sign and the level share one byte at most


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """At least fp32 for norms and probabilities (half-precision sums of squares overflow)."""
    return torch.promote_types(dtype, torch.float32)


def _round_up_to_wire(values: Tensor) -> Tensor:
    """``values`` as fp32, rounded up where fp32 cannot hold them exactly (so ``|x| / scale <= 1`` still holds)."""
    wire = values.to(_WIRE)
    too_small = wire.to(values.dtype) < values
    return torch.where(too_small, torch.nextafter(wire, torch.full_like(wire, float("inf"))), wire)


_RANDOM_BITS = (None, 16)  # None: torch's uniform in the compute dtype (24 random bits in fp32, 53 in fp64)


def _squares(dtype: torch.dtype) -> Callable[[Tensor], Tensor]:
    """A row reduction: every row's sum of squares in ``dtype`` (the rows are a gathered copy: squared in place)."""
    return lambda rows: rows.to(dtype).square_().sum(dim=1)


def _sums(rows: Tensor) -> Tensor:
    return rows.sum(dim=1)


def _magnitudes(x: Tensor, out: Tensor) -> Tensor:
    """``x.abs().to(out.dtype)`` written into ``out`` (the same values: ``|x|`` and widening are exact)."""
    return torch.abs(x, out=out) if x.dtype == out.dtype else out.copy_(x).abs_()


def _look_up(table: Tensor, index: Tensor, out: Tensor) -> Tensor:
    """``table[index]`` written into ``out`` (converted to its dtype)."""
    if out.dtype == table.dtype:
        return torch.index_select(table, 0, index, out=out)
    return out.copy_(table.index_select(0, index))


def _check_random_bits(value: Any) -> int | None:
    """``None`` (torch's uniform draw in the compute dtype) or the integer 16."""
    if value is None or (type(value) is int and value in _RANDOM_BITS):
        return value
    raise ValueError(f"Expected `random_bits` to be None or 16, got {value!r}.")


def _clamp_(x: Tensor, bound: Tensor) -> None:
    """``x.clamp_(-bound, bound)`` elementwise in ``x``'s dtype (NumPy's ``clip`` on the CPU: the same values)."""
    bound = bound.to(x.dtype)
    if numpy_floats(x):
        limit = bound.numpy()
        np.clip(x.detach().numpy(), -limit, limit, out=x.detach().numpy())
    else:
        x.clamp_(-bound, bound)


def _check_levels(levels: Any) -> int:
    """Quantisation levels per sign: an integer in [1, 127]."""
    return check_int(levels, "levels", low=1, high=_MAX_LEVELS)


class QSGD(ShardedExchange):
    """QSGD: stochastic rounding of ``|x| / ||bucket||`` to ``levels`` levels; unbiased; norm, sign and level sent.

    Alistarh, Grubic, Li, Tomioka & Vojnovic, "QSGD: Communication-Efficient SGD via Gradient Quantization and
    Encoding", NIPS 2017 (arXiv:1610.02132). Each layer is cut into buckets of ``bucket_size`` consecutive elements
    (the last may be shorter; buckets never span layers, so results do not depend on DDP's bucketing). For a bucket
    ``v`` with ``s = levels``: ``Q(v_j) = ||v||_2 sign(v_j) xi_j / s``, where ``xi_j`` is ``l = floor(s |v_j| / ||v||)``
    or ``l + 1`` with probability ``s |v_j| / ||v|| - l``: ``E[Q(v)] = v``. The draws are different on every rank
    (independent quantisation noise averages out) and keyed by layer and step.

    Wire format: per bucket the norm in fp32 (rounded up to fp32 where needed, and the levels computed against that
    rounded norm, so the compressor stays exactly unbiased); per element a sign bit and the level in
    ``ceil(log2(levels + 1))`` bits, packed. The paper additionally Elias-codes the levels (variable length); this
    implementation sends fixed-width fields, so payload sizes depend only on the layout. Norms differ between ranks,
    so payloads are all-gathered and averaged.

    Payload per layer of ``d`` elements: ``4 ceil(d / bucket_size) + ceil(d (ceil(log2(levels + 1)) + 1) / 8)`` bytes.

    Args:
        levels: quantisation levels ``s`` per sign, in [1, 127] (7: 4 bits per element with the sign).
        bucket_size: elements per norm. The paper's experiments use buckets of a few hundred elements and 2 to 8 bits
            [recall: the exact settings could not be checked]; both are configurable.
        random_bits: random bits in each element's uniform draw ``u``. ``None`` (the default): torch's uniform in
            the compute dtype, 24 bits in fp32, so the probability of rounding up is resolved to ``2^-24``. ``16``:
            ``u = (r + 1/2) 2^-16`` for a uniform 16-bit ``r``, about 3x cheaper to draw on the CPU (the draw is
            most of QSGD's encoding there); the expectation is then off by at most ``2^-17`` of a level per element.
            Our design, not the paper's (which assumes exact draws); what is sent differs from the default's.
        transport: ``"allgather"`` (every rank receives every rank's payload: ``(N - 1) P`` bytes),
            ``"two_phase"`` (:mod:`lightning_gradcomp.compressors.transports.two_phase`: shard ``s`` of every rank's
            payload to rank ``s``, which averages it in fp32 and re-quantizes it, unbiased, for an all-gather:
            ``2 (N - 1) / N P`` bytes, flat in ``N``) or ``"auto"`` (the default: the two-phase exchange from 3
            ranks on, where it moves fewer bytes). With the two-phase exchange the norm buckets are cut at shard
            boundaries, and per-layer levels are refused.

    Raises:
        ValueError: If ``levels``, ``bucket_size``, ``random_bits`` or ``transport`` is out of range.

    Example::

        >>> from lightning_gradcomp.compressors import QSGD
        >>> QSGD(levels=7, bucket_size=512)
        QSGD(levels=7, bucket_size=512, random_bits=None, transport='auto')
    """

    collective: ClassVar[Collective] = "allgather"
    unbiased: ClassVar[bool] = True
    level_attribute: ClassVar[str] = "levels"

    def __init__(
        self, levels: int = 7, bucket_size: int = 512, random_bits: int | None = None, transport: str = "auto"
    ) -> None:
        super().__init__()
        self.levels = _check_levels(levels)
        self.bucket_size = check_positive_int(bucket_size, "bucket_size")
        self.random_bits = _check_random_bits(random_bits)
        self.transport = check_transport(transport)

    def check_level(self, value: Any) -> int:
        """Levels: an integer in [1, 127]."""
        return _check_levels(value)

    def _buckets(self, layer: Layer) -> int:
        return -(-layer.numel // self.bucket_size)

    def error_feedback_growth(self, enabled: bool | None) -> str | None:
        """A reason when QSGD's error bound is not below 1 (3.2 at the defaults; the paper has no error feedback).

        The bound is Lemma 3.1's ``min(d / s^2, sqrt(d) / s)`` for buckets of ``d`` elements and ``s`` levels, the
        fewest any layer is set to.
        """
        levels = min([self.levels, *self.layer_levels.values()])
        bound = min(self.bucket_size / levels**2, math.sqrt(self.bucket_size) / levels)
        if bound < 1 or not self.resolve_error_feedback(enabled):
            return None
        return (
            f"its squared error may reach {bound:.3g} times the input's squared norm (QSGD's Lemma 3.1 bound"
            f" min(d / s^2, sqrt(d) / s), for buckets of d = {self.bucket_size} elements and s = {levels} levels);"
            " more levels or smaller buckets bring it below 1"
        )

    def _per_bucket_(self, values: Tensor, factors: Tensor) -> Tensor:
        """Multiply each bucket of ``values`` (one layer) by its factor, in place, on 2-D views (no expansion)."""
        full = values.numel() // self.bucket_size * self.bucket_size
        if full:
            values[:full].view(-1, self.bucket_size).mul_(factors[: full // self.bucket_size].unsqueeze(1))
        if full < values.numel():
            values[full:].mul_(factors[-1])
        return values

    def compress(self, tensor: Tensor, ctx: BucketContext) -> Payload:
        """Bucket norms (fp32) and the packed sign and level of every element.

        Every layer's norm buckets, draws and levels at once (a fixed number of operators per bucket); with per-layer
        levels, the levels and their packing layer by layer.
        """
        dtype = _compute_dtype(ctx.dtype)
        draws = uniform_draws(ctx, dtype, self.random_bits)
        if self.layer_levels:
            return self._compress_layers(tensor, ctx, draws)
        s, bits = self.levels, self.levels.bit_length()
        blocks, lengths = segments_of(ctx.layers, ctx.device).block_rows(self.bucket_size)
        wire = _round_up_to_wire(blocks.reduce(tensor, _squares(dtype), _sums).sqrt_())
        norm = wire.to(dtype)
        scale = torch.where(norm > 0, s / norm, 0)  # levels per unit of |x|; an all-zero bucket stays 0
        # floor(s |x| / norm + u) is l + 1 with probability s |x| / norm - l: the stochastic rounding
        ratio = _magnitudes(tensor, torch.empty(ctx.numel, dtype=dtype, device=ctx.device))
        ratio.mul_(torch.repeat_interleave(scale, lengths, output_size=ctx.numel)).add_(draws)
        level = ratio.to(torch.uint8).clamp_(max=s)  # truncation is floor here; the clamp guards rounding
        fields = (signbit(tensor).view(torch.uint8) << bits).bitwise_or_(level)  # the sign is the top bit
        return wire, pack_uint(fields, bits + 1)

    def _compress_layers(self, tensor: Tensor, ctx: BucketContext, draws: Tensor) -> Payload:
        """:meth:`compress` layer by layer, each at its own levels, packed on its own."""
        dtype = _compute_dtype(ctx.dtype)
        norms, packed = [], []
        magnitudes = torch.empty(ctx.numel, dtype=dtype, device=ctx.device)
        for layer in ctx.layers:
            s = self.level(layer)
            bits = s.bit_length()
            x = layer.flat(tensor)
            full = layer.numel // self.bucket_size * self.bucket_size
            bucket_norms = [torch.linalg.vector_norm(x[:full].view(-1, self.bucket_size), dim=1, dtype=dtype)]
            if full < layer.numel:
                bucket_norms.append(torch.linalg.vector_norm(x[full:], dtype=dtype).unsqueeze(0))
            wire = _round_up_to_wire(torch.cat(bucket_norms))
            norm = wire.to(dtype)
            scale = torch.where(norm > 0, s / norm, 0)
            ratio = self._per_bucket_(_magnitudes(x, layer.flat(magnitudes)), scale)
            ratio += layer.flat(draws)
            level = ratio.to(torch.uint8).clamp_(max=s)
            fields = (signbit(x).view(torch.uint8) << bits).bitwise_or_(level)
            norms.append(wire)
            packed.append(pack_uint(fields, bits + 1))
        return torch.cat(norms), torch.cat(packed)

    def nonfinite_witness(self, payload: Payload) -> Tensor:
        """The bucket norms, which the guard reads instead of the input.

        Every element is in one bucket, whose L2 norm a NaN or an infinity makes non-finite. So does a finite bucket
        whose squared norm overflows (an element above about ``1.8e19`` in fp32): its norm, and every level and
        decoded value of the bucket, could not be sent, and with error feedback the residual would keep the NaN.
        """
        return payload[0]

    def decompress(self, payload: Payload, ctx: BucketContext, out: Tensor | None = None) -> Tensor:
        """``norm * sign * level / levels`` for every element."""
        norms, packed = payload
        dtype = _compute_dtype(ctx.dtype)
        out = ctx.output(out)
        if self.layer_levels:
            return self._decompress_layers(norms, packed, ctx, out)
        s, bits = self.levels, self.levels.bit_length()
        levels = torch.arange(1 << bits, dtype=dtype, device=ctx.device)
        target = out if out.dtype == dtype else torch.empty(ctx.numel, dtype=dtype, device=out.device)
        lookup_uint(packed, bits + 1, ctx.numel, torch.cat([levels, -levels]), target)
        _, lengths = segments_of(ctx.layers, ctx.device).block_rows(self.bucket_size)
        target.mul_(torch.repeat_interleave(norms.to(dtype) / s, lengths, output_size=ctx.numel))
        return out if target is out else out.copy_(target)

    def _decompress_layers(self, norms: Tensor, packed: Tensor, ctx: BucketContext, out: Tensor) -> Tensor:
        """:meth:`decompress` layer by layer (per-layer levels)."""
        dtype = _compute_dtype(ctx.dtype)
        norm_at = byte_at = 0
        tables: dict[int, Tensor] = {}  # field -> signed level (the sign is the top bit), one table per field width
        for layer in ctx.layers:
            s = self.level(layer)
            bits = s.bit_length()
            nbytes = packed_nbytes(layer.numel, bits + 1)
            table = tables.get(bits)
            if table is None:
                levels = torch.arange(1 << bits, dtype=dtype, device=ctx.device)
                table = tables[bits] = torch.cat([levels, -levels])
            target = layer.flat(out) if out.dtype == dtype else torch.empty(layer.numel, dtype=dtype, device=out.device)
            lookup_uint(packed[byte_at : byte_at + nbytes], bits + 1, layer.numel, table, target)
            nb = self._buckets(layer)
            self._per_bucket_(target, norms[norm_at : norm_at + nb].to(dtype) / s)
            if target is not layer.flat(out):
                layer.flat(out).copy_(target)
            norm_at += nb
            byte_at += nbytes
        return out


class TernGrad(Compressor):
    """TernGrad: per-layer gradient clipping, a scaler shared by all ranks, stochastic ternarisation, exact integer sum.

    Wen, Xu, Yan, Wu, Wang, Chen & Li, "TernGrad: Ternary Gradients to Reduce Communication in Distributed Deep
    Learning", NIPS 2017 (arXiv:1705.07878). Per layer and rank, following the authors' code:

    1. clip: ``g <- clamp(g, -c sigma, c sigma)`` with ``sigma`` the layer's (population) standard deviation and
       ``c = clip`` (2.5); the rank's scaler is ``c sigma`` (``max |g|`` when ``clip=None``);
    2. scaler sharing: ``s = max over ranks`` (one max all-reduce of one fp32 scaler per layer: round 0);
    3. ``t_j = sign(g_j) b_j`` with ``b_j ~ Bernoulli(|g_j| / s)``, drawn differently on every rank, so
       ``E[s t] = g`` (the clipped gradient);
    4. the ternaries of all ranks are summed exactly in the integer domain (round 1) and the average is
       ``s sum_r t_r / n``.

    How the integers travel (``aggregation``): a 2-bit field per value, as the paper's encoder packs them, cannot hold a
    sum of ``n`` ternaries, so with ``"allreduce"`` each value is offset to {0, 1, 2} at the source and
    packed into int64 words with fields of ``ceil(log2(2 n + 1))`` bits (3 bits for 2 ranks, 4 up to 7 ranks), 63 bits
    used per word: a SUM all-reduce of the words sums every field without carries. The values are 2-bit at the
    source and sum-safe on the wire: ``8 ceil(d / floor(63 / w))`` bytes per rank. With ``"allgather"`` every rank
    sends the paper's 2-bit packing (``ceil(d / 4)`` bytes) and every rank sums the gathered values: fewer bytes per
    rank, but each rank receives ``n - 1`` payloads, while the all-reduce's traffic stays bounded as ``n`` grows.
    With ``"two_phase"`` (:func:`~lightning_gradcomp.compressors.transports.two_phase.exact_sum`) each rank sends shard
    ``s`` of its 2-bit values to rank ``s``, which sums them exactly and all-gathers the sums in ``ceil(log2(2 n + 1))``
    bits: ``(n - 1) / n d (2 + ceil(log2(2 n + 1))) / 8`` bytes per rank, 0.156 of a dense fp32 ring all-reduce at 64
    ranks where the all-reduce's words are 0.28 and the all-gather's 0.98. ``"auto"`` (the default) takes whichever
    of the three moves the fewest bytes per rank at the world size (the all-gather at 2 ranks, the two-phase exchange
    from 3 on). Whichever way, the sums are exact: the result is bitwise the same.

    Unbiased for the clipped gradient; with ``clip=None`` unbiased for the gradient itself (``unbiased`` is then
    ``True``). Error feedback is off by default (the paper has none) even though clipping adds a small bias.

    Payload per rank and step, for a bucket of ``L`` layers and ``d`` elements: ``4 L`` bytes of scalers, plus the
    ternaries as above (``"allgather"`` pads the scalers and the packed values to whole 8-byte words).

    Args:
        clip: the clipping factor ``c`` in standard deviations, or ``None`` for no clipping (scaler ``max |g|``).
        aggregation: ``"allreduce"`` (sum-safe words), ``"allgather"`` (2-bit values, summed after gathering),
            ``"two_phase"`` (2-bit shards to their owners, exact sums gathered) or ``"auto"`` (the fewest bytes).
        random_bits: random bits in each element's uniform draw ``u`` (``b_j`` is 1 where ``u s < |g_j|``).
            ``None`` (the default): 24 random bits in fp32 (:mod:`~lightning_gradcomp.compressors.ops.draws`). ``16``:
            ``u = (r + 1/2) 2^-16`` for a uniform 16-bit ``r``; the keep probability is then off by at most
            ``2^-17`` per element. Our design, not the paper's; what is sent differs from the default's.

    Raises:
        ValueError: If ``clip`` is not a positive number or ``None``, ``aggregation`` is unknown, or ``random_bits``
            is neither ``None`` nor 16.

    Example::

        >>> from lightning_gradcomp.compressors import TernGrad
        >>> TernGrad()
        TernGrad(clip=2.5, aggregation='auto', random_bits=None)
    """

    def __init__(
        self,
        clip: float | None = 2.5,
        aggregation: Literal["allreduce", "allgather", "two_phase", "auto"] = "auto",
        random_bits: int | None = None,
    ) -> None:
        super().__init__()
        self.clip = check_number(clip, "clip", low=0.0, low_open=True, allow_none=True)
        self.aggregation = check_choice(aggregation, "aggregation", ("allreduce", "allgather", "two_phase", "auto"))
        self.random_bits = _check_random_bits(random_bits)

    @property
    def collective(self) -> Collective:
        """How the ternaries travel: summed (``"allreduce"``) or gathered (the others)."""
        return "allreduce" if self.aggregation == "allreduce" else "allgather"

    @property
    def rounds(self) -> int:
        """The scalers' maximum, then the ternaries: in one round, or two for the two-phase exchange."""
        return 3 if self.aggregation in ("two_phase", "auto") else 2

    def mode(self, numel: int, world_size: int) -> str:
        """How ``numel`` ternaries travel at ``world_size``: ``aggregation``, or for ``"auto"`` the fewest bytes.

        Bytes a rank sends: the all-reduce's words ``2 (n - 1) / n B``, the all-gather's ``(n - 1) B_2``, the
        two-phase exchange's ``(n - 1) / n (B_2 + B_sums)`` (ties in that order). Decided on the host.
        """
        if self.aggregation != "auto":
            return self.aggregation
        if world_size < 2:
            return "allreduce"
        n = world_size
        size = -(-shard_numel(numel, n) // 8) * 8  # exact_sum's shards: whole bytes
        costs = {
            "allreduce": wire.all_reduce(8 * words_needed(numel, field_width(2 * n)), n).sent,
            "allgather": wire.all_gather(-(-packed_nbytes(numel, 2) // 8) * 8, n).sent,
            "two_phase": (n - 1) / n * n * size * (2 + field_width(2 * n)) / 8,
        }
        return min(costs, key=lambda name: costs[name])

    def error_feedback_growth(self, enabled: bool | None) -> str | None:
        """A reason whenever error feedback is on (the paper has none).

        Ternarisation with the scaler ``s`` errs by ``s ||x||_1 - ||x||^2`` in expectation: about ``||x||^2`` for
        Gaussian values at the default clipping (``s = 2.5 sigma``), more without clipping (``s = max |x|``) or when
        another rank's larger scaler is shared.
        """
        if not self.resolve_error_feedback(enabled):
            return None
        return (
            "ternarisation with the shared scaler s has a squared error of s ||x||_1 - ||x||^2 in expectation: about"
            " the input's squared norm for Gaussian values at the default clipping, more without it"
        )

    @property
    def unbiased(self) -> bool:
        """Unbiased for the gradient itself only without clipping (always unbiased for the clipped gradient)."""
        return self.clip is None

    @property
    def default_error_feedback(self) -> bool:
        """Off, as in the paper."""
        return False

    # ------------------------------------------------------------------------------------------------------------
    # The steps
    # ------------------------------------------------------------------------------------------------------------
    def _clip_and_scale(self, tensor: Tensor, ctx: BucketContext, inplace: bool) -> tuple[Tensor, Tensor]:
        """Clip every layer at ``clip`` standard deviations; return the (clipped) tensor and each layer's scaler.

        Every layer's at once: its mean and its mean squared deviation from it (the population variance, two
        passes; the squares summed in fp64) as segmented sums in rows aligned to the layer's start (a layer's
        scaler does not depend on its bucket), its bound expanded to its elements for one clamp of the bucket.
        """
        if not inplace:
            tensor = tensor.clone()
        dtype = _compute_dtype(ctx.dtype)
        if not ctx.layers:
            return tensor, torch.zeros(0, dtype=_WIRE)
        segments = segments_of(ctx.layers, ctx.device)
        if self.clip is None:  # max |g| per layer
            return tensor, _round_up_to_wire(segments.max_magnitudes(tensor, dtype))
        values = tensor.to(dtype)
        means = segments.sums(values, dtype) / segments.lengths
        deviations = torch.sub(values, segments.expand(means))
        # squares summed in fp64: a finite fp32 value above 1.8e19 has no fp32 square (the deviation from the mean
        # does not overflow; its square would)
        squares = segments.rows.reduce(deviations, _squares(torch.float64), _sums)
        bounds = (self.clip * (squares / segments.lengths).sqrt_()).to(dtype)
        _clamp_(tensor, segments.expand(bounds))
        return tensor, _round_up_to_wire(bounds)

    def _ternarize(self, tensor: Tensor, scales: Tensor, ctx: BucketContext) -> Tensor:
        """``t + 1`` in {0, 1, 2} (uint8) for every element, ``t = sign(g) Bernoulli(|g| / s)``, the bucket at once."""
        dtype = _compute_dtype(ctx.dtype)
        out = torch.empty(ctx.numel, dtype=torch.uint8, device=ctx.device)
        draws = uniform_draws(ctx, dtype, self.random_bits)
        draws.mul_(
            segments_of(ctx.layers, ctx.device).expand(scales[: len(ctx.layers)].to(device=ctx.device, dtype=dtype))
        )
        if numpy_floats(tensor, draws):
            # with d = u s >= 0 (or NaN): kept and positive is x > d, kept and negative is x < -d, so
            # t + 1 = 1 + [x > d] - [x < -d]: two NumPy comparisons and two byte passes, no |x|
            values, bound, offset = tensor.detach().numpy(), draws.numpy(), out.numpy()
            np.add(np.greater(values, bound).view(np.uint8), 1, out=offset)
            np.subtract(offset, np.less(values, np.negative(bound, out=bound)).view(np.uint8), out=offset)
            return out
        keep = draws < tensor.abs()  # probability |g| / s (never where s = 0)
        # kept and positive: 2 (t = +1); kept and negative: 0 (t = -1); not kept: 1 (t = 0). Bit operations on
        # bytes: several times faster than nested `where` on the CPU
        positive = (keep & (tensor > 0)).view(torch.uint8)
        return torch.bitwise_or(positive << 1, (~keep).view(torch.uint8), out=out)

    def _wire(self, offset_values: Tensor, world_size: int, mode: str | None = None) -> Tensor:
        if (mode or self.collective) == "allreduce":
            return pack_fields(offset_values, field_width(2 * world_size))
        packed = pack_uint(offset_values, 2)
        return torch.nn.functional.pad(packed, (0, -packed.numel() % 8))  # whole 8-byte words, counted as sent

    def _offset_sum(self, wire: Tensor, ctx: BucketContext, mode: str | None = None) -> Tensor:
        """``sum_r (t_r + 1)`` per element from summed words, or ``t + 1`` from one 2-bit payload."""
        if (mode or self.collective) == "allreduce":
            return unpack_fields(wire, field_width(2 * ctx.world_size), ctx.numel)
        return unpack_uint(wire, 2, ctx.numel)

    def _scaled(self, offset_sum: Tensor, scales: Tensor, ctx: BucketContext, count: int, out: Tensor) -> Tensor:
        """``s (offset_sum - count) / count`` per layer (the average of ``count`` ranks' ``s t``), by table lookup."""
        index = offset_sum.int().add_(self._table_rows(ctx, count, out.device))
        return _look_up(self._tables(scales, ctx, count, out.device), index, out)

    def _table_rows(self, ctx: BucketContext, count: int, device: torch.device) -> Tensor:
        """Where every element's layer's table starts in :meth:`_tables`' flat tables (int32)."""
        segments = segments_of(ctx.layers, device)
        first = torch.arange(len(ctx.layers), dtype=torch.int32, device=device) * (2 * count + 1)
        return segments.expand(first)

    def _tables(self, scales: Tensor, ctx: BucketContext, count: int, device: torch.device) -> Tensor:
        """Every layer's ``2 count + 1`` values ``s (k - count) / count``, one after the other (flat).

        ``k`` ranks' ``s t`` sum to ``s (k - count)``: their average is the product of the scaler and a fixed table.
        """
        dtype = _compute_dtype(ctx.dtype)
        ternary_sums = torch.arange(-count, count + 1, dtype=dtype, device=device) / count
        return (scales[: len(ctx.layers)].to(device=device, dtype=dtype).unsqueeze(1) * ternary_sums).view(-1)

    def _scaled_words(self, summed: Tensor, scales: Tensor, ctx: BucketContext, out: Tensor) -> Tensor:
        """:meth:`_scaled` of the average of all ranks, read plane by plane from the summed words.

        Each plane of the words holds consecutive elements (:func:`~lightning_gradcomp.compressors.ops.packing.
        field_planes`); each is looked up in the tables of its elements' layers as it is unpacked, so no
        element-sized integer array of the sums is ever written.
        """
        count = ctx.world_size
        tables = self._tables(scales, ctx, count, out.device)
        rows = self._table_rows(ctx, count, out.device)
        for start, plane in field_planes(summed, field_width(2 * count), ctx.numel):
            end = start + plane.numel()
            _look_up(tables, torch.add(rows[start:end], plane), out[start:end])
        return out

    def _pad_scales(self, scales: Tensor) -> Tensor:
        # all-gather mode: whole 8-byte words, so that what the contract counts is what moves
        return scales if self.aggregation == "allreduce" else torch.nn.functional.pad(scales, (0, scales.numel() % 2))

    # ------------------------------------------------------------------------------------------------------------
    # The contract (one rank on its own: its local scaler)
    # ------------------------------------------------------------------------------------------------------------
    def compress(self, tensor: Tensor, ctx: BucketContext) -> Payload:
        """This rank alone: scalers (fp32) and its ternaries on the wire (``tensor`` is not modified)."""
        clipped, scales = self._clip_and_scale(tensor, ctx, inplace=False)
        return self._pad_scales(scales), self._wire(self._ternarize(clipped, scales, ctx), ctx.world_size)

    def decompress(self, payload: Payload, ctx: BucketContext, out: Tensor | None = None) -> Tensor:
        """``s t`` for one payload."""
        scales, wire = payload
        out = ctx.output(out)
        return self._scaled(self._offset_sum(wire, ctx), scales, ctx, 1, out)

    # ------------------------------------------------------------------------------------------------------------
    # The reduction: max of the scalers, then the exact sum of the ternaries
    # ------------------------------------------------------------------------------------------------------------
    @property
    def keeps_input(self) -> bool:
        """Yes: the tensor is only read (clipped into ``out``); what is owed is measured from the unclipped tensor."""
        return True

    def exchange(self, tensor: Tensor, ctx: BucketContext, out: Tensor) -> Exchange:
        """Round 0: max all-reduce of the scalers. Round 1: ternarise with them; sum the ternaries exactly."""
        # clipped in place in the output buffer (a copy of the tensor first, when it is another buffer)
        source = tensor if self.clip is None or tensor is out else out.copy_(tensor)
        _, scales = self._clip_and_scale(source, ctx, inplace=True)
        (shared,) = yield AllReduce((self._pad_scales(scales),), op="max")
        offset = self._ternarize(source, shared, ctx)
        if ctx.error_feedback:  # what this rank's own ternaries carried
            yield SentValue(self._scaled(offset, shared, ctx, 1, torch.empty_like(tensor)))
        mode = self.mode(ctx.numel, ctx.world_size)
        if mode == "two_phase":
            total = yield from exact_sum(offset, 2, ctx)
            return self._scaled(total, shared, ctx, ctx.world_size, out)
        words = self._wire(offset, ctx.world_size, mode)
        if mode == "allreduce":
            (summed,) = yield AllReduce((words,))
            return self._scaled_words(summed, shared, ctx, out)
        gathered = yield AllGather((words,))
        total = torch.zeros(ctx.numel, dtype=torch.int32, device=ctx.device)  # integer sums: exact in any order
        for (rank_wire,) in gathered:
            total += self._offset_sum(rank_wire, ctx, mode)
        return self._scaled(total, shared, ctx, ctx.world_size, out)

    def words(self, numel: int, world_size: int) -> int:
        """Bytes of ternaries one rank sends for ``numel`` elements (for byte accounting and docs)."""
        if self.aggregation == "allreduce":
            return 8 * words_needed(numel, field_width(2 * world_size))
        return -(-packed_nbytes(numel, 2) // 8) * 8
