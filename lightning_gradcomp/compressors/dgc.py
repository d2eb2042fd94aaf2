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
from lightning_gradcomp.compressors.packing import decode_indices, flat_nonzero, magnitude_above, unpack_bits
from lightning_gradcomp.compressors.random_subsets import draws, uniform_below
from lightning_gradcomp.compressors.sparse import SparseLayout, encode_sparse, sparse_layout
from lightning_gradcomp.compressors.sparse_shards import SPARSE_TRANSPORTS, SparseShards, owner_exchange, route_pairs
from lightning_gradcomp.compressors.sparsify import top_k_among
from lightning_gradcomp.compressors.transport import SparseTransport, sparse_transport_sum
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
# the CPU selects with the reference's loop, reading counts (free there); False takes the fixed-size selection there too
EARLY_EXIT_ON_CPU = True
WARMUP_RATIOS = (0.25, 0.0625, 0.015625, 0.004)  # sparsity 75%, 93.75%, 98.4375%, 99.6%, then the final ratio


def _clip_norm_(tensor: Tensor, max_norm: float) -> None:
    """Scale ``tensor`` so its L2 norm is at most ``max_norm`` (the reference's per-tensor ``clip_grad_norm_``)."""
    coefficient = (max_norm / (tensor.norm() + 1e-6)).clamp(max=1.0)  # a tensor: no host sync
    tensor.mul_(coefficient)


def _host_randint(high: int, generator: torch.Generator) -> int:
    """A draw in ``[0, high)`` from the CPU ``generator``: a host value, whatever the gradient's device."""
    return int(torch.randint(0, high, (1,), generator=generator))


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


