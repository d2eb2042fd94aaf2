"""The identity compressor: plain DDP averaging through the compressor contract (the parity anchor)."""

from __future__ import annotations

from typing import ClassVar

from torch import Tensor

from lightning_gradcomp.compressors.base import BucketContext, Collective, Compressor, Layer, Payload


class Identity(Compressor):
    """Send the gradient as it is: bitwise the same result as DDP's default all-reduce.

    Every layer goes through it (there is nothing to exempt), so a bucket costs one all-reduce of the bucket buffer
    divided by the world size, exactly like torch's ``allreduce_hook``. Useful to measure the overhead of the hook
    and as the reference the other compressors are tested against.

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
