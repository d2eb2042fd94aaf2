"""LGC, the all-reduce variant: every rank's code of the leader's top-k slots is summed, one decoder decodes it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import torch
from torch import Tensor
from torch.nn import functional as F  # noqa: N812 (the usual alias)

from lightning_gradcomp.compressors.base import BucketContext, Collective, Payload
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
from lightning_gradcomp.engine.requests import (
    AllGather,
    AllReduce,
    Broadcast,
    Exchange,
    OwedAt,
    SentAt,
    SentExactly,
)
from lightning_gradcomp.validation import check_bool, check_choice, check_number

__all__ = ["LGCAllReduce"]

_ORDERS = ("index", "value")
_RESIDUALS = ("average", "own")


class LGCAllReduce(LGCBase):
    """Learned gradient compression, the all-reduce variant: the ranks' codes are averaged, one decoder decodes them.

    Abrahamyan, Chen, Bekoulis & Deligiannis, "Learned Gradient Compression for Distributed Deep Learning", IEEE
    TNNLS 2021 (doi:10.1109/TNNLS.2021.3084806, arXiv:2103.08870), its ring-all-reduce instance. Stage 1
    (``dense_steps``) averages densely. The leader (rotating by default, as
    :class:`~lightning_gradcomp.compressors.ScaleCom`) broadcasts its top-k indices, with one scale per layer in
    stage 3. Stage 2 (``training_steps``) all-gathers every rank's values there (ScaleCom's CLT-k), on which every
    rank trains the same autoencoder; stage 3 all-reduces every rank's code ``E(x_i / s)`` and one decoder maps the
    averaged code to the averaged values, which ``project`` scales to their least-squares fit to the true average
    (one more all-reduce of one number per layer). Error feedback keeps what the aggregate did not use for this
    rank (``residual``), optionally low-pass filtered (``beta``). The parameter-server instance is
    :class:`~lightning_gradcomp.compressors.LGC`; docs/lgc.md has the design, its sources and measurements.

    Args:
        ratio: fraction of each layer's entries in the top-k, in (0, 1].
        dense_steps: steps of stage 1 (dense), an integer >= 0.
        training_steps: steps of stage 2 (top-k while the autoencoder trains), an integer >= 0.
        leader: ``"fixed"`` (rank 0) or ``"rotating"`` (``step mod n``); ``None``: rotating.
        channels: the encoder's stride-2 convolution widths.
        decoder_channels: the decoder's stride-2 transposed convolution widths.
        latent_channels: channels of the code; the code holds about ``latent_channels / 2**len(channels)`` numbers
            per top-k value.
        linear_encoder: no activations in the encoder, so that the average of the codes is the code of the average.
        lr: the autoencoder's learning rate (Adam's 1e-2: chosen over 1e-3 on the CIFAR-shaped digits, docs/lgc.md).
        optimizer: ``"adam"`` or ``"sgd"``.
        momentum: SGD's momentum, in [0, 1) (``"sgd"`` only).
        reconstruction_weight: ``lambda1`` of the loss (>= 0).
        similarity_weight: ``lambda2`` of the loss (>= 0); ``None``: 0 (the codes are averaged anyway, and the term
            stops the autoencoder from learning: docs/lgc.md).
        normalize: divide the values by the leader's root mean square before encoding (sent along, one float).
        project: ``None`` or ``True``: scale the decoded average of each layer to its least-squares fit to the true
            average, clamped to [0, ``max_factor``], from one more all-reduce of one number per layer (a third round).
        max_factor: the upper bound of that factor, > 0; ``None``: none. Any bound keeps the update no further from
            the true average than no update (the clamped least-squares factor never does worse than 0, which the
            interval holds). With ``residual="own"`` each rank keeps ``(1 - f) p_i``, no larger than ``p_i`` while
            ``f <= 2``. 1 (the default) never scales the decoded values up; the decoder tends to output too little
            (docs/lgc.md measures the factor and a bound of 2). Needs ``project``.
        seed: the autoencoder's seed (its initialisation and the random rank of each training step).
        beta: ScaleCom's low-pass filtered memory, ``m <- (1 - beta) m + beta r`` with ``r`` what the aggregate did
            not use, in (0, 1]; ``m / beta`` is then what is owed. ``None``: 1, plain error feedback. Needs error
            feedback.
        order: the order of the leader's top-k slots, the sequence the autoencoder sees: ``"value"`` (``None``), the
            leader's values largest (signed) first, sent as int32 lists; ``"index"``, increasing index (the indices
            may go as a bitmap).
        residual: what a rank's error feedback counts as sent in stage 3. ``"own"`` (``None``; ScaleCom's
            accounting): the share ``f`` of its own values that the projected aggregate carried, so each rank keeps
            ``(1 - f) p_i`` at the slots; needs ``project``. ``"average"`` (``None`` with ``project=False``): the
            decoded average itself, so that ``sum of updates + mean residual`` telescopes exactly. Needs error
            feedback.

    Raises:
        ValueError: If an argument is out of range or of the wrong type.

    Example::

        >>> from lightning_gradcomp.compressors import LGCAllReduce
        >>> LGCAllReduce(dense_steps=100, training_steps=200).residual_accounting
        'own'
    """

    variant: ClassVar[str] = "allreduce"
    default_leader: ClassVar[str] = "rotating"  # as ScaleCom
    default_similarity_weight: ClassVar[float] = 0.0

    def __init__(
        self,
        ratio: float = 1e-3,
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
        project: bool | None = None,
        seed: int = 0,
        beta: float | None = None,
        order: str | None = None,
        residual: str | None = None,
        max_factor: float | None = 1.0,
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
        self.project = check_bool(project, "project", allow_none=True)
        self.beta = check_number(beta, "beta", low=0.0, high=1.0, low_open=True, allow_none=True)
        self.order = check_choice(order, "order", (None, *_ORDERS))
        self.residual = check_choice(residual, "residual", (None, *_RESIDUALS))
        self.max_factor = check_number(max_factor, "max_factor", low=0.0, low_open=True, allow_none=True)
        if project is False and max_factor != 1.0:
            raise ValueError(
                f"Expected `max_factor` to be 1.0 (the default) with project=False (it bounds the projection's factor),"
                f" got {max_factor!r}."
            )
        if residual == "own" and project is False:
            raise ValueError(
                "Expected `project` to be None or True with residual='own' (the share each rank counts as sent is the"
                " projection's factor), got False."
            )

    @property
    def memory_beta(self) -> float:
        """The error-feedback memory's low-pass coefficient in use: ``beta``, or 1 (plain error feedback)."""
        return 1.0 if self.beta is None else self.beta

    @property
    def slot_order(self) -> str:
        """The order of the leader's top-k slots in use: ``order``, or ``"value"``."""
        return "value" if self.order is None else self.order

    @property
    def residual_accounting(self) -> str:
        """The stage-3 accounting in use: ``residual``, or ``"own"`` (``"average"`` without the projection)."""
        if self.residual is not None:
            return self.residual
        return "average" if self.project is False else "own"

    def check_error_feedback(self, enabled: bool | None) -> None:
        """Refuse ``beta`` or ``residual`` without error feedback: both only change what the memory keeps."""
        if self.resolve_error_feedback(enabled):
            return
        for name in ("beta", "residual"):
            if getattr(self, name) is not None:
                raise ValueError(
                    f"Expected `{name}` to be None without error feedback (it sets what the error-feedback memory"
                    f" keeps), got {getattr(self, name)!r}; turn error feedback on (`error_feedback=None` or `True`)"
                    " or leave it unset."
                )

    @property
    def collective(self) -> Collective:
        """``"allreduce"``: the ranks' codes are summed."""
        return "allreduce"

    @property
    def residual_beta(self) -> float:
        """:attr:`memory_beta`: ScaleCom's low-pass filtered memory (the driver's), 1 without ``beta``."""
        return self.memory_beta

    # ------------------------------------------------------------------------------------------------------------
    # Training: the average of every rank's values from the average of their codes
    # ------------------------------------------------------------------------------------------------------------
    def _encoding_scale(self, scales: Tensor, chosen: Tensor) -> Tensor:
        """Stage 3 encodes every rank's values by the leader's scale: here the chosen rank's."""
        return chosen

    def _reconstruction(
        self, model: LGCAutoencoder, entry: dict[str, Tensor], codes: Tensor, r: int, s: Tensor
    ) -> Tensor:
        """``MSE(mean_j x_j, D(mean_j E(x_j)))``, the values divided by rank ``r``'s scale ``s``."""
        values = entry["values"]
        decoded = model.decode(0, codes.mean(0, keepdim=True), values.shape[1])
        return F.mse_loss(decoded[0], values.mean(0) / s)

    # ------------------------------------------------------------------------------------------------------------
    # The contract for one rank on its own (its own leader)
    # ------------------------------------------------------------------------------------------------------------
    def _compress_sparse(self, tensor: Tensor, ctx: BucketContext, stage: int, layout: SparseLayout) -> Payload:
        """Stage 2: index blob, values. Stage 3: index blob, scales, code (and with ``project``, the dot products)."""
        if stage == 2:
            blob = self._leader_blob(tensor, layout)
            return blob, tensor.index_select(0, torch.cat(decode_sparse(layout, blob)))
        model = self._autoencoder(ctx)
        blob = self._leader_blob(tensor, layout)
        indices = torch.cat(decode_sparse(layout, blob))
        x = tensor.index_select(0, indices).float()
        scales = self._scales(x, ctx)
        z = encode_layers(model, x, scales, self._segments(ctx))
        if not self._projects:
            return blob, scales, z
        return blob, scales, z, self._dots(x, decode_layers(model, 0, z, scales, self._segments(ctx)), ctx)

    def _decompress_sparse(
        self, payload: Payload, ctx: BucketContext, out: Tensor | None, stage: int, layout: SparseLayout
    ) -> Tensor:
        """Stage 2: the values at the blob's indices. Stage 3: the decoded (and projected) values there."""
        if stage == 2:
            blob, values = payload
            indices = torch.cat(decode_sparse(layout, blob))
            return ctx.output(out, zeros=True).index_copy_(0, indices, values.to(ctx.dtype))
        model = self._autoencoder(ctx)
        blob, scales, z = payload[:3]
        indices = torch.cat(decode_sparse(layout, blob))
        decoded = decode_layers(model, 0, z, scales, self._segments(ctx))
        if self._projects:
            decoded = self._projected(decoded, self._factors(decoded, payload[3], ctx), ctx)
        decoded = decoded.to(ctx.dtype)
        return ctx.output(out, zeros=True).index_copy_(0, indices, decoded)

    # ------------------------------------------------------------------------------------------------------------
    # The reduction
    # ------------------------------------------------------------------------------------------------------------
    def _exchange_topk(self, tensor: Tensor, ctx: BucketContext) -> Exchange:
        layout, leader = self._layout(ctx), self.leader_of(ctx)
        if ctx.rank == leader:
            blob = self._leader_blob(tensor, layout)
        else:  # filled by the broadcast; the size depends only on the layout
            blob = torch.zeros(index_blob_nbytes(layout), dtype=torch.uint8, device=ctx.device)
        (shared,) = yield Broadcast((blob,), src=leader)
        indices = torch.cat(decode_sparse(layout, shared))
        values = tensor.index_select(0, indices)
        yield SentExactly(indices)  # with ``beta``, low-pass filtered by the driver
        gathered = yield AllGather((values,))
        total = gathered[0][0].to(ctx.dtype).clone()
        for (vals,) in gathered[1:]:
            total.add_(vals.to(ctx.dtype))
        self._stage_data(ctx, values=torch.stack([vals.float() for (vals,) in gathered]))
        return tensor.zero_().index_copy_(0, indices, total.div_(ctx.world_size))

    def _exchange_code(self, tensor: Tensor, ctx: BucketContext, model: LGCAutoencoder) -> Exchange:
        layout, leader = self._layout(ctx), self.leader_of(ctx)
        if ctx.rank == leader:
            blob = self._leader_blob(tensor, layout)
            scales = self._scales(tensor.index_select(0, torch.cat(decode_sparse(layout, blob))).float(), ctx)
        else:
            blob = torch.zeros(index_blob_nbytes(layout), dtype=torch.uint8, device=ctx.device)
            scales = torch.zeros(len(ctx.layers), dtype=torch.float32, device=ctx.device)
        shared, scales = yield Broadcast((blob, scales), src=leader)
        indices = torch.cat(decode_sparse(layout, shared))
        z = encode_layers(model, tensor.index_select(0, indices), scales, self._segments(ctx))
        (summed,) = yield AllReduce((z.div_(ctx.world_size),))
        decoded = decode_layers(model, 0, summed, scales, self._segments(ctx))
        if self._projects:
            # the decoded average scaled, per layer, to its least-squares fit to the true average (clamped to
            # [0, max_factor]): the update never moves further from the average than no update would, however poorly
            # the autoencoder decodes
            dots = self._dots(tensor.index_select(0, indices).float(), decoded, ctx).div_(ctx.world_size)
            (dots,) = yield AllReduce((dots,))
            factors = self._factors(decoded, dots, ctx)
            decoded = self._projected(decoded, factors, ctx)
        decoded = decoded.to(ctx.dtype)
        if ctx.error_feedback:  # with ``beta``, low-pass filtered by the driver
            if self.residual_accounting == "own":
                # ScaleCom's accounting: the aggregate carried a share `factor` of the average, so every rank counts
                # that share of its own values as sent and keeps the rest; its deviation from the average, which no
                # code of the average can carry, is not owed (see the class docstring)
                kept = torch.cat([(1.0 - f).expand(k) for f, (_, _, k) in zip(factors, self._segments(ctx))])
                yield OwedAt(indices, tensor.index_select(0, indices) * kept.to(ctx.dtype))
            else:
                # every rank's share of the aggregate is the aggregate: sum of updates + mean residual telescopes
                yield SentAt(indices, decoded)
        return tensor.zero_().index_copy_(0, indices, decoded)

    @property
    def _projects(self) -> bool:
        return self.project is not False

    def _dots(self, x: Tensor, decoded: Tensor, ctx: BucketContext) -> Tensor:
        """Per layer ``<x, decoded>`` over the slots (float32)."""
        return layer_dots(x, decoded, self._segments(ctx))

    def _factors(self, decoded: Tensor, dots: Tensor, ctx: BucketContext) -> list[Tensor]:
        """Per layer ``clamp(dots / |decoded|^2, 0, max_factor)`` (:func:`fit_factors`), 0-dim tensors."""
        return fit_factors(decoded, dots, self._segments(ctx), self.max_factor)

    def _projected(self, decoded: Tensor, factors: Sequence[Tensor], ctx: BucketContext) -> Tensor:
        """``decoded`` scaled per layer by its factor (:meth:`_factors`)."""
        return scaled(decoded, factors, self._segments(ctx))

    # ------------------------------------------------------------------------------------------------------------
    # Bytes
    # ------------------------------------------------------------------------------------------------------------
    def _sparse_bytes(self, ctx: BucketContext, stage: int, layout: SparseLayout, b: int) -> int:
        """Stage 2 or 3's bytes for one bucket.

        With ``k`` top-k slots, ``c`` code numbers, ``L`` layers (one scale each), ``B`` the leader's index blob and
        ``p(x) = 8 ceil(x / 8)``:

        * stage 2: ``p(b k) + 8``, plus ``B`` on the leader;
        * stage 3: ``4 c + 4``, plus ``B + p(4 L)`` on the leader (its blob and scales), plus ``4 L`` with ``project``
          (one dot product per layer).
        """
        k, blob = layout.slots, index_blob_nbytes(layout)
        lead = ctx.rank == self.leader_of(ctx)
        if stage == 2:
            return pad8(b * k) + 8 + (blob if lead else 0)
        projection = 4 * len(ctx.layers) if self._projects else 0
        return 4 * self._code_numel(ctx) + 4 + projection + (blob + pad8(4 * len(ctx.layers)) if lead else 0)
