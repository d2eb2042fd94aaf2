"""AdaComp: adaptive residual gradient compression with per-layer local bins (a data-dependent number per bin)."""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import torch
from torch import Tensor

from lightning_gradcomp.compressors.base import (
    BucketContext,
    Collective,
    Compressor,
    Layer,
    LayerBuffers,
    Payload,
)
from lightning_gradcomp.compressors.ops.adacomp_bins import bin_plan
from lightning_gradcomp.compressors.ops.packing import flat_nonzero, numpy_floats
from lightning_gradcomp.compressors.ops.segments import segments_of
from lightning_gradcomp.compressors.transports.adacomp_shards import (
    ShardPlan,
    owner_context,
    residual_key,
    shard_plan,
    shard_scales,
)
from lightning_gradcomp.compressors.transports.hashed_sum import SparseTransport, sparse_transport_sum
from lightning_gradcomp.compressors.transports.two_phase import uses_two_phase
from lightning_gradcomp.engine.requests import AllGather, AllToAll, Exchange, SentValue
from lightning_gradcomp.validation import check_choice, check_positive_int

_WIRE = torch.float32
#: the all-gather, Zen, the two-phase exchange, and the one of the all-gather and the two-phase exchange that moves
#: fewer bytes
ADACOMP_TRANSPORTS = ("allgather", "zen", "auto", "two_phase")


def _at_least(values: Tensor, bounds: Tensor, out: Tensor) -> None:
    """``out = values >= bounds`` (broadcast), through NumPy on the CPU: the same mask at a third of torch's time."""
    if numpy_floats(values, bounds):
        np.greater_equal(values.numpy(), bounds.numpy(), out=out.numpy())
    else:
        torch.ge(values, bounds, out=out)


_TRITS_PER_BYTE = 5  # 3^5 = 243 codes fit a byte: 1.6 bits per element
_TABLES: dict[str, Tensor] = {}


def _sign_table(dtype: torch.dtype, device: torch.device) -> Tensor:
    """``[0, -1, 1]``: each code's sign, kept per dtype and device (no copy from the host on every step)."""
    key = f"signs {dtype} {device}"
    table = _TABLES.get(key)
    if table is None:
        table = _TABLES[key] = torch.tensor([0.0, -1.0, 1.0], dtype=dtype).to(device)
    return table


def pack_trits(codes: Tensor) -> Tensor:
    """Pack codes in {0, 1, 2} (uint8) five to a byte, ``c0 + 3 c1 + 9 c2 + 27 c3 + 81 c4``: ``ceil(n / 5)`` bytes."""
    n = codes.numel()
    rows = torch.nn.functional.pad(codes, (0, -n % _TRITS_PER_BYTE)).view(-1, _TRITS_PER_BYTE)
    packed = rows[:, 4].clone()
    for j in (3, 2, 1, 0):  # Horner; every intermediate stays below 243
        packed.mul_(3).add_(rows[:, j])
    return packed


