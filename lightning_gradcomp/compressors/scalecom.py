"""ScaleCom: cyclic local top-k (one leader's indices for every rank, all-reduce of values) with low-pass memory."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor

from lightning_gradcomp.compressors.base import (
    BucketContext,
    Collective,
    Compressor,
    Layer,
    Payload,
    keep_count,
)
from lightning_gradcomp.compressors.ops.layer_topk import layer_topk
from lightning_gradcomp.compressors.ops.sparse import SparseLayout, sparse_layout
from lightning_gradcomp.compressors.ops.sparse_blob import decode_blob, encode_full_blob
from lightning_gradcomp.engine.requests import AllReduce, Broadcast, Exchange, SentExactly
from lightning_gradcomp.validation import check_ratio


class ScaleCom(Compressor):
    """ScaleCom (CLT-k): the leader's top-k indices for everyone, values summed by all-reduce, low-pass filtered memory.

    Chen, Ni, Lu, Cui, Chen, Sun, Wang, Venkataramani, Srinivasan, Zhang & Gopalakrishnan, "ScaleCom: Scalable
    Sparsified Gradient Compression for Communication-Efficient Distributed Training", NeurIPS 2020
    (arXiv:2104.11125). Per bucket and step ``t``, with ``n`` ranks and memory ``m`` per rank:

    1. ``p = m + g`` (error feedback);
    2. the leader ``t mod n`` (every rank knows it without communicating) picks the top ``k = max(1, int(ratio d))``
       indices of its own ``|p|`` in every layer and broadcasts them (round 0; int32, or a bitmap where smaller);
    3. every rank takes its values at those indices, and one all-reduce sums them (round 1): because every rank uses
       the same indices, the sum of the compressed gradients is the compressed sum, and the average is identical on
       every rank;
    4. memory update (low-pass filter): ``r = p`` with the sent entries zeroed, ``m <- (1 - beta) m + beta r``.

    ``beta = 1`` is ordinary error feedback (then ``sum of updates + m`` telescopes to ``sum of gradients``); with
    ``beta < 1`` the memory is a low-pass filter and ``m / beta`` is what is owed (``m`` changes by
    ``beta (g - sent)`` per step). The paper uses ``beta < 1`` for large-batch runs; the exact values per experiment
    could not be checked against the paper's text, so ``beta`` defaults to 1 and is configurable. The memory is the
    hook's error-feedback residual (per parameter, checkpointed); with ``CompressedDDP(error_feedback=False)`` there
    is none.

    Bytes per rank do not grow with the number of ranks: every rank all-reduces ``4 k`` bytes of values per step, and
    the leader (one step in ``n`` for each rank) broadcasts ``4 k`` bytes of indices (or ``ceil(d / 32) * 4`` bytes of
    bitmap); a ring all-reduce moves at most twice its payload per rank whatever ``n``, unlike the all-gather of
    per-rank top-k, where each rank receives ``n - 1`` payloads and the union of supports grows with ``n``.

    Args:
        ratio: fraction of each layer sent, in (0, 1] (0.01: about 65x fewer bytes with 2 ranks, 80x with many).
        beta: the memory's low-pass coefficient, in (0, 1]; below 1, needs error feedback (the hook's state
            refuses it without).

    Raises:
        ValueError: If ``ratio`` or ``beta`` is out of range.

    Example::

        >>> from lightning_gradcomp.compressors import ScaleCom
        >>> ScaleCom(ratio=0.01)
        ScaleCom(ratio=0.01, beta=1.0)
    """

    collective: ClassVar[Collective] = "allreduce"
    unbiased: ClassVar[bool] = False
    rounds: ClassVar[int] = 2
    level_attribute: ClassVar[str] = "ratio"

    def __init__(self, ratio: float = 0.01, beta: float = 1.0) -> None:
        super().__init__()
        self.ratio = check_ratio(ratio)
        self.beta = check_ratio(beta, "beta")

    def check_error_feedback(self, enabled: bool | None) -> None:
        """Refuse ``beta`` below 1 without error feedback: the low-pass filter acts on the memory only."""
        if not self.resolve_error_feedback(enabled) and self.beta != 1.0:
            raise ValueError(
                f"Expected `beta` to be 1 without error feedback (the low-pass filter acts on the error-feedback"
                f" memory only), got {self.beta!r}; turn error feedback on (`error_feedback=None` or `True`)."
            )

    def check_level(self, value: Any) -> float:
        """A keep-ratio in (0, 1]."""
        return check_ratio(value)

    def _layout(self, ctx: BucketContext) -> SparseLayout:
        return sparse_layout(ctx.layers, [keep_count(layer.numel, self.level(layer)) for layer in ctx.layers])

    def leader(self, ctx: BucketContext) -> int:
        """The rank whose indices every rank uses at this step: ``step mod world_size``."""
        return ctx.step % ctx.world_size

    def _indices(self, tensor: Tensor, layout: SparseLayout) -> Tensor:
        """This rank's top-k indices of every layer, as an index blob (:func:`top_k_blob`)."""
        return top_k_blob(tensor, layout)

    # ------------------------------------------------------------------------------------------------------------
    # The contract: one rank on its own is its own leader
    # ------------------------------------------------------------------------------------------------------------
    def compress(self, tensor: Tensor, ctx: BucketContext) -> Payload:
        """As the leader: the index blob of this rank's top-k, and its values there."""
        layout = self._layout(ctx)
        blob = self._indices(tensor, layout)
        return blob, tensor.index_select(0, _decoded(layout, blob))

    def decompress(self, payload: Payload, ctx: BucketContext, out: Tensor | None = None) -> Tensor:
        """The values scattered into zeros at the payload's indices."""
        blob, values = payload
        layout = self._layout(ctx)
        out = ctx.output(out, zeros=True)
        return out.index_copy_(0, _decoded(layout, blob), values.to(ctx.dtype))

    # ------------------------------------------------------------------------------------------------------------
    # The reduction: broadcast of the leader's indices, all-reduce of everyone's values at them
    # ------------------------------------------------------------------------------------------------------------
    @property
    def keeps_input(self) -> bool:
        """Yes: ``p`` is only read (the values at the shared indices are copied out); the average goes into ``out``."""
        return True

    @property
    def residual_beta(self) -> float:
        """``beta``: the memory is ScaleCom's low-pass filter, ``m <- (1 - beta) m + beta r`` (the driver's)."""
        return self.beta

    def exchange(self, tensor: Tensor, ctx: BucketContext, out: Tensor) -> Exchange:
        """Round 0: the leader broadcasts its indices. Round 1: all-reduce of the values there."""
        layout = self._layout(ctx)
        leader = self.leader(ctx)
        if ctx.rank == leader:
            blob = self._indices(tensor, layout)
        else:  # filled by the broadcast; the size depends only on the layout
            blob = torch.zeros(index_blob_nbytes(layout), dtype=torch.uint8, device=ctx.device)
        (shared,) = yield Broadcast((blob,), src=leader)
        indices = _decoded(layout, shared)
        values = tensor.index_select(0, indices).div_(ctx.world_size)  # dividing first: half sums stay in range
        yield SentExactly(indices)  # r = p with the sent entries zeroed (the values are a copy)
        (average,) = yield AllReduce((values,))
        return out.zero_().index_copy_(0, indices, average.to(out.dtype))

    def bytes_per_step(self, ctx: BucketContext) -> tuple[int, int]:
        """``(index bytes the leader broadcasts, value bytes every rank all-reduces)`` for fp32 gradients."""
        layout = self._layout(ctx)
        return index_blob_nbytes(layout), 4 * layout.slots


