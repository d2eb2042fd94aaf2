"""Lightning's per-step SIGTERM broadcast, run only at the steps a decision names (``DiLoCo(sigterm_check="sync")``).

Lightning's training loop broadcasts rank 0's SIGTERM flag on the default group before every batch. The broadcast is
one element, but on a slow link it costs a round trip per step, and while a streamed fragment is on the wire it waits
in the link's queue behind it. DiLoCo runs it once a sync period instead: the decision reads the phase in the round,
the same on every rank, so every rank broadcasts at the same steps.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl

__all__ = ["SigtermGate"]

_BROADCAST = "_broadcast_sigterm_tensor"


class SigtermGate:
    """Gates one trainer's SIGTERM broadcast by ``due`` (called before every batch) until :meth:`remove`."""

    def __init__(self) -> None:
        self._loop: Any = None  # the training loop whose broadcast is gated

    def install(self, trainer: pl.Trainer, due: Callable[[], bool]) -> None:
        """Run ``trainer``'s broadcast only before the batches where ``due()`` is true.

        An instance attribute on the trainer's loop, so that other trainers keep theirs; a Lightning without the
        per-step broadcast has nothing to gate.
        """
        loop = trainer.fit_loop.epoch_loop
        broadcast = getattr(type(loop), _BROADCAST, None)
        if broadcast is None:
            return

        def gated() -> None:
            if due():
                broadcast(loop)

        loop.__dict__[_BROADCAST] = gated
        self._loop = loop

    def remove(self) -> None:
        """Give the loop its per-step broadcast back."""
        if self._loop is not None:
            self._loop.__dict__.pop(_BROADCAST, None)
            self._loop = None
