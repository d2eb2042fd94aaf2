"""Mask compaction: send only the gradient entries a pruning mask keeps, as one dense all-reduce (PacTrain).

Wang, Wu, Li & Kutscher, "PacTrain: Pruning and Adaptive Sparse Gradient Compression for Efficient Collective
Communication in Distributed Deep Learning", arXiv:2505.18563 (2025). Only the abstract could be read: pruning makes
weights and gradients sparse, and because every worker knows the sparsity pattern ("global knowledge of the gradient
sparsity"), the gradients can be compressed in an all-reduce compatible way. How is not in the abstract; the
mechanism here is this package's design, a reading of that sentence, not verified against the paper's text:

* every rank holds the same masks (the weights they are computed from are equal, and PacTrain checks it);
* per layer, the entries the mask keeps are gathered into one compact dense buffer (no indices: every rank knows
  them), that buffer is reduced, and the result is scattered back with zeros at the pruned entries;
* any compressor of the contract can be stacked on the compact buffer (``inner``: the "adaptive sparse compression");
* a layer whose mask keeps more than ``dense_threshold`` of its entries is not compacted (gathering and scattering
  would cost more than the few bytes saved): it is masked in place and handed on whole.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from lightning_gradcomp.compressors.base import BucketContext, Collective, Compressor, Layer, Payload
from lightning_gradcomp.compressors.identity import Identity
from lightning_gradcomp.compressors.ops.packing import flat_nonzero
from lightning_gradcomp.engine.driver import Delegate
from lightning_gradcomp.validation import check_number


class Masks:
    """Boolean masks per parameter name (``True``: kept), shared by PacTrain and :class:`MaskedCompressor`.

    Keyed by parameter name, so they do not depend on how DDP buckets the parameters. :attr:`version` changes with
    every :meth:`update`, which is how the compressor knows to rebuild its index tensors.
    """

    def __init__(self, masks: Mapping[str, Tensor] | None = None) -> None:
        self._masks: dict[str, Tensor] = {}
        self._kept: dict[str, int] = {}
        self.version = 0
        if masks:
            self.update(masks)

    def update(self, masks: Mapping[str, Tensor]) -> None:
        """Set (or replace) the masks of the given parameters; counts their kept entries (a host sync, once)."""
        for name, mask in masks.items():
            if mask.dtype != torch.bool:
                raise ValueError(f"Expected boolean masks, got {mask.dtype} for {name!r}.")
            self._masks[name] = mask
            self._kept[name] = int(mask.sum())
        self.version += 1

    def to(self, device: torch.device | str) -> Masks:
        """Move every mask to ``device`` (in place; the version is unchanged); returns ``self``."""
        self._masks = {name: mask.to(device) for name, mask in self._masks.items()}
        return self

    def __contains__(self, name: object) -> bool:
        return name in self._masks

    def __getitem__(self, name: str) -> Tensor:
        return self._masks[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._masks)

    def __len__(self) -> int:
        return len(self._masks)

    def items(self) -> Iterator[tuple[str, Tensor]]:
        """``(name, mask)`` pairs."""
        return iter(self._masks.items())

    def kept(self, name: str) -> int:
        """How many entries the mask of ``name`` keeps."""
        return self._kept[name]

    def density(self, name: str) -> float:
        """The fraction of entries the mask of ``name`` keeps."""
        return self._kept[name] / max(1, self._masks[name].numel())

    def partial(self, name: str) -> bool:
        """Whether ``name`` has a mask that prunes something."""
        return name in self._masks and self._kept[name] < self._masks[name].numel()

    def state_dict(self) -> dict[str, Any]:
        """The masks (CPU copies) and the version."""
        return {"version": self.version, "masks": {name: m.detach().to("cpu", copy=True) for name, m in self.items()}}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` in place (whoever holds this object sees the restored masks)."""
        self._masks.clear()
        self._kept.clear()
        self.update(state_dict["masks"])
        self.version = int(state_dict["version"])

    def __repr__(self) -> str:
        total = sum(m.numel() for m in self._masks.values())
        kept = sum(self._kept.values())
        return f"Masks({len(self)} parameters, density {kept / max(1, total):.4f}, version {self.version})"


