"""The compressor contract: one small interface that every gradient compression method implements.

A :class:`Compressor` turns one flat gradient tensor (the compressible layers of a DDP bucket, concatenated) into a
*payload* (a tuple of tensors) and back. The base class owns everything else (error feedback, the collective, the
averaging and the telemetry), so a method is usually just :meth:`Compressor.compress` and
:meth:`Compressor.decompress`.
"""

from __future__ import annotations

import dataclasses
import inspect
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import torch
from torch import Tensor

from lightning_gradcomp.comm import Payload
from lightning_gradcomp.compressors.exchange import (
    AllGather,
    AllGatherV,
    AllReduce,
    AllToAll,
    Broadcast,
    Exchange,
    Request,
    StepUpdates,
    nonfinite_flag,
)

if TYPE_CHECKING:
    from lightning_gradcomp.comm import Comm

Collective = Literal["allreduce", "allgather"]

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    """One round of SplitMix64: a cheap, well-mixed integer hash (Steele et al., 2014)."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def derive_seed(*parts: int) -> int:
    """Mix integers into one 63-bit seed; the same parts give the same seed on every rank and every run."""
    h = 0
    for part in parts:
        h = _splitmix64(h ^ (part & _MASK64))
    return h >> 1


@dataclass(frozen=True)
class Layer:
    """One parameter's gradient inside the flat tensor handed to a compressor.

    Attributes:
        name: the parameter's name in the module (``"layer1.0.conv1.weight"``).
        index: the parameter's position in ``module.parameters()``. It is the same on every rank, across DDP's bucket
            rebuild and across a resume, so per-layer randomness and memory are keyed by it (or by ``name``).
        shape: the parameter's shape.
        offset: where the layer starts in the flat tensor handed to the compressor.
    """

    name: str
    index: int
    shape: torch.Size
    offset: int = 0

    @property
    def numel(self) -> int:
        """Number of elements of the layer."""
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def ndim(self) -> int:
        """Number of dimensions of the layer."""
        return len(self.shape)

    def flat(self, tensor: Tensor) -> Tensor:
        """The layer's elements in ``tensor`` as a 1-D view."""
        return tensor[self.offset : self.offset + self.numel]

    def view(self, tensor: Tensor) -> Tensor:
        """The layer's elements in ``tensor`` as a view with the parameter's shape."""
        return self.flat(tensor).view(self.shape)

    def matrix(self, tensor: Tensor) -> Tensor:
        """The layer's elements viewed as a matrix ``(shape[0], -1)``, as PowerSGD and torch's hook do."""
        return self.flat(tensor).view(self.shape[0], -1)


def layers_from_shapes(shapes: Sequence[Sequence[int]], names: Sequence[str] | None = None) -> tuple[Layer, ...]:
    """Build consecutive :class:`Layer` entries for tensors of the given shapes (handy outside DDP and in tests)."""
    layers = []
    offset = 0
    for i, shape in enumerate(shapes):
        layer = Layer(name=names[i] if names else f"param{i}", index=i, shape=torch.Size(shape), offset=offset)
        layers.append(layer)
        offset += layer.numel
    return tuple(layers)


@dataclass(frozen=True)
class GradientRuns:
    """Where a bucket's compressed layers still are: ``[start, end)`` ranges of DDP's bucket buffer, in layer order.

    DDP interleaves a convolution's weight with its normalisation's parameters, which are averaged densely, so the
    compressed layers of a bucket are usually several runs. With error feedback the hook does not gather them into the
    compressor's contiguous tensor first: :meth:`Compressor.accumulate` reads them from the bucket and writes
    ``g + e`` in the same pass (:meth:`into`), where a gather and then ``+= e`` took one memory pass more per step.
    The same sums, element by element, so the same bits.
    """

    buffer: Tensor
    runs: tuple[tuple[int, int], ...]

    def into(self, out: Tensor, plus: Tensor | None = None, *, per_run: bool | None = None) -> Tensor:
        """Write the runs, concatenated, into ``out`` (plus ``plus``, element by element, when given).

        ``per_run`` (``None``: on the CPU) sums each run straight from the bucket. Otherwise the runs are gathered,
        then ``plus`` is added: two kernel launches, where a sum per run is a launch each (a GPU codec is bound by
        its launches, not by the memory pass this saves). The same values either way.
        """
        if per_run is None:
            per_run = out.device.type == "cpu"
        if plus is None or not per_run:
            gathered = torch.cat([self.buffer[start:end] for start, end in self.runs], out=out)
            return gathered if plus is None else gathered.add_(plus)
        offset = 0
        for start, end in self.runs:
            size = end - start
            torch.add(self.buffer[start:end], plus[offset : offset + size], out=out[offset : offset + size])
            offset += size
        return out


