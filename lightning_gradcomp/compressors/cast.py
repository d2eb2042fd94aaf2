"""Half-precision casts: FP16 and BF16, the strong baseline every compression method must beat."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor

from lightning_gradcomp.compressors.base import BucketContext, Collective, Compressor, Layer, Payload
from lightning_gradcomp.engine.requests import AllReduce, Exchange

# what a cast between the two 16-bit formats loses, (gradient, wire) -> the error's clause
_CAST_LOSS = {
    (torch.bfloat16, torch.float16): ", and values beyond float16's 65504, which bfloat16 holds, would become infinite",
    (torch.float16, torch.bfloat16): ", and it would keep 8 of float16's 11 significant bits",
}


class _Cast(Compressor):
    collective: ClassVar[Collective] = "allreduce"
    unbiased: ClassVar[bool] = False
    propagates_nonfinite: ClassVar[bool] = True
    wire_dtype: ClassVar[torch.dtype]

    @property
    def default_error_feedback(self) -> bool:
        """Off: rounding to half precision loses less than the gradient noise, as torch's cast hooks assume."""
        return False

    def compresses(self, layer: Layer, min_numel: int) -> bool:
        """Every layer: a cast treats all elements alike, as torch's ``fp16_compress_hook`` does."""
        return True

    def check_gradient_dtype(self, layer: Layer, dtype: torch.dtype) -> None:
        """Refuse gradients that are not wider than the wire format: the cast would save nothing.

        Such gradients come from training in 16 bits (``precision="16-true"`` or ``"bf16-true"``). A cast between the
        two 16-bit formats would also lose what one holds and the other does not: float16 overflows beyond 65504,
        which bfloat16 holds; bfloat16 keeps 8 significant bits of float16's 11. Sending those gradients as they are
        (``Identity()``) costs the same bytes and loses nothing.
        """
        if dtype.itemsize > self.wire_dtype.itemsize:
            return
        loss = _CAST_LOSS.get((dtype, self.wire_dtype), "")
        wire = str(self.wire_dtype).removeprefix("torch.")
        raise ValueError(
            f"{self!r} sends {wire} ({self.wire_dtype.itemsize} bytes per element), but the"
            f" gradient of {layer.name!r} is {dtype} ({dtype.itemsize} bytes per element): the cast would save"
            f" nothing{loss}. {type(self).__name__} accepts gradients wider than {8 * self.wire_dtype.itemsize} bits"
            " (float32, float64). For 16-bit gradients (precision '16-true' or 'bf16-true') use Identity(), which"
            f" sends them as they are; to keep {type(self).__name__}, train with 32-bit gradients (precision"
            " '32-true', 'bf16-mixed' or '16-mixed')."
        )

    def compress(self, tensor: Tensor, ctx: BucketContext) -> Payload:
        """Cast to the wire dtype (round to nearest)."""
        return (tensor.to(self.wire_dtype),)

    def decompress(self, payload: Payload, ctx: BucketContext, out: Tensor | None = None) -> Tensor:
        """Cast back to the gradient's dtype (into ``out`` when given, as torch's hooks copy into the bucket)."""
        return payload[0].to(ctx.dtype) if out is None else out.copy_(payload[0])

    def nonfinite_witness(self, payload: Payload) -> Tensor:
        """The cast values themselves, which the guard reads instead of the input (half the bytes).

        Read only with error feedback (without it a cast keeps no state and skips the guard, as Identity does). A NaN
        or an infinity stays one in the cast, and so does a finite value beyond the wire format's range (FP16's
        65504): that step is then non-finite on every rank, where the residual ``p - inf`` would otherwise keep an
        infinity for good.
        """
        return payload[0]


class FP16(_Cast):
    """Send gradients as IEEE half precision (2 bytes per element, 2x less than fp32).

    Same numerics as torch's ``fp16_compress_hook``: cast, divide by the world size, all-reduce in fp16, cast back.
    Error feedback is off by default (pass ``CompressedDDP(error_feedback=True)`` to carry the rounding error).

    Example::

        >>> from lightning_gradcomp.compressors import FP16
        >>> FP16()
        FP16()
    """

    wire_dtype: ClassVar[torch.dtype] = torch.float16


class BF16(_Cast):
    """Send gradients as bfloat16 (2 bytes per element; fp32's exponent range, so no overflow risk).

    Same numerics as torch's ``bf16_compress_hook``. Error feedback is off by default.

    Example::

        >>> from lightning_gradcomp.compressors import BF16
        >>> BF16()
        BF16()
    """

    wire_dtype: ClassVar[torch.dtype] = torch.bfloat16

    def exchange(self, tensor: Tensor, ctx: BucketContext, out: Tensor) -> Exchange:
        """Cast, divide by the world size, all-reduce, cast back (the CPU at power-of-two world sizes: divide first).

        Dividing by a power of two commutes with rounding to bfloat16, which has fp32's exponent range: both orders
        give the same bits for every input whose quotient is at least ``2**-126`` in magnitude (below it, bfloat16
        and fp32 both round into their subnormals). On the CPU an fp32 division is one memory pass, while bfloat16's
        runs at a fifth of fp16's speed (``benchmarks/codec.py``). Other world sizes, error feedback and other
        devices, and gradients narrower than fp32 (fp16's own subnormals start at ``2**-14``) take the default path.
        """
        n = ctx.world_size
        if (
            ctx.error_feedback
            or tensor.device.type != "cpu"
            or n & (n - 1)
            or tensor.dtype not in (torch.float32, torch.float64)
        ):
            return (yield from super().exchange(tensor, ctx, out))
        payload = (tensor.mul_(1.0 / n).to(self.wire_dtype),)  # the input is spent: scale it in place
        summed = yield AllReduce(payload)
        return self.decompress(summed, ctx, out=out)
