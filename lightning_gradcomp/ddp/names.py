"""The names ``Trainer(strategy="compressed_ddp")`` and its presets resolve through Lightning's ``StrategyRegistry``.

Lightning calls ``register_strategies`` only for its own strategies, so ``import lightning_gradcomp`` registers these
(it must come before ``Trainer(...)``). A name already registered, a user's own entry for instance, is kept: nothing
here overrides.

A preset is :class:`~lightning_gradcomp.CompressedDDP` with frozen arguments, as Lightning's
``ddp_find_unused_parameters_true`` is ``DDPStrategy`` with ``find_unused_parameters=True``. Its compressor is built
afresh for each ``Trainer``: a compressor holds state (PowerSGD's warm-start factors) that two trainers must not share.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from lightning.fabric.strategies.registry import _StrategyRegistry

from lightning_gradcomp.compressors.base import Compressor
from lightning_gradcomp.compressors.cast import BF16, FP16
from lightning_gradcomp.compressors.powersgd import PowerSGD

#: name -> (the compressor, built for each Trainer, or "auto"; the other frozen arguments; one line for the registry)
PRESETS: dict[str, tuple[Callable[[], Compressor] | str | None, dict[str, Any], str]] = {
    "compressed_ddp": (None, {}, "CompressedDDP (plain DDP averaging until a compressor is set)"),
    "compressed_ddp_spawn": (None, {"start_method": "spawn"}, "CompressedDDP with `start_method` 'spawn'"),
    "compressed_ddp_powersgd": (functools.partial(PowerSGD, rank=2), {}, "CompressedDDP(compressor=PowerSGD(rank=2))"),
    "compressed_ddp_fp16": (FP16, {}, "CompressedDDP(compressor=FP16())"),
    "compressed_ddp_bf16": (BF16, {}, "CompressedDDP(compressor=BF16())"),
    "compressed_ddp_auto": ("auto", {}, "CompressedDDP(compressor='auto'): AutoCompression with its defaults"),
}


def _build(strategy_class: type, make_compressor: Callable[[], Compressor] | str | None, **init_params: Any) -> Any:
    compressor = make_compressor() if callable(make_compressor) else make_compressor
    return strategy_class(compressor=compressor, **init_params)


def register_presets(strategy_class: type, registry: _StrategyRegistry) -> list[str]:
    """Register every free name of :data:`PRESETS` for ``strategy_class``; return the names registered."""
    registered = []
    for name, (compressor, init_params, description) in PRESETS.items():
        if name in registry:
            continue
        if compressor is None:
            registry.register(name, strategy_class, description=description, **init_params)
        else:
            factory = functools.partial(_build, strategy_class, compressor)
            registry.register(name, factory, description=description, **init_params)
        registered.append(name)
    return registered