@dataclass(frozen=True)
class BucketContext:
    """What a compressor may know about the tensor it compresses.

    Built by the communication hook for every bucket and step. Every field is identical on every rank except
    ``rank`` and ``residual``, which is what lets compressors draw shared randomness without communicating.

    Attributes:
        index: DDP's bucket index (changes when DDP rebuilds its buckets after the first step).
        step: the optimizer step (``trainer.global_step`` under Lightning), the same on every rank.
        rank: this process's rank in the process group.
        world_size: the number of processes that average the gradient.
        layers: the layers in the flat tensor, in order, with offsets into it.
        dtype: the gradient's dtype; :meth:`Compressor.decompress` returns this dtype.
        device: the gradient's device.
        seed: the seed shared by all ranks (``CompressedDDP(seed=...)``).
        residual: this rank's error-feedback memory for the flat tensor as of the last finite step (read-only during
            a reduction), or ``None`` when error feedback is off.
        comm: the collectives (with byte accounting and round ordering); ``None`` outside a reduction.
        new_residual: where a reduction writes the updated residual (committed when the step is finite on every
            rank); set during :meth:`Compressor.reduce` when error feedback is on.
        updates: the step's staged state changes (:class:`~lightning_gradcomp.compressors.exchange.StepUpdates`);
            set during :meth:`Compressor.reduce` and :meth:`Compressor.finish_dense`.
        gradient_runs: set by the hook when the compressed layers are not contiguous in DDP's bucket: the tensor
            handed to :meth:`Compressor.reduce` is not filled yet, and the accumulation gathers the gradient from
            these runs of the bucket (:class:`GradientRuns`). ``None`` (the tensor holds the gradient) from
            :meth:`Compressor.accumulate` on.
    """

    index: int
    step: int
    rank: int
    world_size: int
    layers: tuple[Layer, ...]
    dtype: torch.dtype = torch.float32
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    seed: int = 0
    residual: Tensor | None = None
    comm: Comm | None = None
    new_residual: Tensor | None = None
    updates: StepUpdates | None = None
    gradient_runs: GradientRuns | None = None

    @property
    def numel(self) -> int:
        """Number of elements of the flat tensor (the sum over ``layers``)."""
        return sum(layer.numel for layer in self.layers)

    def output(self, out: Tensor | None = None, *, zeros: bool = False) -> Tensor:
        """The flat result tensor of :meth:`Compressor.decompress`.

        ``out`` if given (zeroed when ``zeros``), else a new one of ``numel`` elements, ``dtype`` and ``device``.
        """
        if out is None:
            factory = torch.zeros if zeros else torch.empty
            return factory(self.numel, dtype=self.dtype, device=self.device)
        return out.zero_() if zeros else out

    def layer_seed(self, layer: Layer, *salt: int, per_rank: bool = False) -> int:
        """A seed for ``layer`` at this step: shared by all ranks unless ``per_rank``.

        Keyed by the layer's stable ``index`` (not the bucket), so results do not depend on how DDP buckets the
        parameters; this is what makes a resumed run bitwise equal to an uninterrupted one.
        """
        parts = (self.seed, self.step, layer.index, *salt)
        if per_rank:
            parts = (*parts, 0x5EED, self.rank)
        return derive_seed(*parts)

    def generator(
        self, layer: Layer, *salt: int, per_rank: bool = False, device: str | torch.device = "cpu"
    ) -> torch.Generator:
        """A fresh generator seeded with :meth:`layer_seed` (on the CPU by default, so draws match across devices)."""
        return torch.Generator(device=device).manual_seed(self.layer_seed(layer, *salt, per_rank=per_rank))


