"""The checks of DiLoCo's arguments, shared by its front doors (``error``: the exception a front door raises).

Every bad value is refused when the strategy is built, in one line naming the argument, what is accepted and what
was given.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_gradcomp.compressors.base import Compressor
from lightning_gradcomp.diloco.defaults import (
    AUTO,
    DEFAULT_MERGE,
    DEFAULT_MIXING_FACTOR,
    MERGES,
    OUTER_LR,
    OUTER_MOMENTUM,
)
from lightning_gradcomp.diloco.replicas import check_replica_group
from lightning_gradcomp.validation import check_choice, check_int, check_number

__all__ = ["ARGUMENTS", "check_arguments", "check_fit", "check_merge", "check_schedule", "outer_optimizer_of"]

#: the arguments of DiLoCo's own (a misspelt keyword gets the closest of these, or of the front door's base)
ARGUMENTS = (
    "sync_every",
    "outer_optimizer",
    "fragments",
    "overlap_steps",
    "merge",
    "mixing_factor",
    "offload",
    "monitor",
    "replica_group",
    "compressor",
    "sigterm_check",
    "fault_tolerance",
)
_OUTER_EXAMPLE = "functools.partial(torch.optim.SGD, lr=0.7, momentum=0.5, nesterov=True)"


def check_arguments(
    sync_every: Any,
    outer_optimizer: Any,
    fragments: Any,
    overlap_steps: Any,
    replica_group: Any,
    compressor: Any,
    error: type[Exception],
) -> None:
    """Refuse a bad schedule, outer optimizer, replica group or compressor in one line.

    The message names the argument, what is accepted and what was given. With ``sync_every="auto"`` the schedule is
    checked again when fitting starts (:func:`check_schedule`), once H is known.
    """
    check_replica_group(replica_group, error=error)
    if compressor is not None and not isinstance(compressor, Compressor):
        raise error(
            f"Expected `compressor` to be a lightning_gradcomp Compressor (e.g. MinMax(bits=8)) or None, got"
            f" {compressor!r}."
        )
    if compressor is not None and replica_group is not None:
        raise error(
            f"Expected `compressor=None` with `replica_group={replica_group!r}`: a compressed outer exchange between"
            f" replica groups is not supported, got compressor={compressor!r}."
        )
    if sync_every != AUTO:
        if isinstance(sync_every, str):
            raise error(f"Expected `sync_every` to be an integer >= 1 or 'auto', got {sync_every!r}.")
        check_int(sync_every, "sync_every", low=1, error=error)
    check_int(fragments, "fragments", low=1, error=error)
    check_int(overlap_steps, "overlap_steps", low=0, error=error)
    if sync_every != AUTO:
        check_schedule(sync_every, fragments, overlap_steps, error)
    if isinstance(outer_optimizer, Optimizer):
        raise error(
            "Expected `outer_optimizer` to be a callable that builds the optimizer from theta_global's tensors (e.g."
            f" {_OUTER_EXAMPLE}), got an optimizer instance, {type(outer_optimizer).__name__}, built over other"
            " tensors."
        )
    if outer_optimizer is not None and not callable(outer_optimizer):
        raise error(
            "Expected `outer_optimizer` to be a callable that takes the parameters and returns a"
            f" torch.optim.Optimizer (e.g. {_OUTER_EXAMPLE}), got {outer_optimizer!r}."
        )


def check_schedule(sync_every: int, fragments: int, overlap_steps: int, error: type[Exception]) -> None:
    """Refuse ``fragments`` that do not divide ``sync_every``, and an overlap longer than a period."""
    if sync_every % fragments:
        raise error(
            f"Expected `fragments` to be an integer >= 1 that divides `sync_every` ({sync_every}), got {fragments}."
        )
    check_int(overlap_steps, "overlap_steps", low=0, high=sync_every // fragments, error=error)


def check_merge(overlap_steps: int, merge: Any, mixing_factor: Any, error: type[Exception]) -> tuple[str, float]:
    """The overlap's merge and mixing factor, with the defaults filled in; refused where they would be ignored.

    Raises:
        error: If ``merge`` or ``mixing_factor`` is given without ``overlap_steps``, a
            ``mixing_factor`` with a merge other than ``"mix"``, or a value out of range.
    """
    if merge is not None:
        check_choice(merge, "merge", MERGES, error=error)
    if mixing_factor is not None:
        check_number(mixing_factor, "mixing_factor", low=0, high=1, high_open=True, error=error)
    if not overlap_steps and (merge is not None or mixing_factor is not None):
        given = "merge" if merge is not None else "mixing_factor"
        raise error(
            f"Expected `overlap_steps` >= 1 with `{given}`: without an overlapped exchange there is no local work to"
            f" merge, got overlap_steps=0 and {given}={merge if merge is not None else mixing_factor!r}."
        )
    resolved = merge or DEFAULT_MERGE
    if mixing_factor is not None and resolved != "mix":
        raise error(
            f"Expected `merge='mix'` with `mixing_factor`: it is Streaming DiLoCo's mixing factor, got"
            f" merge={resolved!r} and mixing_factor={mixing_factor!r}."
        )
    if resolved == "mix":
        return resolved, float(DEFAULT_MIXING_FACTOR if mixing_factor is None else mixing_factor)
    return resolved, 0.0


def outer_optimizer_of(
    value: Any, error: type[Exception]
) -> tuple[Callable[[Iterable[Tensor]], Optimizer] | None, str | None]:
    """``outer_optimizer`` as a callable of the parameters, and a note when a bare optimizer class was given.

    A bare ``torch.optim.SGD`` would get torch's default lr (0.001), with which the outer step barely moves
    theta_global; it is taken with DiLoCo's default outer settings instead, and the note says so. Another bare
    optimizer class is refused: no default lr of ours fits every optimizer.

    Raises:
        error: If ``value`` is a bare optimizer class other than SGD.
    """
    if inspect.isclass(value) and issubclass(value, torch.optim.SGD):
        settings = f"lr={OUTER_LR}, momentum={OUTER_MOMENTUM}, nesterov=True"
        note = (
            f"DiLoCo: outer_optimizer={value.__name__} is a bare class: built as {value.__name__}({settings})"
            " (DiLoCo's default outer settings; torch's default lr=0.001 would barely move theta_global); pass"
            f" functools.partial(torch.optim.{value.__name__}, lr=...) to choose."
        )
        return partial(value, lr=OUTER_LR, momentum=OUTER_MOMENTUM, nesterov=True), note
    if inspect.isclass(value) and issubclass(value, Optimizer):
        raise error(
            f"Expected `outer_optimizer` to be a callable with its settings, e.g."
            f" functools.partial(torch.optim.{value.__name__}, lr=...), got the bare class {value.__name__}: its"
            " default lr is not an outer step's."
        )
    return value, None


def check_fit(optimizers: int, params: int, fragments: int, error: type[Exception]) -> None:
    """Refuse, when fitting starts, more than one inner optimizer or fewer parameter tensors than ``fragments``."""
    if optimizers != 1:
        raise error(
            f"DiLoCo steps one inner optimizer; `configure_optimizers` returned {optimizers}: return one optimizer"
            " with a parameter group per part instead (e.g. torch.optim.AdamW([{'params': a}, {'params': b, 'lr':"
            " 0.01}]), or lightning_gradcomp.optim.MuonAdamW for Muon on the matrices and AdamW on the rest)."
        )
    if params < fragments:
        raise error(f"Expected `fragments` to be at most the model's {params} parameter tensors, got {fragments}.")
