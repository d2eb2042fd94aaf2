"""LGC: learned gradient compression, an autoencoder trained during training carries the top-k values."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor
from torch.nn import functional as F  # noqa: N812 (the usual alias)

from lightning_gradcomp.compressors.base import (
    BucketContext,
    Collective,
    Compressor,
    Layer,
    Payload,
    derive_seed,
    keep_count,
)
from lightning_gradcomp.compressors.exchange import (
    AllGather,
    AllReduce,
    Broadcast,
    Exchange,
    Lossless,
    OwedAt,
    SentAt,
    SentExactly,
)
from lightning_gradcomp.compressors.lgc_autoencoder import LGCAutoencoder, latent_numel, optimizer_state, optimizer_step
from lightning_gradcomp.compressors.scalecom import index_blob_nbytes, top_k_blob
from lightning_gradcomp.compressors.sparse import SparseLayout, decode_sparse, sparse_layout
from lightning_gradcomp.compressors.sparsify import sampled_topk_indices, topk_indices
from lightning_gradcomp.validation import check_bool, check_choice, check_int, check_number, check_ratio

__all__ = ["LGC"]

_VARIANTS = ("ps", "allreduce")
_LEADERS = ("fixed", "rotating")
_OPTIMIZERS = ("adam", "sgd")
_PS_FORMS = ("allgather", "gather")
_ORDERS = ("index", "value")
_RESIDUALS = ("average", "own")


def _pad8(nbytes: int) -> int:
    return -(-nbytes // 8) * 8


def _channels(value: Any, name: str) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError(f"Expected `{name}` to be a non-empty sequence of positive integers, got {value!r}.")
    return tuple(check_int(c, name, low=1) for c in value)


def _top_k(values: Tensor, k: int) -> Tensor:
    """Indices of the ``k`` largest ``|values|`` (unsorted): ``topk_indices``, except for a few indices on the CPU.

    ``topk_indices`` samples about ``64 n / k`` elements to bracket the k-th largest; for the innovation's handful
    (1e-5 of a layer) that sample is the whole layer. Here a fixed sample of 8192 brackets the top 1% instead
    (:func:`sampled_topk_indices`: exact, with the full ``topk`` when fewer than ``k`` elements are above the bound).
    """
    n = values.numel()
    if k > 128:
        return topk_indices(values, k)
    if values.device.type != "cpu" or n < (1 << 16):
        return torch.topk(values.abs(), k, sorted=False).indices
    return sampled_topk_indices(values, k, 8192, 82)


def _dot(a: Tensor, b: Tensor) -> Tensor:
    """``<a, b>`` as a product and a sum, whose rounding does not depend on where the slices lie in memory.

    ``torch.dot`` on the CPU calls BLAS, which sums in an order set by the pointer's alignment: a layer's dot product
    then changed with its place in DDP's bucket, which changes across a resume (DDP's first step puts every layer in
    one bucket), and the resumed run was no longer bitwise the uninterrupted one.
    """
    return (a * b).sum()


def _rms(values: Tensor) -> Tensor:
    """The root mean square of the last dimension, shaped for broadcasting: ``[..., 1]``.

    Squares overflow fp32 from about ``1.8e19`` (their sum sooner): where the plain root mean square is infinite but
    the values are finite, it is computed again from the values divided by their largest magnitude. An infinite
    scale would zero the codes and decode to ``0 * inf``, a NaN that error feedback would keep in the residual. The
    plain computation is kept everywhere else, so the scales' bits do not change.
    """
    rms = values.pow(2).mean(-1, keepdim=True).sqrt()
    peak = values.abs().amax(-1, keepdim=True)
    rescaled = peak * (values / peak).pow(2).mean(-1, keepdim=True).sqrt()
    return torch.where(torch.isinf(rms) & torch.isfinite(peak), rescaled, rms)


def _divisor(scale: Tensor) -> Tensor:
    """What values are divided by before encoding: the scale, or 1 where it is 0 (all-zero values)."""
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def _scale(values: Tensor) -> Tensor:
    """The root mean square of the last dimension (1 where it is 0), shaped for broadcasting: ``[..., 1]``."""
    return _divisor(_rms(values))


class LGC(Compressor):
    """Learned gradient compression: dense, then top-k while an autoencoder learns, then the autoencoder's code.

    Abrahamyan, Chen, Bekoulis & Deligiannis, "Learned Gradient Compression for Distributed Deep Learning", IEEE
    TNNLS 2021 (doi:10.1109/TNNLS.2021.3084806, arXiv:2103.08870). The gradients of the ranks are correlated; an
    autoencoder trained during the first stages of training captures what they have in common, so that a short code
    (plus, for the parameter-server variant, a tiny per-rank "innovation") replaces the top-k values. Three stages,
    keyed on the step (the same on every rank, checkpointed):

    1. ``step < dense_steps``: dense averaging (an all-reduce; error feedback owes nothing afterwards);
    2. ``step < dense_steps + training_steps``: top-k at ``ratio`` per layer with error feedback; the values that
       every rank receives anyway are the autoencoder's training data, so every rank trains the same autoencoder
       with no extra communication (one optimizer step per training step, on the data of the step before, see below);
    3. afterwards: the autoencoder carries the values.

    **Variant ``"ps"``** (the paper's parameter-server protocol mapped onto collectives). Stage 2 all-gathers every
    rank's top-k (values and int32 indices), as :class:`~lightning_gradcomp.compressors.TopK`. Stage 3: every rank
    all-gathers its innovation (its top ``innovation_ratio`` per layer: values and indices, round 0), and the leader
    broadcasts its code ``E(x_m / s_m)``, its scale ``s_m`` and its top-k indices ``I_m`` (round 1). Every rank then
    decodes every rank ``j``'s values at ``I_m`` with rank ``j``'s decoder, from the leader's code and ``j``'s
    innovation in ``I_m``'s slots; rank ``j``'s contribution is those values at ``I_m``, with its innovation, exact,
    at its own indices; the aggregate is the average of the contributions, computed alike on every rank. The
    all-gather form (``ps_form="allgather"``, the default) moves fewer bytes than the gather-to-the-leader form
    (``ps_form="gather"``: only the leader decodes every rank, and it broadcasts the ``k`` averaged values with its
    code and indices, so that each other rank decodes only itself, for its error feedback); the two give bitwise
    the same aggregate and residuals. docs/lgc.md has their measured bytes and times.

    **Variant ``"allreduce"``** (the paper's ring-all-reduce instance). The leader's top-k indices are broadcast to
    every rank (round 0, as :class:`~lightning_gradcomp.compressors.ScaleCom`), with its scale in stage 3. Stage 2
    all-gathers every rank's values there (the decoder is trained on every rank's values); stage 3 all-reduces
    every rank's code ``E(x_i / s)`` (round 1) and one decoder maps the averaged code to the averaged values. With
    ``linear_encoder=True`` the encoder has no activation, so the average of the codes is the code of the average.
    With ``project`` (on by default) one more all-reduce of ``<x_i, decoded>`` per layer (round 2) scales the decoded
    average to its least-squares fit to the true average, clamped to [0, 1].

    **Error feedback** subtracts what the aggregate used for this rank: stage 2, the sent entries; stage 3 ``"ps"``,
    the decoded values at the leader's indices and the innovation at its own (not the stale stage-2 mask of the
    third-party code); stage 3 ``"allreduce"``, by default (``residual="own"``, ScaleCom's accounting) the share
    ``f`` of its own values that the projected aggregate carried (``m_i = (1 - f) p_i`` at the shared indices: the
    ranks' deviations from the average are dropped, not owed); with ``residual="average"`` the decoded average
    itself (every rank's share of the aggregate is the aggregate, so ``sum of updates + mean residual`` telescopes
    exactly; with ``beta < 1``, ``sum of updates + mean residual / beta``).

    **The all-reduce variant's defaults** send the leader's slots in value order, train without the code-similarity
    term and use ScaleCom's accounting. With its first defaults (index order, ``similarity_weight=0.5``,
    ``"average"``) its stage 3 carried almost none of the average; over ten seeds of the CIFAR-shaped digits at a
    learning rate where dense training is stable, the new defaults end 0.50 points below dense on average and the
    first ones 8.44 (docs/lgc.md, "The all-reduce variant repaired").

    **What follows what.** From the paper's abstract: the two instances, the autoencoder trained during the first
    stages of training, inter-node redundancy, a lightweight network. From the third-party implementation (a
    federated-learning framework, the only code found): the three stages and their default lengths (200 and 300
    rounds), ``ratio`` 1e-3, ``innovation_ratio`` 1e-5, the architecture, the loss ``lambda1 sum_j MSE(x_j, D_j(E(x_r),
    u_j)) + lambda2 sum_{i != j} MSE(E(x_i), E(x_j))`` with ``x_r`` a random rank's values and ``lambda1 = lambda2 =
    0.5``, the fixed leader (rank 0). This package's design (configurable): training targets aligned to the
    chosen rank's indices (the third-party code compares each rank's values in its own order, which assumes the
    supports coincide), normalisation by the leader's root mean square, Adam (the third-party code uses SGD with
    ``lr=1e-3``: ``optimizer="sgd"``), smaller default channels, the mapping onto collectives, and the whole
    all-reduce variant: its objective (``D(mean_i E(x_i)) ~ mean_i x_i``), the rotating leader, the linear encoder,
    the projection, ScaleCom's low-pass memory (``beta``) and accounting (``residual``), the value order and the
    all-reduce variant's ``similarity_weight`` of 0 are not from the paper's text, which could not be read.

    **When the autoencoder trains.** The values of step ``t`` are staged (kept only if the step is finite on every
    rank) and trained on at the start of step ``t + 1``, on the main thread, in bucket order: training inside a
    bucket's last callback would run on the collectives' threads in an order that may differ between ranks. The new
    weights and optimizer state are staged too, so a non-finite step leaves the autoencoder as it was, and a resume
    is bitwise exact (the weights, the optimizer state and the pending data are in :meth:`state_dict`).

    Args:
        variant: ``"ps"`` or ``"allreduce"``.
        ratio: fraction of each layer's entries in the top-k, in (0, 1].
        innovation_ratio: ``"ps"`` only: fraction of each layer's entries in a rank's innovation, in (0, ratio);
            ``None`` gives 1e-5 (the third-party default).
        dense_steps: steps of stage 1 (dense), an integer >= 0.
        training_steps: steps of stage 2 (top-k while the autoencoder trains), an integer >= 0.
        leader: ``"fixed"`` (rank 0) or ``"rotating"`` (``step mod n``); ``None``: fixed for ``"ps"`` (third-party
            code), rotating for ``"allreduce"`` (as ScaleCom).
        channels: the encoder's stride-2 convolution widths (third-party: ``(64, 128, 256, 64)``).
        decoder_channels: each decoder's stride-2 transposed convolution widths (third-party: ``(32, 64, 128, 32)``).
        latent_channels: channels of the code; the code holds about ``latent_channels / 2**len(channels)`` numbers
            per top-k value (1/4 by default, as the third-party code).
        linear_encoder: no activations in the encoder.
        lr: the autoencoder's learning rate.
        optimizer: ``"adam"`` or ``"sgd"`` (third-party: SGD, ``lr=1e-3``).
        momentum: SGD's momentum, in [0, 1) (``"sgd"`` only).
        reconstruction_weight: ``lambda1`` of the loss (>= 0).
        similarity_weight: ``lambda2`` of the loss (>= 0); ``None``: 0.5 for ``"ps"`` (third-party code), 0 for
            ``"allreduce"``, whose codes are averaged anyway and whose autoencoder the term stops from learning
            (docs/lgc.md).
        normalize: divide the values by the leader's root mean square before encoding (sent along, one float).
        project: ``"allreduce"`` only (``None``: on): scale the decoded average of each layer to its least-squares
            fit to the true average, clamped to [0, 1], from one more all-reduce of one number per layer (a third
            round). This package's design: without it the all-reduce variant diverged on the digits task
            (docs/lgc.md).
        ps_form: ``"ps"`` only (``None``: ``"allgather"``): ``"allgather"``, every rank decodes every rank from the
            leader's broadcast code; ``"gather"``, the innovations go to every rank as before (an all-gather: they
            are a few hundred bytes, and the exchange has no gather), the leader alone decodes every rank and
            broadcasts the averaged values with its code and indices, and every other rank decodes only its own
            values (for its error feedback). Both give bitwise the same results; they differ in bytes and time.
        seed: the autoencoder's seed (its initialisation and the random rank of each training step).
        beta: ``"allreduce"`` only (``None``: 1, plain error feedback): ScaleCom's low-pass filtered memory,
            ``m <- (1 - beta) m + beta r`` with ``r`` what the aggregate did not use, in (0, 1]; ``m / beta`` is
            then what is owed. Stage 2 of the all-reduce variant is ScaleCom's CLT-k (the leader's indices for
            every rank), which ScaleCom's paper pairs with this filter. On the CIFAR-shaped digits ``beta=0.5``
            rescued the seed on which plain error feedback stalled at chance in stage 2, and cost accuracy on
            others (docs/lgc.md): not the default. Needs error feedback.
        order: ``"allreduce"`` only (``None``: ``"value"``): the order of the leader's top-k slots, which is the
            sequence the autoencoder sees. ``"index"``, increasing index (the indices may go as a bitmap);
            ``"value"``, the leader's values largest (signed) first, sent as int32 lists (the same bytes wherever a
            list is smaller than a bitmap, below a density of 1/32). In index order the values have no structure a
            convolutional autoencoder can use; in value order the leader's values are a decreasing curve and every
            rank's follow it as far as they agree. This package's design (docs/lgc.md).
        residual: ``"allreduce"`` only (``None``: ``"own"``; ``"average"`` with ``project=False``): what a rank's
            error feedback counts as sent in stage 3. ``"average"``, the aggregate itself: ``sum of updates + mean
            residual`` telescopes exactly, but each rank's memory also keeps its deviation from the average at the
            leader's slots, which no code of the average can carry, step after step. ``"own"``, ScaleCom's
            accounting: the aggregate carried a share ``f`` of the average (the projection's factor, per layer), and
            every rank counts that share of its own values there as sent (``m_i = (1 - f) p_i`` at the slots; with
            ``f = 1``, ScaleCom's ``m_i = 0``); the deviations and the decoder's error ``f (decoded - mean p)`` are
            dropped, not owed. Needs ``project`` and error feedback. This package's design (docs/lgc.md has the
            measurements that made ``order="value"``, ``similarity_weight=0`` and ``"own"`` the all-reduce variant's
            defaults).

    Raises:
        ValueError: If an argument is out of range or of the wrong type.

    Example::

        >>> from lightning_gradcomp.compressors import LGC
        >>> LGC(variant="allreduce", dense_steps=100, training_steps=200).variant
        'allreduce'
    """

    unbiased: ClassVar[bool] = False
    rounds: ClassVar[int] = 3  # the all-reduce variant's projection takes a third; the others return after two

    def __init__(
        self,
        variant: str = "ps",
        ratio: float = 1e-3,
        innovation_ratio: float | None = None,
        dense_steps: int = 200,
        training_steps: int = 300,
        leader: str | None = None,
        channels: Sequence[int] = (16, 32, 64, 16),
        decoder_channels: Sequence[int] = (8, 16, 32, 8),
        latent_channels: int = 4,
        linear_encoder: bool = False,
        lr: float = 1e-3,
        optimizer: str = "adam",
        momentum: float = 0.0,
        reconstruction_weight: float = 0.5,
        similarity_weight: float | None = None,
        normalize: bool = True,
        project: bool | None = None,
        seed: int = 0,
        ps_form: str | None = None,
        beta: float | None = None,
        order: str | None = None,
        residual: str | None = None,
    ) -> None:
        super().__init__()
        self.variant = check_choice(variant, "variant", _VARIANTS)
        self.ratio = check_ratio(ratio)
        if variant == "allreduce" and innovation_ratio is not None:
            raise ValueError(
                f"Expected `innovation_ratio` to be None with variant='allreduce' (a per-rank innovation does not"
                f" survive a sum), got {innovation_ratio!r}."
            )
        if variant == "ps":
            innovation_ratio = 1e-5 if innovation_ratio is None else innovation_ratio
            check_number(innovation_ratio, "innovation_ratio", low=0.0, high=self.ratio, low_open=True, high_open=True)
            innovation_ratio = float(innovation_ratio)
        self.innovation_ratio = innovation_ratio
        self.dense_steps = check_int(dense_steps, "dense_steps", low=0)
        self.training_steps = check_int(training_steps, "training_steps", low=0)
        self.leader = check_choice(leader, "leader", (None, *_LEADERS))
        self.channels = _channels(channels, "channels")
        self.decoder_channels = _channels(decoder_channels, "decoder_channels")
        self.latent_channels = check_int(latent_channels, "latent_channels", low=1)
        self.linear_encoder = check_bool(linear_encoder, "linear_encoder")
        self.lr = check_number(lr, "lr", low=0.0, low_open=True)
        self.optimizer = check_choice(optimizer, "optimizer", _OPTIMIZERS)
        self.momentum = check_number(momentum, "momentum", low=0.0, high=1.0, high_open=True)
        if optimizer == "adam" and momentum != 0.0:
            raise ValueError(f"Expected `momentum` to be 0 with optimizer='adam' (SGD only), got {momentum!r}.")
        self.reconstruction_weight = check_number(reconstruction_weight, "reconstruction_weight", low=0.0)
        self.similarity_weight = check_number(similarity_weight, "similarity_weight", low=0.0, allow_none=True)
        self.normalize = check_bool(normalize, "normalize")
        if variant == "ps" and project is not None:
            raise ValueError(f"Expected `project` to be None with variant='ps' (all-reduce only), got {project!r}.")
        self.project = check_bool(project, "project", allow_none=True)
        if variant == "allreduce" and ps_form is not None:
            raise ValueError(f"Expected `ps_form` to be None with variant='allreduce' (PS only), got {ps_form!r}.")
        self.ps_form = check_choice(ps_form, "ps_form", (None, *_PS_FORMS))
        if variant == "ps" and beta is not None:
            raise ValueError(f"Expected `beta` to be None with variant='ps' (all-reduce only), got {beta!r}.")
        self.beta = check_number(beta, "beta", low=0.0, high=1.0, low_open=True, allow_none=True)
        if variant == "ps" and order is not None:
            raise ValueError(f"Expected `order` to be None with variant='ps' (all-reduce only), got {order!r}.")
        self.order = check_choice(order, "order", (None, *_ORDERS))
        if variant == "ps" and residual is not None:
            raise ValueError(f"Expected `residual` to be None with variant='ps' (all-reduce only), got {residual!r}.")
        self.residual = check_choice(residual, "residual", (None, *_RESIDUALS))
        if residual == "own" and project is False:
            raise ValueError(
                "Expected `project` to be None or True with residual='own' (the share each rank counts as sent is the"
                " projection's factor), got False."
            )
        self.seed = check_int(seed, "seed", low=0)
        self._reset_autoencoder()

    def _reset_autoencoder(self) -> None:
        self._committed: dict[str, Tensor] | None = None  # weights and optimizer state as of the last finite step
        self._decoders = 0
        self._pending: dict[str, dict[str, Tensor]] = {}  # stage-2 data not trained on yet, per bucket
        self._model: LGCAutoencoder | None = None  # the working copy this step encodes and decodes with
        self._prepared_step: int | None = None

    @property
    def memory_beta(self) -> float:
        """The error-feedback memory's low-pass coefficient in use: ``beta``, or 1 (plain error feedback)."""
        return 1.0 if self.beta is None else self.beta

    @property
    def code_similarity_weight(self) -> float:
        """``lambda2`` in use: ``similarity_weight``, or 0.5 (PS, third-party code) or 0 (all-reduce)."""
        if self.similarity_weight is not None:
            return float(self.similarity_weight)
        return 0.5 if self.variant == "ps" else 0.0

    @property
    def slot_order(self) -> str:
        """The order of the leader's top-k slots in use: ``order``, or ``"value"`` (all-reduce), ``"index"`` (PS)."""
        if self.order is not None:
            return self.order
        return "value" if self.variant == "allreduce" else "index"

    @property
    def residual_accounting(self) -> str | None:
        """The all-reduce variant's stage-3 accounting in use: ``residual``, or ``"own"``.

        ``"average"`` without the projection, whose factor ``"own"`` needs; ``None`` for the PS variant.
        """
        if self.variant == "ps":
            return None
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
        """``"allgather"`` for the parameter-server variant, ``"allreduce"`` for the all-reduce one."""
        return "allgather" if self.variant == "ps" else "allreduce"

    # ------------------------------------------------------------------------------------------------------------
    # Stages, layouts, the leader
    # ------------------------------------------------------------------------------------------------------------
    def stage(self, step: int) -> int:
        """The stage at ``step``: 1 (dense), 2 (top-k, the autoencoder trains) or 3 (the autoencoder's code)."""
        if step < self.dense_steps:
            return 1
        return 2 if step < self.dense_steps + self.training_steps else 3

    def leader_of(self, ctx: BucketContext) -> int:
        """The rank whose indices (and code) every rank uses at this step."""
        leader = self.leader or ("fixed" if self.variant == "ps" else "rotating")
        return 0 if leader == "fixed" else ctx.step % ctx.world_size

    def _layout(self, ctx: BucketContext) -> SparseLayout:
        slots = [keep_count(layer.numel, self.ratio) for layer in ctx.layers]
        return sparse_layout(ctx.layers, slots, bitmaps=self.slot_order != "value")

    def _leader_blob(self, tensor: Tensor, layout: SparseLayout) -> Tensor:
        """The leader's top-k indices of every layer, in increasing index order or (``order="value"``) by value.

        In value order (largest signed value first) the leader's own values form a decreasing curve and every rank's
        values in those slots follow it as far as they agree with the leader: a sequence a convolutional
        autoencoder can learn, where the index order is one it cannot (docs/lgc.md).
        """
        return top_k_blob(tensor, layout, order=self.slot_order)

    def _innovation_counts(self, ctx: BucketContext) -> list[int]:
        assert self.innovation_ratio is not None
        return [keep_count(layer.numel, self.innovation_ratio) for layer in ctx.layers]

    def _top(self, tensor: Tensor, ctx: BucketContext, counts: Sequence[int]) -> Tensor:
        """Each layer's top-``counts`` indices of ``|tensor|``, global and sorted (int64)."""
        picked = [
            _top_k(layer.flat(tensor), k).sort().values + layer.offset for layer, k in zip(ctx.layers, counts)
        ]
        return torch.cat(picked) if picked else torch.zeros(0, dtype=torch.long, device=tensor.device)

    def _index_dtype(self, ctx: BucketContext) -> torch.dtype:
        return torch.int32 if ctx.numel < 2**31 else torch.int64

    # ------------------------------------------------------------------------------------------------------------
    # The autoencoder: built on first use, trained at the start of each step on the previous step's data
    # ------------------------------------------------------------------------------------------------------------
    def _build(self, decoders: int, device: torch.device) -> LGCAutoencoder:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(derive_seed(self.seed, 0x16C))
            model = LGCAutoencoder(decoders, self.channels, self.decoder_channels, self.latent_channels,
                                   innovation=self.variant == "ps", linear_encoder=self.linear_encoder)  # fmt: skip
        return model.to(device)

    def latent_numel(self, k: int) -> int:
        """Numbers in the code of ``k`` top-k values."""
        return latent_numel(k, len(self.channels), self.latent_channels)

    def _autoencoder(self, ctx: BucketContext) -> LGCAutoencoder:
        """The working autoencoder for this step (trained on the pending data first, when the step can stage)."""
        decoders = ctx.world_size if self.variant == "ps" else 1
        if self._committed is None and ctx.updates is None:
            # compress/decompress outside a reduction, before any: the initial autoencoder, not kept as state
            return self._build(decoders, ctx.device)
        if self._committed is None:
            model = self._build(decoders, ctx.device)
            params = {name: p.detach().clone() for name, p in model.named_parameters()}
            self._committed = {**params, **optimizer_state(params, self.optimizer)}
            self._decoders = decoders
            self._model = model
        elif self._decoders != decoders:
            raise RuntimeError(
                f"LGC's autoencoder has {self._decoders} decoder(s) (it was trained with that many ranks) but this run"
                f" has {ctx.world_size} ranks; the parameter-server variant needs one decoder per rank."
            )
        if next(iter(self._committed.values())).device != ctx.device:
            self._committed = {k: v.to(ctx.device) for k, v in self._committed.items()}
            self._pending = {key: {k: v.to(ctx.device) for k, v in e.items()} for key, e in self._pending.items()}
            self._model = None
        if self._model is None:
            self._model = self._build(decoders, ctx.device)
            self._prepared_step = None
        model = self._model
        if self._prepared_step != ctx.step or ctx.updates is None:
            with torch.no_grad():
                for name, p in model.named_parameters():
                    p.copy_(self._committed[name])
            if ctx.updates is not None:  # outside a reduction nothing can be staged: no training
                self._prepared_step = ctx.step
                self._train(model, ctx)
        return model

    def _train(self, model: LGCAutoencoder, ctx: BucketContext) -> None:
        """One optimizer step on every bucket's pending data; the result is staged (and used at once)."""
        assert self._committed is not None
        assert ctx.updates is not None
        entries = [(key, self._pending[key]) for key in sorted(self._pending)]
        on_cpu = ctx.device.type == "cpu"
        if on_cpu:  # reading a CPU flag costs nothing; on CUDA the step is masked instead (no host sync)
            entries = [(key, e) for key, e in entries if bool(e["fresh"])]
        if not entries:
            return
        params = dict(model.named_parameters())
        with torch.enable_grad():  # the hook runs inside the model's backward pass, where grad mode is off
            loss = torch.zeros((), device=ctx.device)
            for key, entry in entries:
                generator = torch.Generator().manual_seed(derive_seed(self.seed, ctx.seed, ctx.step, _hash_key(key)))
                part = self._loss(model, entry, generator)
                loss = loss + (part if on_cpu else part * entry["fresh"].float())
            grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
        grads_by_name = {name: torch.zeros_like(p) if g is None else g for (name, p), g in zip(params.items(), grads)}
        state = {k: v for k, v in self._committed.items() if k not in params}
        # a finite gradient spike can still overflow the fp32 loss or its gradients (a rank's values divided by
        # another rank's scale): such a step is skipped, or the autoencoder would keep a NaN that every later code
        # carries. Its data is dropped all the same.
        finite = torch.isfinite(torch.stack([loss.detach(), *(g.sum() for g in grads_by_name.values())]).sum())
        if not on_cpu or bool(finite):
            apply = None if on_cpu else torch.stack([e["fresh"] for _, e in entries]).any() & finite
            new = optimizer_step({n: p.detach() for n, p in params.items()}, grads_by_name, state,
                                 kind=self.optimizer, lr=self.lr, momentum=self.momentum, apply=apply)  # fmt: skip
            with torch.no_grad():
                for name, p in params.items():
                    p.copy_(new[name])
            for key, value in new.items():
                ctx.stage(self._committed[key], value)
        for _, entry in entries:
            ctx.stage(entry["fresh"], torch.zeros_like(entry["fresh"]))

    def _loss(self, model: LGCAutoencoder, entry: dict[str, Tensor], generator: torch.Generator) -> Tensor:
        values = entry["values"]  # [n, k]: every rank's values (PS: at its own indices; all-reduce: shared ones)
        n, k = values.shape
        r = int(torch.randint(n, (1,), generator=generator))  # a random rank's code, as the third-party code
        scales = _scale(values) if self.normalize else torch.ones_like(values[:, :1])
        s = scales[r]
        # stage 3 encodes the leader's values by its own scale (PS) or every rank's by the leader's (all-reduce)
        codes = model.encode(values / (scales if self.variant == "ps" else s))
        similarity = values.new_zeros(())
        for i in range(n):
            for j in range(n):
                if i != j:
                    similarity = similarity + F.mse_loss(codes[i], codes[j])
        if self.variant == "allreduce":
            decoded = model.decode(0, codes.mean(0, keepdim=True), k)
            reconstruction = F.mse_loss(decoded[0], values.mean(0) / s)
        else:
            indices, innovation = entry["indices"], entry["innovation"]
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
        return self.reconstruction_weight * reconstruction + self.code_similarity_weight * similarity

    def _stage_data(self, ctx: BucketContext, **data: Tensor) -> None:
        """Keep this step's training data, per layer (committed only if the step is finite), for the next step.

        ``data`` holds ``[n, k]`` rows in the bucket's slot layout (every layer's ``k`` slots in turn); ``indices``,
        if given, are global and are made layer-local, so that nothing depends on how DDP buckets the layers.
        """
        if ctx.updates is None:
            return
        for layer, at, k in self._segments(ctx):
            part = {name: value[:, at : at + k] for name, value in data.items()}
            if "indices" in part:
                part["indices"] = part["indices"] - layer.offset
            self._stage_layer(ctx, layer.name, part)

    def _stage_layer(self, ctx: BucketContext, key: str, data: dict[str, Tensor]) -> None:
        assert ctx.updates is not None
        entry = self._pending.get(key)
        if entry is None or any(entry[name].shape != value.shape for name, value in data.items()):
            entry = {name: torch.zeros_like(value) for name, value in data.items()}
            entry["fresh"] = torch.zeros((), dtype=torch.bool, device=ctx.device)
            self._pending[key] = entry
        for name, value in data.items():
            ctx.stage(entry[name], value.clone())  # a buffer of its own
        ctx.stage(entry["fresh"], torch.ones_like(entry["fresh"]))

    def _innovation_of(self, values: Tensor, ctx: BucketContext) -> Tensor:
        """Rows of top-k ``values`` with everything but each layer's top ``innovation_ratio`` zeroed."""
        out = torch.zeros_like(values)
        for (_, at, k), k_u in zip(self._segments(ctx), self._innovation_counts(ctx)):
            part = values[:, at : at + k]
            picked = torch.topk(part.abs(), k_u, dim=1).indices
            out[:, at : at + k].scatter_(1, picked, part.gather(1, picked))
        return out

    def _segments(self, ctx: BucketContext) -> list[tuple[Layer, int, int]]:
        """``(layer, where its top-k slots start, how many)`` for every layer, in order."""
        out, at = [], 0
        for layer in ctx.layers:
            k = keep_count(layer.numel, self.ratio)
            out.append((layer, at, k))
            at += k
        return out

    # ------------------------------------------------------------------------------------------------------------
    # Encoding and decoding, one layer at a time (so that nothing depends on how DDP buckets the layers)
    # ------------------------------------------------------------------------------------------------------------
    def _code_numel(self, ctx: BucketContext) -> int:
        return sum(self.latent_numel(k) for _, _, k in self._segments(ctx))

    def _scales(self, x: Tensor, ctx: BucketContext) -> Tensor:
        """Each layer's root mean square of the top-k values ``x`` (ones without ``normalize``).

        A layer whose values are all zero has scale 0: it is encoded as if its scale were 1 and decoded times 0, so
        it decodes to zeros, as plain DDP would average it, instead of to what the decoder makes of a zero code.
        """
        if not self.normalize:
            return x.new_ones(len(ctx.layers))
        return torch.cat([_rms(x[at : at + k]) for _, at, k in self._segments(ctx)])

    def _encode(self, model: LGCAutoencoder, x: Tensor, scales: Tensor, ctx: BucketContext) -> Tensor:
        """The codes of every layer's top-k values ``x`` (slot layout), each divided by its layer's scale."""
        with torch.no_grad():
            return torch.cat([
                model.encode((x[at : at + k].float() / _divisor(scales[i]))[None])[0]
                for i, (_, at, k) in enumerate(self._segments(ctx))
            ])  # fmt: skip

    def _decode(
        self, model: LGCAutoencoder, j: int, z: Tensor, scales: Tensor, ctx: BucketContext, side: Tensor | None = None
    ) -> Tensor:
        """Decoder ``j``'s values (slot layout, float32, scaled back) from every layer's code in ``z``."""
        out, at_z = [], 0
        with torch.no_grad():
            for i, (_, at, k) in enumerate(self._segments(ctx)):
                c = self.latent_numel(k)
                inn = None if side is None else (side[at : at + k] / _divisor(scales[i]))[None]
                out.append(model.decode(j, z[at_z : at_z + c][None], k, inn)[0] * scales[i])
                at_z += c
        return torch.cat(out) if out else z.new_zeros(0)

    # ------------------------------------------------------------------------------------------------------------
    # Stage 3 decoding, shared by the reduction and the single-rank contract
    # ------------------------------------------------------------------------------------------------------------
    def _ps_contribution(
        self, model: LGCAutoencoder, j: int, code: Tensor, indices: Tensor, values: Tensor, own: Tensor,
        ctx: BucketContext,
    ) -> tuple[Tensor, Tensor]:  # fmt: skip
        """Rank ``j``'s decoded values at the leader's ``indices``, and the correction at its innovation ``own``.

        Rank ``j``'s contribution is ``decoded`` at ``indices`` plus ``correction`` at ``own`` (where its innovation
        ``values`` replace whatever was decoded there). ``code`` is the leader's codes followed by its scales.
        """
        k = indices.numel()
        layers = len(ctx.layers)
        z, scales = code[:-layers], code[-layers:]
        pos = torch.searchsorted(indices, own).clamp_(max=max(k - 1, 0))
        hit = indices[pos] == own
        side = torch.zeros(k, dtype=torch.float32, device=code.device)
        side.index_add_(0, pos, torch.where(hit, values.float(), 0.0))  # misses add zero
        decoded = self._decode(model, j, z, scales, ctx, side).to(ctx.dtype)
        correction = values.to(ctx.dtype) - torch.where(hit, decoded[pos], 0.0)
        return decoded, correction

    def _ps_leader_code(self, model: LGCAutoencoder, tensor: Tensor, indices: Tensor, ctx: BucketContext) -> Tensor:
        x = tensor.index_select(0, indices).float()
        scales = self._scales(x, ctx)
        return torch.cat([self._encode(model, x, scales, ctx), scales])

    # ------------------------------------------------------------------------------------------------------------
    # The contract for one rank on its own (its own leader)
    # ------------------------------------------------------------------------------------------------------------
    def compress(self, tensor: Tensor, ctx: BucketContext) -> Payload:
        """This rank's payload as if it were the leader.

        Stage 1: the tensor. Stage 2: top-k (PS: values, indices; all-reduce: index blob, values). Stage 3 PS: code
        and scale, index blob, innovation values and indices; all-reduce: index blob, scale, code.
        """
        stage = self.stage(ctx.step)
        if stage == 1:
            return (tensor.clone(),)
        layout = self._layout(ctx)
        if stage == 2:
            if self.variant == "ps":
                indices = self._top(tensor, ctx, [s.slots for s in layout.segments])
                return tensor.index_select(0, indices), indices.to(self._index_dtype(ctx))
            blob = self._leader_blob(tensor, layout)
            return blob, tensor.index_select(0, torch.cat(decode_sparse(layout, blob)))
        model = self._autoencoder(ctx)
        blob = self._leader_blob(tensor, layout)
        indices = torch.cat(decode_sparse(layout, blob))
        if self.variant == "ps":
            own = self._top(tensor, ctx, self._innovation_counts(ctx))
            code = self._ps_leader_code(model, tensor, indices, ctx)
            return code, blob, tensor.index_select(0, own), own.to(self._index_dtype(ctx))
        x = tensor.index_select(0, indices).float()
        scales = self._scales(x, ctx)
        z = self._encode(model, x, scales, ctx)
        if not self._projects:
            return blob, scales, z
        return blob, scales, z, self._dots(x, self._decode(model, 0, z, scales, ctx), ctx)

    def decompress(self, payload: Payload, ctx: BucketContext, out: Tensor | None = None) -> Tensor:
        """The dense tensor the payload stands for (stage 3 PS: with this rank's decoder)."""
        stage = self.stage(ctx.step)
        if stage == 1:
            return ctx.output(out).copy_(payload[0])
        layout = self._layout(ctx)
        if stage == 2:
            if self.variant == "ps":
                values, indices = payload
                return ctx.output(out, zeros=True).index_copy_(0, indices.long(), values.to(ctx.dtype))
            blob, values = payload
            indices = torch.cat(decode_sparse(layout, blob))
            return ctx.output(out, zeros=True).index_copy_(0, indices, values.to(ctx.dtype))
        model = self._autoencoder(ctx)
        if self.variant == "ps":
            code, blob, values, own = payload
            indices = torch.cat(decode_sparse(layout, blob))
            decoded, correction = self._ps_contribution(model, ctx.rank, code, indices, values, own.long(), ctx)
            result = ctx.output(out, zeros=True).index_add_(0, indices, decoded)
            return result.index_add_(0, own.long(), correction)
        blob, scales, z = payload[:3]
        indices = torch.cat(decode_sparse(layout, blob))
        decoded = self._decode(model, 0, z, scales, ctx)
        if self._projects:
            decoded = self._projected(decoded, self._factors(decoded, payload[3], ctx), ctx)
        decoded = decoded.to(ctx.dtype)
        return ctx.output(out, zeros=True).index_copy_(0, indices, decoded)

    # ------------------------------------------------------------------------------------------------------------
    # The reduction
    # ------------------------------------------------------------------------------------------------------------
    @property
    def residual_beta(self) -> float:
        """:attr:`memory_beta`: ScaleCom's low-pass filtered memory (the driver's), 1 without ``beta``."""
        return self.memory_beta

    def exchange(self, tensor: Tensor, ctx: BucketContext, out: Tensor) -> Exchange:
        """One of the five reductions (stage 1; stages 2 and 3 of each variant), see the class docstring.

        ``out`` is ``tensor`` itself (LGC does not keep its input): each reduction declares what went out before it
        writes the average there.
        """
        stage, n = self.stage(ctx.step), ctx.world_size
        if stage == 1:
            yield Lossless()  # everything is sent
            (summed,) = yield AllReduce((tensor.div_(n),))
            return summed
        # first thing of the step (in bucket order, on the main thread): train on the previous step's data
        model = self._autoencoder(ctx)
        if stage == 2:
            return (yield from self._ps_topk(tensor, ctx) if self.variant == "ps" else self._shared_topk(tensor, ctx))
        if self.variant == "ps":
            if self.ps_form == "gather":
                return (yield from self._ps_code_gathered(tensor, ctx, model))
            return (yield from self._ps_code(tensor, ctx, model))
        return (yield from self._allreduce_code(tensor, ctx, model))

    def _ps_topk(self, tensor: Tensor, ctx: BucketContext) -> Exchange:
        layout = self._layout(ctx)
        indices = self._top(tensor, ctx, [s.slots for s in layout.segments])
        values = tensor.index_select(0, indices)
        yield SentExactly(indices)
        gathered = yield AllGather((values, indices.to(self._index_dtype(ctx))))
        out = tensor.zero_()
        for vals, idx in gathered:  # rank order: the same sum on every rank
            out.index_add_(0, idx.long(), vals.to(ctx.dtype))
        data = torch.stack([vals.float() for vals, _ in gathered])
        self._stage_data(ctx, values=data, indices=torch.stack([idx.long() for _, idx in gathered]),
                         innovation=self._innovation_of(data, ctx))  # fmt: skip
        return out.div_(ctx.world_size)

    def _shared_topk(self, tensor: Tensor, ctx: BucketContext) -> Exchange:
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

    def _ps_code(self, tensor: Tensor, ctx: BucketContext, model: LGCAutoencoder) -> Exchange:
        layout, leader = self._layout(ctx), self.leader_of(ctx)
        own = self._top(tensor, ctx, self._innovation_counts(ctx))
        if ctx.rank == leader:
            blob = self._leader_blob(tensor, layout)
            code = self._ps_leader_code(model, tensor, torch.cat(decode_sparse(layout, blob)), ctx)
        else:
            blob = torch.zeros(index_blob_nbytes(layout), dtype=torch.uint8, device=ctx.device)
            code = torch.zeros(self._code_numel(ctx) + len(ctx.layers), dtype=torch.float32, device=ctx.device)
        gathered = yield AllGather((tensor.index_select(0, own), own.to(self._index_dtype(ctx))))
        code, shared = yield Broadcast((code, blob), src=leader)
        indices = torch.cat(decode_sparse(layout, shared))
        parts = [
            self._ps_contribution(model, j, code, indices, values, idx.long(), ctx)
            for j, (values, idx) in enumerate(gathered)
        ]
        # what the aggregate used for this rank: its decoded values at the leader's indices, its innovation exactly
        # at its own
        yield SentAt(indices, parts[ctx.rank][0], exactly=own)
        out = tensor.zero_()
        for (decoded, correction), (_, idx) in zip(parts, gathered):
            out.index_add_(0, indices, decoded).index_add_(0, idx.long(), correction)
        return out.div_(ctx.world_size)

    def _ps_code_gathered(self, tensor: Tensor, ctx: BucketContext, model: LGCAutoencoder) -> Exchange:
        """``ps_form="gather"``: the leader decodes every rank and broadcasts the average at the indices it touched."""
        layout, leader = self._layout(ctx), self.leader_of(ctx)
        own = self._top(tensor, ctx, self._innovation_counts(ctx))
        gathered = yield AllGather((tensor.index_select(0, own), own.to(self._index_dtype(ctx))))
        touched = torch.cat([idx.long() for _, idx in gathered])  # every rank's innovation indices, in rank order
        k, mine = layout.slots, None
        if ctx.rank == leader:
            blob = self._leader_blob(tensor, layout)
            indices = torch.cat(decode_sparse(layout, blob))
            code = self._ps_leader_code(model, tensor, indices, ctx)
            # the all-gather form's sum, in the same order, so that both forms agree bitwise
            total = torch.zeros_like(tensor)
            for j, (values, idx) in enumerate(gathered):
                decoded, correction = self._ps_contribution(model, j, code, indices, values, idx.long(), ctx)
                total.index_add_(0, indices, decoded).index_add_(0, idx.long(), correction)
                mine = decoded if j == ctx.rank else mine
            total.div_(ctx.world_size)
            averaged = torch.cat([total.index_select(0, indices), total.index_select(0, touched)])
        else:
            blob = torch.zeros(index_blob_nbytes(layout), dtype=torch.uint8, device=ctx.device)
            code = torch.zeros(self._code_numel(ctx) + len(ctx.layers), dtype=torch.float32, device=ctx.device)
            averaged = torch.zeros(k + touched.numel(), dtype=ctx.dtype, device=ctx.device)
        code, shared, averaged = yield Broadcast((code, blob, averaged), src=leader)
        indices = torch.cat(decode_sparse(layout, shared))
        if ctx.error_feedback:
            if mine is None:  # this rank's own decoder only: what the aggregate used for it
                mine = self._ps_contribution(model, ctx.rank, code, indices, tensor.index_select(0, own), own, ctx)[0]
            yield SentAt(indices, mine, exactly=own)
        out = tensor.zero_().index_copy_(0, indices, averaged[:k])
        return out.index_copy_(0, touched, averaged[k:])

    def _allreduce_code(self, tensor: Tensor, ctx: BucketContext, model: LGCAutoencoder) -> Exchange:
        layout, leader = self._layout(ctx), self.leader_of(ctx)
        if ctx.rank == leader:
            blob = self._leader_blob(tensor, layout)
            scales = self._scales(tensor.index_select(0, torch.cat(decode_sparse(layout, blob))).float(), ctx)
        else:
            blob = torch.zeros(index_blob_nbytes(layout), dtype=torch.uint8, device=ctx.device)
            scales = torch.zeros(len(ctx.layers), dtype=torch.float32, device=ctx.device)
        shared, scales = yield Broadcast((blob, scales), src=leader)
        indices = torch.cat(decode_sparse(layout, shared))
        z = self._encode(model, tensor.index_select(0, indices), scales, ctx)
        (summed,) = yield AllReduce((z.div_(ctx.world_size),))
        decoded = self._decode(model, 0, summed, scales, ctx)
        if self._projects:
            # the decoded average scaled, per layer, to its least-squares fit to the true average (clamped to
            # [0, 1]): the update never moves further from the average than no update would, so error feedback stays
            # contractive however poorly the autoencoder decodes
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
        return self.variant == "allreduce" and self.project is not False

    def _dots(self, x: Tensor, decoded: Tensor, ctx: BucketContext) -> Tensor:
        """Per layer ``<x, decoded>`` over the slots (float32)."""
        if not ctx.layers:
            return x.new_zeros(0)
        return torch.stack([_dot(x[at : at + k], decoded[at : at + k]) for _, at, k in self._segments(ctx)])

    def _factors(self, decoded: Tensor, dots: Tensor, ctx: BucketContext) -> list[Tensor]:
        """Per layer ``clamp(dots / |decoded|^2, 0, 1)`` (0 where ``decoded`` is all zeros), 0-dim tensors."""
        out = []
        for i, (_, at, k) in enumerate(self._segments(ctx)):
            part = decoded[at : at + k]
            norm = _dot(part, part)
            out.append(torch.where(norm > 0, dots[i] / torch.where(norm > 0, norm, 1.0), 0.0).clamp(0.0, 1.0))
        return out

    def _projected(self, decoded: Tensor, factors: Sequence[Tensor], ctx: BucketContext) -> Tensor:
        """``decoded`` scaled per layer by its factor (:meth:`_factors`)."""
        out = [decoded[at : at + k] * f for f, (_, at, k) in zip(factors, self._segments(ctx))]
        return torch.cat(out) if out else decoded

    # ------------------------------------------------------------------------------------------------------------
    # Bytes
    # ------------------------------------------------------------------------------------------------------------
    def bytes_per_step(self, ctx: BucketContext) -> int:
        """Bytes this rank hands to the collectives for one bucket at ``ctx.step``, the non-finite flag included.

        With ``k`` top-k slots, ``k_u`` innovation slots, ``c`` code numbers (:meth:`latent_numel` summed over
        the layers), ``L`` layers (one scale each), ``B`` the leader's index blob (int32 or bitmap per layer, padded
        to 8 bytes), ``b`` the value size (4 for fp32), ``d`` the tensor's elements and ``p(x) = 8 ceil(x / 8)``:

        * stage 1: ``b d + b`` (the all-reduce, the flag in its dtype);
        * stage 2 ``"ps"``: ``p(b k) + p(4 k) + 8`` (the all-gather of values and int32 indices, packed with the flag);
        * stage 3 ``"ps"``: ``p(b k_u) + p(4 k_u) + 8``, plus ``p(4 (c + L)) + B`` on the leader, and with
          ``ps_form="gather"`` also ``p(b (k + n k_u))`` on the leader (the averaged values);
        * stage 2 ``"allreduce"``: ``p(b k) + 8``, plus ``B`` on the leader;
        * stage 3 ``"allreduce"``: ``4 c + 4``, plus ``B + p(4 L)`` on the leader (its blob and scales), plus ``4 L``
          with ``project`` (one dot product per layer).
        """
        stage, b = self.stage(ctx.step), torch.empty(0, dtype=ctx.dtype).element_size()
        if stage == 1:
            return b * ctx.numel + b
        layout = self._layout(ctx)
        k, blob = layout.slots, index_blob_nbytes(layout)
        lead = ctx.rank == self.leader_of(ctx)
        index = torch.empty(0, dtype=self._index_dtype(ctx)).element_size()
        if self.variant == "ps":
            if stage == 2:
                return _pad8(b * k) + _pad8(index * k) + 8
            k_u = sum(self._innovation_counts(ctx))
            sent = _pad8(b * k_u) + _pad8(index * k_u) + 8
            if not lead:
                return sent
            sent += _pad8(4 * (self._code_numel(ctx) + len(ctx.layers))) + blob
            return sent + (_pad8(b * (k + ctx.world_size * k_u)) if self.ps_form == "gather" else 0)
        if stage == 2:
            return _pad8(b * k) + 8 + (blob if lead else 0)
        projection = 4 * len(ctx.layers) if self._projects else 0
        return 4 * self._code_numel(ctx) + 4 + projection + (blob + _pad8(4 * len(ctx.layers)) if lead else 0)

    # ------------------------------------------------------------------------------------------------------------
    # State
    # ------------------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The autoencoder's weights and optimizer state (as of the last finite step) and the pending data."""
        state = super().state_dict()
        if self._committed is not None:
            state["autoencoder"] = {k: v.detach().clone() for k, v in self._committed.items()}
            state["decoders"] = self._decoders
        if self._pending:
            state["pending"] = {key: {k: v.clone() for k, v in e.items()} for key, e in self._pending.items()}
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (tensors move to the gradient's device at the next step)."""
        super().load_state_dict(state_dict)
        self._reset_autoencoder()
        if "autoencoder" in state_dict:
            self._committed = {k: v.clone() for k, v in state_dict["autoencoder"].items()}
            self._decoders = int(state_dict["decoders"])
        self._pending = {key: {k: v.clone() for k, v in e.items()} for key, e in state_dict.get("pending", {}).items()}

    def __getstate__(self) -> dict[str, Any]:
        # the working copy is rebuilt from the committed weights on first use
        return {**self.__dict__, "_model": None, "_prepared_step": None}


def _hash_key(key: str) -> int:
    """A stable integer for a pending-data key (Python's ``hash`` of a string differs between processes)."""
    h = 0
    for ch in key.encode():
        h = (h * 131 + ch) & ((1 << 62) - 1)
    return h
