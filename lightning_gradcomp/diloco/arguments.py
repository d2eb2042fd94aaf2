"""The checks of :class:`~lightning_gradcomp.DiLoCo`'s arguments, and of what its ``**kwargs`` pass on to DDPStrategy.

Every bad value is refused when the strategy is built, in one line naming the argument, what is accepted and what
was given.
"""

from __future__ import annotations

import inspect
from typing import Any

from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch.nn.parallel import DistributedDataParallel

from lightning_gradcomp.compressors.base import Compressor
from lightning_gradcomp.diloco.replicas import check_replica_group
from lightning_gradcomp.runtime.arguments import STRATEGY_KWARGS, check_strategy_kwargs, unexpected_keyword
from lightning_gradcomp.validation import check_int, one_line

__all__ = ["check_arguments", "check_fit", "strategy_kwargs"]

_MiscError = MisconfigurationException
_OWN_ARGUMENTS = ("sync_every", "outer_optimizer", "fragments", "overlap_steps", "offload", "monitor", "replica_group")
#: DDPStrategy arguments that configure DDP's gradient all-reduce, which DiLoCo does not run
_REFUSED = ("ddp_comm_state", "ddp_comm_hook", "ddp_comm_wrapper", "model_averaging_period")
#: DistributedDataParallel's arguments and their defaults (what LightningCLI passes when a recipe sets none)
_DDP_DEFAULTS = {
    n: p.default
    for n, p in inspect.signature(DistributedDataParallel.__init__).parameters.items()
    if n not in ("self", "module", "device_ids")
}


def strategy_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """DDPStrategy's own arguments, checked; ``DistributedDataParallel``'s refused unless left at their defaults.

    DiLoCo does not wrap the model in ``DistributedDataParallel``, so its arguments would have no effect. Left at
    their defaults they are dropped quietly: LightningCLI passes every argument it resolves, defaults included.
    """
    own = {}
    for name, value in kwargs.items():
        if name in _REFUSED:
            if value is not None:
                raise MisconfigurationException(
                    f"DiLoCo does not accept `{name}`: it runs no per-step gradient all-reduce to hook into."
                )
        elif name in _DDP_DEFAULTS:
            if value is not _DDP_DEFAULTS[name] and value != _DDP_DEFAULTS[name]:
                raise MisconfigurationException(
                    f"DiLoCo does not accept `{name}`={one_line(value)}: it does not wrap the model in"
                    " DistributedDataParallel, whose arguments would have no effect."
                )
        elif name in STRATEGY_KWARGS:
            own[name] = value
        else:
            raise unexpected_keyword("DiLoCo", name, [*_OWN_ARGUMENTS, *STRATEGY_KWARGS], "DiLoCo or DDPStrategy")
    check_strategy_kwargs(own)
    return own


def check_arguments(
    sync_every: Any, outer_optimizer: Any, fragments: Any, overlap_steps: Any, replica_group: Any, compressor: Any
) -> None:
    """Refuse a bad schedule, outer optimizer, replica group or compressor in one line.

    The message names the argument, what is accepted and what was given.
    """
    check_replica_group(replica_group, error=_MiscError)
    if compressor is not None and not isinstance(compressor, Compressor):
        raise MisconfigurationException(
            f"Expected `compressor` to be a lightning_gradcomp Compressor (e.g. MinMax(bits=8)) or None, got"
            f" {compressor!r}."
        )
    if compressor is not None and replica_group is not None:
        raise MisconfigurationException(
            f"Expected `compressor=None` with `replica_group={replica_group!r}`: a compressed outer exchange between"
            f" replica groups is not supported, got compressor={compressor!r}."
        )
    check_int(sync_every, "sync_every", low=1, error=_MiscError)
    check_int(fragments, "fragments", low=1, error=_MiscError)
    if sync_every % fragments:
        raise MisconfigurationException(
            f"Expected `fragments` to be an integer >= 1 that divides `sync_every` ({sync_every}), got {fragments}."
        )
    check_int(overlap_steps, "overlap_steps", low=0, high=sync_every // fragments - 1, error=_MiscError)
    if outer_optimizer is not None and not callable(outer_optimizer):
        raise MisconfigurationException(
            "Expected `outer_optimizer` to be a callable that takes the parameters and returns a"
            f" torch.optim.Optimizer (e.g. functools.partial(torch.optim.SGD, lr=0.7)), got {outer_optimizer!r}."
        )


def check_fit(optimizers: int, params: int, fragments: int) -> None:
    """Refuse, when fitting starts, more than one inner optimizer or fewer parameter tensors than ``fragments``."""
    if optimizers != 1:
        raise MisconfigurationException(
            f"DiLoCo steps one inner optimizer; `configure_optimizers` returned {optimizers}."
        )
    if params < fragments:
        raise MisconfigurationException(
            f"Expected `fragments` to be at most the model's {params} parameter tensors, got {fragments}."
        )