def top_k_blob(tensor: Tensor, layout: SparseLayout, *, order: str | None = None) -> Tensor:
    """The top-k indices of ``|tensor|`` in every layer of ``layout``, as an index blob padded to whole 8-byte words.

    The leader's half of CLT-k (also LGC's). The broadcast sends whole words anyway (payloads are packed at 8-byte
    offsets); padding here makes the payload exactly what moves. ``order`` of each layer's int32 list: ``None``, as
    the selection returns them; ``"index"``, increasing (a bitmap always decodes in that order), so the decoded
    indices are sorted; ``"value"``, largest signed value first (LGC's value order; the layout must send lists).
    """
    if not layout.segments:
        return torch.zeros(0, dtype=torch.uint8, device=tensor.device)
    layers = [segment.layer for segment in layout.segments]
    picked = layer_topk(tensor, layers, [segment.slots for segment in layout.segments])
    if order == "index":  # the layers lie in increasing offsets: one sort orders every layer's
        picked = picked.sort().values
    elif order == "value":  # by value, then by layer, both stable: every layer's largest value first
        picked = picked.index_select(0, torch.sort(tensor.index_select(0, picked), descending=True, stable=True)[1])
        layer = torch.searchsorted(_ends(layers, tensor.device), picked, right=True)
        picked = picked.index_select(0, torch.sort(layer, stable=True)[1])
    blob = encode_full_blob(layout, picked)
    return torch.nn.functional.pad(blob, (0, index_blob_nbytes(layout) - blob.numel()))


def _ends(layers: list[Layer], device: torch.device) -> Tensor:
    return torch.tensor([layer.offset + layer.numel for layer in layers], dtype=torch.int64, device=device)


def _decoded(layout: SparseLayout, blob: Tensor) -> Tensor:
    """Every flat index of a (padded) index blob, at once (:func:`decode_blob`)."""
    return decode_blob(layout, blob[: layout.nbytes]) if layout.segments else blob.long()


def index_blob_nbytes(layout: SparseLayout) -> int:
    """Bytes of the index blob of ``layout`` once padded to whole 8-byte words."""
    return -(-layout.nbytes // 8) * 8
