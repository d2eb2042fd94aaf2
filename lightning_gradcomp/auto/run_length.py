"""The run's length, for ``advise``: which DiLoCo rounds its recommendation may name.

``advise`` trains a recipe for a few steps only, so the trainer it measures knows nothing of the run's length; DiLoCo's
own preflight (:func:`~lightning_gradcomp.diloco.preflight.few_outer_steps`) warns when a round leaves fewer than
:data:`~lightning_gradcomp.diloco.defaults.MIN_OUTER_STEPS` outer steps. The rounds priced here are those the
preflight accepts for the recipe's length, so that pasting the recommendation never draws its warning.
"""

from __future__ import annotations

import math

from lightning_gradcomp.auto.periodic import SYNC_EVERY
from lightning_gradcomp.diloco.defaults import MIN_OUTER_STEPS, auto_sync_every
from lightning_gradcomp.diloco.preflight import few_outer_steps

__all__ = ["choices_note", "run_steps", "sync_every_choices"]


def run_steps(max_steps: int, max_epochs: int | None, batches_per_epoch: float, accumulate: int) -> float | None:
    """The optimizer steps of a run, as Lightning estimates them (``estimated_stepping_batches``); None if unknown.

    Args:
        max_steps: the Trainer's ``max_steps`` (-1: unbounded).
        max_epochs: the Trainer's ``max_epochs`` (None or -1: unbounded).
        batches_per_epoch: the training batches per epoch on one rank (``trainer.num_training_batches``).
        accumulate: ``accumulate_grad_batches``.
    """
    by_steps = math.inf if max_steps == -1 else float(max_steps)
    known = max_epochs not in (None, -1) and math.isfinite(batches_per_epoch)
    by_epochs = math.ceil(batches_per_epoch / accumulate) * max(int(max_epochs or 1), 1) if known else math.inf
    total = min(by_steps, by_epochs)
    return total if math.isfinite(total) and total > 0 else None


def sync_every_choices(total_steps: float | None) -> tuple[int, ...]:
    """The H values ``advise`` may recommend: :data:`SYNC_EVERY`'s that the preflight accepts, else ``"auto"``'s H.

    Args:
        total_steps: the run's optimizer steps (None: unknown, every H of :data:`SYNC_EVERY`).
    """
    if total_steps is None:
        return SYNC_EVERY
    accepted = tuple(h for h in SYNC_EVERY if few_outer_steps(total_steps, h, None) is None)
    return accepted or (auto_sync_every(total_steps),)


def choices_note(total_steps: float | None, choices: tuple[int, ...]) -> str:
    """The line that says why the recommendation is limited to ``choices``."""
    return (
        f"(H={' or '.join(map(str, choices))} only: this run's {int(total_steps or 0)} optimizer steps leave"
        f" {MIN_OUTER_STEPS} outer steps or more, as DiLoCo's preflight asks, only at H <="
        f" {max(int(total_steps or 0) // MIN_OUTER_STEPS, 1)}.)"
    )
