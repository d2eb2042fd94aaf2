"""How an overlapped exchange's fragment keeps the local work done while it was in flight.

With ``DiLoCo(overlap_steps=tau)`` a fragment's pseudo-gradient is sent and the worker goes on with ``tau`` inner steps
before the averaged pseudo-gradient arrives and the outer step is applied. Two ways to merge what the fragment learned
in those steps with the new theta_global:

- **mix** (Streaming DiLoCo, Douillard et al. 2025, arXiv 2501.18512, its mixing factor ``alpha``; torchft's
  ``fragment_update_alpha``, MaxText's ``communication_overlapping_alpha``): the fragment becomes
  ``alpha * local + (1 - alpha) * theta_global``. ``alpha = 0`` replaces the local work by theta_global.
- **eager** (eager updates, Kale, Douillard and Donchev 2025, arXiv 2502.12996): as the exchange starts, the fragment
  is set to the outer step of an estimate of the average that is known at once, and trains from there; when the
  average arrives, the fragment is moved by the true outer step minus the estimate's, so that it ends at the new
  theta_global plus every inner step taken in flight. The estimate is the paper's eager outer gradient: this worker's
  fresh pseudo-gradient as its share (``1 / M`` of it) plus the other workers' shares from their previous exchange of
  this fragment (what the last average held beyond this worker's own share). The paper keeps a separate outer
  optimizer per worker, stepped with that estimate and never corrected; here theta_global and the outer optimizer
  stay the same on every rank (stepped with the true average when it arrives), and the estimate's step is taken on
  a copy, only to place the worker's fragment (our design, so that checkpoints and validation keep one model).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import Tensor
from torch.optim import Optimizer

__all__ = ["eager_estimate", "mix_into", "others_share", "tentative_step"]


def tentative_step(optimizer: Optimizer, params: Sequence[Tensor], grads: Sequence[Tensor]) -> list[Tensor]:
    """What ``optimizer.step()`` makes of ``params`` with ``grads`` as their ``.grad``, without changing anything.

    The parameters, their ``.grad`` and the optimizer's state are as they were afterwards; the result is new
    tensors. Only ``params`` move (the optimizer skips parameters without a gradient), so the copies are of them
    alone. Deterministic: the same inputs give the same bits, which a resume relies on.
    """
    saved = [p.detach().clone() for p in params]
    state = {p: copy.deepcopy(optimizer.state[p]) for p in params if p in optimizer.state}
    for p, g in zip(params, grads, strict=True):
        p.grad = g
    optimizer.step()
    moved = [p.detach().clone() for p in params]
    with torch.no_grad():
        for p, value in zip(params, saved, strict=True):
            p.copy_(value)
            p.grad = None
    for p in params:
        if p in state:
            optimizer.state[p] = state[p]
        else:
            optimizer.state.pop(p, None)
    return moved


def eager_estimate(contribution: Sequence[Tensor], others: Sequence[Tensor] | None, workers: int) -> list[Tensor]:
    """The eager outer gradient: this worker's share ``contribution / workers`` plus the others' previous shares."""
    own = [c / workers for c in contribution]
    if others is None:  # the fragment's first exchange: the others' previous shares are zero (arXiv 2502.12996)
        return own
    return [mine + theirs for mine, theirs in zip(own, others, strict=True)]


def others_share(average: Sequence[Tensor], contribution: Sequence[Tensor], workers: int) -> list[Tensor]:
    """What the average holds beyond this worker's own share: the other workers' pseudo-gradients over ``workers``.

    With a compressed exchange the average is of what was sent (after compression and error feedback), and this
    worker's share is taken as its uncompressed pseudo-gradient over ``workers``.
    """
    return [a - c / workers for a, c in zip(average, contribution, strict=True)]


def mix_into(local: Sequence[Tensor], global_: Sequence[Tensor], alpha: float) -> None:
    """Set ``local`` to ``alpha * local + (1 - alpha) * global_`` in place (``alpha = 0``: a copy, bit for bit)."""
    with torch.no_grad():
        for mine, theirs in zip(local, global_, strict=True):
            theirs = theirs.to(mine.device)
            if alpha == 0:
                mine.copy_(theirs)
            else:
                mine.lerp_(theirs, 1 - alpha)
