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

from lightning_gradcomp.compressors.base import BucketContext, Collective, Compressor, Layer, Payload, keep_count
from lightning_gradcomp.compressors.ops.packing import pack_uint, unpack_uint
from lightning_gradcomp.compressors.transports.two_phase import check_transport, next_owner_residuals, shard_numel
from lightning_gradcomp.engine import wire
from lightning_gradcomp.engine.requests import AllGather, AllToAll, Exchange, SentValue

__all__ = ["SparseLoCo"]

_MAX_CHUNK = 1 << 15  # in-chunk positions travel as int16


class SparseLoCo(Compressor):
    """Top-k by magnitude in every chunk of ``chunk_size`` elements; the kept values in 2 bits.

    Each compressed layer is cut into chunks of ``chunk_size`` elements (its last one padded with zeros; a layer
    smaller than a chunk is one chunk), and each chunk keeps its ``keep_count(chunk_size, ratio)`` largest magnitudes:
    a fixed number per chunk, so payload shapes depend only on the layout, no chunk is starved by a layer of larger
    scale elsewhere, and the result does not depend on which layers share a bucket. Each kept value is quantized to
    one of 4 levels, ``{-m, -m/3, m/3, m}`` with ``m`` the chunk's largest kept magnitude, rounded to the nearest: 2
    bits per value, 2 bytes per in-chunk position and one fp32 scale per chunk. With ``transport="allgather"``
    payloads are all-gathered; each rank decodes and sums them in rank order.

    With ``transport="two_phase"`` the bytes per rank stay flat in the number of ranks (docs/two_phase.md): the
    chunks are dealt out to the ranks in order (``ceil(chunks / n)`` each), every rank sends each owner its encoding
    of the owner's chunks (all-to-all), the owner sums them in fp32 in rank order, adds what it still owes (its error
    feedback), encodes the sum with the same chunk-wise top-k in 2 bits and the owners' encodings are all-gathered:
    two encodings' bytes whatever ``n``. ``"auto"``, the default, takes whichever of the two moves fewer bytes: the
    all-gather at 2 ranks, the two-phase exchange from 3. On a ResNet-18-shaped bucket (1.58M parameters, 396
    chunks) the default moves 0.012 of a dense ring all-reduce's bytes at 2 ranks, 0.013 at 64 and 0.028 at 1024
    (more ranks than chunks: most owners' rows are padding), where the all-gather moves 0.300 at 64 (``python
    benchmarks/scaling.py --workers 2 --analytical 2 4 8 16 32 64 128 256 1024``).

    Biased: error feedback is on by default (what the selection and the rounding leave out is sent in later rounds).

    Args:
        ratio: the fraction of each chunk kept (1-3 % in the paper; default 1/64, about 1.6 %).
        chunk_size: elements per chunk, at most 32768 (positions in a chunk travel as int16).
        transport: ``"auto"`` (the default), ``"allgather"`` or ``"two_phase"``.

    Example::

        >>> from lightning_gradcomp.compressors import SparseLoCo
        >>> SparseLoCo(ratio=0.02, chunk_size=4096)
        SparseLoCo(ratio=0.02, chunk_size=4096, transport='auto')
    """

    collective: ClassVar[Collective] = "allgather"

    def __init__(self, ratio: float = 1 / 64, chunk_size: int = 4096, transport: str = "auto") -> None:
        super().__init__()
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
            raise ValueError(f"Expected `ratio` to be a number in (0, 1], got {ratio!r}.")
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or not 1 <= chunk_size <= _MAX_CHUNK:
            raise ValueError(f"Expected `chunk_size` to be an integer in [1, {_MAX_CHUNK}], got {chunk_size!r}.")
        self.ratio = float(ratio)
        self.chunk_size = chunk_size
        self.transport = check_transport(transport)
        self.layer_state("owner_residual")  # the two-phase owner's (declared: a checkpoint's loads into a fresh one)
        self._layouts: dict[tuple, Tensor] = {}  # chunk positions per layer layout (see _chunks)

    @property
    def rounds(self) -> int:
        """Two where the two-phase exchange may run (all-to-all, all-gather); the all-gather's one otherwise."""
        return 1 if self.transport == "allgather" else 2

    def _chunks(self, ctx: BucketContext, rows: int = 0) -> Tensor:
        """Where each chunk's elements are in the flat tensor, ``(chunks, chunk_size)``; padding points past its end.

        Each layer is cut into its own chunks (the last one padded), so the selection does not depend on which layers
        share a bucket; ``rows`` more chunks of padding are appended. Built once per layout (the loop over layers runs
        on a new layout only).
        """
        key = (tuple((layer.offset, layer.numel) for layer in ctx.layers), str(ctx.device), rows)
        chunks = self._layouts.get(key)
        if chunks is None:
            size, numel = self.chunk_size, ctx.numel
            parts = []
            for layer in ctx.layers:
                count = -(-layer.numel // size)
                positions = torch.arange(count * size, dtype=torch.int64) + layer.offset
                parts.append(positions.masked_fill_(positions >= layer.offset + layer.numel, numel))
            parts.append(torch.full((rows * size,), numel, dtype=torch.int64))
            chunks = self._layouts[key] = torch.cat(parts).view(-1, size).to(ctx.device)
        return chunks

    @property
    def _keep(self) -> int:
        return keep_count(self.chunk_size, self.ratio)

    def _encode_rows(self, rows: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Every row's kept positions (int16), their 2-bit codes (uint8, unpacked) and its scale (fp32)."""
        positions = rows.abs().topk(self._keep, dim=1, sorted=False).indices
        kept = rows.gather(1, positions)
        scales = kept.abs().amax(dim=1)
        inverse = torch.where(scales > 0, scales.reciprocal(), torch.zeros_like(scales))
        # levels -m, -m/3, m/3, m are codes 0..3: code = round(1.5 (v / m + 1))
        codes = kept.mul_(inverse.unsqueeze(1)).add_(1.0).mul_(1.5).round_().clamp_(0, 3).to(torch.uint8)
        return positions.to(torch.int16), codes, scales

    @staticmethod
    def _values(codes: Tensor, scales: Tensor) -> Tensor:
        """``(code / 1.5 - 1) * m`` of every kept value (fp32)."""
        return codes.float().div_(1.5).sub_(1.0).mul_(scales.unsqueeze(1))

    @staticmethod
    def _scatter(chunks: Tensor, positions: Tensor, values: Tensor, numel: int) -> Tensor:
        """Zeros but at the kept positions of ``chunks``' rows; ``numel + 1`` elements, the last one padding's."""
        flat = torch.zeros(numel + 1, dtype=torch.float32, device=values.device)
        flat[chunks.gather(1, positions.long())] = values  # kept positions are distinct but for the padding's
        return flat

    def compress(self, tensor: Tensor, ctx: BucketContext) -> Payload:
        """In-chunk positions (int16), packed 2-bit codes and one scale per chunk (fp32)."""
        rows = torch.cat([tensor.float(), tensor.new_zeros(1, dtype=torch.float32)])[self._chunks(ctx)]
        positions, codes, scales = self._encode_rows(rows)  # padding reads a zero
        return positions, pack_uint(codes.reshape(-1), 2), scales

    def decompress(self, payload: Payload, ctx: BucketContext, out: Tensor | None = None) -> Tensor:
        """Zeros but at the kept positions, where ``(code / 1.5 - 1) * m``."""
        positions, packed, scales = payload
        chunks = self._chunks(ctx)
        codes = unpack_uint(packed, 2, chunks.shape[0] * self._keep).view(-1, self._keep)
        flat = self._scatter(chunks, positions, self._values(codes, scales), ctx.numel)
        return ctx.output(out).copy_(flat[: ctx.numel])

    # ------------------------------------------------------------------------------------------------------------
    # The two-phase exchange: chunks dealt out to owners
    # ------------------------------------------------------------------------------------------------------------
    def _row_nbytes(self, rows: int, aligned: bool) -> int:
        """Bytes of ``rows`` chunks' encoding (the codes padded to 4 bytes where ``aligned``, as in the push)."""
        codes = -(-rows * self._keep // 4)
        return 2 * rows * self._keep + (-(-codes // 4) * 4 if aligned else codes) + 4 * rows

    def two_phase(self, ctx: BucketContext) -> bool:
        """Whether this bucket goes by the two-phase exchange.

        ``"two_phase"``, or ``"auto"`` where it moves fewer bytes per rank than the all-gather (counted with
        :mod:`lightning_gradcomp.engine.wire`; a tie stays on the all-gather).
        """
        n = ctx.world_size
        if n < 2 or self.transport == "allgather":
            return False
        if self.transport == "two_phase":
            return True
        count = self._chunks(ctx).shape[0]
        per = shard_numel(count, n)
        push = wire.all_to_all([self._row_nbytes(per, True)] * n, [self._row_nbytes(per, True)] * n, 0)
        ours = push + wire.all_gather(self._row_nbytes(per, False), n)
        return ours.moved < wire.all_gather(self._row_nbytes(count, False), n).moved

    def exchange(self, tensor: Tensor, ctx: BucketContext, out: Tensor) -> Exchange:
        """The all-gather, or the two-phase exchange where :meth:`two_phase` says so."""
        if not self.two_phase(ctx):
            return (yield from super().exchange(tensor, ctx, out))
        n, me, numel = ctx.world_size, ctx.rank, ctx.numel
        count = self._chunks(ctx).shape[0]
        per = shard_numel(count, n)
        chunks = self._chunks(ctx, n * per - count)
        rows = torch.cat([tensor.float(), tensor.new_zeros(1, dtype=torch.float32)])[chunks]
        positions, codes, scales = self._encode_rows(rows)
        if ctx.error_feedback:  # what went out of x: this rank's encoding of every chunk
            sent = self._scatter(chunks, positions, self._values(codes, scales), numel)
            yield SentValue(sent[:numel].to(ctx.dtype))
        # phase 1: owner s gets rows [s per, (s + 1) per) of every rank's encoding, as one row of bytes
        code_bytes = -(-per * self._keep // 4)
        packed = pack_uint(
            torch.nn.functional.pad(codes.view(n, -1), (0, 4 * code_bytes - per * self._keep)).reshape(-1), 2
        ).view(n, -1)
        packed = torch.nn.functional.pad(packed, (0, -code_bytes % 4))
        row = torch.cat([positions.view(n, -1).view(torch.uint8), packed, scales.view(n, -1).view(torch.uint8)], 1)
        nbytes = row.shape[1]
        received = yield AllToAll((row.reshape(-1),), (nbytes,) * n, (nbytes,) * n)
        # phase 2: the owner's fp32 (or wider) sum in rank order, averaged, plus what it owes, re-encoded the same way
        mine = chunks[me * per : (me + 1) * per]
        wide = torch.promote_types(ctx.dtype, torch.float32)
        total = torch.zeros(per, self.chunk_size, dtype=wide, device=tensor.device)
        split = (2 * per * self._keep, 2 * per * self._keep + packed.shape[1])
        for (part,) in received:
            theirs = part[: split[0]].clone().view(torch.int16).view(per, -1).long()
            their_codes = unpack_uint(part[split[0] : split[1]], 2, per * self._keep).view(per, -1)
            their_values = self._values(their_codes, part[split[1] :].clone().view(torch.float32))
            total.scatter_add_(1, theirs, their_values.to(wide))
        padding = mine >= numel
        total.div_(n).masked_fill_(padding, 0.0)
        residual = None
        if ctx.error_feedback:
            key = Layer(f"{ctx.layers[0].name}/chunks{me}of{n}", ctx.layers[0].index, total.shape)
            residual = self.layer_state("owner_residual").get(key, total)
            total.add_(residual)
        owned_positions, owned_codes, owned_scales = self._encode_rows(total)
        owned_scales = owned_scales.float()  # the wire's scales: what every rank decodes with
        if residual is not None:  # what the owner's encoding left out, and its rounding, stays owed
            owed = next_owner_residuals(self).get(key, total)
            decoded = self._values(owned_codes, owned_scales).to(wide)
            owed.copy_(total).scatter_add_(1, owned_positions.long(), decoded.neg_())
            ctx.stage(residual, owed.masked_fill_(padding, 0.0), swap=True)
        gathered = yield AllGather((owned_positions, pack_uint(owned_codes.reshape(-1), 2), owned_scales))
        all_positions = torch.cat([p for p, _, _ in gathered])
        all_codes = torch.cat([unpack_uint(c, 2, per * self._keep).view(per, -1) for _, c, _ in gathered])
        all_scales = torch.cat([s for _, _, s in gathered])
        flat = self._scatter(chunks, all_positions, self._values(all_codes, all_scales), numel)
        return out.copy_(flat[:numel])

    def owner_owed(self, ctx: BucketContext) -> Tensor:
        """What this rank, as an owner, still owes of ``ctx``'s bucket (zeros where it owns nothing)."""
        n, me = ctx.world_size, ctx.rank
        count = self._chunks(ctx).shape[0]
        per = shard_numel(count, n)
        flat = torch.zeros(ctx.numel + 1, dtype=torch.promote_types(ctx.dtype, torch.float32), device=ctx.device)
        residual = self.layer_state("owner_residual").state_dict().get(f"{ctx.layers[0].name}/chunks{me}of{n}")
        if residual is not None:
            mine = self._chunks(ctx, n * per - count)[me * per : (me + 1) * per]
            flat.index_add_(0, mine.reshape(-1), residual.reshape(-1))
        return flat[: ctx.numel]

    def hparams(self) -> dict[str, Any]:
        """The constructor arguments."""
        return {"ratio": self.ratio, "chunk_size": self.chunk_size, "transport": self.transport}