class DGC(SparseShards, SparseTransport, Compressor):
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

    No host synchronisation on a GPU: the reference's loop reads the candidate count after every threshold; here
    (:meth:`select_fixed`) the counts at every threshold the loop may try come from one histogram, its decisions are
    taken on the device, and every layer sends its ``k`` slots with the unused ones zero. Where the loop would take
    the exact top-k among more than 1.3 k candidates, the fixed-size path takes the layer's top-k (the same
    elements). On the CPU, where reading a count costs nothing, the loop itself selects; both select the same
    elements. The uniform sample (``strided_sample=False``) is drawn on the gradient's device from a counter-based
    hash.

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
        transport: how the selected pairs are summed: ``"allgather"`` (the paper's), ``"two_phase"`` (to the owners
            of their indices, re-selected there: docs/two_phase.md), ``"auto"`` (the default: whichever of the two
            moves fewer bytes at the world size, the all-gather up to 3 ranks), ``"zen"`` or ``"zen-auto"`` (see
            :class:`~lightning_gradcomp.compressors.TopK` and docs/zen.md). Each rank's selection is the same;
            momentum factor masking clears what went out (over the two-phase exchange, a pair an owner's row had no
            slot for stays in ``v`` and ``u``). On a ResNet-18-shaped bucket (1.58M parameters) the default moves
            0.005 of a dense ring all-reduce's bytes at 2 ranks, 0.006 at 4 to 256 and 0.007 at 1024, where the
            all-gather moves 0.067 at 64 (``python benchmarks/scaling.py --workers 2 --analytical 2 4 8 16 32 64 128
            256 1024``).

    Raises:
        ValueError: If an argument is out of range.

    Example::

        >>> from lightning_gradcomp.compressors import DGC
        >>> DGC(ratio=0.001, warmup_steps=100)  # doctest: +ELLIPSIS
        DGC(ratio=0.001, momentum=0.9, ..., warmup_ratios=(0.25, 0.0625, 0.015625, 0.004), transport='auto')
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
        transport: str = "auto",
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
        self.transport = check_choice(transport, "transport", SPARSE_TRANSPORTS)
        self._momenta = self.layer_state("momentum")  # u, per layer (checkpointed)
        self.layer_state("owner_residual")  # the two-phase owner's (declared: a checkpoint's loads into a fresh one)
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
    def _threshold(self, values: Tensor, ratio: float, generator: torch.Generator) -> tuple[Tensor, bool]:
        """The sampled threshold of ``|values|`` (a 0-d tensor), and whether it came from a sample (not the layer)."""
        numel = values.numel()
        num_samples, top_k_samples, stride = sample_plan(numel, ratio, self.sample_ratio)
        if num_samples == numel:
            samples = values.abs()
        elif self.strided_sample:
            start = _host_randint(stride, generator)
            samples = values[start::stride].abs()
        else:  # uniform positions, drawn on the layer's device from a key the generator gives
            key = _host_randint(2**31, generator)
            counters = torch.arange(num_samples, dtype=torch.int64, device=values.device)
            samples = values.index_select(0, uniform_below(draws(key, counters), numel)).abs()
        threshold = torch.topk(samples, min(top_k_samples, samples.numel()), sorted=False).values.min()
        return threshold, numel > num_samples

    def select(self, values: Tensor, ratio: float, generator: torch.Generator) -> Tensor:
        """Layer-local indices of at most ``ceil(ratio d)`` large entries of ``values`` (the reference's rules).

        The reference's loop, which reads the candidate count after every threshold: the path taken on the CPU (where
        reading a count waits for nothing). :meth:`select_fixed` selects the same elements without reading.
        """
        k = math.ceil(values.numel() * ratio)
        # the importance |values| is formed only where it is read (the sample, the candidates): the masks compare the
        # values with both signs of the threshold, the same elements without a gradient-sized |values|
        threshold, sampled = self._threshold(values, ratio, generator)
        indices = flat_nonzero(magnitude_above(values, threshold, inclusive=True))
        if sampled:
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

    def select_fixed(self, values: Tensor, ratio: float, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        """:meth:`select`'s elements in ``k = ceil(ratio d)`` slots, and which slots are used: no host reads.

        The counts at every threshold the loop may try (the sampled one lowered 0 to 10 times by 0.8) come from one
        histogram of ``|values|`` over those thresholds; the loop's decisions are then made on the device. Where the
        loop stops at more than 1.3 k candidates, the exact top-k among them is the layer's top-k, taken from the
        whole layer (the candidates' number is not known on the host); otherwise the candidates in index order, at
        most ``k``. The selected indices come in increasing order, then the unused slots, which repeat the first.
        """
        numel = values.numel()
        k = math.ceil(numel * ratio)
        threshold, sampled = self._threshold(values, ratio, generator)
        magnitudes = values.abs()
        count: Tensor | None = None
        exact: Tensor | None = None
        if sampled:
            ladder = [threshold]
            for _ in range(_MAX_ADAPTATION_ITERS):  # as the loop lowers it: one rounding per step
                ladder.append(ladder[-1] * _LOWER_BOUND)
            ascending = torch.stack(ladder[::-1])
            level = torch.bucketize(magnitudes, ascending, right=True)  # thresholds at or below each |x|
            histogram = torch.zeros(len(ladder) + 1, dtype=torch.int64, device=values.device)
            histogram.index_add_(0, level, torch.ones(1, dtype=torch.int64, device=values.device).expand(numel))
            counts = histogram.flip(0).cumsum(0)[: len(ladder)]  # counts[j]: |x| >= threshold lowered j times
            enough = counts[:-1] >= _LOWER_BOUND * k
            stop = torch.where(enough.any(), enough.int().argmax(), _MAX_ADAPTATION_ITERS)
            threshold = ascending.flip(0).index_select(0, stop.view(1)).squeeze(0)
            count = counts.index_select(0, stop.view(1)).squeeze(0)
            exact = (stop < _MAX_ADAPTATION_ITERS) & (count > _UPPER_BOUND * k)
        candidates = magnitudes >= threshold
        rank = torch.cumsum(candidates, 0)
        if count is None:
            count = rank[-1]
        slot = torch.where(candidates & (rank <= k), rank - 1, k)
        first = torch.zeros(k + 1, dtype=torch.int64, device=values.device)
        first.scatter_(0, slot, torch.arange(numel, device=values.device))  # slot k takes the rest: dropped
        kept = torch.clamp(count, max=k)
        if exact is not None:
            top = torch.topk(magnitudes, k, sorted=False).indices.sort().values
            first = torch.where(exact, torch.cat([top, top[:1]]), first)
            kept = torch.where(exact, k, kept)
        used = torch.arange(k, device=values.device) < kept
        return torch.where(used, first[:k], first[:1]), used

    # ------------------------------------------------------------------------------------------------------------
    # The contract: sparsify what is given (momentum and accumulation are in reduce)
    # ------------------------------------------------------------------------------------------------------------
    def _fixed(self, tensor: Tensor) -> bool:
        """Whether :meth:`select_fixed` selects (all but the CPU's all-gather, where :meth:`select` reads freely)."""
        return self.transport not in ("zen", "zen-auto") and not (tensor.device.type == "cpu" and EARLY_EXIT_ON_CPU)

    def _encode(self, tensor: Tensor, ctx: BucketContext, layout: SparseLayout) -> tuple[Payload, list[Tensor]]:
        fixed = self._fixed(tensor)
        picked, values = [], []
        for layer in ctx.layers:
            flat, ratio, generator = (
                layer.flat(tensor),
                self.ratio_at(layer, ctx.step),
                ctx.generator(layer, per_rank=True),
            )
            if fixed:  # k slots: the unused ones repeat a selected index with the value 0
                idx, used = self.select_fixed(flat, ratio, generator)
                values.append(flat.index_select(0, idx).masked_fill_(~used, 0))
            else:
                idx = self.select(flat, ratio, generator)
                values.append(flat.index_select(0, idx))
            picked.append(idx)
        # the fixed selection is in increasing order already, its unused slots last (as a bitmap decodes)
        blob, slotted = encode_sparse(layout, picked, values, tensor, ordered_=fixed)
        assert slotted is not None  # values were given
        return (blob, slotted), picked

    def compress(self, tensor: Tensor, ctx: BucketContext) -> Payload:
        """Index blob and slot values of every layer."""
        return self._encode(tensor, ctx, self._layout(ctx))[0]

    def _add_sparse(self, layout: SparseLayout, blob: Tensor, values: Tensor, out: Tensor) -> None:
        """Add one rank's slot values at its indices; a bitmap's through the ranks of its set bits (fixed sizes)."""
        for segment in layout.segments:
            part = blob[segment.blob_at : segment.blob_at + segment.nbytes]
            slotted = values[segment.value_at : segment.value_at + segment.slots].to(out.dtype)
            target = segment.layer.flat(out)
            if segment.bitmap:  # the i-th set bit takes the i-th slot (zeros elsewhere): no data-dependent size
                mask = unpack_bits(part, segment.layer.numel)
                rank = torch.cumsum(mask, 0).sub_(1).clamp_(0, segment.slots - 1)
                target.add_(slotted.index_select(0, rank).masked_fill_(~mask, 0))
            else:  # within one rank the indices are distinct or carry 0 (unused slots): deterministic on CUDA too
                target.index_add_(0, decode_indices(part, segment.layer.numel, segment.slots, False), slotted)

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
        if self.sparse_two_phase(ctx, layout.slots, sum(p.numel() * p.element_size() for p in payload)):
            return (yield from self._two_phase_exchange(tensor, payload, picked, layout, ctx, out))
        pairs = None
        zen = self.transport in ("zen", "zen-auto")
        if zen or ctx.error_feedback:
            indices = torch.cat([idx + layer.offset for layer, idx in zip(ctx.layers, picked)])
            if zen:  # read before v is cleared where sent
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

    def _two_phase_exchange(
        self, tensor: Tensor, payload: Payload, picked: list[Tensor], layout: SparseLayout, ctx: BucketContext,
        out: Tensor,
    ) -> Exchange:  # fmt: skip
        """The selected pairs to their owners; ``v`` (and ``u``) cleared where a pair went (sparse_shards.py)."""
        if self._fixed(tensor):  # k slots per layer, in index order; the unused ones repeat an index with the value 0
            local, values = picked, payload[1]
        else:  # the early-exit selection: at most k distinct indices per layer, padded here with the value 0
            local = [torch.nn.functional.pad(idx, (0, segment.slots - idx.numel())) for idx, segment in
                     zip(picked, layout.segments)]  # fmt: skip
            values = torch.cat([torch.nn.functional.pad(layer.flat(tensor).index_select(0, idx), (0, n - idx.numel()))
                                for layer, idx, n in zip(ctx.layers, picked, (len(i) for i in local))])  # fmt: skip
        indices = torch.cat([idx + layer.offset for layer, idx in zip(ctx.layers, local)])
        routed = route_pairs(indices, values, ctx)
        yield routed.declaration(indices, values)
        if self.momentum_masking and self.momentum:
            at = 0
            for layer, idx in zip(ctx.layers, local):
                u, sent = self._next_momenta[layer.name], routed.sent[at : at + idx.numel()]
                at += idx.numel()
                u.index_add_(0, idx, torch.where(sent, u.index_select(0, idx), 0.0), alpha=-1)  # u - u: exactly 0
        return (yield from owner_exchange(self, routed, ctx, out))

    def finish_dense(self, average: Tensor, ctx: BucketContext) -> None:
        """Densely averaged layers get the momentum too: clipping at ``clip_norm``, then ``u <- momentum u + avg``."""
        for layer in ctx.layers:
            g = layer.flat(average)
            if self.clip_norm is not None:
                _clip_norm_(g, self.clip_norm)
            self._correct(layer, g, ctx)
