"""What DiLoCo says when fitting starts about a run that will not train as DDP would: one line each, naming the fix.

:class:`~lightning_gradcomp.DiLoCo` refuses bad values when it is built (:mod:`~lightning_gradcomp.diloco.arguments`);
what depends on the Trainer (the run's length, the number of processes) or on the outer optimizer it builds is only
known in ``setup``, before the first step. These functions make those lines; the strategy logs them on rank 0.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch.optim import Optimizer

from lightning_gradcomp.diloco.defaults import MIN_OUTER_STEPS

__all__ = ["describe_optimizer", "few_outer_steps", "low_outer_lr", "one_worker", "stale_weights"]

#: below this, an outer SGD's lr barely moves theta_global (the outer step is lr times the averaged pseudo-gradient)
_LOW_OUTER_LR = 0.05


def describe_optimizer(optimizer: Optimizer) -> str:
    """The outer optimizer as its constructor call, with the settings that shape the step (``SGD(lr=1.0)``)."""
    group = optimizer.param_groups[0] if optimizer.param_groups else {}
    shown = []
    for key in ("lr", "momentum", "nesterov", "betas", "weight_decay"):
        value = group.get(key)
        if value is None or (key in ("momentum", "weight_decay") and not value) or (key == "nesterov" and not value):
            continue
        shown.append(f"{key}={value:g}" if isinstance(value, float) else f"{key}={value}")
    return f"{type(optimizer).__name__}({', '.join(shown)})"


def few_outer_steps(
    total_steps: float, sync_every: int, auto: int | None, callbacks: Sequence[object] = ()
) -> str | None:
    """A warning when the run has fewer than :data:`MIN_OUTER_STEPS` outer steps, else ``None``.

    ``total_steps``: the run's optimizer steps (infinite when bounded by neither steps nor epochs: no warning);
    ``auto``: what ``sync_every="auto"`` would pick for this run (the fix to name); ``callbacks``: the trainer's
    (a ``DenseWarmup`` among them: the warning does not suggest adding one).
    """
    if math.isinf(total_steps) or total_steps <= 0 or sync_every == 1:  # H = 1: no shorter round gives more
        return None
    steps = int(total_steps)
    rounds = steps // sync_every
    if rounds >= MIN_OUTER_STEPS:
        return None
    longest = max(steps // MIN_OUTER_STEPS, 1)
    partial = " and a partial one at the end" if steps % sync_every else ""
    fix = f"sync_every='auto' (H={auto} here)" if auto is not None and auto < sync_every else f"sync_every={longest}"
    until = "validation and checkpoints hold the starting weights until the end; " if not rounds else ""
    return (
        f"DiLoCo: sync_every={sync_every} gives {rounds} outer step{'' if rounds == 1 else 's'}{partial} in this"
        f" run's {steps} optimizer steps (fewer than {MIN_OUTER_STEPS}): {until}few outer steps end far above plain"
        f" DDP's loss (measured: 12 ended 12 to 13 % above it, 60 about 4 %); use {fix}"
        + ("." if _has_dense_warmup(callbacks) else ", or start dense with DenseWarmup.")
    )


def _has_dense_warmup(callbacks: Sequence[object]) -> bool:
    # by name, a subclass's too: the callbacks sit a layer above the strategies and import them
    return any(k.__name__ == "DenseWarmup" for callback in callbacks for k in type(callback).__mro__)


def one_worker(replicas: int) -> str | None:
    """A warning when there is one replica: nothing is averaged, the outer step is on one worker's own progress."""
    if replicas > 1:
        return None
    return (
        "DiLoCo: 1 replica (one process, or one replica group of every rank): nothing is averaged, the outer optimizer"
        " steps on this worker's own pseudo-gradient; for data parallelism set `devices` or `num_nodes` to 2 or more"
        " (or train with strategy='auto')."
    )


def low_outer_lr(optimizer: Optimizer) -> str | None:
    """A warning when an outer SGD's lr is too small to move theta_global (torch's default lr is 0.001)."""
    if not isinstance(optimizer, torch.optim.SGD) or not optimizer.param_groups:
        return None
    lr = float(optimizer.param_groups[0]["lr"])
    if lr >= _LOW_OUTER_LR:
        return None
    return (
        f"DiLoCo: the outer optimizer's lr is {lr:g}: the outer step moves theta_global by lr times the averaged"
        f" pseudo-gradient, so it barely trains; DiLoCo's outer lr is 0.5 to 1 (e.g."
        " outer_optimizer=functools.partial(torch.optim.SGD, lr=1.0))."
    )


def stale_weights(steps_since_sync: int, in_flight: bool, checkpoint: bool) -> str | None:
    """A note that validation runs on theta_global of the last sync, not on the workers' steps since; else ``None``.

    ``checkpoint``: the weights are a checkpoint's (``validate``/``test`` with ``ckpt_path``), not the running fit's.
    """
    if not steps_since_sync and not in_flight:
        return None
    flight = " and an exchange in flight" if in_flight else ""
    if checkpoint:
        return (
            f"DiLoCo: this checkpoint was saved {steps_since_sync} inner steps into a round{flight}: its weights are"
            " theta_global of the last sync, without those steps; resume `fit` from it to continue the round."
        )
    return (
        f"DiLoCo: validation runs on theta_global of the last sync ({steps_since_sync} inner steps ago{flight}); the"
        " workers' progress since is in the next outer step."
    )


def same_data(averaged: Sequence[torch.Tensor], pending: Any, part: Any) -> str | None:
    """A warning when the first sync's average equals this worker's own pseudo-gradient over several contributors.

    Then every worker trained on the same batches, and DiLoCo's average is one worker's training at several times
    the cost: a fault-tolerant group whose data is not split, ``use_distributed_sampler=False`` or an
    ``IterableDataset`` read the same way everywhere. A pseudo-gradient of zeros (nothing trained) says nothing.
    """
    own = pending.contribution
    if part.contributors < 2 or not part.contributes or not any(bool(t.abs().sum() > 0) for t in own):
        return None
    if not all(torch.allclose(a, o, rtol=1e-5, atol=0.0) for a, o in zip(averaged, own, strict=True)):
        return None
    return (
        f"DiLoCo: the {part.contributors} workers' first pseudo-gradients are identical: they trained on the same"
        " batches, and their average is one worker's training at several times the cost. Give each its own part of"
        " the data (Lightning's sampler does unless `use_distributed_sampler=False`; an IterableDataset is split by"
        " hand; fault-tolerant groups: an integer REPLICA_GROUP_ID below `TorchFT(num_groups=...)`)."
    )
