"""Error-feedback memory of one rank: what compression has not yet sent, owed to the next step.

Error feedback (Seide et al., 2014; Karimireddy et al., 2019, "Error Feedback Fixes SignSGD"): before compressing,
add the residual ``e`` to the gradient, ``x = g + e``; after compressing, keep ``e = x - C(x)``. Summed over steps,
what was applied plus the final residual equals what was computed (the telescoping identity the tests check).

The memory is flat per DDP bucket while the layout holds (one add and one subtraction per step, no per-parameter
work), and is split per parameter whenever the layout changes: DDP rebuilds its buckets after the first step (and
starts with a single bucket again after a resume), and a compressor swap can change which layers are compressed.
Keying by parameter name makes the memory independent of bucketing, which is what lets a checkpoint restore it
exactly and lets a rebuild keep every element's debt attached to its own parameter.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_gradcomp.engine.context import Layer, ResidualBuffers


class ErrorFeedback:
    """One rank's residuals: flat per bucket on the hot path, per parameter when the layout changes or at rest.

    Each bucket's flat residual has a twin buffer the reduction writes the updated residual into; the twin is copied
    over the residual only when the step is finite on every rank (:class:`~lightning_gradcomp.engine.requests.
    StepUpdates`), so a non-finite step never reaches the memory.
    """

    def __init__(self) -> None:
        self._flat: dict[int, tuple[tuple[str, ...], tuple[Layer, ...], Tensor, Tensor]] = {}
        self._pending: dict[str, Tensor] = {}

    def __bool__(self) -> bool:
        return bool(self._flat or self._pending)

    def prepare(
        self,
        bucket_index: int,
        compressed: tuple[Layer, ...],
        tensor: Tensor | None,
        dense: tuple[Layer, ...] = (),
        dense_tensor: Tensor | None = None,
        *,
        keep: bool,
    ) -> ResidualBuffers | None:
        """Everything error feedback does to one bucket before its reduction, in one call.

        Debts of layers that are now averaged densely (``dense``, laid out in ``dense_tensor``) are paid into it; with
        ``keep`` (error feedback on) the compressed layers get their residual and its twin, else their debts are paid
        into ``tensor`` too.

        Returns:
            The compressed layers' residual and its twin, or ``None`` without ``keep``.
        """
        if self and dense and dense_tensor is not None:
            self._drain_into(dense_tensor, dense)
        if tensor is None:
            return None
        if not keep:
            if self:  # error feedback was on for a previous compressor: pay what is owed, once
                self._drain_into(tensor, compressed)
            return None
        return self._buffers(bucket_index, compressed, tensor)

    def _buffers(self, bucket_index: int, layers: tuple[Layer, ...], like: Tensor) -> ResidualBuffers:
        key = tuple(layer.name for layer in layers)
        entry = self._flat.get(bucket_index)
        if entry is not None and entry[0] == key:
            return ResidualBuffers(entry[2], entry[3])
        if entry is not None:
            self.spill()
        flat = torch.zeros(sum(layer.numel for layer in layers), dtype=like.dtype, device=like.device)
        for layer in layers:
            owed = self._pending.pop(layer.name, None)
            if owed is not None:
                layer.flat(flat).copy_(owed.reshape(-1))
        self._flat[bucket_index] = (key, layers, flat, torch.empty_like(flat))
        return ResidualBuffers(flat, self._flat[bucket_index][3])

    def spill(self) -> None:
        """Move every flat residual into per-parameter pieces (after DDP re-buckets or the plan changes)."""
        for _, layers, flat, _ in self._flat.values():
            for layer in layers:
                self._pending[layer.name] = layer.view(flat)
        self._flat.clear()

    def _drain_into(self, tensor: Tensor, layers: Sequence[Layer]) -> None:
        """Add the residual still owed for ``layers`` into ``tensor`` and forget it.

        A layer with a residual that is now averaged densely (compression switched off, or the layer no longer
        compressed) pays its debt into the dense gradient instead of dropping it.
        """
        names = {layer.name for layer in layers}
        if any(names.intersection(entry[0]) for entry in self._flat.values()):
            self.spill()
        for layer in layers:
            owed = self._pending.pop(layer.name, None)
            if owed is not None:
                layer.flat(tensor).add_(owed.reshape(-1).to(tensor.device, tensor.dtype))

    def clear(self) -> None:
        """Forget every residual."""
        self._flat.clear()
        self._pending.clear()

    def state_dict(self) -> dict[str, Tensor]:
        """Per-parameter residuals (CPU copies), independent of the bucket layout."""
        out = {name: t.detach().to("cpu", copy=True) for name, t in self._pending.items()}
        for _, layers, flat, _ in self._flat.values():
            for layer in layers:
                out[layer.name] = layer.view(flat).detach().to("cpu", copy=True)
        return out

    def load_state_dict(self, state_dict: dict[str, Tensor]) -> None:
        """Restore residuals saved by :meth:`state_dict`; they are laid into buckets at the next step."""
        self._flat.clear()
        self._pending = {name: t.clone() for name, t in state_dict.items()}

    def drop_except(self, names: set[str]) -> list[str]:
        """Forget residuals of parameters not in ``names`` (the model changed); returns what was dropped."""
        self.spill()
        dropped = [name for name in self._pending if name not in names]
        for name in dropped:
            del self._pending[name]
        return dropped
