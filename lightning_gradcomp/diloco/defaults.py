"""DiLoCo's defaults, in one place: the outer optimizer, the round length ``"auto"``, the overlap's merge.

The values were chosen by measurement on the language task (``benchmarks/diloco.py convergence``: tuned on seeds 0-2,
reported on seeds 3-5 and a second model shape; docs/diloco.md, "Arguments", gives what the papers specify beside
each). The papers' own values are kept here too, named, for the documentation and for the presets.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from functools import partial

import torch
from torch import Tensor
from torch.optim import Optimizer

__all__ = [
    "AUTO",
    "AUTO_MAX_SYNC_EVERY",
    "AUTO_OUTER_STEPS",
    "DEFAULT_MERGE",
    "DEFAULT_MIXING_FACTOR",
    "MERGES",
    "MIN_OUTER_STEPS",
    "OUTER_LR",
    "OUTER_MOMENTUM",
    "PAPER_OUTER_LR",
    "PAPER_OUTER_MOMENTUM",
    "auto_sync_every",
    "default_outer_optimizer",
    "paper_outer_optimizer",
]

#: ``sync_every="auto"``: H from the run's length (:func:`auto_sync_every`)
AUTO = "auto"
#: the outer steps ``"auto"`` aims for in a run (H = the run's optimizer steps over this, rounded)
AUTO_OUTER_STEPS = 60
#: ``"auto"`` never makes the round longer than the paper's H
AUTO_MAX_SYNC_EVERY = 500
#: fewer outer steps than this in a run is warned about when fitting starts (measured: 12 outer steps ended 12 to 13 %
#: above plain DDP, 60 about 4 %, on the language task's held-apart seeds)
MIN_OUTER_STEPS = 20

#: the default outer optimizer: Nesterov SGD, lr 0.5, momentum 0.5 (a constant pseudo-gradient is applied once per
#: outer step at steady state, lr / (1 - momentum) = 1; measured, it never diverged where the paper's 0.7 and 0.9,
#: and even plain averaging, did on some seeds)
OUTER_LR = 0.5
OUTER_MOMENTUM = 0.5
#: DiLoCo's (arXiv 2311.08105, section 3): Nesterov SGD, lr 0.7, momentum 0.9, tuned for H = 500
PAPER_OUTER_LR, PAPER_OUTER_MOMENTUM = 0.7, 0.9

#: how a fragment's local work is merged when its overlapped exchange completes (``DiLoCo(merge=...)``); measured at
#: H = 50, 5 fragments, 5 steps of overlap: mixing factor 0.5 ended 0.2 % above the blocking exchange, eager updates
#: 1.8 %, mixing factor 0 diverged on one seed of three
MERGES = ("mix", "eager")
DEFAULT_MERGE = "mix"
#: Streaming DiLoCo's mixing factor with ``merge="mix"`` (arXiv 2501.18512; torchft's ``fragment_update_alpha``)
DEFAULT_MIXING_FACTOR = 0.5


def default_outer_optimizer(params: Iterable[Tensor]) -> Optimizer:
    """The default outer optimizer: Nesterov SGD with :data:`OUTER_LR` and :data:`OUTER_MOMENTUM` (measured)."""
    if OUTER_MOMENTUM:
        return torch.optim.SGD(params, lr=OUTER_LR, momentum=OUTER_MOMENTUM, nesterov=True)
    return torch.optim.SGD(params, lr=OUTER_LR)


def paper_outer_optimizer() -> partial[torch.optim.SGD]:
    """DiLoCo's outer optimizer as the paper gives it (Nesterov SGD, lr 0.7, momentum 0.9), for ``outer_optimizer=``."""
    return partial(torch.optim.SGD, lr=PAPER_OUTER_LR, momentum=PAPER_OUTER_MOMENTUM, nesterov=True)


def auto_sync_every(total_steps: float, fragments: int = 1, overlap_steps: int = 0) -> int:
    """``sync_every="auto"``: about :data:`AUTO_OUTER_STEPS` outer steps over the run, at most the paper's 500.

    ``total_steps`` is the run's optimizer steps (``trainer.estimated_stepping_batches``; infinite for a run bounded
    by neither steps nor epochs, which gets the longest round). The result is a multiple of ``fragments`` whose
    period (``H / fragments``) is at least ``overlap_steps``.
    """
    if math.isinf(total_steps):
        h = AUTO_MAX_SYNC_EVERY
    else:
        h = min(max(round(total_steps / AUTO_OUTER_STEPS), 1), AUTO_MAX_SYNC_EVERY)
    period = max(math.ceil(h / fragments), overlap_steps, 1)
    return period * fragments
