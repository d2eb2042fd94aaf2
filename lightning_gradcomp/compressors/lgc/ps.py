"""LGC, the parameter-server variant: the leader's code, decoded for every rank with that rank's innovation."""

from __future__ import annotations

from collections.abc import Generator, Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor
from torch.nn import functional as F  # noqa: N812 (the usual alias)

from lightning_gradcomp.compressors.base import BucketContext, Collective, Payload, keep_count
from lightning_gradcomp.compressors.lgc.autoencoder import LGCAutoencoder
from lightning_gradcomp.compressors.lgc.base import (
    LGCBase,
    decode_layers,
    encode_layers,
    fit_factors,
    layer_dots,
    pad8,
    scaled,
)
from lightning_gradcomp.compressors.ops.sparse import SparseLayout, decode_sparse
from lightning_gradcomp.compressors.scalecom import index_blob_nbytes
from lightning_gradcomp.engine.requests import AllGather, Broadcast, Exchange, SentAt, SentExactly
from lightning_gradcomp.validation import check_bool, check_choice, check_number

__all__ = ["LGC"]

_PS_FORMS = ("allgather", "gather")


class LGC(LGCBase):
    """Learned gradient compression, the parameter-server variant: dense, top-k while an autoencoder learns, its code.

    Abrahamyan, Chen, Bekoulis & Deligiannis, "Learned Gradient Compression for Distributed Deep Learning", IEEE
    TNNLS 2021 (doi:10.1109/TNNLS.2021.3084806, arXiv:2103.08870). The ranks' gradients are correlated: an
    autoencoder trained during training captures what they share, so that the leader's short code plus a tiny
    per-rank "innovation" replaces every rank's top-k values. Stage 1 (``dense_steps``) averages densely; stage 2
    (``training_steps``) all-gathers every rank's top-k values and indices, on which every rank trains the same
    autoencoder; in stage 3 the leader broadcasts its code, scales and indices, every rank all-gathers its
    innovation (and its projection factors), and every rank decodes every rank ``j``'s values with decoder ``j``.
    Error feedback keeps what the aggregate did not use for this rank. The ring-all-reduce instance is
    :class:`~lightning_gradcomp.compressors.LGCAllReduce`; docs/lgc.md has the design, its sources and
    measurements.

    Args:
        ratio: fraction of each layer's entries in the top-k, in (0, 1].
        innovation_ratio: fraction of each layer's entries in a rank's innovation, in (0, ratio).
        dense_steps: steps of stage 1 (dense), an integer >= 0.
        training_steps: steps of stage 2 (top-k while the autoencoder trains), an integer >= 0.
        leader: ``"fixed"`` (rank 0) or ``"rotating"`` (``step mod n``); ``None``: fixed.
        channels: the encoder's stride-2 convolution widths.
        decoder_channels: each decoder's stride-2 transposed convolution widths.
        latent_channels: channels of the code; the code holds about ``latent_channels / 2**len(channels)`` numbers
            per top-k value.
        linear_encoder: no activations in the encoder.
        lr: the autoencoder's learning rate (Adam's 1e-2: chosen over 1e-3 on the CIFAR-shaped digits, docs/lgc.md).
        optimizer: ``"adam"`` or ``"sgd"``.
        momentum: SGD's momentum, in [0, 1) (``"sgd"`` only).
        reconstruction_weight: ``lambda1`` of the loss (>= 0).
        similarity_weight: ``lambda2`` of the loss (>= 0); ``None``: 0 (the third-party code's is 0.5; 0 with the
            learning rate 1e-2 was chosen over it on the CIFAR-shaped digits: docs/lgc.md).
        normalize: divide the values by the leader's root mean square before encoding (sent along, one float).
        seed: the autoencoder's seed (its initialisation and the random rank of each training step).
        ps_form: ``"allgather"`` (``None``), every rank decodes every rank from the leader's broadcast code;
            ``"gather"``, the leader alone decodes every rank and broadcasts the averaged values with its code and
            indices, and every other rank decodes only its own values (for its error feedback). Both give bitwise
            the same results; they differ in bytes and time (docs/lgc.md).
        project: ``None`` or ``True``: in stage 3 every rank scales its decoded values, per layer, to their
            least-squares fit to its own values at the leader's slots, clamped to [0, 1], and sends the factors
            with its innovation (one float per layer). Its contribution is then never further from its values than
            no contribution, so error feedback's memory cannot grow however poorly its decoder decodes; without it
            (``False``) a poor decoder can make the memory grow geometrically and training diverge (docs/lgc.md).

    Raises:
        ValueError: If an argument is out of range or of the wrong type.

    Example::

        >>> from lightning_gradcomp.compressors import LGC
        >>> LGC(dense_steps=100, training_steps=200).stage(150)
        2
    """

    variant: ClassVar[str] = "ps"
    default_leader: ClassVar[str] = "fixed"  # the third-party code's rank 0
    default_similarity_weight: ClassVar[float] = 0.0  # the third-party code's lambda2 is 0.5 (docs/lgc.md)

    def __init__(
        self,
        ratio: float = 1e-3,
        innovation_ratio: float = 1e-5,
        dense_steps: int = 200,
        training_steps: int = 300,
        leader: str | None = None,
        channels: Sequence[int] = (16, 32, 64, 16),
        decoder_channels: Sequence[int] = (8, 16, 32, 8),
        latent_channels: int = 4,
        linear_encoder: bool = False,
        lr: float = 1e-2,
        optimizer: str = "adam",
        momentum: float = 0.0,
        reconstruction_weight: float = 0.5,
        similarity_weight: float | None = None,
        normalize: bool = True,
        seed: int = 0,
        ps_form: str | None = None,
        project: bool | None = None,
    ) -> None:
        super().__init__(
            ratio=ratio,
            dense_steps=dense_steps,
            training_steps=training_steps,
            leader=leader,
            channels=channels,
            decoder_channels=decoder_channels,
            latent_channels=latent_channels,
            linear_encoder=linear_encoder,
            lr=lr,
            optimizer=optimizer,
            momentum=momentum,
            reconstruction_weight=reconstruction_weight,
            similarity_weight=similarity_weight,
            normalize=normalize,
            seed=seed,
        )
        check_number(innovation_ratio, "innovation_ratio", low=0.0, high=self.ratio, low_open=True, high_open=True)
        self.innovation_ratio = float(innovation_ratio)
        self.ps_form = check_choice(ps_form, "ps_form", (None, *_PS_FORMS))
        self.project = check_bool(project, "project", allow_none=True)

    @property
    def collective(self) -> Collective:
        """``"allgather"``: every rank's values and innovation travel as they are."""
        return "allgather"

    def _decoder_count(self, ctx: BucketContext) -> int:
        """One decoder per rank."""
        return ctx.world_size

    def _innovation_counts(self, ctx: BucketContext) -> list[int]:
        return [keep_count(layer.numel, self.innovation_ratio) for layer in ctx.layers]

    def _innovation_of(self, values: Tensor, ctx: BucketContext) -> Tensor:
        """Rows of top-k ``values`` with everything but each layer's top ``innovation_ratio`` zeroed."""
        out = torch.zeros_like(values)
        for (_, at, k), k_u in zip(self._segments(ctx), self._innovation_counts(ctx)):
            part = values[:, at : at + k]
            picked = torch.topk(part.abs(), k_u, dim=1).indices
            out[:, at : at + k].scatter_(1, picked, part.gather(1, picked))
        return out

    # ------------------------------------------------------------------------------------------------------------
    # Training: every rank's values at the chosen rank's indices, from its code and their innovation
    # ------------------------------------------------------------------------------------------------------------
    def _encoding_scale(self, scales: Tensor, chosen: Tensor) -> Tensor:
        """Stage 3 encodes the leader's values by the leader's own scale: every rank's values by their own."""
        return scales

    def _reconstruction(
        self, model: LGCAutoencoder, entry: dict[str, Tensor], codes: Tensor, r: int, s: Tensor
    ) -> Tensor:
        """``sum_j MSE(x_j, D_j(E(x_r), u_j))`` at rank ``r``'s indices (zero where rank ``j`` sent nothing)."""
        values, indices, innovation = entry["values"], entry["indices"], entry["innovation"]
        n, k = values.shape
        leader_indices = indices[r]
        reconstruction = values.new_zeros(())
        for j in range(n):
            # rank j's values and innovation at the chosen rank's indices: what stage 3 decodes (zero where
            # rank j sent nothing there)
            pos = torch.searchsorted(indices[j], leader_indices).clamp_(max=k - 1)
            hit = indices[j][pos] == leader_indices
            target = torch.where(hit, values[j][pos], 0.0)
            side = torch.where(hit, innovation[j][pos], 0.0)
            decoded = model.decode(j, codes[r : r + 1], k, (side / s)[None])
            reconstruction = reconstruction + F.mse_loss(decoded[0], target / s)
        return reconstruction

    # ------------------------------------------------------------------------------------------------------------
    # Stage 3 decoding, shared by the reduction and the single-rank contract
    # ------------------------------------------------------------------------------------------------------------
    def _ps_decoded(
        self,
        model: LGCAutoencoder,
        j: int,
        code: Tensor,
        indices: Tensor,
        values: Tensor,
        own: Tensor,
        ctx: BucketContext,
    ) -> Tensor:
        """Rank ``j``'s decoded values at the leader's ``indices`` (float32).

        From the leader's ``code`` (its codes followed by its scales) and rank ``j``'s innovation ``values`` at
        ``own``.
        """
        k, layers = indices.numel(), len(ctx.layers)
        z, scales = code[:-layers], code[-layers:]
        pos = torch.searchsorted(indices, own).clamp_(max=max(k - 1, 0))
        hit = indices[pos] == own
        side = torch.zeros(k, dtype=torch.float32, device=code.device)
        side.index_add_(0, pos, torch.where(hit, values.float(), 0.0))  # misses add zero
        return decode_layers(model, j, z, scales, self._segments(ctx), side)

    def _ps_factors(self, tensor: Tensor, indices: Tensor, decoded: Tensor, ctx: BucketContext) -> Tensor:
        """This rank's projection factors, one per layer (float32; empty without ``project``).

        Each is the least-squares fit of its decoded values to its own values at the leader's slots, clamped to
        [0, 1] (:func:`~lightning_gradcomp.compressors.lgc.base.fit_factors`).
        """
        if self.project is False:  # nothing to send
            return torch.zeros(0, dtype=torch.float32, device=decoded.device)
        segments = self._segments(ctx)
        dots = layer_dots(tensor.index_select(0, indices).float(), decoded, segments)
        factors = fit_factors(decoded, dots, segments)
        return torch.stack(factors) if factors else dots

    def _ps_contribution(
        self, decoded: Tensor, factors: Tensor, indices: Tensor, values: Tensor, own: Tensor, ctx: BucketContext
    ) -> tuple[Tensor, Tensor]:
        """Rank ``j``'s contribution: its values at the leader's ``indices``, and the correction at its innovation.

        The values are ``decoded`` (:meth:`_ps_decoded`) times its ``factors``; at its innovation ``own`` its
        innovation ``values`` replace whatever was decoded there.
        """
        if self.project is not False:
            decoded = scaled(decoded, list(factors.unbind()), self._segments(ctx))
        decoded = decoded.to(ctx.dtype)
        pos = torch.searchsorted(indices, own).clamp_(max=max(indices.numel() - 1, 0))
        hit = indices[pos] == own
        correction = values.to(ctx.dtype) - torch.where(hit, decoded[pos], 0.0)
        return decoded, correction

    def _ps_mine(
        self, model: LGCAutoencoder, tensor: Tensor, code: Tensor, indices: Tensor, own: Tensor, ctx: BucketContext
    ) -> tuple[Tensor, Tensor]:
        """This rank's decoded values (float32) and its projection factors, from the leader's code."""
        decoded = self._ps_decoded(model, ctx.rank, code, indices, tensor.index_select(0, own), own, ctx)
        return decoded, self._ps_factors(tensor, indices, decoded, ctx)

    def _ps_leader_code(self, model: LGCAutoencoder, tensor: Tensor, indices: Tensor, ctx: BucketContext) -> Tensor:
        x = tensor.index_select(0, indices).float()
        scales = self._scales(x, ctx)
        return torch.cat([encode_layers(model, x, scales, self._segments(ctx)), scales])

    def _ps_broadcast(
        self, model: LGCAutoencoder, tensor: Tensor, layout: SparseLayout, ctx: BucketContext
    ) -> tuple[Tensor, Tensor]:
        """What the leader broadcasts first: its code with the scales, and its index blob (zeros elsewhere)."""
        if ctx.rank == self.leader_of(ctx):
            blob = self._leader_blob(tensor, layout)
            return self._ps_leader_code(model, tensor, torch.cat(decode_sparse(layout, blob)), ctx), blob
        blob = torch.zeros(index_blob_nbytes(layout), dtype=torch.uint8, device=ctx.device)
        return torch.zeros(self._code_numel(ctx) + len(ctx.layers), dtype=torch.float32, device=ctx.device), blob

    # ------------------------------------------------------------------------------------------------------------
    # The contract for one rank on its own (its own leader)
    # ------------------------------------------------------------------------------------------------------------
    def _compress_sparse(self, tensor: Tensor, ctx: BucketContext, stage: int, layout: SparseLayout) -> Payload:
        """Stage 2: values, indices. Stage 3: code and scales, index blob, innovation values and indices, factors."""
        if stage == 2:
            indices = self._top(tensor, ctx, [s.slots for s in layout.segments])
            return tensor.index_select(0, indices), indices.to(self._index_dtype(ctx))
        model = self._autoencoder(ctx)
        blob = self._leader_blob(tensor, layout)
        indices = torch.cat(decode_sparse(layout, blob))
        own = self._top(tensor, ctx, self._innovation_counts(ctx))
        code = self._ps_leader_code(model, tensor, indices, ctx)
        _, factors = self._ps_mine(model, tensor, code, indices, own, ctx)
        return code, blob, tensor.index_select(0, own), own.to(self._index_dtype(ctx)), factors

    def _decompress_sparse(
        self, payload: Payload, ctx: BucketContext, out: Tensor | None, stage: int, layout: SparseLayout
    ) -> Tensor:
        """Stage 2: the values at their indices. Stage 3: this rank's decoder's values and its innovation."""
        if stage == 2:
            values, indices = payload
            return ctx.output(out, zeros=True).index_copy_(0, indices.long(), values.to(ctx.dtype))
        model = self._autoencoder(ctx)
        code, blob, values, own, factors = payload
        indices = torch.cat(decode_sparse(layout, blob))
        decoded = self._ps_decoded(model, ctx.rank, code, indices, values, own.long(), ctx)
        decoded, correction = self._ps_contribution(decoded, factors, indices, values, own.long(), ctx)
        result = ctx.output(out, zeros=True).index_add_(0, indices, decoded)
        return result.index_add_(0, own.long(), correction)

    # ------------------------------------------------------------------------------------------------------------
    # The reduction
    # ------------------------------------------------------------------------------------------------------------
    def _exchange_code(self, tensor: Tensor, ctx: BucketContext, model: LGCAutoencoder) -> Exchange:
        """The all-gather form or (``ps_form="gather"``) the gather-to-the-leader form: bitwise the same result."""
        if self.ps_form == "gather":
            return (yield from self._ps_code_gathered(tensor, ctx, model))
        return (yield from self._ps_code(tensor, ctx, model))

    def _exchange_topk(self, tensor: Tensor, ctx: BucketContext) -> Exchange:
        layout = self._layout(ctx)
        indices = self._top(tensor, ctx, [s.slots for s in layout.segments])
        values = tensor.index_select(0, indices)
        yield SentExactly(indices)
        gathered = yield AllGather((values, indices.to(self._index_dtype(ctx))))
        out = tensor.zero_()
        for vals, idx in gathered:  # rank order: the same sum on every rank
            out.index_add_(0, idx.long(), vals.to(ctx.dtype))
        data = torch.stack([vals.float() for vals, _ in gathered])
        self._stage_data(
            ctx,
            values=data,
            indices=torch.stack([idx.long() for _, idx in gathered]),
            innovation=self._innovation_of(data, ctx),
        )
        return out.div_(ctx.world_size)

    def _ps_round_one(
        self, tensor: Tensor, ctx: BucketContext, model: LGCAutoencoder
    ) -> Generator[Any, Any, tuple[Tensor, Tensor, Tensor, Tensor, list]]:
        """Both forms' first two rounds: the leader's code and indices, then every rank's innovation and factors.

        Returns the leader's code, its indices, this rank's decoded values and innovation indices, and what was
        all-gathered: every rank's ``(innovation values, indices, factors)``.
        """
        layout = self._layout(ctx)
        code, blob = self._ps_broadcast(model, tensor, layout, ctx)
        code, shared = yield Broadcast((code, blob), src=self.leader_of(ctx))
        indices = torch.cat(decode_sparse(layout, shared))
        own = self._top(tensor, ctx, self._innovation_counts(ctx))
        decoded, factors = self._ps_mine(model, tensor, code, indices, own, ctx)
        gathered = yield AllGather((tensor.index_select(0, own), own.to(self._index_dtype(ctx)), factors))
        return code, indices, decoded, own, gathered

    def _ps_code(self, tensor: Tensor, ctx: BucketContext, model: LGCAutoencoder) -> Exchange:
        code, indices, decoded, own, gathered = yield from self._ps_round_one(tensor, ctx, model)
        parts = [
            self._ps_contribution(
                decoded if j == ctx.rank else self._ps_decoded(model, j, code, indices, values, idx.long(), ctx),
                factors,
                indices,
                values,
                idx.long(),
                ctx,
            )
            for j, (values, idx, factors) in enumerate(gathered)
        ]
        # what the aggregate used for this rank: its (projected) decoded values at the leader's indices, its
        # innovation exactly at its own
        yield SentAt(indices, parts[ctx.rank][0], exactly=own)
        out = tensor.zero_()
        for (values, correction), (_, idx, _) in zip(parts, gathered):
            out.index_add_(0, indices, values).index_add_(0, idx.long(), correction)
        return out.div_(ctx.world_size)

    def _ps_code_gathered(self, tensor: Tensor, ctx: BucketContext, model: LGCAutoencoder) -> Exchange:
        """``ps_form="gather"``: the leader decodes every rank and broadcasts the average at the indices it touched."""
        leader = self.leader_of(ctx)
        code, indices, decoded, own, gathered = yield from self._ps_round_one(tensor, ctx, model)
        touched = torch.cat([idx.long() for _, idx, _ in gathered])  # every rank's innovation indices, in rank order
        k = indices.numel()
        mine = self._ps_contribution(decoded, gathered[ctx.rank][2], indices, gathered[ctx.rank][0], own, ctx)[0]
        if ctx.rank == leader:
            # the all-gather form's sum, in the same order, so that both forms agree bitwise
            total = torch.zeros_like(tensor)
            for j, (values, idx, factors) in enumerate(gathered):
                dec = decoded if j == ctx.rank else self._ps_decoded(model, j, code, indices, values, idx.long(), ctx)
                dec, correction = self._ps_contribution(dec, factors, indices, values, idx.long(), ctx)
                total.index_add_(0, indices, dec).index_add_(0, idx.long(), correction)
            total.div_(ctx.world_size)
            averaged = torch.cat([total.index_select(0, indices), total.index_select(0, touched)])
        else:
            averaged = torch.zeros(k + touched.numel(), dtype=ctx.dtype, device=ctx.device)
        yield SentAt(indices, mine, exactly=own)
        (averaged,) = yield Broadcast((averaged,), src=leader)
        out = tensor.zero_().index_copy_(0, indices, averaged[:k])
        return out.index_copy_(0, touched, averaged[k:])

    # ------------------------------------------------------------------------------------------------------------
    # Bytes
    # ------------------------------------------------------------------------------------------------------------
    def _sparse_bytes(self, ctx: BucketContext, stage: int, layout: SparseLayout, b: int) -> int:
        """Stage 2 or 3's bytes for one bucket.

        With ``k`` top-k slots, ``k_u`` innovation slots, ``c`` code numbers, ``L`` layers (one scale each), ``B``
        the leader's index blob and ``p(x) = 8 ceil(x / 8)``:

        * stage 2: ``p(b k) + p(4 k) + 8`` (the all-gather of values and int32 indices, packed with the flag);
        * stage 3: ``p(b k_u) + p(4 k_u) + 8``, plus ``p(4 L)`` with ``project`` (the factors), plus
          ``p(4 (c + L)) + B`` on the leader, and with
          ``ps_form="gather"`` also ``p(b (k + n k_u))`` on the leader (the averaged values).
        """
        k, blob = layout.slots, index_blob_nbytes(layout)
        lead = ctx.rank == self.leader_of(ctx)
        index = torch.empty(0, dtype=self._index_dtype(ctx)).element_size()
        if stage == 2:
            return pad8(b * k) + pad8(index * k) + 8
        k_u = sum(self._innovation_counts(ctx))
        sent = pad8(b * k_u) + pad8(index * k_u) + 8 + (pad8(4 * len(ctx.layers)) if self.project is not False else 0)
        if not lead:
            return sent
        sent += pad8(4 * (self._code_numel(ctx) + len(ctx.layers))) + blob
        return sent + (pad8(b * (k + ctx.world_size * k_u)) if self.ps_form == "gather" else 0)
