"""The candidates :class:`~lightning_gradcomp.callbacks.AutoCompression` chooses from, by name."""

from __future__ import annotations

from collections.abc import Callable

from lightning_gradcomp.compressors import BF16, DGC, Compressor, Identity, PowerSGD, TopK, Zen

#: the candidates by name, from the least lossy to the most (the planner prefers earlier ones at equal speed)
KNOWN_CANDIDATES: dict[str, Callable[[], Compressor]] = {
    "dense": lambda: Identity(),
    "bf16": lambda: BF16(),
    "powersgd-r8": lambda: PowerSGD(rank=8),
    "powersgd-r4": lambda: PowerSGD(rank=4),
    "powersgd-r2": lambda: PowerSGD(rank=2),
    "powersgd-r1": lambda: PowerSGD(rank=1),
    "topk-10%": lambda: TopK(ratio=0.1),
    "topk-1%": lambda: TopK(ratio=0.01),
    "dgc-1%": lambda: DGC(ratio=0.01),
    "zen": lambda: Zen(),
}
DEFAULT_CANDIDATES = ("dense", "bf16", "powersgd-r4", "powersgd-r1", "topk-10%", "topk-1%", "zen")
