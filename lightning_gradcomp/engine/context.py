"""The compressor contract's data types: what a compressor is told about the tensor it compresses.

:class:`Layer` places one parameter's gradient in the flat tensor, :class:`BucketContext` is everything a compressor
may know about one reduction (identical on every rank but ``rank``), :class:`LayerBuffers` keeps per-layer tensors
between steps, and :class:`GradientRuns` says where a bucket's compressed layers still are in DDP's buffer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import torch
from torch import Tensor

if TYPE_CHECKING:
    from lightning_gradcomp.engine.comm import Comm
    from lightning_gradcomp.engine.requests import StepUpdates

__all__ = [
    "BucketContext",
    "Collective",
    "GradientRuns",
    "Layer",
    "LayerBuffers",
    "ResidualBuffers",
    "ddp_scale_",
    "derive_seed",
    "keep_count",
    "layers_from_shapes",
]

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
    compressor's contiguous tensor first: the driver reads them from the bucket and writes ``g + e`` in the same pass
    (:meth:`into`), where a gather and then ``+= e`` took one memory pass more per step.
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
    ``rank``, which is what lets compressors draw shared randomness without communicating.

    Attributes:
        index: DDP's bucket index (changes when DDP rebuilds its buckets after the first step).
        step: the optimizer step (``trainer.global_step`` under Lightning), the same on every rank.
        rank: this process's rank in the process group.
        world_size: the number of processes that average the gradient.
        layers: the layers in the flat tensor, in order, with offsets into it.
        dtype: the gradient's dtype; :meth:`Compressor.decompress` returns this dtype.
        device: the gradient's device.
        seed: the seed shared by all ranks (``CompressedDDP(seed=...)``).
        comm: the collectives (with byte accounting and round ordering); ``None`` outside a reduction.
        updates: the step's staged state changes (:class:`~lightning_gradcomp.engine.requests.StepUpdates`);
            set during :meth:`Compressor.reduce` and :meth:`Compressor.finish_dense`.
        error_feedback: whether the driver keeps an error-feedback residual for this reduction (it adds it to what is
            compressed, and settles it from what :meth:`Compressor.exchange` declares it sent). A compressor reads
            it only to skip work whose one use is that declaration.
    """

    index: int
    step: int
    rank: int
    world_size: int
    layers: tuple[Layer, ...]
    dtype: torch.dtype = torch.float32
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    seed: int = 0
    comm: Comm | None = None
    updates: StepUpdates | None = None
    error_feedback: bool = False

    @property
    def numel(self) -> int:
        """Number of elements of the flat tensor (the sum over ``layers``)."""
        return sum(layer.numel for layer in self.layers)

    def stage(self, target: Tensor, value: Tensor, *, swap: bool = False) -> None:
        """Write ``value`` into ``target`` once the step is finite on every rank (``updates.stage``).

        Raises:
            RuntimeError: Outside a reduction (no ``updates``).
        """
        if self.updates is None:
            raise RuntimeError("BucketContext.stage is for state changes during a reduction (`updates` is unset).")
        self.updates.stage(target, value, swap=swap)

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


@dataclass(frozen=True)
class ResidualBuffers:
    """One rank's error-feedback memory for one reduction, as the hook (or a test) hands it to the driver.

    Attributes:
        residual: what compression has not yet sent, as of the last finite step (read-only during the reduction).
        twin: where the reduction writes the updated residual, copied over (or swapped with) ``residual`` only when
            the step is finite on every rank; ``None``: the driver allocates one.
    """

    residual: Tensor
    twin: Tensor | None = None


class LayerBuffers:
    """Per-layer tensors a compressor keeps between steps (its momentum, say), keyed by parameter name.

    Keyed by name, not by bucket, so they follow their layer across DDP's bucket rebuild and into checkpoints.
    """

    def __init__(self) -> None:
        self._tensors: dict[str, Tensor] = {}
        self._flats: dict[tuple[tuple[str, int], ...], Tensor] = {}  # a bucket's buffers as one tensor, by layout
        self._flat_of: dict[str, tuple[tuple[str, int], ...]] = {}  # the layout whose flat tensor holds a buffer

    def get(self, layer: Layer, like: Tensor) -> Tensor:
        """``layer``'s buffer, zero-initialised like ``like`` when missing or no longer matching it."""
        buffer = self._tensors.get(layer.name)
        if buffer is None or buffer.shape != like.shape or buffer.dtype != like.dtype:
            buffer = self._replace(layer.name, torch.zeros_like(like))
        elif buffer.device != like.device:  # loaded from a checkpoint on another device: moved, not lost
            buffer = self._replace(layer.name, buffer.to(like.device))
        return buffer

    def flat(self, layers: Sequence[Layer], like: Tensor) -> Tensor:
        """The buffers of ``layers`` as one flat tensor like ``like`` (a bucket), each layer's buffer a view of it.

        Built once per layout (the existing buffers copied in, missing ones zero); afterwards a bucket's buffers are
        updated in a fixed number of operators. Still saved and loaded per layer (:meth:`state_dict`), so they
        follow their layer across DDP's bucket rebuild.
        """
        key = tuple((layer.name, layer.numel) for layer in layers)
        found = self._flats.get(key)
        if found is not None and found.dtype == like.dtype and found.device == like.device:
            return found
        flat = torch.zeros_like(like)
        for layer in layers:
            view = layer.flat(flat)
            view.copy_(self.get(layer, view))
            self._replace(layer.name, view)
            self._flat_of[layer.name] = key
        self._flats[key] = flat
        return flat

    def _replace(self, name: str, buffer: Tensor) -> Tensor:
        """Set ``name``'s buffer; a flat tensor that held the old one no longer holds every buffer of its layout."""
        owner = self._flat_of.pop(name, None)
        if owner is not None:
            self._flats.pop(owner, None)
        self._tensors[name] = buffer
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
        self._flats.clear()
        self._flat_of.clear()

    def clear(self) -> None:
        """Forget every buffer (each starts again from zeros at its next :meth:`get`)."""
        self._tensors.clear()
        self._flats.clear()
        self._flat_of.clear()


def keep_count(numel: int, ratio: float) -> int:
    """How many of ``numel`` elements a keep-ratio selects: ``max(1, int(numel * ratio))`` (GRACE's rule)."""
    return max(1, min(numel, int(numel * ratio)))
