"""SparseLoCo's compressor: chunk-wise top-k of the pseudo-gradient with 2-bit values, under error feedback.

SparseLoCo (Sarfi et al. 2025, "Communication Efficient LLM Pre-training with SparseLoCo", arXiv 2508.15706) replaces
DiLoCo's dense outer exchange with a top-k selection taken chunk by chunk (1-3 % density), quantizes the kept values
to 2 bits, and keeps each worker's compression error in an error-feedback accumulator that is added to the next round's
pseudo-gradient. In this package error feedback is the driver's (``DiLoCo(compressor=SparseLoCo())`` keeps one
residual per rank across outer steps); the compressor is the selection and the quantization.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor

from lightning_gradcomp.compressors.base import BucketContext, Collective, Compressor, Payload, keep_count
from lightning_gradcomp.compressors.packing import pack_uint, unpack_uint

__all__ = ["SparseLoCo"]

_MAX_CHUNK = 1 << 15  # in-chunk positions travel as int16


class SparseLoCo(Compressor):
    """Top-k by magnitude in every chunk of ``chunk_size`` elements; the kept values in 2 bits.

    Each compressed layer is cut into chunks of ``chunk_size`` elements (its last one padded with zeros; a layer
    smaller than a chunk is one chunk), and each chunk keeps its ``keep_count(chunk_size, ratio)`` largest magnitudes:
    a fixed number per chunk, so payload shapes depend only on the layout, no chunk is starved by a layer of larger
    scale elsewhere, and the result does not depend on which layers share a bucket. Each kept value is quantized to
    one of 4 levels, ``{-m, -m/3, m/3, m}`` with ``m`` the chunk's largest kept magnitude, rounded to the nearest: 2
    bits per value, 2 bytes per in-chunk position and one fp32 scale per chunk. Payloads are all-gathered; each rank
    decodes and sums them in rank order.

    Biased: error feedback is on by default (what the selection and the rounding leave out is sent in later rounds).

    Args:
        ratio: the fraction of each chunk kept (1-3 % in the paper; default 1/64, about 1.6 %).
        chunk_size: elements per chunk, at most 32768 (positions in a chunk travel as int16).

    Example::

        >>> from lightning_gradcomp.compressors import SparseLoCo
        >>> SparseLoCo(ratio=0.02, chunk_size=4096)
        SparseLoCo(ratio=0.02, chunk_size=4096)
    """

    collective: ClassVar[Collective] = "allgather"

    def __init__(self, ratio: float = 1 / 64, chunk_size: int = 4096) -> None:
        super().__init__()
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
            raise ValueError(f"Expected `ratio` to be a number in (0, 1], got {ratio!r}.")
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or not 1 <= chunk_size <= _MAX_CHUNK:
            raise ValueError(f"Expected `chunk_size` to be an integer in [1, {_MAX_CHUNK}], got {chunk_size!r}.")
        self.ratio = float(ratio)
        self.chunk_size = chunk_size
        self._layouts: dict[tuple, Tensor] = {}  # chunk positions per layer layout (see _chunks)

    def _chunks(self, ctx: BucketContext) -> Tensor:
        """Where each chunk's elements are in the flat tensor, ``(chunks, chunk_size)``; padding points past its end.

        Each layer is cut into its own chunks (the last one padded), so the selection does not depend on which layers
        share a bucket. Built once per layout (the loop over layers runs on a new layout only).
        """
        key = (tuple((layer.offset, layer.numel) for layer in ctx.layers), str(ctx.device))
        chunks = self._layouts.get(key)
        if chunks is None:
            size, numel = self.chunk_size, ctx.numel
            rows = []
            for layer in ctx.layers:
                count = -(-layer.numel // size)
                positions = torch.arange(count * size, dtype=torch.int64) + layer.offset
                rows.append(positions.masked_fill_(positions >= layer.offset + layer.numel, numel))
            flat = torch.cat(rows) if rows else torch.empty(0, dtype=torch.int64)
            chunks = self._layouts[key] = flat.view(-1, size).to(ctx.device)
        return chunks

    def compress(self, tensor: Tensor, ctx: BucketContext) -> Payload:
        """In-chunk positions (int16), packed 2-bit codes and one scale per chunk (fp32)."""
        chunks = self._chunks(ctx)
        k = keep_count(self.chunk_size, self.ratio)
        rows = torch.cat([tensor.float(), tensor.new_zeros(1, dtype=torch.float32)])[chunks]  # padding reads a zero
        positions = rows.abs().topk(k, dim=1, sorted=False).indices
        kept = rows.gather(1, positions)
        scales = kept.abs().amax(dim=1)
        inverse = torch.where(scales > 0, scales.reciprocal(), torch.zeros_like(scales))
        # levels -m, -m/3, m/3, m are codes 0..3: code = round(1.5 (v / m + 1))
        codes = kept.mul_(inverse.unsqueeze(1)).add_(1.0).mul_(1.5).round_().clamp_(0, 3).to(torch.uint8)
        return positions.to(torch.int16), pack_uint(codes.reshape(-1), 2), scales

    def decompress(self, payload: Payload, ctx: BucketContext, out: Tensor | None = None) -> Tensor:
        """Zeros but at the kept positions, where ``(code / 1.5 - 1) * m``."""
        positions, packed, scales = payload
        chunks = self._chunks(ctx)
        k = keep_count(self.chunk_size, self.ratio)
        codes = unpack_uint(packed, 2, chunks.shape[0] * k).view(-1, k)
        values = codes.float().div_(1.5).sub_(1.0).mul_(scales.unsqueeze(1))
        flat = torch.zeros(ctx.numel + 1, dtype=torch.float32, device=values.device)  # the last element: padding
        flat[chunks.gather(1, positions.long())] = values  # kept positions are distinct but for the padding's
        return ctx.output(out).copy_(flat[: ctx.numel])

    def hparams(self) -> dict[str, Any]:
        """The constructor arguments."""
        return {"ratio": self.ratio, "chunk_size": self.chunk_size}
