"""The checks of :class:`~lightning_gradcomp.CompressedDDP`'s arguments, and of what its ``**kwargs`` pass on.

``CompressedDDP`` accepts whatever Lightning's ``DDPStrategy`` and torch's ``DistributedDataParallel`` accept, and
refuses, before training starts and in one line, what they would accept and then fail on deep inside DDP (a
misspelt keyword, a ``timeout`` that is not a ``timedelta``), and the communication-hook arguments it replaces.
"""

from __future__ import annotations

import difflib
import inspect
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch.nn.parallel import DistributedDataParallel

from lightning_gradcomp.compressors.base import Compressor
from lightning_gradcomp.validation import check_bool, check_choice, check_number, one_line

#: the communication-hook arguments of DDPStrategy that CompressedDDP replaces, and why
REFUSED = {
    "ddp_comm_hook": "CompressedDDP registers its own communication hook; pass `compressor=` instead",
    "ddp_comm_state": "the hook's state is built from `compressor=`, `error_feedback=` and `seed=`",
    "ddp_comm_wrapper": "compose by choosing a compressor (e.g. FP16, BF16) instead of wrapping a hook",
    "model_averaging_period": "post-local SGD model averaging needs torch's PostLocalSGDState hook, which"
    " CompressedDDP replaces",
}
#: set by Lightning itself when it wraps the model, so not accepted from the user
_SET_BY_LIGHTNING = {
    "module": "Lightning wraps the LightningModule itself",
    "device_ids": "Lightning sets it from `Trainer(devices=...)`",
}
#: DistributedDataParallel's arguments that register a communication hook of their own (DDP takes one hook only),
#: refused unless ``None``
CONFLICTING_DDP_KWARGS = {
    "mixed_precision": "DDP's native mixed precision registers a communication hook of its own, and DDP takes one"
    " hook only; use `Trainer(precision='bf16-mixed')`, or a cast compressor (`BF16()`, `FP16()`) to send 16-bit"
    " gradients",
}
#: every keyword ``**kwargs`` may carry: DDPStrategy's own, then DistributedDataParallel's
_STRATEGY_KWARGS = [n for n in inspect.signature(DDPStrategy.__init__).parameters if n not in ("self", "kwargs")]
_DDP_KWARGS = [
    n for n in inspect.signature(DistributedDataParallel.__init__).parameters
    if n != "self" and n not in _SET_BY_LIGHTNING
]  # fmt: skip
#: Lightning's DDPStrategy(start_method=...): "popen" runs the script again per process, the others are
#: multiprocessing's start methods
_START_METHODS = ("popen", "spawn", "fork", "forkserver")
#: ``compressor="auto"``: :class:`~lightning_gradcomp.callbacks.AutoCompression` with its defaults
AUTO = "auto"
_Error = MisconfigurationException


def check_refused(arguments: dict[str, Any]) -> None:
    """Refuse the communication-hook arguments CompressedDDP replaces (any that is not ``None``)."""
    for name, value in arguments.items():
        if value is not None:
            raise MisconfigurationException(f"CompressedDDP does not accept `{name}`: {REFUSED[name]}.")


