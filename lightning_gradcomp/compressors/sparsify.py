"""Sparsifiers: top-k (largest magnitudes, all-gather) and random-k (shared random indices, all-reduce)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor

from lightning_gradcomp.compressors.base import (
    BucketContext,
    Collective,
    Compressor,
    Payload,
    keep_count,
)
from lightning_gradcomp.compressors.ops.layer_topk import layer_topk
from lightning_gradcomp.compressors.ops.packing import flat_nonzero, magnitude_above
from lightning_gradcomp.compressors.ops.random_subsets import shared_subsets, stream_key
from lightning_gradcomp.compressors.transports.hashed_sum import SparseTransport, sparse_transport_sum
from lightning_gradcomp.compressors.transports.sparse_shards import (
    SPARSE_TRANSPORTS,
    SparseShards,
    owner_exchange,
    route_pairs,
)
from lightning_gradcomp.engine.requests import AllGather, AllReduce, Exchange, SentExactly
from lightning_gradcomp.validation import check_bool, check_choice, check_ratio

_RANDOMK_SALT = 0x52414E44  # RandomK's streams, apart from any other compressor's


def _zeros(ctx: BucketContext, out: Tensor | None) -> Tensor:
    return ctx.output(out, zeros=True)


def _index_dtype(numel: int) -> torch.dtype:
    return torch.int32 if numel < 2**31 else torch.int64


def topk_indices(values: Tensor, k: int) -> Tensor:
    """Indices of the ``k`` largest magnitudes ``|values|`` of the 1-D ``values`` (unsorted).

    On the CPU a full ``torch.topk`` over millions of elements costs tens of milliseconds per layer. Instead the k-th
    largest magnitude is bracketed from below with a random sample (:func:`sampled_topk_indices`), which is exact.
    The full ``topk`` is taken for ``k`` above half the elements (about ``1.5 k`` candidates would be nearly all of
    them; up to half, the sampled path is 1.7x (k = n / 2) to 4.5x (k = n / 10) faster on a 2.36M-element layer:
    ``python benchmarks/torch_ops.py --topk-ratio R``). On CUDA ``torch.topk`` is used directly: the candidate count
    is a host sync there.
    """
    n = values.numel()
    if k >= n:  # every entry (TopK(ratio=1)): no ordering needed
        return torch.arange(n, device=values.device)
    if values.device.type != "cpu" or n < (1 << 16) or k * 2 > n:
        return torch.topk(values.abs(), k, sorted=False).indices
    # a sample holding ~64 elements of the top-k estimates its boundary well enough
    size = min(n, max(8192, 64 * n // k))
    # ask the sample for ~1.5x the expected share (plus slack), so the candidates cover k with high probability
    want = min(size, int(math.ceil(1.5 * k * size / n)) + 8)
    return sampled_topk_indices(values, k, size, want)


def sampled_topk_indices(values: Tensor, k: int, size: int, want: int) -> Tensor:
    """The exact indices of the ``k`` largest ``|values|`` (unsorted), through a bound from a random sample.

    The ``want``-th largest magnitude of ``size`` random elements (the sampled threshold of DGC, Lin et al., 2018)
    bounds the k-th largest from below when at least ``k`` elements exceed it; every element whose magnitude is
    strictly above it is a candidate, and the exact top-k is taken among the candidates. When fewer than ``k``
    exceed it, the full ``topk`` decides. The sample is random (from a fixed seed, so runs are reproducible) because a
    strided one aliases with the structure of convolution gradients (a stride that is a multiple of 9 sees one tap of
    every 3x3 kernel). Only the sample and the candidates are made absolute: the candidates' mask compares the values
    with both signs of the bound (:func:`magnitude_above`), the same elements without a gradient-sized ``|values|``.
    For CPU tensors (the candidate count is read on the host).
    """
    n = values.numel()
    generator = torch.Generator().manual_seed(n)
    sample = values.index_select(0, torch.randint(0, n, (size,), generator=generator)).abs()
    threshold = torch.topk(sample, want, sorted=False).values.min()
    candidates = flat_nonzero(magnitude_above(values, threshold))  # strict: ties at a zero bound stay out
    if candidates.numel() < k:
        return torch.topk(values.abs(), k, sorted=False).indices
    return top_k_among(values, candidates, k)


def top_k_among(values: Tensor, candidates: Tensor, k: int) -> Tensor:
    """The ``k`` of the 1-D ``candidates`` (indices into ``values``) with the largest ``|values|``, unsorted.

    Only the candidates are gathered and made absolute. The exact top-k of a layer once a bound has narrowed it down:
    TopK's sampled selection and DGC's resampling.
    """
    best = torch.topk(values.index_select(0, candidates).abs(), k, sorted=False).indices
    return candidates.index_select(0, best)


class TopK(SparseShards, SparseTransport, Compressor):
    """Keep the ``ratio`` largest-magnitude entries of every layer; send values and int32 indices (all-gather).

    Top-k sparsification with error feedback (Aji & Heafield, 2017, "Sparse Communication for Distributed Gradient
    Descent"; Stich et al., 2018, "Sparsified SGD with Memory"): every compressed layer keeps
    ``max(1, int(ratio * numel))`` entries; what is not sent stays in the error-feedback residual. A bucket's layers
    are selected at once (:func:`~lightning_gradcomp.compressors.ops.layer_topk.layer_topk`: a few operators per bucket,
    not per layer); where magnitudes tie at a layer's k-th value, the lowest indices are kept. Indices differ
    between ranks, so payloads are all-gathered and each rank sums them in rank order. A payload costs
    ``k * (4 + 4)`` bytes for fp32 gradients.

    The all-gather's bytes per rank grow with the number of ranks (``(n - 1)`` payloads received). With
    ``transport="two_phase"`` the pairs go to the owners of their indices instead, each owner sums its share in fp32,
    re-selects its ``k / n`` largest (keeping the rest, error feedback at the owner) and the owners' pairs are
    all-gathered: about three selections' bytes whatever ``n``
    (:mod:`~lightning_gradcomp.compressors.transports.sparse_shards`, docs/two_phase.md). ``"auto"``, the default, takes
    whichever of the all-gather and the two-phase exchange moves fewer bytes at the world size: the all-gather up to 3
    ranks, the two-phase exchange from 4. On a ResNet-18-shaped bucket (1.58M parameters, ``ratio=0.01``) the default
    moves 0.023 of a dense ring all-reduce's bytes at 2 ranks, 0.033 at 4 to 256 and 0.034 at 1024, where the all-gather
    moves 0.641 at 64 (``python benchmarks/scaling.py --workers 2 --analytical 2 4 8 16 32 64 128 256 1024``).

    With ``transport="zen"`` the pairs are summed by Zen (:mod:`lightning_gradcomp.compressors.transports.hashed_sum`):
    each rank receives about its ``1 / n`` share of the pairs and the sum, not every rank's pairs, which pays when the
    ranks' top-k supports overlap. ``"zen-auto"`` picks per bucket the path that receives the fewest bytes (dense
    all-reduce, all-gather of pairs or Zen; docs/zen.md). What each rank selects is the same on every transport.

    Args:
        ratio: fraction of each layer's entries sent, in (0, 1].
        transport: ``"auto"`` (the default), ``"allgather"`` (every rank's pairs to every rank), ``"two_phase"``,
            ``"zen"`` or ``"zen-auto"``.

    Raises:
        ValueError: If ``ratio`` is not in (0, 1] or ``transport`` is unknown.

    Example::

        >>> from lightning_gradcomp.compressors import TopK
        >>> TopK(ratio=0.01)
        TopK(ratio=0.01, transport='auto')
    """

    collective: ClassVar[Collective] = "allgather"
    unbiased: ClassVar[bool] = False
    level_attribute: ClassVar[str] = "ratio"

    def __init__(self, ratio: float = 0.01, transport: str = "auto") -> None:
        super().__init__()
        self.ratio = check_ratio(ratio)
        self.transport = check_choice(transport, "transport", SPARSE_TRANSPORTS)
        self.layer_state("owner_residual")  # the two-phase owner's (declared: a checkpoint's loads into a fresh one)

    def check_level(self, value: Any) -> float:
        """A keep-ratio in (0, 1]."""
        return check_ratio(value)

    @property
    def keeps_input(self) -> bool:
        """Yes: the selected values are copied out, and the average is written into ``out``."""
        return True

    def exchange(self, tensor: Tensor, ctx: BucketContext, out: Tensor) -> Exchange:
        """All-gather every rank's pairs, or sum them over ``transport``."""
        values, indices = payload = self.compress(tensor, ctx)
        if self.sparse_two_phase(ctx, indices.numel(), sum(p.numel() * p.element_size() for p in payload)):
            routed = route_pairs(indices.long(), values, ctx)
            yield routed.declaration(indices.long(), values)  # the values are a copy
            return (yield from owner_exchange(self, routed, ctx, out))
        yield SentExactly(indices.long())  # the values are a copy
        if self.transport not in ("zen", "zen-auto"):
            gathered = yield AllGather(payload)
            return self.aggregate(gathered, ctx, out=out).div_(ctx.world_size)
        summed = yield from sparse_transport_sum(self, self.transport, indices, values, ctx, out)
        return summed.div_(ctx.world_size)

    def compress(self, tensor: Tensor, ctx: BucketContext) -> Payload:
        """Values and flat indices of each layer's top-k, every layer's selected at once (:func:`layer_topk`)."""
        indices = layer_topk(tensor, ctx.layers, [keep_count(layer.numel, self.level(layer)) for layer in ctx.layers])
        return tensor.index_select(0, indices), indices.to(_index_dtype(ctx.numel))

    def decompress(self, payload: Payload, ctx: BucketContext, out: Tensor | None = None) -> Tensor:
        """Scatter the values into zeros."""
        values, indices = payload
        out = _zeros(ctx, out)
        return out.index_copy_(0, indices.long(), values.to(ctx.dtype))

    def aggregate(self, payloads: Sequence[Payload], ctx: BucketContext, out: Tensor | None = None) -> Tensor:
        """Sum every rank's sparse values straight into one dense tensor, in rank order.

        Within one rank the indices are unique, so each ``index_add_`` touches every element at most once and the
        sum is deterministic (and identical on every rank) even on CUDA.
        """
        out = _zeros(ctx, out)
        for values, indices in payloads:
            out.index_add_(0, indices.long(), values.to(ctx.dtype))
        return out


class RandomK(Compressor):
    """Send ``ratio`` of every layer's entries at random indices shared by all ranks (all-reduce).

    Random-k sparsification (Stich et al., 2018, "Sparsified SGD with Memory"; Wangni et al., 2018): every rank
    draws the same uniformly random ``k``-subset of each layer from the seed shared by all ranks, the step and the
    layer, so only the values travel and payloads sum: one all-reduce of ``k`` values per layer, no indices.

    With ``rescale=False`` (the default, the memory variant of Stich et al.) the kept values are sent as they are
    and error feedback carries the rest. With ``rescale=True`` values are scaled by ``numel / k``, which makes the
    compressor unbiased (error feedback then defaults to off); the variance grows by that factor.

    Args:
        ratio: fraction of each layer's entries sent, in (0, 1].
        rescale: scale kept values by ``numel / k`` so the compressor is unbiased.

    Raises:
        ValueError: If ``ratio`` is not in (0, 1].

    Example::

        >>> from lightning_gradcomp.compressors import RandomK
        >>> RandomK(ratio=0.01)
        RandomK(ratio=0.01, rescale=False)
    """

    collective: ClassVar[Collective] = "allreduce"
    level_attribute: ClassVar[str] = "ratio"

    def __init__(self, ratio: float = 0.01, rescale: bool = False) -> None:
        super().__init__()
        self.ratio = check_ratio(ratio)
        self.rescale = check_bool(rescale, "rescale")
        self._cache: dict[tuple, Tensor] = {}

    @property
    def unbiased(self) -> bool:
        """Unbiased only when rescaled."""
        return self.rescale

    def check_level(self, value: Any) -> float:
        """A keep-ratio in (0, 1]."""
        return check_ratio(value)

    def error_feedback_growth(self, enabled: bool | None) -> str | None:
        """A reason when rescaled and at most half of a layer is sent.

        Rescaled by ``d / k`` the expected error is ``d / k - 1`` times the input's squared norm, at least 1 then;
        without rescaling it is ``1 - k / d``, a contraction.
        """
        ratio = min([self.ratio, *self.layer_levels.values()])
        if not self.rescale or ratio > 0.5 or not self.resolve_error_feedback(enabled):
            return None
        return (
            f"rescaled by d / k, its expected squared error is d / k - 1 = {1 / ratio - 1:.3g} times the input's"
            f" squared norm (ratio {ratio}); unscaled it would be 1 - k / d, below 1"
        )

    def indices(self, ctx: BucketContext) -> Tensor:
        """The flat indices every rank keeps at this step (sorted per layer, int64, on ``ctx.device``)."""
        counts = [keep_count(layer.numel, self.level(layer)) for layer in ctx.layers]
        key = (
            ctx.seed,
            ctx.step,
            ctx.device,
            tuple((layer.index, layer.offset, layer.numel) for layer in ctx.layers),
            tuple(counts),
        )
        cached = self._cache.get(key)
        if cached is not None:
            return cached
        keys = [stream_key(ctx.seed, layer.index, _RANDOMK_SALT) for layer in ctx.layers]
        indices = shared_subsets(ctx.layers, counts, keys, ctx.step, ctx.device)
        if len(self._cache) >= 32:  # compress and decompress of one step hit the cache; older steps never do
            self._cache.clear()
        self._cache[key] = indices
        return indices

    def compress(self, tensor: Tensor, ctx: BucketContext) -> Payload:
        """The values at the shared indices."""
        return (tensor.index_select(0, self.indices(ctx)),)

    @property
    def keeps_input(self) -> bool:
        """Unscaled: the values at the shared indices are copied out, and the average is written into ``out``."""
        return not self.rescale

    def exchange(self, tensor: Tensor, ctx: BucketContext, out: Tensor) -> Exchange:
        """The default all-reduce of the values; unscaled, declared as sent exactly at the shared indices."""
        if self.rescale:
            return (yield from super().exchange(tensor, ctx, out))
        indices = self.indices(ctx)
        values = tensor.index_select(0, indices)  # a copy
        yield SentExactly(indices)
        (summed,) = yield AllReduce((values.div_(ctx.world_size),))
        return self.decompress((summed,), ctx, out=out)

    def decompress(self, payload: Payload, ctx: BucketContext, out: Tensor | None = None) -> Tensor:
        """Scatter the values into zeros (scaled by ``numel / k`` per layer when ``rescale``)."""
        out = _zeros(ctx, out)
        values = payload[0].to(ctx.dtype)
        if self.rescale:  # the kept values scaled before they are scattered: the same products, no pass over out
            factors = self._factors(ctx)  # in at least fp32, as a Python factor multiplies a half-precision tensor
            values = (values.to(factors.dtype) * factors).to(ctx.dtype)
        return out.index_copy_(0, self.indices(ctx), values)

    def _factors(self, ctx: BucketContext) -> Tensor:
        """``numel / k`` of its layer for every kept value (cached with the indices' layout)."""
        counts = [keep_count(layer.numel, self.level(layer)) for layer in ctx.layers]
        key = ("factors", ctx.device, tuple(layer.numel for layer in ctx.layers), tuple(counts))
        cached = self._cache.get(key)
        if cached is None:
            factors = [layer.numel / k for layer, k in zip(ctx.layers, counts)]
            cached = torch.tensor(factors, dtype=torch.float64).repeat_interleave(torch.tensor(counts))
            cached = self._cache[key] = cached.to(ctx.device, torch.promote_types(ctx.dtype, torch.float32))
        return cached

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "_cache"}  # cached index tensors are not state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._cache = {}
