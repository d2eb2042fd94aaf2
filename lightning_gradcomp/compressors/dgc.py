"""Deep Gradient Compression: momentum correction, local clipping, momentum factor masking, sampled-threshold top-k."""

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
    Layer,
    LayerBuffers,
    Payload,
)
from lightning_gradcomp.compressors.exchange import AllGather, Exchange, SentExactly
from lightning_gradcomp.compressors.packing import flat_nonzero, magnitude_above
from lightning_gradcomp.compressors.sparse import SparseLayout, decode_sparse, encode_sparse, sparse_layout
from lightning_gradcomp.compressors.sparsify import top_k_among
from lightning_gradcomp.compressors.transport import TRANSPORTS, SparseTransport, sparse_transport_sum
from lightning_gradcomp.validation import (
    check_bool,
    check_choice,
    check_int,
    check_momentum,
    check_number,
    check_ratio,
)

# the reference code's threshold adaptation (synxlin/deep-gradient-compression, dgc/compression.py)
_UPPER_BOUND = 1.3  # more than 1.3 k candidates: exact top-k among them
_LOWER_BOUND = 0.8  # fewer than 0.8 k: lower the threshold by this factor and count again
_MAX_ADAPTATION_ITERS = 10
WARMUP_RATIOS = (0.25, 0.0625, 0.015625, 0.004)  # sparsity 75%, 93.75%, 98.4375%, 99.6%, then the final ratio


def _clip_norm_(tensor: Tensor, max_norm: float) -> None:
    """Scale ``tensor`` so its L2 norm is at most ``max_norm`` (the reference's per-tensor ``clip_grad_norm_``)."""
    coefficient = (max_norm / (tensor.norm() + 1e-6)).clamp(max=1.0)  # a tensor: no host sync
    tensor.mul_(coefficient)


def sample_plan(numel: int, ratio: float, sample_ratio: float) -> tuple[int, int, int]:
    """``(num_samples, top_k_samples, stride)`` of the reference code for a layer of ``numel`` elements.

    The stride is ``32 j + 1`` stepped down by 8 until the strided sample holds at least ``max(ceil(sample_ratio
    numel), ceil(2 / ratio))`` elements; layers with at most ``ceil(2 / ratio)`` elements are not sampled.
    """
    if sample_ratio >= 1.0:
        return numel, math.ceil(numel * ratio), 1
    wanted = max(math.ceil(numel * sample_ratio), math.ceil(2 / ratio))
    if numel <= math.ceil(2 / ratio):
        return numel, math.ceil(numel * ratio), 1
    stride = math.ceil(numel / wanted / 32) * 32 + 1
    samples = numel // stride
    while samples < wanted:
        stride -= 8
        samples = numel // stride
    return samples, math.ceil(samples * ratio), stride


