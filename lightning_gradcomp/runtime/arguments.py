"""The keyword checks both strategies share: what their ``**kwargs`` pass on to Lightning's ``DDPStrategy``.

Each strategy accepts DDPStrategy's own keywords (``timeout``, ``start_method``, ``process_group_backend``, ...) and
refuses, when it is built and in one line, a misspelt keyword (suggesting the closest valid name) or a value that
DDPStrategy would take and fail on later.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch.nn.parallel import DistributedDataParallel

from lightning_gradcomp.validation import check_choice, one_line

__all__ = [
    "START_METHODS",
    "STRATEGY_KWARGS",
    "check_strategy_kwargs",
    "unexpected_keyword",
    "unwrapped_strategy_kwargs",
]

#: every keyword DDPStrategy itself takes
STRATEGY_KWARGS = [n for n in inspect.signature(DDPStrategy.__init__).parameters if n not in ("self", "kwargs")]
#: Lightning's DDPStrategy(start_method=...): "popen" runs the script again per process, the others are
#: multiprocessing's start methods
START_METHODS = ("popen", "spawn", "fork", "forkserver")


def unexpected_keyword(strategy: str, name: str, valid: Sequence[str], accepted_by: str) -> MisconfigurationException:
    """The error for a keyword no class in ``accepted_by`` takes, with the closest name in ``valid`` suggested."""
    close = difflib.get_close_matches(name, list(valid), n=1, cutoff=0.6)
    hint = f" Did you mean `{close[0]}`?" if close else ""
    return MisconfigurationException(
        f"{strategy} got an unexpected keyword argument `{name}`: it is not an argument of {accepted_by}.{hint}"
    )


def check_strategy_kwargs(kwargs: dict[str, Any]) -> None:
    """Refuse values of DDPStrategy's keywords that DDPStrategy would accept and fail on once training starts."""
    timeout = kwargs.get("timeout")
    if timeout is not None and not isinstance(timeout, timedelta):
        raise MisconfigurationException(
            f"Expected `timeout` to be a datetime.timedelta (e.g. `timedelta(minutes=30)`) or None, got {timeout!r}."
        )
    if "start_method" in kwargs:
        check_choice(kwargs["start_method"], "start_method", START_METHODS, error=MisconfigurationException)
    backend = kwargs.get("process_group_backend")
    # any name: a package may register its backend with torch (Backend.register_backend) after the strategy is
    # built, as DDPStrategy allows; the name is checked against torch's list when the process group is created
    if backend is not None and not isinstance(backend, str):
        raise MisconfigurationException(
            f"Expected `process_group_backend` to be None or a backend name such as 'gloo' or 'nccl', got {backend!r}."
        )


#: DDPStrategy arguments that configure DDP's gradient all-reduce, which a strategy without the wrapper does not run
_REFUSED = ("ddp_comm_state", "ddp_comm_hook", "ddp_comm_wrapper", "model_averaging_period")
#: DistributedDataParallel's arguments and their defaults (what LightningCLI passes when a recipe sets none)
_DDP_DEFAULTS = {
    n: p.default
    for n, p in inspect.signature(DistributedDataParallel.__init__).parameters.items()
    if n not in ("self", "module", "device_ids")
}


def unwrapped_strategy_kwargs(label: str, own_arguments: Sequence[str], kwargs: dict[str, Any]) -> dict[str, Any]:
    """DDPStrategy's own arguments, checked; ``DistributedDataParallel``'s refused unless left at their defaults.

    ``label`` (e.g. DiLoCo) does not wrap the model in ``DistributedDataParallel``, so its arguments would have no
    effect. Left at their defaults they are dropped quietly: LightningCLI passes every argument it resolves, defaults
    included. ``own_arguments``: the strategy's own, for the closest name of a misspelt keyword.
    """
    own = {}
    for name, value in kwargs.items():
        if name in _REFUSED:
            if value is not None:
                raise MisconfigurationException(
                    f"{label} does not accept `{name}`: it runs no per-step gradient all-reduce to hook into."
                )
        elif name in _DDP_DEFAULTS:
            if value is not _DDP_DEFAULTS[name] and value != _DDP_DEFAULTS[name]:
                raise MisconfigurationException(
                    f"{label} does not accept `{name}`={one_line(value)}: it does not wrap the model in"
                    " DistributedDataParallel, whose arguments would have no effect."
                )
        elif name in STRATEGY_KWARGS:
            own[name] = value
        else:
            raise unexpected_keyword(label, name, [*own_arguments, *STRATEGY_KWARGS], f"{label} or DDPStrategy")
    check_strategy_kwargs(own)
    return own
