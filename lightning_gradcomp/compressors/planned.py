"""``Planned``: a compressor that hands each bucket to one of several named candidates (the auto planner's output)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor

from lightning_gradcomp.compressors.base import BucketContext, Collective, Compressor, Layer, Payload
from lightning_gradcomp.compressors.identity import Identity
from lightning_gradcomp.engine.driver import Delegate


class Planned(Compressor):
    """Reduce each bucket with the candidate its layers are assigned to; the assignment can change between steps.

    The assignment maps parameter names (stable across DDP's bucket rebuild and across a resume) to candidate
    names. A bucket goes to the candidate of its largest assigned layer (the planner assigns every layer of a bucket
    alike; after a rebuild mixes them, the largest layer decides); layers not in the assignment use ``default``.
    The communication hook asks :meth:`bucket_compressor` for the bucket's candidate and runs it as if it were the
    strategy's compressor: its own split into compressed and dense layers, its error feedback default, its rounds.

    Changing the assignment (:meth:`set_assignment`) changes :meth:`plan_key`, so the hook re-plans its buckets and
    moves every error-feedback residual back to its parameter; a layer whose new candidate keeps no residual pays
    it into its next gradient (never lost, never paid twice).

    **Limits.** Candidates are ordered from the least lossy to the most. A layer's level (``level_attribute`` is
    ``"limit"``, set with :meth:`set_levels`, what :class:`~lightning_gradcomp.callbacks.Accordion` switches) is the
    most lossy candidate it may use; by default the last one. A bucket whose assigned candidate is lossier than the
    strictest limit of its layers goes to that limit's candidate instead, so an accuracy limit holds from the step it
    is set, whatever the plan (:class:`~lightning_gradcomp.callbacks.AutoCompression` then re-plans within it).

    Args:
        candidates: name to compressor; every rank must hold the same names and configurations.
        assignment: parameter name to candidate name.
        default: the candidate of unassigned layers (default: the first candidate).

    Raises:
        ValueError: If ``candidates`` is empty, a value is not a compressor, or an assigned or default name is not a
            candidate.

    Example::

        >>> from lightning_gradcomp.compressors import BF16, Identity, Planned
        >>> Planned({"dense": Identity(), "bf16": BF16()}, {"fc.weight": "bf16"})
        Planned(candidates={'dense': Identity(), 'bf16': BF16()}, assignment={'fc.weight': 'bf16'}, default='dense')
    """

    unbiased: ClassVar[bool] = False
    level_attribute: ClassVar[str | None] = "limit"

    def __init__(
        self,
        candidates: Mapping[str, Compressor],
        assignment: Mapping[str, str] | None = None,
        default: str | None = None,
    ) -> None:
        super().__init__()
        if not candidates:
            raise ValueError("Expected `candidates` to name at least one compressor, got none.")
        for name, candidate in candidates.items():
            if not isinstance(candidate, Compressor) or isinstance(candidate, Planned):
                raise ValueError(
                    f"Expected `candidates` to map names to compressors (not Planned), got {name!r}: {candidate!r}."
                )
        self.candidates = dict(candidates)
        self.default = next(iter(self.candidates)) if default is None else self._check_name(default, "default")
        self.assignment: dict[str, str] = {}
        self._version = 0
        self.set_assignment(assignment or {})

    def __repr__(self) -> str:
        """The candidates' names and how many layers each is assigned; their settings are in ``candidates``.

        Short: it is printed in the setup line and the end-of-fit summary, where every candidate's full repr would
        be several hundred characters.
        """
        used = Counter(self.assignment.values())
        assigned = ", ".join(f"{name}: {used[name]}" for name in self.candidates if used[name])
        return f"Planned(candidates={list(self.candidates)}, default={self.default!r}, layers assigned={{{assigned}}})"

    def _check_name(self, name: str, argument: str) -> str:
        if name not in self.candidates:
            raise ValueError(f"Expected `{argument}` to name one of {sorted(self.candidates)}, got {name!r}.")
        return name

    @property
    def limit(self) -> str:
        """The default limit of every layer: the most lossy candidate (no limit)."""
        return next(reversed(self.candidates))

    def check_level(self, value: Any) -> str:
        """A limit must name a candidate."""
        if not isinstance(value, str) or value not in self.candidates:
            raise ValueError(
                f"Expected a `limit` to name one of {list(self.candidates)} (least lossy first), got {value!r}."
            )
        return value

    def lossiness(self, name: str) -> int:
        """The position of candidate ``name`` from the least lossy (0) to the most."""
        return list(self.candidates).index(name)

    def allowed(self, layers: Sequence[str]) -> list[str]:
        """The candidates the strictest limit of ``layers`` (parameter names) allows, least lossy first."""
        names = list(self.candidates)
        cap = min((names.index(self._layer_levels.get(layer, self.limit)) for layer in layers), default=len(names) - 1)
        return names[: cap + 1]

    def may_compress(self, layer: Layer, min_numel: int) -> bool:
        """Whether a candidate within ``layer``'s limit, other than plain averaging, compresses it (Accordion's)."""
        return any(
            not isinstance(self.candidates[name], Identity) and self.candidates[name].compresses(layer, min_numel)
            for name in self.allowed([layer.name])
        )

    def set_assignment(self, assignment: Mapping[str, str]) -> None:
        """Assign parameters to candidates (the others to ``default``); call on every rank alike, between steps."""
        checked = {str(layer): self._check_name(name, "assignment") for layer, name in assignment.items()}
        if checked != self.assignment:
            self.assignment = checked
            self._version += 1

    # ----------------------------------------------------------------------------------------------------------
    # Dispatch
    # ----------------------------------------------------------------------------------------------------------
    def candidate_name(self, layers: Sequence[Layer]) -> str:
        """The candidate a bucket of ``layers`` goes to.

        That of its largest assigned layer, else ``default``; if that is lossier than the strictest limit of the
        bucket's layers, the limit's candidate.
        """
        assigned = [layer for layer in layers if layer.name in self.assignment]
        if not assigned:
            name = self.default
        else:
            name = self.assignment[max(assigned, key=lambda layer: (layer.numel, -layer.index)).name]
        if self._layer_levels:
            allowed = self.allowed([layer.name for layer in layers])
            if name not in allowed:
                return allowed[-1]
        return name

    def bucket_compressor(self, layers: Sequence[Layer]) -> Compressor:
        """The candidate that reduces a bucket of ``layers`` (see :meth:`candidate_name`)."""
        return self.candidates[self.candidate_name(layers)]

    @property
    def collective(self) -> Collective:
        """``"allreduce"`` if every candidate sums its payloads, else ``"allgather"`` (the hook asks per bucket)."""
        return "allreduce" if all(c.collective == "allreduce" for c in self.candidates.values()) else "allgather"

    @property
    def rounds(self) -> int:
        """The most rounds any candidate needs (process groups are made for all of them)."""
        return max(candidate.rounds for candidate in self.candidates.values())

    def compresses(self, layer: Layer, min_numel: int) -> bool:
        """What ``layer``'s own candidate decides."""
        return self.bucket_compressor([layer]).compresses(layer, min_numel)

    def error_feedback_growth(self, enabled: bool | None) -> str | None:
        """The first candidate's reason (the hook resolves error feedback per bucket, for the bucket's candidate)."""
        for name, candidate in self.candidates.items():
            reason = candidate.error_feedback_growth(enabled)
            if reason is not None:
                return f"candidate {name!r}, {candidate!r}: {reason}"
        return None

    def check_gradient_dtype(self, layer: Layer, dtype: torch.dtype) -> None:
        """``layer``'s own candidate's check."""
        self.bucket_compressor([layer]).check_gradient_dtype(layer, dtype)

    @property
    def default_error_feedback(self) -> bool:
        """Used only when the hook is not told per bucket: on if any candidate wants it."""
        return any(candidate.default_error_feedback for candidate in self.candidates.values())

    def check_error_feedback(self, enabled: bool | None) -> None:
        """Every candidate's check (the hook resolves error feedback per bucket, for the bucket's candidate)."""
        for candidate in self.candidates.values():
            candidate.check_error_feedback(enabled)

    def compress(self, tensor: Tensor, ctx: BucketContext) -> Payload:
        """The bucket's candidate's payload."""
        return self.bucket_compressor(ctx.layers).compress(tensor, ctx)

    def decompress(self, payload: Payload, ctx: BucketContext, out: Tensor | None = None) -> Tensor:
        """The bucket's candidate's decompression."""
        return self.bucket_compressor(ctx.layers).decompress(payload, ctx, out)

    def delegate(self, ctx: BucketContext) -> Delegate:
        """The bucket's candidate reduces it (its accumulation, its exchange and rounds, its declaration)."""
        return Delegate(self.bucket_compressor(ctx.layers), ctx)

    def finish_dense(self, average: Tensor, ctx: BucketContext) -> None:
        """The bucket's candidate's dense update."""
        self.bucket_compressor(ctx.layers).finish_dense(average, ctx)

    @property
    def has_dense_update(self) -> bool:
        """Whether any candidate has a dense update."""
        return any(candidate.has_dense_update for candidate in self.candidates.values())

    def plan_key(self) -> tuple:
        """Changes with the assignment, the limits and any candidate's own key (its levels)."""
        return (id(self), self._version, self._levels_version, tuple(c.plan_key() for c in self.candidates.values()))

    # ----------------------------------------------------------------------------------------------------------
    # State
    # ----------------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The assignment, the limits and every candidate's own state."""
        return {
            "assignment": dict(self.assignment),
            "layer_levels": self.layer_levels,
            "candidates": {name: candidate.state_dict() for name, candidate in self.candidates.items()},
        }

    def reset_state(self) -> None:
        """Every candidate's (the assignment and the limits are settings)."""
        super().reset_state()
        for candidate in self.candidates.values():
            candidate.reset_state()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (candidates missing from it keep their state)."""
        self.set_assignment(state_dict.get("assignment", {}))
        if state_dict.get("layer_levels") or self.layer_levels:
            self.set_levels(state_dict.get("layer_levels", {}))
        for name, state in state_dict.get("candidates", {}).items():
            if name in self.candidates:
                self.candidates[name].load_state_dict(state)
