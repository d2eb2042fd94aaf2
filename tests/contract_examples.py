"""The smallest sparsifier and the smallest quantizer of docs/concepts.md: ``compress``, ``decompress``, class facts.

``tests/test_contract.py`` runs both through the whole contract suite, so a new single-round method needs nothing else.
"""

import torch

from lightning_gradcomp.compressors import BucketContext, Compressor
from lightning_gradcomp.compressors.base import keep_count


class BucketTopK(Compressor):
    """The bucket's ``ratio`` largest magnitudes and their indices; error feedback keeps the rest."""

    def __init__(self, ratio: float = 0.1) -> None:
        super().__init__()
        self.ratio = ratio

    def compress(self, tensor, ctx: BucketContext):
        indices = tensor.abs().topk(keep_count(ctx.numel, self.ratio), sorted=False).indices
        return tensor[indices], indices  # k depends only on the layout: every rank sends the same shapes

    def decompress(self, payload, ctx: BucketContext, out=None):
        values, indices = payload
        return ctx.output(out, zeros=True).index_copy_(0, indices, values.to(ctx.dtype))


class ScaledSign(Compressor):
    """Each layer as ``mean |x| * sign(x)``; error feedback carries what the scale loses."""

    def compress(self, tensor, ctx: BucketContext):
        scales = torch.stack([layer.flat(tensor).abs().mean() for layer in ctx.layers])
        return tensor >= 0, scales

    def decompress(self, payload, ctx: BucketContext, out=None):
        positive, scales = payload
        out = ctx.output(out)
        for i, layer in enumerate(ctx.layers):
            torch.where(layer.flat(positive), scales[i], -scales[i], out=layer.flat(out))
        return out
