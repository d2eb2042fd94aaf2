"""Min-max quantization to 8 or 4 bits per element, per layer: the outer exchange of INTELLECT-1 and Streaming DiLoCo.

INTELLECT-1 (Jaghouar et al. 2024, "INTELLECT-1 Technical Report", arXiv 2412.01152) averages DiLoCo's
pseudo-gradient with an int8 all-reduce (PCCL's ``UINT8`` ``MIN_MAX`` quantization); Streaming DiLoCo (Douillard et
al. 2025, "Streaming DiLoCo with overlapping communication", arXiv 2501.18512) sends the outer gradients in 4 bits
and accumulates them in fp32. :class:`MinMax` is the min-max quantizer on the compressor contract: each layer's values
are mapped linearly from ``[min, max]`` onto the ``2**bits`` codes, rounded to the nearest code, and sent as packed
unsigned codes with the layer's minimum and step (two fp32 numbers per layer).

How the sum is done: the codes are **all-gathered** (with each rank's minima and steps), and every rank dequantizes
each rank's codes and sums them in fp32, in rank order (the contract's default aggregate): the bytes on the wire are
the 8-bit (or 4-bit) ones, and every rank computes bitwise the same average. A ring all-reduce that re-quantizes
its partial sums at every hop (what PCCL does) sends the same bytes per element but loses precision at each hop; the
all-gather's receive volume grows with the number of workers instead, which the few workers of a DiLoCo run afford.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor

from lightning_gradcomp.compressors.base import BucketContext, Collective, Payload
from lightning_gradcomp.compressors.ops.packing import pack_uint, unpack_uint
from lightning_gradcomp.compressors.ops.segments import segments_of
from lightning_gradcomp.compressors.transports.two_phase import ShardedExchange, check_transport

__all__ = ["MinMax"]


def _lengths(ctx: BucketContext) -> Tensor:
    """The layers' sizes on the device, built once per layout (not copied from the host at every call)."""
    return segments_of(ctx.layers, ctx.device).lengths


class MinMax(ShardedExchange):
    """Quantize each layer linearly between its minimum and maximum to ``bits``-bit codes, round to nearest.

    Biased (round to nearest), so error feedback is on by default: what rounding leaves out is sent in a later round.
    The quantization error is at most half a step, ``(max - min) / (2 (2**bits - 1))``, per element: a contraction
    whenever a layer's values are not all equal, so error feedback keeps a bounded residual.

    Args:
        bits: bits per element on the wire, 8 (INTELLECT-1's uint8) or 4 (Streaming DiLoCo's 4-bit).
        transport: ``"allgather"`` (above), ``"two_phase"`` (:mod:`lightning_gradcomp.compressors.transports.two_phase`:
        each
            rank owns a shard, averages every rank's codes of it in fp32 and re-quantizes the average, with a minimum
            and step per shard, keeping what that rounding loses when error feedback is on; bytes flat in ``N``) or
            ``"auto"`` (the default: the two-phase exchange from 3 ranks on, where it moves fewer bytes).

    Raises:
        ValueError: If ``bits`` or ``transport`` is not one of those.

    Example::

        >>> from lightning_gradcomp.compressors import MinMax
        >>> MinMax(bits=4)
        MinMax(bits=4, transport='auto')
    """

    collective: ClassVar[Collective] = "allgather"

    def __init__(self, bits: int = 8, transport: str = "auto") -> None:
        super().__init__()
        if isinstance(bits, bool) or bits not in (4, 8):
            raise ValueError(f"Expected `bits` to be 8 or 4, got {bits!r}.")
        self.bits = bits
        self.transport = check_transport(transport)

    @property
    def levels(self) -> int:
        """The largest code, ``2**bits - 1``."""
        return (1 << self.bits) - 1

    def compress(self, tensor: Tensor, ctx: BucketContext) -> Payload:
        """Packed codes, and each layer's minimum and step (fp32), computed without a loop over the layers."""
        lengths = _lengths(ctx)
        x = tensor.float()
        empty = lengths == 0
        # an empty layer reduces to +-inf: its minimum and step are set to zero, it has no codes anyway
        lows = torch.segment_reduce(x, "min", lengths=lengths, unsafe=True).masked_fill_(empty, 0.0)
        highs = torch.segment_reduce(x, "max", lengths=lengths, unsafe=True).masked_fill_(empty, 0.0)
        steps = (highs - lows) / self.levels
        # a constant layer has step 0: every code 0 decodes to its minimum exactly
        inverse = torch.where(steps > 0, steps.reciprocal(), torch.zeros_like(steps))
        codes = (x - lows.repeat_interleave(lengths, output_size=x.numel())) * inverse.repeat_interleave(
            lengths, output_size=x.numel()
        )
        codes = codes.round_().clamp_(0, self.levels).to(torch.uint8)
        packed = codes if self.bits == 8 else pack_uint(codes, self.bits)
        return packed, lows, steps

    def decompress(self, payload: Payload, ctx: BucketContext, out: Tensor | None = None) -> Tensor:
        """``min + code * step`` for every element, in the gradient's dtype."""
        packed, lows, steps = payload
        n = ctx.numel
        codes = packed if self.bits == 8 else unpack_uint(packed, self.bits, n)
        lengths = _lengths(ctx)
        values = codes.float().mul_(steps.repeat_interleave(lengths, output_size=n))
        values.add_(lows.repeat_interleave(lengths, output_size=n))
        result = ctx.output(out)
        return result.copy_(values)

    def hparams(self) -> dict[str, Any]:
        """The constructor arguments."""
        return {"bits": self.bits, "transport": self.transport}
