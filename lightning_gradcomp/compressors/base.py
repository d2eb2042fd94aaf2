"""The compressor contract: one small interface that every gradient compression method implements.

A :class:`Compressor` turns one flat gradient tensor (the compressible layers of a DDP bucket, concatenated) into a
*payload* (a tuple of tensors) and back. The driver (:mod:`lightning_gradcomp.engine.driver`) owns everything
else (error feedback, the collective, the averaging and the telemetry), so a method is usually just
:meth:`Compressor.compress` and :meth:`Compressor.decompress`. The contract's data types live in
:mod:`lightning_gradcomp.engine.context` and are re-exported here.
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_gradcomp.engine import driver, wire, wire_model
from lightning_gradcomp.engine.comm import Payload
from lightning_gradcomp.engine.context import (
    BucketContext,
    Collective,
    GradientRuns,
    Layer,
    LayerBuffers,
    ResidualBuffers,
    ddp_scale_,
    derive_seed,
    keep_count,
    layers_from_shapes,
)
from lightning_gradcomp.engine.requests import AllGather, AllReduce, Exchange, SentPayload

__all__ = [
    "BucketContext",
    "Collective",
    "Compressor",
    "GradientRuns",
    "Layer",
    "LayerBuffers",
    "Payload",
    "ResidualBuffers",
    "check_gradient_dtypes",
    "ddp_scale_",
    "derive_seed",
    "keep_count",
    "layers_from_shapes",
    "rank_order_sum",
]


class Compressor(ABC):
    """Compress one flat gradient tensor into a small payload and restore it.

    The contract, smallest first:

    * every method implements :meth:`compress` and :meth:`decompress`, and states its class facts
      (:attr:`collective`, :attr:`unbiased`, ...: class attributes, or properties where they depend on the
      instance); a single-round method (one all-reduce or all-gather per bucket) needs nothing else: the driver runs
      error feedback, the collective, the averaging, the timing and the non-finite guard (:meth:`reduce`);
    * a method whose reduction takes several dependent rounds (PowerSGD's two projections, ScaleCom's shared indices,
      TernGrad's shared scaler, AdaComp's exchange of sizes) overrides :meth:`exchange`, a generator that *yields*
      each collective it needs and receives its result, yields once what it sent (a declaration, from which the
      driver settles error feedback's residual), and declares how many rounds with :attr:`rounds`;
    * a method that changes what is compressed before error feedback (DGC's momentum correction, Signum's momentum)
      overrides :meth:`accumulate`, and one whose update for densely averaged layers is not the average itself (DGC's
      momentum, signSGD's sign step) overrides :meth:`finish_dense`;
    * state that a step changes (momentum buffers, warm-start factors) is *staged* with ``ctx.stage`` and
      written only when the step is finite on every rank.

    No compressor touches a future, a process group or a residual, and :meth:`reduce` cannot be overridden.
    """

    @property
    def collective(self) -> Collective:
        """How payloads travel: ``"allreduce"`` (summed) or ``"allgather"`` (gathered, decompressed, averaged).

        ``"allreduce"`` needs ``decompress(sum of payloads)`` to be the sum of the decompressed payloads (every rank
        then uses the same indices or projections).
        """
        return "allgather"

    @property
    def unbiased(self) -> bool:
        """``True`` if ``E[decompress(compress(x))] == x`` over the compressor's randomness."""
        return False

    @property
    def rounds(self) -> int:
        """How many dependent rounds of collectives one reduction needs (a process group is made for each)."""
        return 1

    @property
    def level_attribute(self) -> str | None:
        """The hyper-parameter that sets how hard a layer is compressed (``"ratio"``, ``"rank"``), or ``None``.

        Compressors that have one can compress each layer at its own level (:meth:`set_levels`, Accordion's switch).
        """
        return None

    @property
    def propagates_nonfinite(self) -> bool:
        """The aggregate is a plain sum (Identity, the casts): a NaN reaches every rank; no guard without a residual."""
        return False

    @property
    def exchanges_sizes(self) -> bool:
        """Payload sizes depend on the data and are exchanged in a first round (AdaComp)."""
        return False

    @property
    def optimizer_momentum_conflicts(self) -> bool:
        """The compressor applies momentum itself (DGC): an optimizer's momentum would apply it twice."""
        return False

    def __init__(self) -> None:
        self._layer_levels: dict[str, Any] = {}
        self._levels_version = 0
        self._layer_state: dict[str, LayerBuffers] = {}

    def layer_state(self, key: str) -> LayerBuffers:
        """Per-layer tensors kept between steps under ``key`` (a momentum, say), saved in :meth:`state_dict`."""
        return self._layer_state.setdefault(key, LayerBuffers())

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "reduce" in cls.__dict__:
            raise TypeError(
                f"{cls.__name__} overrides Compressor.reduce; implement `exchange` (a generator that yields its"
                " collectives) instead, so that error feedback, ordering and the non-finite guard stay in one place."
            )

    # ----------------------------------------------------------------------------------------------------------
    # The two methods a compressor implements
    # ----------------------------------------------------------------------------------------------------------
    @abstractmethod
    def compress(self, tensor: Tensor, ctx: BucketContext) -> Payload:
        """Compress the flat ``tensor`` (laid out as ``ctx.layers``).

        The payload's shapes and dtypes must depend only on ``ctx`` (never on the values), so that every rank sends
        tensors of the same shape.
        """

    @abstractmethod
    def decompress(self, payload: Payload, ctx: BucketContext, out: Tensor | None = None) -> Tensor:
        """Return a flat tensor of ``ctx.numel`` elements and dtype ``ctx.dtype`` from ``payload``.

        ``out``, when given, is a tensor of that size the caller no longer needs; writing the result into it and
        returning it avoids allocating one per step (it may be the tensor that was compressed).
        """

    # ----------------------------------------------------------------------------------------------------------
    # Optional refinements
    # ----------------------------------------------------------------------------------------------------------
    def compresses(self, layer: Layer, min_numel: int) -> bool:
        """Whether ``layer`` is compressed; the rest of the bucket is averaged densely.

        By default 1-D tensors (biases, normalisation weights) and tensors with fewer than ``min_numel`` elements go
        dense, as in the PowerSGD, DGC and Accordion reference code. Empty tensors always go dense.
        """
        return layer.ndim >= 2 and layer.numel >= max(min_numel, 1)

    def bucket_compressor(self, layers: Sequence[Layer]) -> Compressor:
        """The compressor that reduces a bucket of ``layers``: this one.

        :class:`~lightning_gradcomp.compressors.Planned` hands each bucket to one of its candidates; the hook asks
        this once per bucket layout and runs the answer as the bucket's compressor (its split into compressed and
        dense layers, its error feedback, its dense update).
        """
        return self

    @property
    def default_error_feedback(self) -> bool:
        """Whether error feedback is on when the strategy is not told: on for biased compressors."""
        return not self.unbiased

    def check_error_feedback(self, enabled: bool | None) -> None:
        """Refuse, before training, a configuration that cannot run with error feedback as set (default: accept both).

        Called by the hook's state when it is made and by the strategy when its compressor is replaced, so that a
        setting that acts only on the error-feedback memory is never silently ignored.

        Args:
            enabled: the strategy's ``error_feedback`` (``None``: :attr:`default_error_feedback`).

        Raises:
            ValueError: If the configuration cannot run with error feedback as set.
        """

    def check_gradient_dtype(self, layer: Layer, dtype: torch.dtype) -> None:
        """Refuse, with a clear error, a layer whose gradient this compressor cannot usefully compress.

        Called before training, for every layer it compresses, with the dtype of the layer's parameter (the dtype of
        its gradient: ``Trainer(precision="16-true")`` and ``"bf16-true"`` train with 16-bit gradients). The default
        accepts every dtype; a cast to a 16-bit format refuses gradients that are not wider than it.

        Raises:
            ValueError: If ``layer``'s gradient, of ``dtype``, cannot be compressed as configured.
        """

    def error_feedback_growth(self, enabled: bool | None) -> str | None:
        """Why error feedback's residual can grow without bound, if ``enabled`` turns it on here; else ``None``.

        ``enabled`` is the strategy's ``error_feedback``, as in :meth:`check_error_feedback`. Error feedback keeps a
        bounded residual when the compressor is a contraction, ``E ||C(x) - x||^2 <= w ||x||^2`` with ``w < 1``
        (Stich & Karimireddy, 2019, "The Error-Feedback Framework"). Sparsifiers without rescaling are (``w = 1 - k /
        d``); unbiased quantizers with few levels, rescaled sparsifiers and ternarisation need not be, and then the
        residual, and with it the noise of every average, can grow with every step. Their defaults keep error
        feedback off; the strategy warns with this reason when it is switched on.
        """
        return None

    def resolve_error_feedback(self, enabled: bool | None) -> bool:
        """Whether error feedback is on under the strategy's ``error_feedback`` (``None``: the default)."""
        return self.default_error_feedback if enabled is None else enabled

    def aggregate(self, payloads: Sequence[Payload], ctx: BucketContext, out: Tensor | None = None) -> Tensor:
        """Sum the decompressed payloads of all ranks, in rank order (``"allgather"`` compressors only).

        Override when the sum can be formed without one dense tensor per rank (sparse payloads). ``out`` is as in
        :meth:`decompress`.
        """
        return rank_order_sum(self, payloads, ctx, out)

    def average(self, payloads: Sequence[Payload], ctx: BucketContext, out: Tensor | None = None) -> Tensor:
        """:meth:`aggregate` divided by the world size: what the all-gather exchange returns.

        Override where the division folds into the decoding with the same bits (a table of sums divided once per
        entry, instead of a pass over the output); ``out`` is as in :meth:`decompress`.
        """
        return self.aggregate(payloads, ctx, out=out).div_(ctx.world_size)

    def accumulate(self, tensor: Tensor, ctx: BucketContext) -> Tensor | Sequence[Tensor]:
        """What is compressed before error feedback: ``tensor`` itself unless overridden.

        Override to compress something else than the gradient (DGC's momentum correction, Signum's momentum): change
        ``tensor`` in place and return it, or return one tensor per layer of ``ctx.layers`` (the driver then adds the
        residual to each into its own buffer: no copy into ``tensor`` first). Stage any state it changes with
        ``ctx.stage``. The driver adds error feedback's residual to what this returns, in one place.
        """
        return tensor

    @property
    def keeps_input(self) -> bool:
        """Whether :meth:`exchange` never writes the tensor it compresses (it writes its average into ``out``).

        The driver then forms error feedback's ``x = g + e`` straight in the updated residual's buffer and settles it
        there in place (the sent entries zeroed, ``P Q^T`` subtracted), where it would otherwise start as a copy of
        ``x``: one memory pass less per step. ``out`` is then the gradient's buffer: it holds what an overridden
        :meth:`accumulate` left there (AdaComp reads its ``dW``) until the exchange writes it.
        """
        return False

    @property
    def residual_beta(self) -> float:
        """Error feedback's low-pass coefficient (ScaleCom): ``m <- (1 - beta) m + beta (x - sent)``; 1: plain."""
        return 1.0

    def delegate(self, ctx: BucketContext) -> driver.Delegate | None:
        """The compressor that runs this one's reduction of the bucket, for wrappers; ``None``: this one."""
        return None

    def nonfinite_witness(self, payload: Payload) -> Tensor | None:
        """A tensor of ``payload`` that is non-finite whenever what was compressed holds a NaN or an infinity.

        The non-finite guard reads the whole input, one pass per step, unless this names such a tensor of the payload
        of the first all-reduce or all-gather, smaller or narrower than the input. Every element must reach it through
        sums, which carry a NaN or an infinity: an L1 norm per layer (EF-signSGD's scales), a bucket's L2 norm
        (QSGD's), the element cast to the wire (FP16's values). A product by factors that can be zero does not (BLAS
        may skip a zero factor), so PowerSGD's ``P`` is no witness. A witness that overflows counts as non-finite,
        which keeps a finite value the payload cannot hold out of the residual. The default names none.
        """
        return None

    def finish_dense(self, average: Tensor, ctx: BucketContext) -> None:
        """Turn the dense average of ``ctx.layers`` into the update, in place (default: the average itself).

        Called for the layers a bucket averages densely (small layers, and every layer while compression is off, as
        during :class:`~lightning_gradcomp.callbacks.DenseWarmup`), so that a method whose update is not the averaged
        gradient keeps its semantics there (DGC's momentum correction, signSGD's sign step). ``average`` is identical
        on every rank; stage state changes with ``ctx.stage``.
        """

    @property
    def has_nonfinite_witness(self) -> bool:
        """Whether :meth:`nonfinite_witness` is overridden (the guard then reads the payload, not the input)."""
        return type(self).nonfinite_witness is not Compressor.nonfinite_witness

    @property
    def has_own_accumulation(self) -> bool:
        """Whether :meth:`accumulate` is overridden (the driver then hands it the gradient gathered)."""
        return type(self).accumulate is not Compressor.accumulate

    @property
    def has_dense_update(self) -> bool:
        """Whether :meth:`finish_dense` changes anything (the hook skips it otherwise)."""
        return type(self).finish_dense is not Compressor.finish_dense

    # ----------------------------------------------------------------------------------------------------------
    # Multi-round methods: the extension point
    # ----------------------------------------------------------------------------------------------------------
    def exchange(self, tensor: Tensor, ctx: BucketContext, out: Tensor) -> Exchange:
        """The reduction as a generator: yield each collective and what was sent, receive results, return the average.

        ``tensor`` is what is compressed (error feedback's ``x``); ``out`` is a buffer of its size for the average
        (``tensor`` itself unless :attr:`keeps_input`: read what you need before writing it).

        The default is the single-round method: ``payload = compress(tensor)``, declared as sent
        (:class:`~lightning_gradcomp.engine.requests.SentPayload`); ``"allreduce"``: payloads are divided by the
        world size and summed (dividing first keeps fp16 sums from overflowing, as torch's ``fp16_compress_hook``
        does), then decompressed; ``"allgather"``: payloads are gathered, decompressed and averaged in rank order
        (:meth:`average`, so every rank computes bitwise the same average).

        A multi-round method overrides it, yielding :class:`~lightning_gradcomp.engine.requests.AllReduce`,
        :class:`~lightning_gradcomp.engine.requests.AllGather` or
        :class:`~lightning_gradcomp.engine.requests.Broadcast` requests, at most ``rounds`` of them, the same
        number on every rank, and once, before it writes over ``tensor``, the declaration of what went out of it.
        """
        payload = self.compress(tensor, ctx)
        yield SentPayload(payload)
        if self.collective == "allreduce":
            for part in payload:
                if not part.is_floating_point():
                    raise TypeError(
                        f"{type(self).__name__} declares collective='allreduce' but its payload has a {part.dtype}"
                        " tensor; the default exchange averages by dividing the payload, so integer payloads need"
                        " an exchange of their own."
                    )
                part.div_(ctx.world_size)
            summed = yield AllReduce(payload)
            return self.decompress(summed, ctx, out=out)  # the input is spent: decode into it
        gathered = yield AllGather(payload)
        return self.average(gathered, ctx, out=out)

    def reduce(
        self,
        tensor: Tensor,
        ctx: BucketContext,
        memory: ResidualBuffers | None = None,
        runs: GradientRuns | None = None,
    ) -> torch.futures.Future[Tensor]:
        """Average ``tensor`` across ranks through this compressor; returns a future of the flat average.

        Error feedback with ``memory`` (``x = accumulate(g) + e``, then ``e = x - sent`` from what :meth:`exchange`
        declares), :meth:`exchange` round by round (round ``k`` on its own process group, in bucket order on every
        rank), timing and the non-finite guard: :func:`lightning_gradcomp.engine.driver.reduce`, in one call.
        ``tensor`` may be modified in place. Not to be overridden.
        """
        return driver.reduce(self, tensor, ctx, memory, runs)

    def wire_bytes(
        self,
        layers: Sequence[Layer] | int,
        world_size: int,
        *,
        error_feedback: bool | None = None,
        tensor: Tensor | None = None,
        step: int = 0,
    ) -> wire.Wire:
        """The byte model: what one rank sends and receives (mean over ranks) to reduce ``layers`` over ``world_size``.

        ``layers``: those the compressor takes (or a number of elements, one flat layer); ``error_feedback``: the
        strategy's (``None``: the default; it decides whether the non-finite flag travels); ``tensor``: the flat
        gradient, where sizes depend on the data (a seeded Gaussian in float32 otherwise); ``step``: the optimizer
        step. The default reads the requests :meth:`exchange` yields, counted as the telemetry counts them
        (:func:`~lightning_gradcomp.engine.wire_model.traced_wire_bytes`), so it fits any exchange; a compressor
        may override it with a closed form that must agree. A whole bucket: ``wire_model.bucket_wire_bytes``.
        """
        enabled = self.resolve_error_feedback(error_feedback)
        return wire_model.traced_wire_bytes(self, layers, world_size, error_feedback=enabled, tensor=tensor, step=step)

    # ----------------------------------------------------------------------------------------------------------
    # Per-layer compression levels
    # ----------------------------------------------------------------------------------------------------------
    def level(self, layer: Layer) -> Any:
        """The level ``layer`` is compressed at: its own from :meth:`set_levels`, else the compressor's."""
        if self.level_attribute is None:
            raise TypeError(f"{type(self).__name__} has no compression level to set per layer.")
        return self._layer_levels.get(layer.name, getattr(self, self.level_attribute))

    @property
    def layer_levels(self) -> dict[str, Any]:
        """The per-layer levels set with :meth:`set_levels` (layer name to level)."""
        return dict(self._layer_levels)

    def set_levels(self, levels: Mapping[str, Any]) -> None:
        """Compress the named layers at their own level (the others at the compressor's); ``{}`` clears them.

        Levels decide payload shapes, so set the same levels on every rank, between steps (Accordion broadcasts its
        decisions for this reason).

        Raises:
            TypeError: If the compressor has no level.
            ValueError: If a level is out of range (as the constructor argument would be).
        """
        if self.level_attribute is None:
            raise TypeError(f"{type(self).__name__} has no compression level to set per layer.")
        self._layer_levels = {str(name): self.check_level(value) for name, value in levels.items()}
        self._levels_version += 1

    def check_level(self, value: Any) -> Any:
        """Validate one level (as the constructor validates ``level_attribute``) and return it."""
        return value

    def plan_key(self) -> tuple:
        """What decides which layers this compressor takes; the hook re-plans its buckets when it changes."""
        default = getattr(self, self.level_attribute) if self.level_attribute else None
        return (id(self), self._levels_version, default)

    # ----------------------------------------------------------------------------------------------------------
    # State
    # ----------------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The compressor's own state (beyond error feedback), for checkpoints: per-layer levels and buffers."""
        state: dict[str, Any] = {key: buffers.state_dict() for key, buffers in self._layer_state.items() if buffers}
        levels = self.layer_levels
        if levels:
            state["layer_levels"] = levels
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        if state_dict.get("layer_levels") or self.layer_levels:
            self.set_levels(state_dict.get("layer_levels", {}))
        for key, buffers in self._layer_state.items():
            buffers.load_state_dict(state_dict.get(key, {}))

    def reset_state(self) -> None:
        """Forget the state kept between steps (momenta, warm starts), as at the start of training.

        Called on every rank at the same step after a run of non-finite steps (``CompressionState.reset_state``).
        The configuration and the per-layer levels stay: they are settings, not state that arithmetic can poison.
        A compressor with state outside :meth:`layer_state` extends this.
        """
        for buffers in self._layer_state.values():
            buffers.clear()

    # ----------------------------------------------------------------------------------------------------------
    # Plumbing
    # ----------------------------------------------------------------------------------------------------------
    def hparams(self) -> dict[str, Any]:
        """The constructor arguments (each compressor stores them under the same names)."""
        names = [p for p in inspect.signature(type(self).__init__).parameters if p != "self"]
        return {name: getattr(self, name) for name in names if hasattr(self, name)}

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.hparams().items())
        return f"{type(self).__name__}({args})"


def rank_order_sum(
    compressor: Compressor, payloads: Sequence[Payload], ctx: BucketContext, out: Tensor | None = None
) -> Tensor:
    """The sum of ``compressor``'s decompressed ``payloads``, in rank order: :meth:`Compressor.aggregate`'s default.

    The first payload is decoded straight into the result, then ``+ 0.0``: the bits of accumulating into zeros
    (``0 + x`` is ``x`` but for ``-0.0``, which becomes ``+0.0``) for one pass where zeroing and adding took two; every
    other rank's payload is decoded into one scratch buffer (a fresh gradient-sized tensor per rank may cost its page
    faults on the CPU: as much as the decoding itself). A decompressed payload may be the payload itself, which must
    not change: it is copied, never written.
    """
    total = ctx.output(out)
    if not payloads:
        return total.zero_()
    first = compressor.decompress(payloads[0], ctx, out=total)
    if first is not total:
        total.copy_(first)
    total.add_(0.0)
    scratch = torch.empty_like(total) if len(payloads) > 1 else None
    for payload in payloads[1:]:
        total.add_(compressor.decompress(payload, ctx, out=scratch))
    return total


def check_gradient_dtypes(compressor: Compressor, layers: Iterable[tuple[Layer, torch.dtype]], min_numel: int) -> None:
    """Ask ``compressor`` to check the gradient dtype of each of ``layers`` (layer, dtype) that it compresses.

    A layer the compressor leaves dense (below ``min_numel`` elements, or not its kind) is not asked.

    Raises:
        ValueError: The compressor's error for the first layer it refuses (:meth:`Compressor.check_gradient_dtype`).
    """
    for layer, dtype in layers:
        if compressor.compresses(layer, min_numel):
            compressor.check_gradient_dtype(layer, dtype)
