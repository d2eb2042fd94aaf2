"""Half-precision casts: FP16 and BF16, the strong baseline every compression method must beat."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor

from lightning_gradcomp.compressors.base import BucketContext, Collective, Compressor, Layer, Payload


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

    def compress(self, tensor: Tensor, ctx: BucketContext) -> Payload:
        """Cast to the wire dtype (round to nearest)."""
        return (tensor.to(self.wire_dtype),)

    def decompress(self, payload: Payload, ctx: BucketContext, out: Tensor | None = None) -> Tensor:
        """Cast back to the gradient's dtype (into ``out`` when given, as torch's hooks copy into the bucket)."""
        return payload[0].to(ctx.dtype) if out is None else out.copy_(payload[0])


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