def ddp_scale_(tensor: Tensor, world_size: int) -> Tensor:
    """``tensor`` times ``1 / world_size``, in place: how DDP's reducer scales a bucket before its sum.

    Not a division: at world sizes that are not powers of two, ``x * (1 / n)`` and ``x / n`` round differently, and
    plain DDP multiplies (its sparse gradients it divides). Plain averages that must be bitwise DDP's use this.
    """
    return tensor.mul_(1.0 / world_size)


class Compressor(ABC):
    """Compress one flat gradient tensor into a small payload and restore it.

    The contract, smallest first:

    * every method implements :meth:`compress` and :meth:`decompress`; a single-round method (one all-reduce or
      all-gather per bucket) needs nothing else: the base class runs error feedback, the collective, the averaging,
      the timing and the non-finite guard (:meth:`reduce`);
    * a method whose reduction takes several dependent rounds (PowerSGD's two projections, ScaleCom's shared indices,
      TernGrad's shared scaler, AdaComp's exchange of sizes) overrides :meth:`exchange`, a generator that *yields*
      each collective it needs and receives its result, and declares how many with ``rounds``;
    * a method that changes what is compressed before error feedback (DGC's momentum correction, Signum's momentum)
      overrides :meth:`accumulate`, and one whose update for densely averaged layers is not the average itself (DGC's
      momentum, signSGD's sign step) overrides :meth:`finish_dense`;
    * state that a step changes (momentum buffers, warm-start factors) is *staged* with ``ctx.updates.stage`` and
      written only when the step is finite on every rank.

    No compressor touches a future or a process group, and :meth:`reduce` cannot be overridden.

    Attributes:
        collective: ``"allreduce"`` if payloads can be summed: ``decompress(sum of payloads)`` is the sum of the
            decompressed payloads (every rank must then use the same indices or projections). ``"allgather"``
            otherwise: every rank's payload is gathered, decompressed and averaged locally.
        unbiased: ``True`` if ``E[decompress(compress(x))] == x`` over the compressor's randomness.
        rounds: how many dependent rounds of collectives one reduction needs (a process group is made for each).
        level_attribute: the hyper-parameter that sets how hard a layer is compressed (``"ratio"`` for sparsifiers,
            ``"rank"`` for PowerSGD), or ``None``. Compressors that have one can compress each layer at its own
            level (:meth:`set_levels`), which is what Accordion switches.
        propagates_nonfinite: the aggregate is a plain sum (Identity, the casts): a NaN on any rank reaches every
            rank by itself, so without error feedback no guard is needed.
        exchanges_sizes: payload sizes depend on the data and are exchanged in a first round (AdaComp).
        optimizer_momentum_conflicts: the compressor applies momentum itself (DGC): an optimizer with momentum on
            the gradient would apply it twice.
    """

    collective: ClassVar[Collective] = "allgather"
    unbiased: ClassVar[bool] = False
    rounds: ClassVar[int] = 1
    level_attribute: ClassVar[str | None] = None
    propagates_nonfinite: ClassVar[bool] = False
    exchanges_sizes: ClassVar[bool] = False
    optimizer_momentum_conflicts: ClassVar[bool] = False

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
        """Refuse, with a clear error, a configuration that cannot run with error feedback as set.

        Called before training (by the hook's state when it is made, and by the strategy when its compressor is
        replaced), so that a setting that acts only on the error-feedback memory is never silently ignored, and a
        method that cannot carry a memory says so at once. The default accepts both.

        Args:
            enabled: the strategy's ``error_feedback``: ``True``, ``False``, or ``None`` for
                :attr:`default_error_feedback`.

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
        # the first payload is decoded straight into the result, then ``+ 0.0``: the bits of accumulating into zeros
        # (``0 + x`` is ``x`` but for ``-0.0``, which becomes ``+0.0``) for one pass where zeroing and adding took
        # two; every other rank's payload is decoded into one scratch buffer (a fresh gradient-sized tensor per rank
        # may cost its page faults on the CPU: as much as the decoding itself). A decompressed payload may be the
        # payload itself, which must not change: it is copied, never written.
        total = ctx.output(out)
        if not payloads:
            return total.zero_()
        first = self.decompress(payloads[0], ctx, out=total)
        if first is not total:
            total.copy_(first)
        total.add_(0.0)
        scratch = torch.empty_like(total) if len(payloads) > 1 else None
        for payload in payloads[1:]:
            total.add_(self.decompress(payload, ctx, out=scratch))
        return total

    def average(self, payloads: Sequence[Payload], ctx: BucketContext, out: Tensor | None = None) -> Tensor:
        """:meth:`aggregate` divided by the world size: what the all-gather exchange returns.

        Override where the division folds into the decoding with the same bits (a table of sums divided once per
        entry, instead of a pass over the output); ``out`` is as in :meth:`decompress`.
        """
        return self.aggregate(payloads, ctx, out=out).div_(ctx.world_size)

    def accumulate(self, tensor: Tensor, ctx: BucketContext) -> Tensor | None:
        """Turn the gradient into what is compressed, in place: error feedback's ``tensor += residual``.

        ``ctx.residual`` is this rank's residual from the last finite step (read-only here). Override to accumulate
        something else first (DGC's momentum correction); stage any state it changes with ``ctx.updates.stage``.

        Returns:
            ``None``: what is compressed is in ``tensor``. An override may write it elsewhere and return that tensor
            instead, for its own :meth:`exchange` to read; the non-finite guard then checks it there. With
            :attr:`accumulates_into_new_residual` (PowerSGD, TopK) this default writes ``g + e`` straight into
            ``ctx.new_residual`` and returns it, and ``tensor`` is the output buffer.

        This default also gathers the gradient from ``ctx.gradient_runs`` when the hook left it in DDP's bucket, in
        the pass that adds the residual. An override is handed the gradient already gathered into ``tensor``.
        """
        runs = ctx.gradient_runs
        if self.accumulates_into_new_residual and summed_in_new_residual(ctx):
            if runs is not None:
                return runs.into(ctx.new_residual, plus=ctx.residual)
            return sum_into_new_residual(tensor, ctx)
        if runs is not None:
            runs.into(tensor, plus=ctx.residual)
        elif ctx.residual is not None:
            tensor.add_(ctx.residual)
        return None

    @property
    def accumulates_into_new_residual(self) -> bool:
        """Whether error feedback's ``g + e`` is written straight into ``ctx.new_residual`` (default: into the tensor).

        For methods whose new residual is ``g + e`` with something taken off in place (the sent entries, ``P Q^T``):
        the copy of ``g + e`` into the residual's buffer is saved, one memory pass per step. Their :meth:`exchange`
        then reads ``g + e`` from ``ctx.new_residual`` (where :func:`summed_in_new_residual` says it is) and uses the
        tensor only as the output buffer: its content after :meth:`accumulate` is unspecified.
        """
        return False

    def update_residual(self, residual: Tensor, tensor: Tensor, payload: Payload, ctx: BucketContext) -> None:
        """Write what compression lost into ``residual``: ``tensor - decompress(payload)`` (local reconstruction).

        ``residual`` is a buffer of its own (``ctx.new_residual``); ``ctx.residual`` still holds the old residual.
        """
        # decoded straight into the residual's buffer (no gradient-sized temporary), then subtracted in place
        torch.sub(tensor, self.decompress(payload, ctx, out=residual), out=residual)

    def nonfinite_witness(self, payload: Payload) -> Tensor | None:
        """A tensor of ``payload`` that is non-finite whenever what was compressed holds a NaN or an infinity.

        The non-finite guard reads the whole accumulated tensor, one read pass per step, unless the compressor
        overrides this to name such a tensor of the payload of its first all-reduce or all-gather, smaller or narrower
        than the input; the guard then reads only that tensor. Every element must reach it through sums, which carry a
        NaN or an infinity: an L1 norm per layer does (EF-signSGD's scales), so does a bucket's L2 norm (QSGD's), and
        so does the element itself cast to the wire (FP16's values). A product by factors that can be zero does not
        (BLAS may skip a zero factor, and ``0 * inf`` is NaN only where it is computed), so PowerSGD's ``P`` is no
        witness. A finite input whose witness overflows counts as non-finite, as the guard's own sum does; that is
        also what keeps a finite value the payload cannot hold (beyond FP16's 65504, a bucket whose squared norm
        exceeds fp32) out of the residual, where error feedback would carry its infinity to every later step. The
        default names none.
        """
        return None

    def finish_dense(self, average: Tensor, ctx: BucketContext) -> None:
        """Turn the dense average of ``ctx.layers`` into the update, in place (default: the average itself).

        Called for the layers a bucket averages densely (small layers, and every layer while compression is off, as
        during :class:`~lightning_gradcomp.callbacks.DenseWarmup`), so that a method whose update is not the averaged
        gradient keeps its semantics there (DGC's momentum correction, signSGD's sign step). ``average`` is identical
        on every rank; stage state changes with ``ctx.updates.stage``.
        """

    @property
    def has_dense_update(self) -> bool:
        """Whether :meth:`finish_dense` changes anything (the hook skips it otherwise)."""
        return type(self).finish_dense is not Compressor.finish_dense

    # ----------------------------------------------------------------------------------------------------------
    # Multi-round methods: the extension point
    # ----------------------------------------------------------------------------------------------------------
    def exchange(self, tensor: Tensor, ctx: BucketContext) -> Exchange:
        """The reduction as a generator: yield each collective, receive its result, return the flat average.

        The default is the single-round method: ``payload = compress(tensor)``; the new residual is ``tensor -
        decompress(payload)``; ``"allreduce"``: payloads are divided by the world size and summed (dividing first
        keeps fp16 sums from overflowing, as torch's ``fp16_compress_hook`` does), then decompressed;
        ``"allgather"``: payloads are gathered, decompressed and averaged in rank order (:meth:`average`, so every
        rank computes bitwise the same average).

        A multi-round method overrides it, yielding :class:`~lightning_gradcomp.compressors.exchange.AllReduce`,
        :class:`~lightning_gradcomp.compressors.exchange.AllGather` or
        :class:`~lightning_gradcomp.compressors.exchange.Broadcast` requests, at most ``rounds`` of them, the same
        number on every rank. It writes the new residual into ``ctx.new_residual`` when that is set, and may use
        ``tensor`` as the output buffer.
        """
        payload = self.compress(tensor, ctx)
        if ctx.new_residual is not None:
            self.update_residual(ctx.new_residual, tensor, payload, ctx)
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
            return self.decompress(summed, ctx, out=tensor)  # the input is spent: decode into it
        gathered = yield AllGather(payload)
        return self.average(gathered, ctx, out=tensor)

    def reduce(self, tensor: Tensor, ctx: BucketContext) -> torch.futures.Future[Tensor]:
        """Average ``tensor`` across ranks through this compressor; returns a future of the flat average.

        Runs :meth:`accumulate` (error feedback), then :meth:`exchange` round by round (round ``k`` on its own
        process group, in bucket order on every rank), times encoding and decoding, and guards against non-finite
        input (:mod:`lightning_gradcomp.compressors.exchange`). ``tensor`` may be modified in place. Not to be
        overridden.
        """
        return _run_exchange(self, tensor, ctx)

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

    def __setstate__(self, state: dict[str, Any]) -> None:
        # objects pickled before these were declared attributes lack them
        self.__dict__.update({"_layer_levels": {}, "_levels_version": 0, "_layer_state": {}, **state})

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


class LayerBuffers:
    """Per-layer tensors a compressor keeps between steps (its momentum, say), keyed by parameter name.

    Keyed by name, not by bucket, so they follow their layer across DDP's bucket rebuild and into checkpoints.
    """

    def __init__(self) -> None:
        self._tensors: dict[str, Tensor] = {}

    def get(self, layer: Layer, like: Tensor) -> Tensor:
        """``layer``'s buffer, zero-initialised like ``like`` when missing or no longer matching it."""
        buffer = self._tensors.get(layer.name)
        if buffer is None or buffer.shape != like.shape or buffer.dtype != like.dtype:
            buffer = self._tensors[layer.name] = torch.zeros_like(like)
        elif buffer.device != like.device:  # loaded from a checkpoint on another device: moved, not lost
            buffer = self._tensors[layer.name] = buffer.to(like.device)
        return buffer

    def __getitem__(self, name: str) -> Tensor:
        return self._tensors[name]

    def __bool__(self) -> bool:
        return bool(self._tensors)

    def state_dict(self) -> dict[str, Tensor]:
        """A copy of every buffer."""
        return {name: t.detach().clone() for name, t in self._tensors.items()}

    def load_state_dict(self, state_dict: dict[str, Tensor]) -> None:
        """Replace the buffers with copies of ``state_dict``'s."""
        self._tensors = {name: t.clone() for name, t in state_dict.items()}

    def clear(self) -> None:
        """Forget every buffer (each starts again from zeros at its next :meth:`get`)."""
        self._tensors.clear()


def sum_into_new_residual(tensor: Tensor, ctx: BucketContext) -> Tensor | None:
    """Error feedback's ``g + e``, written into ``ctx.new_residual`` and returned (an :meth:`Compressor.accumulate`).

    For compressors whose new residual is ``g + e`` with something taken off in place (the sent entries, ``P Q^T``).
    That saves the copy of ``g + e`` into the residual's buffer (one memory pass per step); ``tensor`` keeps ``g`` and
    becomes the output buffer. Without both residuals (no error feedback, or a call outside a reduction) it is the
    default accumulation and returns ``None``; :func:`summed_in_new_residual` tells which happened.
    """
    if not summed_in_new_residual(ctx):
        if ctx.residual is not None:
            tensor.add_(ctx.residual)
        return None
    return torch.add(tensor, ctx.residual, out=ctx.new_residual)


def summed_in_new_residual(ctx: BucketContext) -> bool:
    """Whether :func:`sum_into_new_residual` put ``g + e`` into ``ctx.new_residual`` for this reduction."""
    return ctx.residual is not None and ctx.new_residual is not None


def check_gradient_dtypes(
    compressor: Compressor, layers: Iterable[tuple[Layer, torch.dtype]], min_numel: int
) -> None:
    """Ask ``compressor`` to check the gradient dtype of each of ``layers`` (layer, dtype) that it compresses.

    A layer the compressor leaves dense (below ``min_numel`` elements, or not its kind) is not asked.

    Raises:
        ValueError: The compressor's error for the first layer it refuses (:meth:`Compressor.check_gradient_dtype`).
    """
    for layer, dtype in layers:
        if compressor.compresses(layer, min_numel):
            compressor.check_gradient_dtype(layer, dtype)


def keep_count(numel: int, ratio: float) -> int:
    """How many of ``numel`` elements a keep-ratio selects: ``max(1, int(numel * ratio))`` (GRACE's rule)."""
    return max(1, min(numel, int(numel * ratio)))


# ----------------------------------------------------------------------------------------------------------------
# The driver of Compressor.reduce: rounds as futures, the non-finite guard (see compressors/exchange.py)
# ----------------------------------------------------------------------------------------------------------------
class _Done:
    """A reduction that returned before its last declared round (every rank alike): later rounds pass it on."""

    __slots__ = ("result",)

    def __init__(self, result: Tensor) -> None:
        self.result = result


class _Run:
    """One reduction in flight: the generator, the guard's flag, the staged updates."""

    def __init__(self, compressor: Compressor, tensor: Tensor, ctx: BucketContext, comm: Comm) -> None:
        self.compressor = compressor
        self.tensor = tensor
        self.ctx = ctx
        self.comm = comm
        self.generator: Exchange | None = None
        self.flag: Tensor | None = None  # this rank's 0/1, until it has been sent
        self.awaits_witness = False  # the flag is to be read from the first carrier's witness (nonfinite_witness)
        self.flag_at: tuple[int, type] | None = None  # (round, request type) that carried it
        self.ok: Tensor | None = None

    # ------------------------------------------------------------------------------------------------------------
    def issue(self, request: Request, round: int) -> torch.futures.Future:
        """Start ``request``'s collective on ``round``, with the flag if it is the first one that can carry it."""
        comm = self.comm
        payload = tuple(request.payload)
        if self.awaits_witness and isinstance(request, (AllReduce, AllGather)):
            witness = self.compressor.nonfinite_witness(payload)
            if witness is None:
                raise RuntimeError(
                    f"{type(self.compressor).__name__}.nonfinite_witness named no tensor of its first all-reduce or"
                    " all-gather payload; a compressor that overrides it must name one there (the non-finite guard"
                    " reads only that tensor)."
                )
            self.flag = nonfinite_flag(witness)
            self.awaits_witness = False
        carries = self.flag is not None and isinstance(request, (AllReduce, AllGather))
        if carries:
            flag = self._flag_like(payload, request)
            comm.telemetry.add_guard(_flag_nbytes(payload, flag, isinstance(request, AllGather)))
            payload = (*payload, flag)
            self.flag_at = (round, type(request))
            self.flag = None
        if isinstance(request, AllReduce):
            return comm.all_reduce(payload, round=round, op=request.op)
        if isinstance(request, AllGather):
            return comm.all_gather(payload, round=round)
        if isinstance(request, Broadcast):
            return comm.broadcast(payload, src=request.src, round=round)
        if isinstance(request, AllToAll):
            return comm.all_to_all(payload, request.send_counts, request.recv_counts, round=round)
        if isinstance(request, AllGatherV):
            return comm.all_gather_v(payload, request.counts, round=round)
        raise TypeError(
            f"{type(self.compressor).__name__}.exchange yielded {request!r}; it must yield AllReduce, AllGather,"
            " Broadcast, AllToAll or AllGatherV requests (lightning_gradcomp.compressors.exchange)."
        )

    def _flag_like(self, payload: Payload, request: Request) -> Tensor:
        assert self.flag is not None
        # an all-reduce groups its tensors by dtype: in the payload's own dtype the flag costs no extra collective
        # (0 and 1 are exact in every dtype, summed or maxed); an all-gather packs bytes, any dtype will do
        dtype = payload[0].dtype if isinstance(request, AllReduce) and payload else torch.float32
        if dtype == torch.bool:
            dtype = torch.uint8
        return self.flag.to(dtype).reshape(1)

    def received(self, value: Any, round: int) -> Any:
        """The collective's result as the compressor sent it: the flag is taken off (and read) if it rode here."""
        if self.flag_at is None or self.flag_at[0] != round:
            return value
        if self.flag_at[1] is AllReduce:
            *payload, flag = value
            bad = flag.reshape(())
            value = tuple(payload)
        else:
            bad = torch.stack([rank_payload[-1].reshape(()) for rank_payload in value]).sum()
            value = [tuple(rank_payload[:-1]) for rank_payload in value]
        self.ok = bad == 0
        return value

    # ------------------------------------------------------------------------------------------------------------
    def start(self) -> torch.futures.Future:
        ctx, comm = self.ctx, self.comm
        with comm.timed("encode"):
            runs = ctx.gradient_runs
            if runs is not None and type(self.compressor).accumulate is not Compressor.accumulate:
                runs.into(self.tensor)  # an accumulation of its own is handed the gradient gathered
                ctx = self.ctx = dataclasses.replace(ctx, gradient_runs=None)
            accumulated = self.compressor.accumulate(self.tensor, ctx)
            if ctx.gradient_runs is not None:  # gathered by the default accumulation, into what it returned
                ctx = self.ctx = dataclasses.replace(ctx, gradient_runs=None)
            if _needs_guard(self.compressor, ctx):
                if _witnessed(self.compressor):
                    self.awaits_witness = True  # read from the payload when it is issued: no pass over the tensor
                else:
                    self.flag = nonfinite_flag(self.tensor if accumulated is None else accumulated)
            if ctx.residual is not None and ctx.new_residual is not None:
                ctx.updates.stage(ctx.residual, ctx.new_residual, swap=True)
            self.generator = self.compressor.exchange(self.tensor, ctx)
            try:
                request = next(self.generator)
            except StopIteration as stop:
                raise TypeError(
                    f"{type(self.compressor).__name__}.exchange returned without a collective: every reduction must"
                    " communicate (yield AllReduce, AllGather or Broadcast)."
                ) from stop
        fut = self.issue(request, 0)
        for round in range(1, self.compressor.rounds):
            fut = comm.after(fut, lambda done, round=round: self.resume(done, round), round=round)
        return fut.then(self.finish)

    def resume(self, done: torch.futures.Future, round: int) -> torch.futures.Future:
        """Hand round ``round - 1``'s result to the generator and issue what it yields on round ``round``."""
        value = done.value()
        if isinstance(value, _Done):
            return _completed(self.comm, value)
        value = self.received(value, round - 1)
        assert self.generator is not None
        with self.comm.timed("encode"):
            try:
                request = self.generator.send(value)
            except StopIteration as stop:
                return _completed(self.comm, _Done(stop.value))
        return self.issue(request, round)

    def finish(self, done: torch.futures.Future) -> Tensor:
        value = done.value()
        if isinstance(value, _Done):
            out = value.result
        else:
            value = self.received(value, self.compressor.rounds - 1)
            assert self.generator is not None
            with self.comm.timed("decode"):
                try:
                    self.generator.send(value)
                except StopIteration as stop:
                    out = stop.value
                else:
                    raise RuntimeError(
                        f"{type(self.compressor).__name__}.exchange yielded more collectives than its declared"
                        f" `rounds = {self.compressor.rounds}`; declare every round (process groups are created"
                        " for them before training)."
                    )
        if self.flag is not None or self.awaits_witness:
            raise RuntimeError(
                f"{type(self.compressor).__name__}.exchange yielded no AllReduce or AllGather to carry the non-finite"
                " flag; every reduction needs one (a Broadcast alone cannot tell every rank that one rank failed)."
            )
        if self.ok is not None:
            with self.comm.timed("decode"):
                # one NaN is enough for "the gradient is not finite" on every rank (the user's or AMP's check)
                nan = torch.full((), float("nan"), dtype=out.dtype, device=out.device)
                out[:1].add_(torch.where(self.ok, torch.zeros_like(nan), nan))
            self.ctx.updates.observe(self.ok)
        return out


def _flag_nbytes(payload: Payload, flag: Tensor, gathered: bool) -> int:
    """What the flag adds to the bytes handed to the collective (the byte-packed all-gather pads to 8 bytes)."""
    if not gathered:
        return flag.element_size()
    if len(payload) == 1:  # a lone tensor is sent unpacked; with the flag it is packed, so padded too
        nbytes = payload[0].numel() * payload[0].element_size()
        return -(-nbytes // 8) * 8 - nbytes + 8
    return 8


def _completed(comm: Comm, value: Any) -> torch.futures.Future:
    fut = comm.new_future()
    fut.set_result(value)
    return fut


def _witnessed(compressor: Compressor) -> bool:
    """Whether ``compressor`` names a witness of non-finite input in its payload (``nonfinite_witness``)."""
    return type(compressor).nonfinite_witness is not Compressor.nonfinite_witness


def _needs_guard(compressor: Compressor, ctx: BucketContext) -> bool:
    # a plain sum (Identity, the casts) carries a NaN to every rank by itself; with no state to protect there is
    # nothing to do, and Identity stays bitwise plain DDP
    return not (compressor.propagates_nonfinite and ctx.residual is None)


def _run_exchange(compressor: Compressor, tensor: Tensor, ctx: BucketContext) -> torch.futures.Future[Tensor]:
    """Run ``compressor``'s reduction of ``tensor`` (see :meth:`Compressor.reduce`); ``ctx.comm`` must be set."""
    if ctx.comm is None:
        raise RuntimeError("Compressor.reduce needs `ctx.comm` (the hook sets it); use compress/decompress directly.")
    owns_updates = ctx.updates is None
    changes: dict[str, Any] = {}
    if owns_updates:
        changes["updates"] = StepUpdates()
    if ctx.residual is not None and ctx.new_residual is None:
        changes["new_residual"] = torch.empty_like(ctx.residual)
    if changes:
        ctx = dataclasses.replace(ctx, **changes)
    fut = _Run(compressor, tensor, ctx, ctx.comm).start()
    if not owns_updates:
        return fut
    updates = ctx.updates

    def commit(done: torch.futures.Future[Tensor]) -> Tensor:
        out = done.value()
        updates.commit()
        return out

    return fut.then(commit)
