"""The identity compressor: plain DDP averaging through the compressor contract (the parity anchor)."""

from __future__ import annotations

from typing import ClassVar

from torch import Tensor

from lightning_gradcomp.compressors.base import BucketContext, Collective, Compressor, Layer, Payload, ddp_scale_
from lightning_gradcomp.engine.requests import AllReduce, Exchange, Lossless


class Identity(Compressor):
    """Send the gradient as it is: bitwise the same result as DDP's default all-reduce, at every world size.

    Every layer goes through it (there is nothing to exempt), so a bucket costs one all-reduce of the bucket buffer
    scaled by ``1 / world_size``, exactly as DDP's reducer scales it without a hook (torch's ``allreduce_hook``
    divides instead, which rounds differently at world sizes that are not powers of two). Useful to measure the
    overhead of the hook and as the reference the other compressors are tested against.

    Example::

        >>> from lightning_gradcomp.compressors import Identity
        >>> Identity()
        Identity()
    """

    collective: ClassVar[Collective] = "allreduce"
    unbiased: ClassVar[bool] = True
    propagates_nonfinite: ClassVar[bool] = True

    def compresses(self, layer: Layer, min_numel: int) -> bool:
        """Every layer: sending it as it is costs the same as the dense path."""
        return True

    def compress(self, tensor: Tensor, ctx: BucketContext) -> Payload:
        """The tensor itself (no copy)."""
        return (tensor,)

    def decompress(self, payload: Payload, ctx: BucketContext, out: Tensor | None = None) -> Tensor:
        """The tensor itself (copied into ``out`` when that is another tensor)."""
        (tensor,) = payload
        if out is None or out.data_ptr() == tensor.data_ptr():
            return tensor
        return out.copy_(tensor)

    def exchange(self, tensor: Tensor, ctx: BucketContext, out: Tensor) -> Exchange:
        """The default all-reduce, with the payload scaled by ``1 / world_size`` as DDP scales it, not divided."""
        yield Lossless()
        summed = yield AllReduce((ddp_scale_(tensor, ctx.world_size),))
        return self.decompress(summed, ctx, out=out)
