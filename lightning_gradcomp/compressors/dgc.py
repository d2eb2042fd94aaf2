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
from lightning_gradcomp.compressors.ops.dgc_select import (
    LOWER_BOUND,
    MAX_ADAPTATION_ITERS,
    UPPER_BOUND,
    layer_streams,
    sample_plan,
    sample_positions,
    select_layers,
)
from lightning_gradcomp.compressors.ops.packing import flat_nonzero, magnitude_above
from lightning_gradcomp.compressors.ops.segments import segments_of
from lightning_gradcomp.compressors.ops.sparse import SparseLayout, sparse_layout
from lightning_gradcomp.compressors.ops.sparse_blob import decode_pairs, encode_full_blob
from lightning_gradcomp.compressors.transports.hashed_sum import SparseTransport, sparse_transport_sum
from lightning_gradcomp.compressors.transports.sparse_shards import (
    SPARSE_TRANSPORTS,
    SparseShards,
    owner_exchange,
    route_pairs,
)
from lightning_gradcomp.engine.requests import AllGather, Exchange, SentExactly
from lightning_gradcomp.validation import (
    check_bool,
    check_choice,
    check_int,
    check_momentum,
    check_number,
    check_ratio,
)

WARMUP_RATIOS = (0.25, 0.0625, 0.015625, 0.004)  # sparsity 75%, 93.75%, 98.4375%, 99.6%, then the final ratio
#: on the CPU, where reading a count waits for nothing, the reference's loop selects layer by layer: the same elements
#: as the bucket's selection in a fraction of its memory passes (False: the bucket's selection there too)
LOOP_ON_CPU = True
__all__ = ["DGC", "WARMUP_RATIOS", "sample_plan"]


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

    No host synchronisation and no loop over the layers (:mod:`~lightning_gradcomp.compressors.ops.dgc_select`): the
    reference's loop reads the candidate count after every threshold; here every layer's sample is drawn on the
    gradient's device (a counter-based hash of the seed, the layer's index, the rank and the step), every layer's
    threshold comes from one batched top-k of the samples, the counts at every threshold the loop may try from one
    histogram over the bucket, and the loop's decisions are taken on the device; every layer sends its ``k`` slots
    with the unused ones zero. Where the loop would take the exact top-k among more than 1.3 k candidates, the layer's
    top-k is taken (the same elements; ties at the k-th magnitude keep the lowest indices). The momentum correction,
    the clipping (segmented norms), the encoding and the decoding of every rank's payload are bucket-wide too: a
    bucket costs the same number of operators whatever its number of layers. :meth:`select` is the reference loop for
    one layer, which the bucket's selection is tested against.

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
    def select(self, values: Tensor, ratio: float, stream: Tensor) -> Tensor:
        """The reference's loop for one layer: the indices of at most ``ceil(ratio d)`` large ``|values|``.

        It reads the candidate count after every threshold (a host read). The hook takes the same rule for every
        layer of a bucket at once on the device (:func:`~.dgc_select.select_layers`), which is checked against this
        loop. ``stream`` is the layer's sample stream (a 0-d int64 tensor, :func:`~.dgc_select.layer_streams`).
        """
        numel = values.numel()
        k = math.ceil(numel * ratio)
        num_samples, top_k_samples, _ = sample_plan(numel, ratio, self.sample_ratio)
        positions = sample_positions(numel, ratio, self.sample_ratio, self.strided_sample, stream.to(values.device))
        samples = values.index_select(0, positions).abs()
        threshold = torch.topk(samples, min(top_k_samples, samples.numel()), sorted=False).values.min()
        indices = flat_nonzero(magnitude_above(values, threshold, inclusive=True))
        if num_samples < numel:
            for _ in range(MAX_ADAPTATION_ITERS):
                count = indices.numel()
                if count > k:
                    if count > UPPER_BOUND * k:  # the reference's `resample`: exact top-k among the candidates
                        # (ties at the k-th magnitude: the lowest indices, as the bucket's selection keeps)
                        order = torch.sort(values.index_select(0, indices).abs(), descending=True, stable=True)
                        indices = indices.index_select(0, order.indices[:k]).sort().values
                    break
                if count >= LOWER_BOUND * k:
                    break
                threshold = threshold * LOWER_BOUND
                indices = flat_nonzero(magnitude_above(values, threshold, inclusive=True))
        return indices[:k]

    def _select_by_layer(self, tensor: Tensor, ctx: BucketContext, ratios: list[float]) -> tuple[Tensor, Tensor]:
        """:func:`~.dgc_select.select_layers`'s slots through the reference loop, layer by layer (the CPU's path)."""
        streams, picked, used = layer_streams(ctx), [], []
        for i, (layer, ratio) in enumerate(zip(ctx.layers, ratios)):
            idx = self.select(layer.flat(tensor), ratio, streams[i]).sort().values
            k = math.ceil(layer.numel * ratio)
            first = idx[:1] if idx.numel() else torch.zeros(1, dtype=torch.int64)
            picked.append(torch.cat([idx, first.expand(k - idx.numel())]).add_(layer.offset))
            used.append(torch.arange(k) < idx.numel())
        return torch.cat(picked), torch.cat(used)

    def _encode(self, tensor: Tensor, ctx: BucketContext, layout: SparseLayout) -> tuple[Payload, Tensor, Tensor]:
        """The payload, the selected flat indices (``k`` slots per layer) and which slots are used."""
        ratios = [self.ratio_at(layer, ctx.step) for layer in ctx.layers]
        if tensor.device.type == "cpu" and LOOP_ON_CPU:
            indices, used = self._select_by_layer(tensor, ctx, ratios)
        else:
            indices, used = select_layers(
                tensor, ctx.layers, ratios, layer_streams(ctx), self.sample_ratio, self.strided_sample
            )
        values = tensor.index_select(0, indices).masked_fill_(~used, 0)  # unused slots repeat an index: value 0
        return (encode_full_blob(layout, indices), values), indices, used

    # ------------------------------------------------------------------------------------------------------------
    # The contract: sparsify what is given (momentum and accumulation are in reduce)
    # ------------------------------------------------------------------------------------------------------------
    def compress(self, tensor: Tensor, ctx: BucketContext) -> Payload:
        """Index blob and slot values of every layer."""
        return self._encode(tensor, ctx, self._layout(ctx))[0]

    def decompress(self, payload: Payload, ctx: BucketContext, out: Tensor | None = None) -> Tensor:
        """Sparse values scattered into zeros."""
        return self.aggregate([payload], ctx, out)

    def aggregate(self, payloads: Sequence[Payload], ctx: BucketContext, out: Tensor | None = None) -> Tensor:
        """Sum every rank's payload, in rank order, every layer at once (:func:`~.sparse_blob.decode_pairs`).

        Within one rank the used slots' indices are distinct and the unused ones carry 0: deterministic on CUDA too.
        """
        layout = self._layout(ctx)
        out = ctx.output(out, zeros=True)
        for blob, values in payloads:
            indices, slotted = decode_pairs(layout, blob, values)
            out.index_add_(0, indices, slotted.to(out.dtype))
        return out

    # ------------------------------------------------------------------------------------------------------------
    # The reduction: clipping, momentum correction, accumulation, selection, masking
    # ------------------------------------------------------------------------------------------------------------
    def _momentum_step(self, g: Tensor, ctx: BucketContext) -> Tensor:
        """The new ``u`` (``momentum u + g``; ``momentum (u + g)`` for Nesterov) of every layer, staged.

        The bucket at once: every layer's ``u`` is a view of one flat tensor (kept and saved per layer), and so is
        the next one, which replaces it once the step is finite everywhere.
        """
        u = self._momenta.flat(ctx.layers, g)
        new_u = self._next_momenta.flat(ctx.layers, g)  # reused every step: no allocation on the hook path
        if self.nesterov:
            torch.add(u, g, out=new_u).mul_(self.momentum)
        else:
            torch.add(g, u, alpha=self.momentum, out=new_u)
        ctx.stage(u, new_u)  # copied at commit: a swap of storage would leave the layers' views behind
        return new_u

    def _correct(self, g: Tensor, ctx: BucketContext) -> None:
        """Momentum-correct ``g`` in place: ``g`` becomes what is accumulated (``u``, or ``u + g`` for Nesterov)."""
        if not self.momentum:
            return
        new_u = self._momentum_step(g, ctx)
        if self.nesterov:
            g.add_(new_u)
        else:
            g.copy_(new_u)

    def accumulate(self, tensor: Tensor, ctx: BucketContext) -> Tensor | tuple[Tensor, ...]:
        """Local clipping, then ``u <- momentum u + g`` per layer: ``u`` is what error feedback's ``v`` accumulates.

        With error feedback and plain momentum it returns the new ``u`` (its own flat buffer), and the driver sums
        ``v + u`` from there straight into the updated residual's buffer (``u`` is not copied into ``tensor`` first:
        one memory pass per step; the same sums). Otherwise ``tensor`` takes what is accumulated.
        """
        g = tensor.narrow(0, 0, ctx.numel)
        if self.clip_norm is not None:
            _clip_layers_(g, ctx, self.clip_norm / math.sqrt(ctx.world_size))
        if ctx.error_feedback and bool(self.momentum) and not self.nesterov and tensor.numel() == ctx.numel:
            return self._momentum_step(g, ctx)
        self._correct(g, ctx)
        return tensor

    @property
    def keeps_input(self) -> bool:
        """Yes: ``v`` is only read (the selected values are copied out), and the average is written into ``out``."""
        return True

    def exchange(self, tensor: Tensor, ctx: BucketContext, out: Tensor) -> Exchange:
        """Select, clear ``v`` (and ``u``) where sent, all-gather; the average is the sum over ranks ``/ n``."""
        layout = self._layout(ctx)
        payload, indices, used = self._encode(tensor, ctx, layout)
        if self.sparse_two_phase(ctx, layout.slots, sum(p.numel() * p.element_size() for p in payload)):
            return (yield from self._two_phase_exchange(tensor, payload, indices, ctx, out))
        pairs = None
        if self.transport in ("zen", "zen-auto"):  # Zen sends the used slots only (it reads sizes anyway)
            chosen = flat_nonzero(used)
            pairs = (indices.index_select(0, chosen), payload[1].index_select(0, chosen))
        if pairs is not None or ctx.error_feedback:
            yield SentExactly(indices)  # v is cleared where it was sent (an unused slot repeats a sent index)
        if self.momentum_masking and self.momentum:
            self._next_momenta.flat(ctx.layers, tensor.narrow(0, 0, ctx.numel)).index_fill_(0, indices, 0)
        if pairs is not None:
            summed = yield from sparse_transport_sum(self, self.transport, *pairs, ctx, out)
            return summed.div_(ctx.world_size)
        gathered = yield AllGather(payload)
        return self.aggregate(gathered, ctx, out).div_(ctx.world_size)

    def _two_phase_exchange(
        self, tensor: Tensor, payload: Payload, indices: Tensor, ctx: BucketContext, out: Tensor
    ) -> Exchange:
        """The selected pairs to their owners; ``v`` (and ``u``) cleared where a pair went (sparse_shards.py).

        ``k`` slots per layer, in index order; the unused ones repeat an index with the value 0 and take no row slot.
        """
        values = payload[1]
        routed = route_pairs(indices, values, ctx)
        yield routed.declaration(indices, values)
        if self.momentum_masking and self.momentum:
            u = self._next_momenta.flat(ctx.layers, tensor.narrow(0, 0, ctx.numel))
            u.index_add_(0, indices, torch.where(routed.sent, u.index_select(0, indices), 0.0), alpha=-1)  # exactly 0
        return (yield from owner_exchange(self, routed, ctx, out))

    def finish_dense(self, average: Tensor, ctx: BucketContext) -> None:
        """Densely averaged layers get the momentum too: clipping at ``clip_norm``, then ``u <- momentum u + avg``."""
        g = average.narrow(0, 0, ctx.numel)
        if self.clip_norm is not None:
            _clip_layers_(g, ctx, self.clip_norm)
        self._correct(g, ctx)


def _clip_layers_(tensor: Tensor, ctx: BucketContext, max_norm: float) -> None:
    """Scale every layer of ``tensor`` so its L2 norm is at most ``max_norm``, every layer at once.

    The reference's per-tensor ``clip_grad_norm_``; the norms are segmented sums of squares (``segments.py``).
    """
    layers = [layer for layer in ctx.layers if layer.numel]  # a zero-size parameter has nothing to clip
    if not layers:
        return
    segments = segments_of(layers, tensor.device)
    dtype = torch.promote_types(tensor.dtype, torch.float32)
    squares = segments.rows.reduce(tensor, lambda rows: rows.to(dtype).square().sum(1), lambda rows: rows.sum(1))
    coefficient = (max_norm / (squares.sqrt_() + 1e-6)).clamp_(max=1.0).to(tensor.dtype)  # a tensor: no host sync
    tensor.mul_(segments.expand(coefficient))
