"""The checks of :class:`~lightning_gradcomp.CompressedDDP`'s arguments, and of what its ``**kwargs`` pass on.

``CompressedDDP`` accepts whatever Lightning's ``DDPStrategy`` and torch's ``DistributedDataParallel`` accept, and
refuses, before training starts and in one line, what they would accept and then fail on deep inside DDP (a
misspelt keyword, a ``timeout`` that is not a ``timedelta``), and the communication-hook arguments it replaces.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch.distributed as dist
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch.nn.parallel import DistributedDataParallel

from lightning_gradcomp.compressors.base import Compressor
from lightning_gradcomp.runtime.arguments import STRATEGY_KWARGS, check_strategy_kwargs, unexpected_keyword
from lightning_gradcomp.validation import check_bool, check_number, one_line

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
#: DistributedDataParallel's keywords ``**kwargs`` may carry, besides DDPStrategy's own
_DDP_KWARGS = [
    n
    for n in inspect.signature(DistributedDataParallel.__init__).parameters
    if n != "self" and n not in _SET_BY_LIGHTNING
]
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
        if name not in STRATEGY_KWARGS and name not in _DDP_KWARGS:
            of = "CompressedDDP, DDPStrategy or DistributedDataParallel"
            raise unexpected_keyword("CompressedDDP", name, own + STRATEGY_KWARGS + _DDP_KWARGS, of)
    check_strategy_kwargs(kwargs)
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
