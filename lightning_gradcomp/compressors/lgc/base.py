"""LGC's shared machinery: the three stages, the leader's top-k slots and the autoencoder trained during training.

Abrahamyan, Chen, Bekoulis & Deligiannis, "Learned Gradient Compression for Distributed Deep Learning", IEEE TNNLS
2021 (doi:10.1109/TNNLS.2021.3084806, arXiv:2103.08870). The two instances of the paper are
:class:`~lightning_gradcomp.compressors.LGC` (parameter server) and
:class:`~lightning_gradcomp.compressors.LGCAllReduce` (ring all-reduce); docs/lgc.md describes both.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor
from torch.nn import functional as F  # noqa: N812 (the usual alias)

from lightning_gradcomp.compressors.base import BucketContext, Compressor, Layer, Payload, derive_seed, keep_count
from lightning_gradcomp.compressors.lgc.autoencoder import LGCAutoencoder, latent_numel, optimizer_state, optimizer_step
from lightning_gradcomp.compressors.ops.sparse import SparseLayout, sparse_layout
from lightning_gradcomp.compressors.scalecom import top_k_blob
from lightning_gradcomp.compressors.sparsify import sampled_topk_indices, topk_indices
from lightning_gradcomp.engine.requests import AllReduce, Exchange, Lossless
from lightning_gradcomp.validation import check_bool, check_choice, check_int, check_number, check_ratio

__all__ = ["LGCBase"]

_LEADERS = ("fixed", "rotating")
_OPTIMIZERS = ("adam", "sgd")
_VARIANTS = ("ps", "allreduce")


def pad8(nbytes: int) -> int:
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


def dot(a: Tensor, b: Tensor) -> Tensor:
    """``<a, b>`` as a product and a sum, whose rounding does not depend on where the slices lie in memory.

    ``torch.dot`` on the CPU calls BLAS, which sums in an order set by the pointer's alignment: a layer's dot product
    then changed with its place in DDP's bucket, which changes across a resume (DDP's first step puts every layer in
    one bucket), and the resumed run was no longer bitwise the uninterrupted one.
    """
    return (a * b).sum()


def rms(values: Tensor) -> Tensor:
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


def divisor(scale: Tensor) -> Tensor:
    """What values are divided by before encoding: the scale, or 1 where it is 0 (all-zero values)."""
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def _scale(values: Tensor) -> Tensor:
    """The root mean square of the last dimension (1 where it is 0), shaped for broadcasting: ``[..., 1]``."""
    return divisor(rms(values))


def layer_dots(x: Tensor, decoded: Tensor, segments: Sequence[tuple[Layer, int, int]]) -> Tensor:
    """Per layer ``<x, decoded>`` over its slots (float32); ``segments``: :meth:`LGCBase._segments`."""
    if not segments:
        return x.new_zeros(0)
    return torch.stack([dot(x[at : at + k], decoded[at : at + k]) for _, at, k in segments])


def fit_factors(
    decoded: Tensor, dots: Tensor, segments: Sequence[tuple[Layer, int, int]], high: float | None = 1.0
) -> list[Tensor]:
    """Per layer ``clamp(dots / |decoded|^2, 0, high)`` (0 where ``decoded`` is all zeros), 0-dim tensors.

    With ``dots = <x, decoded>``, ``f decoded`` is the least-squares fit of ``decoded`` to ``x`` clamped to
    ``[0, high]`` (``[0, inf)`` with ``high=None``). ``|x - f decoded|^2`` is a convex quadratic in ``f`` whose value
    at ``f = 0`` is ``|x|^2``, so its minimum over any interval that holds 0 is at most ``|x|^2``: ``|x - f decoded|
    <= |x|`` for every ``high >= 0``. The decoded values scaled by it are never further from ``x`` than nothing at
    all, however poorly the autoencoder decodes, and error feedback's memory cannot grow from one step to the next.
    """
    out = []
    for i, (_, at, k) in enumerate(segments):
        part = decoded[at : at + k]
        norm = dot(part, part)
        out.append(torch.where(norm > 0, dots[i] / torch.where(norm > 0, norm, 1.0), 0.0).clamp(0.0, high))
    return out


def scaled(decoded: Tensor, factors: Sequence[Tensor], segments: Sequence[tuple[Layer, int, int]]) -> Tensor:
    """``decoded`` scaled per layer by its factor (:func:`fit_factors`)."""
    out = [decoded[at : at + k] * f for f, (_, at, k) in zip(factors, segments)]
    return torch.cat(out) if out else decoded


def encode_layers(
    model: LGCAutoencoder, x: Tensor, scales: Tensor, segments: Sequence[tuple[Layer, int, int]]
) -> Tensor:
    """The codes of every layer's top-k values ``x`` (slot layout), each divided by its layer's scale.

    Each layer is encoded on its own, so that nothing depends on how DDP buckets the layers. ``segments``:
    :meth:`LGCBase._segments`.
    """
    with torch.no_grad():
        return torch.cat(
            [
                model.encode((x[at : at + k].float() / divisor(scales[i]))[None])[0]
                for i, (_, at, k) in enumerate(segments)
            ]
        )


def decode_layers(
    model: LGCAutoencoder,
    j: int,
    z: Tensor,
    scales: Tensor,
    segments: Sequence[tuple[Layer, int, int]],
    side: Tensor | None = None,
) -> Tensor:
    """Decoder ``j``'s values (slot layout, float32, scaled back) from every layer's code in ``z``.

    ``side``: the innovation in the slot layout (the parameter-server variant's decoders take it as an input).
    """
    out, at_z = [], 0
    with torch.no_grad():
        for i, (_, at, k) in enumerate(segments):
            c = model.latent_numel(k)
            inn = None if side is None else (side[at : at + k] / divisor(scales[i]))[None]
            out.append(model.decode(j, z[at_z : at_z + c][None], k, inn)[0] * scales[i])
            at_z += c
    return torch.cat(out) if out else z.new_zeros(0)


class LGCBase(Compressor):
    """Learned gradient compression's three stages, shared by the parameter-server and the all-reduce variants.

    Abrahamyan, Chen, Bekoulis & Deligiannis, "Learned Gradient Compression for Distributed Deep Learning", IEEE
    TNNLS 2021. The stages are keyed on the step (the same on every rank, checkpointed):

    1. ``step < dense_steps``: dense averaging (an all-reduce; error feedback owes nothing afterwards);
    2. ``step < dense_steps + training_steps``: top-k at ``ratio`` per layer with error feedback; the values every
       rank receives anyway train the autoencoder, the same on every rank, with no extra communication;
    3. afterwards: the autoencoder's code carries the values.

    The values of step ``t`` are staged (kept only if the step is finite on every rank) and trained on at the start
    of step ``t + 1``, on the main thread, in bucket order; the new weights and optimizer state are staged too, so a
    non-finite step leaves the autoencoder as it was and a resume is bitwise exact (:meth:`state_dict`).

    A variant says how stages 2 and 3 travel (:meth:`_exchange_topk`, :meth:`_exchange_code`), what one rank's
    payload is (:meth:`_compress_sparse`, :meth:`_decompress_sparse`), its bytes (:meth:`_sparse_bytes`) and what
    the autoencoder reconstructs (:meth:`_reconstruction`). The arguments are documented on the variants.
    """

    unbiased: ClassVar[bool] = False
    rounds: ClassVar[int] = 3  # the all-reduce variant's projection takes a third; the others return after two
    variant: ClassVar[str]  # "ps" or "allreduce": which of the paper's instances
    default_leader: ClassVar[str]  # the leader when ``leader`` is None
    default_similarity_weight: ClassVar[float]  # lambda2 when ``similarity_weight`` is None

    def __init__(
        self,
        *,
        ratio: float,
        dense_steps: int,
        training_steps: int,
        leader: str | None,
        channels: Sequence[int],
        decoder_channels: Sequence[int],
        latent_channels: int,
        linear_encoder: bool,
        lr: float,
        optimizer: str,
        momentum: float,
        reconstruction_weight: float,
        similarity_weight: float | None,
        normalize: bool,
        seed: int,
    ) -> None:
        super().__init__()
        self.ratio = check_ratio(ratio)
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
        self.seed = check_int(seed, "seed", low=0)
        self._reset_autoencoder()

    def _reset_autoencoder(self) -> None:
        self._committed: dict[str, Tensor] | None = None  # weights and optimizer state as of the last finite step
        self._decoders = 0
        self._pending: dict[str, dict[str, Tensor]] = {}  # stage-2 data not trained on yet, per bucket
        self._model: LGCAutoencoder | None = None  # the working copy this step encodes and decodes with
        self._prepared_step: int | None = None

    @property
    def code_similarity_weight(self) -> float:
        """``lambda2`` in use: ``similarity_weight``, or the variant's default."""
        if self.similarity_weight is not None:
            return float(self.similarity_weight)
        return self.default_similarity_weight

    @property
    def slot_order(self) -> str:
        """The order of the leader's top-k slots: ``"index"`` (increasing index; the all-reduce variant chooses)."""
        return "index"

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
        leader = self.leader or self.default_leader
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

    def _top(self, tensor: Tensor, ctx: BucketContext, counts: Sequence[int]) -> Tensor:
        """Each layer's top-``counts`` indices of ``|tensor|``, global and sorted (int64)."""
        picked = [_top_k(layer.flat(tensor), k).sort().values + layer.offset for layer, k in zip(ctx.layers, counts)]
        return torch.cat(picked) if picked else torch.zeros(0, dtype=torch.long, device=tensor.device)

    def _index_dtype(self, ctx: BucketContext) -> torch.dtype:
        return torch.int32 if ctx.numel < 2**31 else torch.int64

    # ------------------------------------------------------------------------------------------------------------
    # The autoencoder: built on first use, trained at the start of each step on the previous step's data
    # ------------------------------------------------------------------------------------------------------------
    def _build(self, decoders: int, device: torch.device) -> LGCAutoencoder:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(derive_seed(self.seed, 0x16C))
            model = LGCAutoencoder(
                decoders,
                self.channels,
                self.decoder_channels,
                self.latent_channels,
                innovation=self.variant == "ps",
                linear_encoder=self.linear_encoder,
            )
        return model.to(device)

    def latent_numel(self, k: int) -> int:
        """Numbers in the code of ``k`` top-k values."""
        return latent_numel(k, len(self.channels), self.latent_channels)

    def _autoencoder(self, ctx: BucketContext) -> LGCAutoencoder:
        """The working autoencoder for this step (trained on the pending data first, when the step can stage)."""
        decoders = self._decoder_count(ctx)
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
            new = optimizer_step(
                {n: p.detach() for n, p in params.items()},
                grads_by_name,
                state,
                kind=self.optimizer,
                lr=self.lr,
                momentum=self.momentum,
                apply=apply,
            )
            with torch.no_grad():
                for name, p in params.items():
                    p.copy_(new[name])
            for key, value in new.items():
                ctx.stage(self._committed[key], value)
        for _, entry in entries:
            ctx.stage(entry["fresh"], torch.zeros_like(entry["fresh"]))

    def _decoder_count(self, ctx: BucketContext) -> int:
        """How many decoders the autoencoder has at this world size."""
        return 1

    def _loss(self, model: LGCAutoencoder, entry: dict[str, Tensor], generator: torch.Generator) -> Tensor:
        """``lambda1`` times the variant's reconstruction loss plus ``lambda2`` times the codes' pairwise distance."""
        values = entry["values"]  # [n, k]: every rank's values (PS: at its own indices; all-reduce: shared ones)
        n = values.shape[0]
        r = int(torch.randint(n, (1,), generator=generator))  # a random rank's code, as the third-party code
        scales = _scale(values) if self.normalize else torch.ones_like(values[:, :1])
        s = scales[r]
        codes = model.encode(values / self._encoding_scale(scales, s))
        similarity = values.new_zeros(())
        for i in range(n):
            for j in range(n):
                if i != j:
                    similarity = similarity + F.mse_loss(codes[i], codes[j])
        reconstruction = self._reconstruction(model, entry, codes, r, s)
        return self.reconstruction_weight * reconstruction + self.code_similarity_weight * similarity

    @abstractmethod
    def _encoding_scale(self, scales: Tensor, chosen: Tensor) -> Tensor:
        """What the training values are divided by: every rank's own ``scales``, or the ``chosen`` rank's scale."""

    @abstractmethod
    def _reconstruction(
        self, model: LGCAutoencoder, entry: dict[str, Tensor], codes: Tensor, r: int, s: Tensor
    ) -> Tensor:
        """The reconstruction loss of one layer's pending ``entry``, from ``codes``, chosen rank ``r`` and its scale."""

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
        return torch.cat([rms(x[at : at + k]) for _, at, k in self._segments(ctx)])

    # ------------------------------------------------------------------------------------------------------------
    # The contract for one rank on its own (its own leader)
    # ------------------------------------------------------------------------------------------------------------
    def compress(self, tensor: Tensor, ctx: BucketContext) -> Payload:
        """This rank's payload as if it were the leader: stage 1, the tensor; stages 2 and 3, the variant's."""
        stage = self.stage(ctx.step)
        if stage == 1:
            return (tensor.clone(),)
        return self._compress_sparse(tensor, ctx, stage, self._layout(ctx))

    def decompress(self, payload: Payload, ctx: BucketContext, out: Tensor | None = None) -> Tensor:
        """The dense tensor the payload stands for."""
        stage = self.stage(ctx.step)
        if stage == 1:
            return ctx.output(out).copy_(payload[0])
        return self._decompress_sparse(payload, ctx, out, stage, self._layout(ctx))

    @abstractmethod
    def _compress_sparse(self, tensor: Tensor, ctx: BucketContext, stage: int, layout: SparseLayout) -> Payload:
        """Stage 2 or 3's payload."""

    @abstractmethod
    def _decompress_sparse(
        self, payload: Payload, ctx: BucketContext, out: Tensor | None, stage: int, layout: SparseLayout
    ) -> Tensor:
        """Stage 2 or 3's dense tensor."""

    # ------------------------------------------------------------------------------------------------------------
    # The reduction
    # ------------------------------------------------------------------------------------------------------------
    def exchange(self, tensor: Tensor, ctx: BucketContext, out: Tensor) -> Exchange:
        """Stage 1's all-reduce, or the variant's stage 2 or 3 (after the autoencoder's training step).

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
            return (yield from self._exchange_topk(tensor, ctx))
        return (yield from self._exchange_code(tensor, ctx, model))

    @abstractmethod
    def _exchange_topk(self, tensor: Tensor, ctx: BucketContext) -> Exchange:
        """Stage 2: top-k with error feedback; stages the autoencoder's training data."""

    @abstractmethod
    def _exchange_code(self, tensor: Tensor, ctx: BucketContext, model: LGCAutoencoder) -> Exchange:
        """Stage 3: the autoencoder's code."""

    # ------------------------------------------------------------------------------------------------------------
    # Bytes
    # ------------------------------------------------------------------------------------------------------------
    def bytes_per_step(self, ctx: BucketContext) -> int:
        """Bytes this rank hands to the collectives for one bucket at ``ctx.step``, the non-finite flag included.

        Stage 1: ``b d + b`` (the all-reduce of ``d`` values of ``b`` bytes, the flag in its dtype); stages 2 and 3:
        the variant's (:meth:`_sparse_bytes`).
        """
        stage, b = self.stage(ctx.step), torch.empty(0, dtype=ctx.dtype).element_size()
        if stage == 1:
            return b * ctx.numel + b
        return self._sparse_bytes(ctx, stage, self._layout(ctx), b)

    @abstractmethod
    def _sparse_bytes(self, ctx: BucketContext, stage: int, layout: SparseLayout, b: int) -> int:
        """Stage 2 or 3's bytes, with ``b`` the size of one value."""

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