def unpack_trits(packed: Tensor, n: int) -> Tensor:
    """The first ``n`` codes of :func:`pack_trits` (uint8), by a table of every byte's five digits."""
    key = str(packed.device)
    table = _TABLES.get(key)
    if table is None:
        values = torch.arange(243)
        digits = torch.stack([values // 3**j % 3 for j in range(_TRITS_PER_BYTE)], dim=1)
        table = _TABLES[key] = digits.to(torch.uint8).to(packed.device)
    return table.index_select(0, packed.long()).view(-1)[:n]


class AdaComp(SparseTransport, Compressor):
    """AdaComp: in every bin of a layer, send the elements whose residue-plus-gradient beats the bin's largest residue.

    Chen, Choi, Brand, Agrawal, Zhang & Gopalakrishnan, "AdaComp: Adaptive Residual Gradient Compression for
    Data-Parallel Distributed Training", AAAI 2018 (arXiv:1712.02679); the steps follow an MXNet operator that
    implements the paper's algorithm. Per rank and layer, with residue ``R`` (the hook's error-feedback memory) and
    latest gradient ``dW``:

    1. ``G = R + dW`` and ``H = G + dW`` (the "soft threshold": a large *latest* gradient that agrees with the
       residue is favoured);
    2. the layer is cut into bins of ``L`` consecutive elements (the last may be shorter): ``L = bin_size_conv``
       (50) for convolutions (>= 3-D weights), ``bin_size_fc`` (500) for fully-connected and recurrent weights
       (2-D); ``gmax[b] = max |G|`` over bin ``b``;
    3. element ``j`` is sent iff ``|H_j| >= gmax[bin(j)]``, the number sent adapting to each bin (an all-zero bin,
       whose maximum 0 would select all of it, sends nothing: this package's guard, which the operator lacks);
    4. the layer's scale is ``mean_b gmax[b]``; a sent element is ``+scale`` if ``G_j > 0``, else ``-scale`` (a sign
       each, one fp32 scale per layer, as the operator sends it); the residue becomes ``G - sent``.

    What was verified: the selection rule, the soft threshold and the sign-and-scale encoding follow the MXNet
    operator line by line. What was not: the 50/500 bin lengths are remembered from the paper, not re-checked against
    its text; the mean of the bin maxima as the scale is the operator's choice (the paper's own statistic could not be
    read); which layers the paper exempts could not be checked either, so by default 1-D tensors and small layers go
    dense, as for every compressor. Only the bin lengths are configurable.

    The wire format is fixed-size, whatever is selected: every element's code (not sent, ``-scale``, ``+scale``)
    packed five to a byte (``3^5 = 243`` codes fit a byte: 1.6 bits per element) and one fp32 scale per layer, in one
    all-gather. So nothing is read on the host (no sizes to exchange) and the payload does not depend on the data; a
    rank selecting more than about 5 % of a layer would have sent more as an int32 list, one selecting less, fewer.
    Without error feedback there is no residue (``G = dW``).

    ``transport="two_phase"`` keeps the bytes per rank flat in the number of ranks (docs/two_phase.md): every rank
    selects over its layers as above, then sends shard ``s`` of its codes, with every layer's scale, to rank ``s``
    (all-to-all); the owner averages its shard of every rank in fp32, adds what it still owes, and re-encodes it with
    the same rule, the pieces of layers in its shard binned as their layers are (bins cut at the shard's edges,
    ``H = 2 G``: the owner has no latest gradient); the owners' codes are all-gathered. With error feedback the owner
    keeps its re-encoding's error and sends it at the next step (its state). ``"auto"`` (by the bytes: both
    encodings cost the same) is the all-gather at 2 ranks and the two-phase exchange from 3.

    Args:
        bin_size_conv: bin length for convolution weights (>= 3-D).
        bin_size_fc: bin length for fully-connected and recurrent weights (2-D).
        transport: ``"allgather"`` (above), ``"two_phase"``, ``"auto"`` (the default: the one of the two that moves
            fewer bytes) or ``"zen"`` (the selected ``sign * scale`` values as pairs summed by Zen, docs/zen.md; it
            reads sizes on the host). The selection and the residue are the same.

    Raises:
        ValueError: If a bin length is not a positive integer or ``transport`` is unknown.

    Example::

        >>> from lightning_gradcomp.compressors import AdaComp
        >>> AdaComp()
        AdaComp(bin_size_conv=50, bin_size_fc=500, transport='auto')
    """

    collective: ClassVar[Collective] = "allgather"
    unbiased: ClassVar[bool] = False

    def __init__(self, bin_size_conv: int = 50, bin_size_fc: int = 500, transport: str = "auto") -> None:
        super().__init__()
        self.bin_size_conv = check_positive_int(bin_size_conv, "bin_size_conv")
        self.bin_size_fc = check_positive_int(bin_size_fc, "bin_size_fc")
        self.transport = check_choice(transport, "transport", ADACOMP_TRANSPORTS)
        self.layer_state("owner_residual")  # the two-phase owner's (declared: a checkpoint's loads into a fresh one)
        self._next_owner_residual = LayerBuffers()  # staged, swapped in at commit

    @property
    def rounds(self) -> int:
        """Two for the two-phase exchange (all-to-all, all-gather); else the all-gather's one or Zen's four."""
        return 2 if self.transport in ("two_phase", "auto") else super().rounds

    @property
    def exchanges_sizes(self) -> bool:
        """Over Zen only: every other exchange sends fixed-size payloads."""
        return self.transport == "zen"

    def two_phase(self, ctx: BucketContext) -> bool:
        """Whether this bucket goes by the two-phase exchange: ``"two_phase"``, or ``"auto"`` from 3 ranks on.

        Both encodings are codes five to a byte plus scales, so the two-phase exchange moves fewer bytes than the
        all-gather where ``N > 1 + P_2 / P_1 = 2``
        (:func:`~lightning_gradcomp.compressors.transports.two_phase.uses_two_phase`); below, ``"auto"`` is the
        all-gather.
        """
        if self.transport not in ("two_phase", "auto"):
            return False
        return uses_two_phase(self.transport, ctx.world_size, 1.0)

    def bin_size(self, layer: Layer) -> int:
        """The bin length of ``layer``: convolutions (>= 3-D) vs fully-connected and recurrent weights."""
        return self.bin_size_conv if layer.ndim >= 3 else self.bin_size_fc

    # ------------------------------------------------------------------------------------------------------------
    # Selection and the wire format
    # ------------------------------------------------------------------------------------------------------------
    def select(self, residue_plus_grad: Tensor, soft: Tensor, ctx: BucketContext) -> tuple[Tensor, Tensor]:
        """Every element's code and every layer's scale, from ``G = R + dW`` and ``H = G + dW`` (flat).

        Codes (uint8): 0 not sent, 1 sent as ``-scale``, 2 sent as ``+scale`` (``G > 0``).
        """
        chosen = torch.empty(residue_plus_grad.numel(), dtype=torch.bool, device=residue_plus_grad.device)
        if not ctx.layers:
            return chosen.view(torch.uint8).zero_(), torch.zeros(0, dtype=_WIRE, device=residue_plus_grad.device)
        # every layer's bins at once (adacomp_bins.py): the maxima of |G|, each element against its bin's
        plan = bin_plan(ctx.layers, self.bin_size, residue_plus_grad.device)
        gmax = plan.maxima(residue_plus_grad)
        # an all-zero bin sends nothing (its maximum would select every element)
        threshold = torch.where(gmax > 0, gmax, torch.full_like(gmax, float("inf"))).to(soft.dtype)
        _at_least(soft.abs(), plan.expand(threshold), chosen)
        scale = plan.means(gmax.to(torch.promote_types(gmax.dtype, torch.float32))).to(_WIRE)
        codes = torch.gt(residue_plus_grad, 0).view(torch.uint8).add(1).mul_(chosen.view(torch.uint8))
        return codes, scale

    def _values(self, codes: Tensor, scales: Tensor, ctx: BucketContext, dtype: torch.dtype) -> Tensor:
        """The dense ``sign * scale`` values of ``codes`` (zeros where not sent), in ``dtype``."""
        signs = _sign_table(dtype, codes.device).index_select(0, codes.long())
        return signs.mul_(segments_of(ctx.layers, codes.device).expand(scales.to(dtype)))

    # ------------------------------------------------------------------------------------------------------------
    # The contract
    # ------------------------------------------------------------------------------------------------------------
    def compress(self, tensor: Tensor, ctx: BucketContext) -> Payload:
        """``(codes packed five to a byte, scales)``; ``tensor`` is ``G = R + dW``.

        The soft threshold needs the latest gradient ``dW``, which only :meth:`exchange` has; alone, ``H = 2 G`` (as
        without error feedback, where ``G = dW``).
        """
        codes, scales = self.select(tensor, tensor + tensor, ctx)
        return pack_trits(codes), scales

    def decompress(self, payload: Payload, ctx: BucketContext, out: Tensor | None = None) -> Tensor:
        """``sign * scale`` where sent, zeros elsewhere."""
        packed, scales = payload
        out = ctx.output(out)
        return out.copy_(self._values(unpack_trits(packed, ctx.numel), scales, ctx, out.dtype))

    # ------------------------------------------------------------------------------------------------------------
    # The reduction
    # ------------------------------------------------------------------------------------------------------------
    def accumulate(self, tensor: Tensor, ctx: BucketContext) -> Tensor:
        """``dW`` itself, kept in ``tensor``: the soft threshold reads it there (:meth:`exchange`'s ``out``)."""
        return tensor

    @property
    def keeps_input(self) -> bool:
        """Yes: ``G = R + dW`` is only read; ``out`` holds ``dW`` until ``H = G + dW`` is formed in it."""
        return True

    def exchange(self, tensor: Tensor, ctx: BucketContext, out: Tensor) -> Exchange:
        """All-gather every rank's fixed-size payload and sum the values in rank order (or sum over ``transport``)."""
        residue_plus_grad = tensor  # G = R + dW
        # with error feedback ``out`` holds dW (see keeps_input): H = G + dW in place, dW is not needed again;
        # without it G is dW
        soft = out.add_(residue_plus_grad) if ctx.error_feedback else residue_plus_grad + residue_plus_grad
        codes, scales = self.select(residue_plus_grad, soft, ctx)
        if self.two_phase(ctx):
            return (yield from self._two_phase_exchange(codes, scales, ctx, out))
        if self.transport == "zen" or ctx.error_feedback:
            sent = self._values(codes, scales, ctx, tensor.dtype)
            yield SentValue(sent)  # R <- G - sent
            if self.transport == "zen":  # Zen sums the selected pairs
                indices = flat_nonzero(codes)
                summed = yield from sparse_transport_sum(
                    self, self.transport, indices, sent.index_select(0, indices), ctx, out
                )
                return summed.div_(ctx.world_size)
        gathered = yield AllGather((pack_trits(codes), scales))
        out.zero_()
        for packed, scales_r in gathered:
            out.add_(self._values(unpack_trits(packed, ctx.numel), scales_r, ctx, out.dtype))
        return out.div_(ctx.world_size)

    # ------------------------------------------------------------------------------------------------------------
    # The two-phase exchange (adacomp_shards.py)
    # ------------------------------------------------------------------------------------------------------------
    def _two_phase_exchange(self, codes: Tensor, scales: Tensor, ctx: BucketContext, out: Tensor) -> Exchange:
        """Shards of the codes (with every scale) to their owners; the owners' re-encoded averages to everyone."""
        n, numel, me = ctx.world_size, ctx.numel, ctx.rank
        plan = shard_plan(ctx.layers, n, ctx.device)
        if ctx.error_feedback:
            yield SentValue(self._values(codes, scales, ctx, ctx.dtype))  # R <- G - sent, as for the all-gather
        # phase 1: row s holds shard s's codes (padded with 0: not sent) and every layer's scale
        padded = torch.nn.functional.pad(codes, (0, n * plan.size - numel)).view(n, plan.size)
        rows = torch.nn.functional.pad(padded, (0, plan.code_bytes * _TRITS_PER_BYTE - plan.size))
        packed = pack_trits(rows.reshape(-1)).view(n, plan.code_bytes)
        scale_bytes = scales.to(_WIRE).view(torch.uint8).view(1, -1).expand(n, -1)
        row = plan.code_bytes + scale_bytes.shape[1]
        received = yield AllToAll((torch.cat([packed, scale_bytes], dim=1).reshape(-1),), (row,) * n, (row,) * n)
        # phase 2: the owner's fp32 average of its shard, plus what it owes, re-encoded (AdaComp's rule, per piece)
        valid = plan.valid(me, numel)
        owner = owner_context(ctx, plan, me)
        total = torch.zeros(plan.size, dtype=owner.dtype, device=ctx.device)
        for (payload,) in received:
            layer_scales = payload[plan.code_bytes :].clone().view(_WIRE).to(owner.dtype)
            piece_scales = layer_scales.index_select(0, plan.piece_layers[me])
            shard_codes = unpack_trits(payload[: plan.code_bytes], valid)
            total[:valid].add_(self._shard_values(shard_codes, piece_scales, plan, me))
        reduced = total.div_(n)
        residual = None
        if ctx.error_feedback:
            key = residual_key(ctx, me)
            residual = self.layer_state("owner_residual").get(key, reduced)
            reduced.add_(residual)
        owned_codes, owned_scales = self.select(reduced[:valid], reduced[:valid] * 2, owner)
        if residual is not None:
            new = self._next_owner_residual.get(key, reduced)
            new.zero_()[:valid].copy_(reduced[:valid]).sub_(self._shard_values(owned_codes, owned_scales, plan, me))
            ctx.stage(residual, new, swap=True)
        owned = torch.nn.functional.pad(owned_codes, (0, plan.code_bytes * _TRITS_PER_BYTE - valid))
        owned_scales = torch.nn.functional.pad(owned_scales.to(_WIRE), (0, plan.most_pieces - owned_scales.numel()))
        gathered = yield AllGather((pack_trits(owned), owned_scales))
        for shard, (packed_s, scales_s) in enumerate(gathered):
            lo, valid_s = shard * plan.size, plan.valid(shard, numel)
            if valid_s:
                values = self._shard_values(unpack_trits(packed_s, valid_s), scales_s.to(owner.dtype), plan, shard)
                out[lo : lo + valid_s].copy_(values)
        return out

    @staticmethod
    def _shard_values(codes: Tensor, piece_scales: Tensor, plan: ShardPlan, shard: int) -> Tensor:
        """``sign * scale`` of a shard's codes (inside the bucket), each element with its piece's scale."""
        signs = _sign_table(piece_scales.dtype, codes.device)
        return signs.index_select(0, codes.long()).mul_(shard_scales(plan, shard, piece_scales))