class DGC(SparseTransport, Compressor):
    """Deep Gradient Compression: send the 0.1% largest accumulated momentum-corrected gradients (all-gather).

    Lin, Han, Mao, Wang & Dally, "Deep Gradient Compression: Reducing the Communication Bandwidth for Distributed
    Training", ICLR 2018 (arXiv:1712.01887); the steps follow the authors' code (synxlin/deep-gradient-compression).
    Per rank and layer, every step:

    1. **local gradient clipping** (when ``clip_norm`` is set): the layer's gradient norm is clipped to
       ``clip_norm / sqrt(n)``. The paper clips the whole local gradient and scales the threshold by ``n^(-1/2)``
       (from memory of the paper, not re-checked against its text); inside a DDP bucket hook only layers are
       visible, so the norm is per layer, as the authors' code clips each tensor;
    2. **momentum correction**: ``u <- momentum u + g``; ``v <- v + u`` (Nesterov: ``u <- momentum (u + g)``,
       ``v <- v + u + g``). ``v`` is the error-feedback memory (the hook's residual, per parameter, checkpointed);
       ``u`` is this compressor's state (per layer, in :meth:`state_dict`);
    3. **sampled-threshold selection** (not a full sort): the threshold is the smallest of the top
       ``ceil(samples ratio)`` of a strided sample of ``|v|`` (random start, per rank) holding at least 1% of the
       layer; every element at or above it is a candidate; more than 1.3 k candidates: exact top-k among them; fewer
       than 0.8 k: the threshold is lowered by 0.8 and the count repeated (at most 10 times); at most ``k = ceil(ratio
       d)`` are kept;
    4. the values and indices are all-gathered and summed in rank order; the average is the update;
    5. **momentum factor masking**: ``u`` and ``v`` are zeroed where values were sent.

    **Use** :class:`~lightning_gradcomp.optim.DGCSGD` (``DGCSGD(params, lr, momentum=0.9, weight_decay=...)``), the
    reference code's optimizer: the gradient's momentum lives here, and the averaged gradient this compressor returns
    is already the momentum step, so the optimizer applies it as it is and keeps a momentum buffer for the weight
    decay term alone. ``torch.optim.SGD`` with momentum applies momentum twice (``CompressedDDP`` warns), and without
    momentum its weight decay has no momentum, about ten times weaker than the paper's at momentum 0.9.

    Layers with fewer than two dimensions or fewer than ``CompressedDDP(min_compress_numel=...)`` elements are
    averaged densely (one all-reduce) and then given the momentum ``u <- momentum u + avg`` (the reference code's path
    for uncompressed tensors, :meth:`finish_dense`); so is every layer while compression is off (a
    :class:`~lightning_gradcomp.callbacks.DenseWarmup`), so that warm-up is momentum SGD, not SGD without momentum.
    Without error feedback (``CompressedDDP(error_feedback=False)``) ``v`` is not kept and the unsent part is
    dropped.

    Warm-up (the paper's exponential schedule, off by default): with ``warmup_steps > 0`` the keep-ratio is
    ``warmup_ratios[step // warmup_steps]`` (default 25%, 6.25%, 1.5625%, 0.4%: sparsity 75%, 93.75%, 98.4375%,
    99.6%) until ``warmup_steps * len(warmup_ratios)`` steps have passed, then ``ratio``. Set ``warmup_steps`` to the
    number of steps per epoch for the paper's four warm-up epochs. The position depends only on the step, so every
    rank agrees and a resumed run continues exactly.

    Payload per rank and step for a sparsified layer of ``d`` elements: ``k = ceil(ratio d)`` value slots (fp32: 4
    bytes each) plus the indices as int32 (``4 k`` bytes) or a bitmap (``ceil(d / 32) * 4`` bytes) when smaller;
    unused slots (fewer than ``k`` selected) are sent as zeros. Dense layers: ``4 d`` (their own all-reduce).

    On CUDA the selection synchronises with the host per layer (candidate counts), as the reference code does.

    Args:
        ratio: final fraction of each layer sent, in (0, 1] (0.001: 99.9% sparsity).
        momentum: momentum of the correction, in [0, 1).
        nesterov: Nesterov momentum correction.
        momentum_masking: zero the momentum where values were sent (momentum factor masking).
        sample_ratio: fraction of each layer sampled for the threshold, in (0, 1] (1: exact threshold).
        strided_sample: sample at a stride (the reference code) rather than uniformly at random.
        clip_norm: per-layer clipping norm of the averaged gradient, or ``None``; local gradients are clipped at
            ``clip_norm / sqrt(world_size)`` before accumulation.
        warmup_steps: steps per warm-up stage (0: no warm-up).
        warmup_ratios: the keep-ratios of the warm-up stages, each in (0, 1].
        transport: how the selected pairs are summed: ``"allgather"`` (the paper's), ``"zen"`` or ``"auto"`` (see
            :class:`~lightning_gradcomp.compressors.TopK` and docs/zen.md); the selection and the masking are the same.

    Raises:
        ValueError: If an argument is out of range.

    Example::

        >>> from lightning_gradcomp.compressors import DGC
        >>> DGC(ratio=0.001, warmup_steps=100)  # doctest: +ELLIPSIS
        DGC(ratio=0.001, momentum=0.9, ..., warmup_ratios=(0.25, 0.0625, 0.015625, 0.004), transport='allgather')
    """

    collective: ClassVar[Collective] = "allgather"
    unbiased: ClassVar[bool] = False
    level_attribute: ClassVar[str] = "ratio"
    optimizer_momentum_conflicts: ClassVar[bool] = True  # CompressedDDP warns if the optimizer has momentum

    def __init__(
        self,
        ratio: float = 0.001,
        momentum: float = 0.9,
        nesterov: bool = False,
        momentum_masking: bool = True,
        sample_ratio: float = 0.01,
        strided_sample: bool = True,
        clip_norm: float | None = None,
        warmup_steps: int = 0,
        warmup_ratios: Sequence[float] = WARMUP_RATIOS,
        transport: str = "allgather",
    ) -> None:
        super().__init__()
        self.ratio = check_ratio(ratio)
        self.momentum = check_momentum(momentum)
        self.nesterov = check_bool(nesterov, "nesterov")
        self.momentum_masking = check_bool(momentum_masking, "momentum_masking")
        self.strided_sample = check_bool(strided_sample, "strided_sample")
        if nesterov and momentum == 0:
            raise ValueError("Expected `momentum` > 0 with `nesterov=True`, got 0.")
        self.sample_ratio = check_ratio(sample_ratio, "sample_ratio")
        self.clip_norm = check_number(clip_norm, "clip_norm", low=0.0, low_open=True, allow_none=True)
        self.warmup_steps = check_int(warmup_steps, "warmup_steps", low=0)
        if isinstance(warmup_ratios, str) or not isinstance(warmup_ratios, Sequence) or not warmup_ratios:
            raise ValueError(f"Expected `warmup_ratios` to be a non-empty sequence of ratios, got {warmup_ratios!r}.")
        self.warmup_ratios = tuple(check_ratio(r, "warmup_ratios") for r in warmup_ratios)
        self.transport = check_choice(transport, "transport", TRANSPORTS)
        self._momenta = self.layer_state("momentum")  # u, per layer (checkpointed)
        self._next_momenta = LayerBuffers()  # this step's u, staged until the step is known finite

    # ------------------------------------------------------------------------------------------------------------
    # Which layers, how sparse
    # ------------------------------------------------------------------------------------------------------------
    def check_level(self, value: Any) -> float:
        """A keep-ratio in (0, 1]."""
        return check_ratio(value)

    def ratio_at(self, layer: Layer, step: int) -> float:
        """The keep-ratio of ``layer`` at ``step``: a warm-up stage's (if denser) or the layer's level."""
        level = self.level(layer)
        if self.warmup_steps and step < self.warmup_steps * len(self.warmup_ratios):
            return max(level, self.warmup_ratios[step // self.warmup_steps])
        return level

    def _layout(self, ctx: BucketContext) -> SparseLayout:
        slots = [math.ceil(layer.numel * self.ratio_at(layer, ctx.step)) for layer in ctx.layers]
        return sparse_layout(ctx.layers, slots)

    # ------------------------------------------------------------------------------------------------------------
    # Selection
    # ------------------------------------------------------------------------------------------------------------
    def select(self, values: Tensor, ratio: float, generator: torch.Generator) -> Tensor:
        """Layer-local indices of at most ``ceil(ratio d)`` large entries of ``values`` (the reference's rules)."""
        numel = values.numel()
        k = math.ceil(numel * ratio)
        # the importance |values| is formed only where it is read (the sample, the candidates): the masks compare the
        # values with both signs of the threshold, the same elements without a gradient-sized |values|
        num_samples, top_k_samples, stride = sample_plan(numel, ratio, self.sample_ratio)
        if num_samples == numel:
            samples = values.abs()
        elif self.strided_sample:
            start = int(torch.randint(0, stride, (1,), generator=generator))
            samples = values[start::stride].abs()
        else:
            picks = torch.randint(0, numel, (num_samples,), generator=generator).to(values.device)
            samples = values.index_select(0, picks).abs()
        threshold = torch.topk(samples, min(top_k_samples, samples.numel()), sorted=False).values.min()
        indices = flat_nonzero(magnitude_above(values, threshold, inclusive=True))
        if numel > num_samples:
            for _ in range(_MAX_ADAPTATION_ITERS):
                count = indices.numel()
                if count > k:
                    if count > _UPPER_BOUND * k:  # the reference's `resample`: exact top-k among the candidates
                        indices = top_k_among(values, indices, k)
                    break
                if count >= _LOWER_BOUND * k:
                    break
                threshold = threshold * _LOWER_BOUND
                indices = flat_nonzero(magnitude_above(values, threshold, inclusive=True))
        return indices[:k]

    # ------------------------------------------------------------------------------------------------------------
    # The contract: sparsify what is given (momentum and accumulation are in reduce)
    # ------------------------------------------------------------------------------------------------------------
    def _encode(self, tensor: Tensor, ctx: BucketContext, layout: SparseLayout) -> tuple[Payload, list[Tensor]]:
        picked = [
            self.select(layer.flat(tensor), self.ratio_at(layer, ctx.step), ctx.generator(layer, per_rank=True))
            for layer in ctx.layers
        ]
        values = [layer.flat(tensor).index_select(0, idx) for layer, idx in zip(ctx.layers, picked)]
        blob, slotted = encode_sparse(layout, picked, values, tensor)
        assert slotted is not None  # values were given
        return (blob, slotted), picked

    def compress(self, tensor: Tensor, ctx: BucketContext) -> Payload:
        """Index blob and slot values of every layer."""
        return self._encode(tensor, ctx, self._layout(ctx))[0]

    def _add_sparse(self, layout: SparseLayout, blob: Tensor, values: Tensor, out: Tensor) -> None:
        indices = decode_sparse(layout, blob)
        for segment, idx in zip(layout.segments, indices):
            # within one rank the indices are distinct (padding adds zeros), so this is deterministic on CUDA too
            out.index_add_(0, idx, values[segment.value_at : segment.value_at + idx.numel()].to(out.dtype))

    def decompress(self, payload: Payload, ctx: BucketContext, out: Tensor | None = None) -> Tensor:
        """Sparse values scattered into zeros."""
        return self.aggregate([payload], ctx, out)

    def aggregate(self, payloads: Sequence[Payload], ctx: BucketContext, out: Tensor | None = None) -> Tensor:
        """Sum every rank's payload, in rank order."""
        layout = self._layout(ctx)
        out = ctx.output(out, zeros=True)
        for blob, values in payloads:
            self._add_sparse(layout, blob, values, out)
        return out

    # ------------------------------------------------------------------------------------------------------------
    # The reduction: clipping, momentum correction, accumulation, selection, masking
    # ------------------------------------------------------------------------------------------------------------
    def _correct(self, layer: Layer, g: Tensor, ctx: BucketContext) -> None:
        """Momentum-correct ``g`` in place: ``g`` becomes what is accumulated (``u``, or ``u + g`` for Nesterov).

        The new ``u`` goes into a buffer of its own, staged: it replaces ``u`` once the step is finite everywhere.
        """
        if not self.momentum:
            return
        new_u = self._next_momentum(layer, g, ctx)
        if self.nesterov:
            g.add_(new_u)
        else:
            g.copy_(new_u)

    def _next_momentum(self, layer: Layer, g: Tensor, ctx: BucketContext) -> Tensor:
        """The new ``u`` (``momentum u + g``; ``momentum (u + g)`` for Nesterov) in a buffer of its own, staged."""
        u = self._momenta.get(layer, g)
        new_u = self._next_momenta.get(layer, g)
        if self.nesterov:
            torch.add(u, g, out=new_u).mul_(self.momentum)
        else:
            torch.add(g, u, alpha=self.momentum, out=new_u)
        ctx.stage(u, new_u, swap=True)  # the next buffer is rewritten whole
        return new_u

    def accumulate(self, tensor: Tensor, ctx: BucketContext) -> Tensor | tuple[Tensor, ...]:
        """Local clipping, then ``u <- momentum u + g`` per layer: ``u`` is what error feedback's ``v`` accumulates.

        With error feedback and plain momentum it returns each layer's new ``u`` in its own buffer, and the driver
        sums ``v + u`` from there straight into the updated residual's buffer (``u`` is not copied into ``tensor``
        first: one memory pass per step; the same sums). Otherwise ``tensor`` takes what is accumulated.
        """
        direct = ctx.error_feedback and bool(self.momentum) and not self.nesterov and tensor.numel() == ctx.numel
        momenta = []
        for layer in ctx.layers:
            g = layer.flat(tensor)
            if self.clip_norm is not None:
                _clip_norm_(g, self.clip_norm / math.sqrt(ctx.world_size))
            if direct:
                momenta.append(self._next_momentum(layer, g, ctx))
            else:
                self._correct(layer, g, ctx)
        return tuple(momenta) if direct else tensor

    @property
    def keeps_input(self) -> bool:
        """Yes: ``v`` is only read (the selected values are copied out), and the average is written into ``out``."""
        return True

    def exchange(self, tensor: Tensor, ctx: BucketContext, out: Tensor) -> Exchange:
        """Select, clear ``v`` (and ``u``) where sent, all-gather; the average is the sum over ranks ``/ n``."""
        layout = self._layout(ctx)
        payload, picked = self._encode(tensor, ctx, layout)
        pairs = None
        if self.transport != "allgather" or ctx.error_feedback:
            indices = torch.cat([idx + layer.offset for layer, idx in zip(ctx.layers, picked)])
            if self.transport != "allgather":  # read before v is cleared where sent
                pairs = (indices, tensor.index_select(0, indices))
            yield SentExactly(indices)  # v is cleared where it was sent
        if self.momentum_masking and self.momentum:
            for layer, idx in zip(ctx.layers, picked):
                self._next_momenta[layer.name].index_fill_(0, idx, 0)
        if pairs is not None:
            summed = yield from sparse_transport_sum(self, self.transport, *pairs, ctx, out)
            return summed.div_(ctx.world_size)
        gathered = yield AllGather(payload)
        out.zero_()
        for blob, values in gathered:
            self._add_sparse(layout, blob, values, out)
        return out.div_(ctx.world_size)

    def finish_dense(self, average: Tensor, ctx: BucketContext) -> None:
        """Densely averaged layers get the momentum too: clipping at ``clip_norm``, then ``u <- momentum u + avg``."""
        for layer in ctx.layers:
            g = layer.flat(average)
            if self.clip_norm is not None:
                _clip_norm_(g, self.clip_norm)
            self._correct(layer, g, ctx)
