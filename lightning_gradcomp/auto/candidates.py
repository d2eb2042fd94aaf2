"""The candidates :class:`~lightning_gradcomp.callbacks.AutoCompression` chooses from, by name, and its checks."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_gradcomp.auto.timeline import DENSE, Link
from lightning_gradcomp.compressors import BF16, DGC, Compressor, Identity, PowerSGD, TopK, Zen
from lightning_gradcomp.validation import check_number

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


def check_candidates(candidates: object) -> dict[str, Compressor]:
    """``AutoCompression``'s ``candidates`` as a mapping from names to compressors, ``"dense"`` (``Identity``) first.

    Raises:
        MisconfigurationException: If ``candidates`` is neither a list of known names nor a mapping to compressors.
    """
    if candidates is None:
        candidates = DEFAULT_CANDIDATES
    if isinstance(candidates, Mapping):
        out = {}
        for name, c in candidates.items():
            if not isinstance(c, Compressor):
                raise MisconfigurationException(
                    f"Expected `candidates` to map names to compressors, got {name!r}: {c!r}."
                )
            out[str(name)] = c
    elif isinstance(candidates, Sequence) and not isinstance(candidates, str):
        unknown = [c for c in candidates if c not in KNOWN_CANDIDATES]
        if unknown:
            raise MisconfigurationException(
                f"Expected `candidates` to name known candidates ({', '.join(KNOWN_CANDIDATES)}) or map names to"
                f" compressors, got unknown {unknown}."
            )
        out = {name: KNOWN_CANDIDATES[name]() for name in candidates}
    else:
        raise MisconfigurationException(
            f"Expected `candidates` to be a list of names or a mapping, got {candidates!r}."
        )
    if DENSE not in out:
        out = {DENSE: Identity(), **out}
    elif not isinstance(out[DENSE], Identity):
        raise MisconfigurationException("`candidates['dense']` must be `Identity()` (plain all-reduce).")
    return {DENSE: out.pop(DENSE), **out}


def check_link(link: object) -> Link | None:
    """``AutoCompression``'s ``link``, ``(alpha seconds, beta bytes per second)``, as a :class:`Link` (or ``None``).

    Raises:
        MisconfigurationException: If ``link`` is not ``None`` or a pair with ``alpha >= 0`` and ``beta > 0``.
    """
    if link is None:
        return None
    error = MisconfigurationException
    if not (isinstance(link, Sequence) and len(link) == 2):
        raise error(f"Expected `link` to be None or (alpha seconds, beta bytes per second), got {link!r}.")
    check_number(link[0], "link[0] (alpha)", low=0, error=error)
    check_number(link[1], "link[1] (beta)", low=0, low_open=True, error=error)
    return Link(float(link[0]), float(link[1]))