@dataclass(frozen=True)
class _Entry:
    """How one layer goes into the compact buffer."""

    mode: str  # "whole" (no mask), "masked" (masked in place), "elements" or "rows" (compacted)
    layer: Layer  # where it is in the full tensor
    compact: Layer  # where it is in the compact tensor
    mask: Tensor | None = None  # "masked": the mask, flat
    index: Tensor | None = None  # "elements": kept flat positions; "rows": kept rows

    @property
    def kept(self) -> Tensor:
        """The mask (``"masked"``), or the kept positions or rows (``"elements"``, ``"rows"``)."""
        kept = self.mask if self.mode == "masked" else self.index
        assert kept is not None, self.mode
        return kept


@dataclass(frozen=True)
class _Layout:
    entries: tuple[_Entry, ...]
    layers: tuple[Layer, ...]  # the compact layers, for the inner compressor's context
    numel: int
    partial: bool  # whether any layer is masked or compacted
    scratch: dict = dataclasses.field(default_factory=dict, compare=False)  # buffers reduce() reuses every step


def _row_structured(mask: Tensor) -> bool:
    rows = mask.reshape(mask.shape[0], -1)
    return bool((rows.all(dim=1) | ~rows.any(dim=1)).all())


class MaskedCompressor(Compressor):
    """Send only the gradient entries kept by pruning masks, compacted into a dense buffer; stack ``inner`` on it.

    Per layer of the flat tensor: without a mask (or with a mask that keeps everything) it is handed to ``inner`` as
    it is; with a mask keeping at most ``dense_threshold`` of its entries it is *compacted*: its kept entries (or, for
    a mask of whole rows, its kept rows, so the compact layer is still a matrix) are gathered into the compact buffer;
    with a denser mask it is multiplied by its mask and handed on whole. ``inner`` reduces the compact buffer (its
    layers are the compact ones) and the result is scattered back with zeros at the pruned entries. With the default
    ``Identity`` inner this is one all-reduce of ``density x`` the dense bytes, and no indices are sent: all ranks
    hold the same masks. Masks are keyed by parameter name and may change between steps (the compressor rebuilds its
    indices when :attr:`Masks.version` changes); they must be equal on every rank (PacTrain checks that).

    The gradients of pruned entries are discarded, not owed: the pruned weights are held at zero, so a pruned entry's
    error-feedback residual is zero (it is never accumulated, so nothing is dumped into a later dense step). Error
    feedback is on or off as for ``inner`` alone. ``unbiased`` is ``False`` because the pruned entries are dropped.

    Args:
        inner: the compressor applied to the compact buffer (:class:`~lightning_gradcomp.compressors.Identity`:
            exact averaging of the kept entries).
        masks: the masks (a :class:`Masks`, shared with whoever updates them, or a mapping of parameter name to
            boolean tensor shaped like the parameter).
        dense_threshold: layers whose mask keeps more than this fraction are not compacted (this package's design:
            PacTrain's "adaptive" part is not described in its abstract).

    Raises:
        ValueError: If ``inner`` is not a compressor or ``dense_threshold`` is not in [0, 1].
    """

    unbiased: ClassVar[bool] = False

    def __init__(
        self,
        inner: Compressor | None = None,
        masks: Masks | Mapping[str, Tensor] | None = None,
        dense_threshold: float = 0.9,
    ) -> None:
        super().__init__()
        inner = Identity() if inner is None else inner
        if not isinstance(inner, Compressor) or isinstance(inner, MaskedCompressor):
            raise ValueError(f"Expected `inner` to be a compressor (not a MaskedCompressor), got {inner!r}.")
        self.inner = inner
        self.masks = masks if isinstance(masks, Masks) else Masks(masks)
        self.dense_threshold = check_number(dense_threshold, "dense_threshold", low=0.0, high=1.0)
        self._layouts: dict[tuple, _Layout] = {}

    # the inner compressor decides how payloads travel and what it needs
    @property
    def collective(self) -> Collective:
        """The inner compressor's collective."""
        return self.inner.collective

    @property
    def rounds(self) -> int:
        """The inner compressor's rounds."""
        return self.inner.rounds

    @property
    def propagates_nonfinite(self) -> bool:
        """As for the inner compressor.

        A NaN in a kept entry reaches every rank through a plain sum; one in a pruned entry is discarded with the
        entry, whose weight is held at zero.
        """
        return self.inner.propagates_nonfinite

    @property
    def exchanges_sizes(self) -> bool:
        """Whether the inner compressor exchanges payload sizes."""
        return self.inner.exchanges_sizes

    @property
    def optimizer_momentum_conflicts(self) -> bool:
        """Whether the inner compressor applies momentum itself."""
        return self.inner.optimizer_momentum_conflicts

    # ------------------------------------------------------------------------------------------------------------
    # Which layers
    # ------------------------------------------------------------------------------------------------------------
    def compresses(self, layer: Layer, min_numel: int) -> bool:
        """Every pruned layer (its pruned entries must not be sent), and whatever ``inner`` compresses."""
        return self.masks.partial(layer.name) or self.inner.compresses(layer, min_numel)

    def error_feedback_growth(self, enabled: bool | None) -> str | None:
        """``inner``'s reason."""
        return self.inner.error_feedback_growth(enabled)

    def check_gradient_dtype(self, layer: Layer, dtype: torch.dtype) -> None:
        """``inner``'s check."""
        self.inner.check_gradient_dtype(layer, dtype)

    @property
    def default_error_feedback(self) -> bool:
        """As for ``inner``: pruning is not a compression error to pay back."""
        return self.inner.default_error_feedback

    def plan_key(self) -> tuple:
        """Changes when the masks or the inner compressor's levels change."""
        return (id(self), self.masks.version, self.inner.plan_key())

    # ------------------------------------------------------------------------------------------------------------
    # Compaction
    # ------------------------------------------------------------------------------------------------------------
    def _layout(self, ctx: BucketContext) -> _Layout:
        key = (self.masks.version, str(ctx.device), tuple((layer.name, layer.offset) for layer in ctx.layers))
        layout = self._layouts.get(key)
        if layout is not None:
            return layout
        if len(self._layouts) > 64:  # layouts of old mask versions
            self._layouts.clear()
        entries, compact, offset = [], [], 0
        for layer in ctx.layers:
            entry = self._entry(layer, offset, ctx.device)
            entries.append(entry)
            compact.append(entry.compact)
            offset += entry.compact.numel
        layout = _Layout(tuple(entries), tuple(compact), offset, any(e.mode != "whole" for e in entries))
        self._layouts[key] = layout
        return layout

    def _entry(self, layer: Layer, offset: int, device: torch.device) -> _Entry:
        if not self.masks.partial(layer.name):
            return _Entry("whole", layer, Layer(layer.name, layer.index, layer.shape, offset))
        mask = self.masks[layer.name].to(device)
        if tuple(mask.shape) != tuple(layer.shape):
            raise ValueError(
                f"The mask of {layer.name!r} has shape {tuple(mask.shape)}, the layer {tuple(layer.shape)}."
            )
        if self.masks.density(layer.name) > self.dense_threshold:
            return _Entry("masked", layer, Layer(layer.name, layer.index, layer.shape, offset), mask=mask.reshape(-1))
        if layer.ndim >= 2 and _row_structured(mask):
            rows = mask.reshape(mask.shape[0], -1)[:, 0].nonzero().squeeze(1)
            shape = torch.Size((rows.numel(), *layer.shape[1:]))
            return _Entry("rows", layer, Layer(layer.name, layer.index, shape, offset), index=rows)
        index = flat_nonzero(mask.reshape(-1))
        return _Entry(
            "elements", layer, Layer(layer.name, layer.index, torch.Size((index.numel(),)), offset), index=index
        )

    def _gather(self, tensor: Tensor, layout: _Layout, reuse: str | None = None) -> Tensor:
        """The compact buffer of ``tensor``; ``reuse`` names a buffer kept for the next step (``reduce`` only).

        Reusing matters on the CPU, where allocating a bucket-sized tensor every step costs page faults; payloads
        returned by ``compress`` may be the buffer itself (``Identity``), so they always get a fresh one.
        """
        if reuse is None:
            compact = torch.empty(layout.numel, dtype=tensor.dtype, device=tensor.device)
        else:
            compact = self._buffer(layout, reuse, tensor)
        for e in layout.entries:
            target = e.compact.flat(compact)
            if e.mode == "whole":
                target.copy_(e.layer.flat(tensor))
            elif e.mode == "masked":
                torch.mul(e.layer.flat(tensor), e.kept, out=target)
            elif e.mode == "elements":
                torch.index_select(e.layer.flat(tensor), 0, e.kept, out=target)
            else:
                torch.index_select(e.layer.matrix(tensor), 0, e.kept, out=target.view(e.kept.numel(), -1))
        return compact

    def _buffer(self, layout: _Layout, name: str, like: Tensor) -> Tensor:
        """A compact-sized buffer kept with ``layout`` and reused every step."""
        key = (name, like.dtype)
        buffer = layout.scratch.get(key)
        if buffer is None:
            buffer = layout.scratch[key] = torch.empty(layout.numel, dtype=like.dtype, device=like.device)
        return buffer

    def _scatter(self, compact: Tensor, layout: _Layout, out: Tensor) -> Tensor:
        """Lay ``compact`` back into ``out``, zeros at the pruned entries (``out`` may alias nothing in ``compact``)."""
        for e in layout.entries:
            source = e.compact.flat(compact)
            if e.mode == "whole":
                e.layer.flat(out).copy_(source)
            elif e.mode == "masked":
                torch.mul(source, e.kept, out=e.layer.flat(out))
            elif e.mode == "elements":
                e.layer.flat(out).zero_().index_copy_(0, e.kept, source)
            else:
                e.layer.matrix(out).zero_().index_copy_(0, e.kept, source.view(e.kept.numel(), -1))
        return out

    def _inner_ctx(self, ctx: BucketContext, layout: _Layout) -> BucketContext:
        return dataclasses.replace(ctx, layers=layout.layers)

    # ------------------------------------------------------------------------------------------------------------
    # The contract
    # ------------------------------------------------------------------------------------------------------------
    def compress(self, tensor: Tensor, ctx: BucketContext) -> Payload:
        """``inner``'s payload of the compact buffer."""
        layout = self._layout(ctx)
        return self.inner.compress(self._gather(tensor, layout), self._inner_ctx(ctx, layout))

    def decompress(self, payload: Payload, ctx: BucketContext, out: Tensor | None = None) -> Tensor:
        """``inner``'s reconstruction, scattered back (zeros at the pruned entries)."""
        layout = self._layout(ctx)
        compact = self.inner.decompress(payload, self._inner_ctx(ctx, layout))
        out = ctx.output(out)
        return self._scatter(compact, layout, out)

    def aggregate(self, payloads: Any, ctx: BucketContext, out: Tensor | None = None) -> Tensor:
        """``inner``'s sum of the gathered payloads, scattered back."""
        layout = self._layout(ctx)
        compact = self.inner.aggregate(payloads, self._inner_ctx(ctx, layout))
        out = ctx.output(out)
        return self._scatter(compact, layout, out)

    def delegate(self, ctx: BucketContext) -> Delegate:
        """``inner`` reduces the bucket: itself where nothing is pruned, else the compact buffer of kept entries.

        Compacted, the driver hands ``inner`` the kept entries of the gradient and of the residual, settles the
        residual there, and lays both back (zeros at the pruned entries: nothing is owed there).
        """
        layout = self._layout(ctx)
        if not layout.partial:  # nothing pruned here: exactly the inner compressor
            return Delegate(self.inner, ctx)
        return Delegate(self.inner, self._inner_ctx(ctx, layout), _Compaction(self, layout))

    def finish_dense(self, average: Tensor, ctx: BucketContext) -> None:
        """The inner compressor's update of densely averaged layers (pruned entries stay zero: they averaged 0)."""
        self.inner.finish_dense(average, ctx)

    @property
    def has_dense_update(self) -> bool:
        """Whether the inner compressor has a dense update."""
        return self.inner.has_dense_update

    # ------------------------------------------------------------------------------------------------------------
    # State
    # ------------------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The inner compressor's state (the masks belong to whoever owns them: PacTrain checkpoints them)."""
        return {**super().state_dict(), "inner": self.inner.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        super().load_state_dict(state_dict)
        self.inner.load_state_dict(state_dict.get("inner", {}))

    def reset_state(self) -> None:
        """The inner compressor's (the masks are its owner's, not state between steps)."""
        super().reset_state()
        self.inner.reset_state()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_layouts"] = {}  # device index tensors and buffers: rebuilt on demand
        return state

    def __repr__(self) -> str:
        return f"MaskedCompressor(inner={self.inner!r}, masks={self.masks!r}, dense_threshold={self.dense_threshold})"


class _Compaction:
    """A bucket's kept entries (:class:`~lightning_gradcomp.engine.driver.Compaction`), with reused buffers."""

    def __init__(self, owner: MaskedCompressor, layout: _Layout) -> None:
        self.owner, self.layout = owner, layout

    def gather(self, tensor: Tensor, name: str) -> Tensor:
        return self.owner._gather(tensor, self.layout, reuse=name)

    def buffer(self, name: str, like: Tensor) -> Tensor:
        return self.owner._buffer(self.layout, name, like)

    def scatter(self, compact: Tensor, out: Tensor) -> Tensor:
        return self.owner._scatter(compact, self.layout, out)
