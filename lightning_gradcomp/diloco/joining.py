"""The Lightning side of fault-tolerant DiLoCo: a replica group's job, its training state, its first step.

:class:`~lightning_gradcomp.diloco.elastic.ElasticRound` knows nothing of Lightning; this module tells it which job
it runs in (its ranks and rendezvous store, from the strategy's cluster environment), how to take and load the
group's Lightning training state for a heal (:mod:`lightning_gradcomp.ft.loops`), and runs the group's first
optimizer step, where it joins the run: a new run goes on with its step; a group that joins the others at their sync
heals there instead, and its own step, whose closure Lightning's loop still needs run, trains nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import Tensor
from torch.optim import Optimizer

from lightning_gradcomp.diloco.elastic import ElasticRound, Job
from lightning_gradcomp.diloco.replicas import averaging_in
from lightning_gradcomp.ft.config import TorchFT
from lightning_gradcomp.ft.loops import load_training_state, training_state

__all__ = ["bind", "check_fault_tolerance", "dense_step_across_groups", "joins_at_this_step"]


def check_fault_tolerance(fault_tolerance: Any, replica_group: Any) -> None:
    """Refuse, in one line, a ``fault_tolerance`` that is not a ``TorchFT``, or one beside ``replica_group``.

    With fault tolerance, the Lightning job is the replica group.
    """
    if fault_tolerance is None:
        return
    if not isinstance(fault_tolerance, TorchFT):
        raise MisconfigurationException(
            "Expected `fault_tolerance` to be lightning_gradcomp.TorchFT(lighthouse=..., replica_group_id=...) or"
            f" None, got {fault_tolerance!r}."
        )
    if replica_group is not None:
        raise MisconfigurationException(
            f"Expected `replica_group=None` with `fault_tolerance`: each Lightning job is one replica group (its"
            f" processes train with dense data parallelism inside it), got replica_group={replica_group!r}."
        )


def bind(round: ElasticRound, strategy: Any, trainer: pl.Trainer, group: Any) -> None:
    """Tell ``round`` its job and how to take and load the job's Lightning training state.

    ``group``: the job's process group, for the two levels (with several ranks).

    Raises:
        MisconfigurationException: If a compressor is set on a job of several processes (as two levels refuse it).
    """
    world_size = strategy.world_size if dist.is_available() and dist.is_initialized() else 1
    if world_size > 1 and round.exchange.compressor is not None:
        raise MisconfigurationException(
            f"Expected `compressor=None` with `fault_tolerance` on a job of {world_size} processes: a compressed outer"
            " exchange between replica groups of several processes is not supported (one process per job is)."
        )
    environment = strategy.cluster_environment
    store = (str(environment.main_address), int(environment.main_port))
    round.job = Job(strategy.global_rank, world_size, store, group if world_size > 1 else None)
    round.training_state = lambda: training_state(trainer)
    round.load_training_state = lambda state: load_training_state(trainer, state)


def joins_at_this_step(
    round: ElasticRound, closure: Callable[[], Any], optimizers: Sequence[Optimizer]
) -> bool:
    """At the group's first optimizer step, join the run; whether that took the place of this step.

    ``True`` when the group joined the others at their sync: it ran ``closure`` (its gradients are dropped), healed
    and took part in the sync; the caller must not step. ``False``: the step goes on as usual.
    """
    if round.joined or not round.join():
        return False
    closure()
    for optimizer in optimizers:
        optimizer.zero_grad(set_to_none=True)
    round.finish_join(optimizers)
    return True


def dense_step_across_groups(
    round: ElasticRound,
    optimizers: Sequence[Optimizer],
    optimizer: Optimizer,
    closure: Callable[[], Any],
    tensors: tuple[Sequence[Tensor], Sequence[Tensor]],
    scaled: bool,
    step: Callable[..., Any],
) -> Any:
    """A dense step with fault tolerance: the inner step on the mean gradient over the groups, if they commit.

    The forward and backward (averaged inside the group first), then the mean over the groups in this step's quorum
    and their vote (:meth:`ElasticRound.dense_step`); a discarded step leaves the weights as they were.

    Args:
        round: the group's round (an exchange in flight is applied first).
        optimizers: the inner optimizers.
        optimizer: the one stepping.
        closure: Lightning's closure (the forward and backward).
        tensors: the model's trained parameters and its buffers.
        scaled: a gradient scaler is in use (it skips a non-finite step itself, and must see it).
        step: the strategy's own optimizer step, given the closure.
    """
    params, buffers = tensors
    round.close(optimizers)
    if round.exchange.in_group is not None:
        closure = averaging_in(closure, params, buffers, round.exchange.in_group)
    output = closure()
    if not round.dense_step(params, buffers, finite_only=not scaled):
        optimizer.zero_grad(set_to_none=True)
        return None
    output = step(lambda: output)
    round.follow()
    return output