def check_kwargs(kwargs: dict[str, Any], own: list[str]) -> None:
    """Refuse keywords that neither DDPStrategy nor DistributedDataParallel accept (a misspelling) and bad values.

    Without this a misspelt ``compresor=`` lands in DDP's keyword arguments and fails, if at all, deep inside DDP
    with an unrelated message once training starts.
    """
    for name in kwargs:
        if name in _SET_BY_LIGHTNING:
            raise MisconfigurationException(f"CompressedDDP does not accept `{name}`: {_SET_BY_LIGHTNING[name]}.")
        if name in CONFLICTING_DDP_KWARGS and kwargs[name] is not None:
            raise MisconfigurationException(
                f"CompressedDDP does not accept `{name}`={one_line(kwargs[name])}: {CONFLICTING_DDP_KWARGS[name]}."
            )
        if name not in _STRATEGY_KWARGS and name not in _DDP_KWARGS:
            valid = own + _STRATEGY_KWARGS + _DDP_KWARGS
            close = difflib.get_close_matches(name, valid, n=1, cutoff=0.6)
            hint = f" Did you mean `{close[0]}`?" if close else ""
            raise MisconfigurationException(
                f"CompressedDDP got an unexpected keyword argument `{name}`: it is not an argument of CompressedDDP,"
                f" DDPStrategy or DistributedDataParallel.{hint}"
            )
    if "timeout" in kwargs and kwargs["timeout"] is not None and not isinstance(kwargs["timeout"], timedelta):
        raise MisconfigurationException(
            f"Expected `timeout` to be a datetime.timedelta (e.g. `timedelta(minutes=30)`) or None,"
            f" got {kwargs['timeout']!r}."
        )
    if "start_method" in kwargs:
        check_choice(kwargs["start_method"], "start_method", _START_METHODS, error=_Error)
    backend = kwargs.get("process_group_backend")
    # any name: a package may register its backend with torch (Backend.register_backend) after this strategy is
    # built, as DDPStrategy allows; the name is checked against torch's list when the process group is created
    if backend is not None and not isinstance(backend, str):
        raise MisconfigurationException(
            f"Expected `process_group_backend` to be None or a backend name such as 'gloo' or 'nccl', got {backend!r}."
        )
    if "bucket_cap_mb" in kwargs:
        check_number(kwargs["bucket_cap_mb"], "bucket_cap_mb", low=0, low_open=True, allow_none=True, error=_Error)
    for name in ("static_graph", "gradient_as_bucket_view", "find_unused_parameters", "broadcast_buffers"):
        if name in kwargs:
            check_bool(kwargs[name], name, allow_none=True, error=_Error)  # None: DDP decides (broadcast_buffers)


def check_backend(backend: str | None) -> None:
    """Refuse a process-group backend torch does not know, now (third-party ones registered by now included).

    ``backend`` is one name (``"gloo"``) or torch's per-device list (``"cpu:gloo,cuda:nccl"``).
    """
    if backend is None:
        return
    known = list(dist.Backend.backend_list)
    names = [part.split(":")[-1].strip().lower() for part in backend.split(",")]
    unknown = [name for name in names if name not in known]
    if unknown:
        raise MisconfigurationException(
            f"Expected `process_group_backend` to be one of the backends torch knows here ({', '.join(known)};"
            f" a package adds its own with torch.distributed.Backend.register_backend), or a per-device list such"
            f" as 'cpu:gloo,cuda:nccl', got {backend!r}."
        )


def check_compressor(compressor: Any, *, allow_auto: bool = False) -> Compressor | str | None:
    """A compressor instance (or ``None`` and ``"auto"``, the constructor's, where ``allow_auto``).

    Raises:
        MisconfigurationException: naming what is accepted and what was given; a string names ``"auto"`` and the
            ``AutoCompression`` callback.
    """
    if isinstance(compressor, Compressor) or (allow_auto and (compressor is None or compressor == AUTO)):
        return compressor
    if isinstance(compressor, str) and allow_auto:
        raise MisconfigurationException(
            f"Expected `compressor` to be a compressor instance (e.g. `PowerSGD(rank=2)`) or 'auto' (the"
            f" `AutoCompression` callback with its defaults; pass `callbacks=[AutoCompression(...)]` to choose its"
            f" settings), got {compressor!r}."
        )
    raise MisconfigurationException(
        "`compressor` must be a lightning_gradcomp compressor (an instance of"
        " `lightning_gradcomp.Compressor`, e.g. `PowerSGD(rank=2)` or `TopK(ratio=0.01)`),"
        f" got {compressor!r} of type {type(compressor).__name__}."
    )
