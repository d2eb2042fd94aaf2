"""Argument checks shared by every layer: one wording, one place, the exception type chosen by the caller.

A bad setting must fail before training starts, with a message that names the argument, what is accepted and
what was given (``Expected `ratio` to be a number in (0, 1], got 0.0.``). Compressors raise ``ValueError`` (they
are plain Python objects, usable without Lightning); the strategy and the callbacks pass Lightning's
``MisconfigurationException`` as ``error``. Booleans are never accepted as numbers, and NaN and infinities are
refused unless a check says otherwise: a NaN epsilon or clipping norm would train silently and wrongly.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from typing import Any, Literal, TypeVar, overload

__all__ = [
    "check_bool",
    "check_choice",
    "check_int",
    "check_momentum",
    "check_number",
    "check_positive_int",
    "check_ratio",
    "one_line",
]

T = TypeVar("T")
ErrorType = type[Exception]


def one_line(value: Any, limit: int = 200) -> str:
    """``repr(value)`` on one line (a tensor's or a module's repr spans several), cut after ``limit`` characters."""
    text = " ".join(repr(value).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _fail(error: ErrorType, name: str, accepted: str, value: Any) -> Exception:
    return error(f"Expected `{name}` to be {accepted}, got {one_line(value, limit=10_000)}.")


def _interval(low: float | None, high: float | None, low_open: bool, high_open: bool) -> str:
    if low is not None and high is not None:
        return f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    if low is not None:
        return f"{'>' if low_open else '>='} {low:g}"
    if high is not None:
        return f"{'<' if high_open else '<='} {high:g}"
    return ""


# ``allow_none=True`` is the one way to get ``None`` back: the overloads tell the type checker so
@overload
def check_number(
    value: Any,
    name: str,
    *,
    low: float | None = ...,
    high: float | None = ...,
    low_open: bool = ...,
    high_open: bool = ...,
    allow_none: Literal[False] = ...,
    allow_inf: bool = ...,
    error: ErrorType = ...,
) -> float: ...
@overload
def check_number(
    value: Any,
    name: str,
    *,
    low: float | None = ...,
    high: float | None = ...,
    low_open: bool = ...,
    high_open: bool = ...,
    allow_none: bool,
    allow_inf: bool = ...,
    error: ErrorType = ...,
) -> float | None: ...
def check_number(
    value: Any,
    name: str,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
    allow_none: bool = False,
    allow_inf: bool = False,
    error: ErrorType = ValueError,
) -> float | None:
    """A real number (not a bool, not NaN, finite unless ``allow_inf``) within the given bounds, as a float.

    Raises:
        error: If ``value`` is not such a number (``None`` passes when ``allow_none``).
    """
    if value is None and allow_none:
        return None
    kind = "a number" if allow_inf else "a finite number"
    bounds = _interval(low, high, low_open, high_open)
    accepted = f"{kind} {bounds}".strip() + (" or None" if allow_none else "")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _fail(error, name, accepted, value)
    number = float(value)
    if math.isnan(number) or (math.isinf(number) and not allow_inf):
        raise _fail(error, name, accepted, value)
    if low is not None and (number < low or (low_open and number == low)):
        raise _fail(error, name, accepted, value)
    if high is not None and (number > high or (high_open and number == high)):
        raise _fail(error, name, accepted, value)
    return number


@overload
def check_int(
    value: Any,
    name: str,
    *,
    low: int | None = ...,
    high: int | None = ...,
    allow_none: Literal[False] = ...,
    error: ErrorType = ...,
) -> int: ...
@overload
def check_int(
    value: Any, name: str, *, low: int | None = ..., high: int | None = ..., allow_none: bool, error: ErrorType = ...
) -> int | None: ...
def check_int(
    value: Any,
    name: str,
    *,
    low: int | None = None,
    high: int | None = None,
    allow_none: bool = False,
    error: ErrorType = ValueError,
) -> int | None:
    """An integer (not a bool) within ``[low, high]``.

    Raises:
        error: If ``value`` is not such an integer (``None`` passes when ``allow_none``).
    """
    if value is None and allow_none:
        return None
    accepted = f"an integer {_interval(low, high, False, False)}".strip() + (" or None" if allow_none else "")
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail(error, name, accepted, value)
    if (low is not None and value < low) or (high is not None and value > high):
        raise _fail(error, name, accepted, value)
    return value


@overload
def check_bool(value: Any, name: str, *, allow_none: Literal[False] = ..., error: ErrorType = ...) -> bool: ...
@overload
def check_bool(value: Any, name: str, *, allow_none: bool, error: ErrorType = ...) -> bool | None: ...
def check_bool(value: Any, name: str, *, allow_none: bool = False, error: ErrorType = ValueError) -> bool | None:
    """``True`` or ``False`` (``None`` too when ``allow_none``); truthy stand-ins such as ``1`` are refused.

    Raises:
        error: If ``value`` is not a bool.
    """
    if value is None and allow_none:
        return None
    if not isinstance(value, bool):
        raise _fail(error, name, "True or False" + (" or None" if allow_none else ""), value)
    return value


def check_choice(value: T, name: str, choices: Collection[Any], *, error: ErrorType = ValueError) -> T:
    """One of ``choices``.

    Raises:
        error: If ``value`` is not one of them.
    """
    if isinstance(value, bool) or value not in choices:
        raise _fail(error, name, "one of " + ", ".join(repr(c) for c in choices), value)
    return value


def check_ratio(value: Any, name: str = "ratio", *, error: ErrorType = ValueError) -> float:
    """A keep-ratio (fraction of elements kept) in (0, 1]."""
    return check_number(value, name, low=0.0, high=1.0, low_open=True, error=error)


def check_positive_int(value: Any, name: str, *, error: ErrorType = ValueError) -> int:
    """An integer >= 1."""
    return check_int(value, name, low=1, error=error)


def check_momentum(value: Any, name: str = "momentum", *, error: ErrorType = ValueError) -> float:
    """A momentum coefficient in [0, 1)."""
    return check_number(value, name, low=0.0, high=1.0, high_open=True, error=error)


def sgd_defaults(lr: Any, momentum: Any, dampening: Any, weight_decay: Any, nesterov: Any) -> dict[str, Any]:
    """``torch.optim.SGD``'s hyper-parameters, checked, as an optimizer's ``defaults`` dict.

    Raises:
        ValueError: naming the argument, what is accepted and what was given (as ``torch.optim.SGD`` would, earlier
            and for every argument).
    """
    check_number(lr, "lr", low=0.0)
    check_momentum(momentum)
    check_number(dampening, "dampening", low=0.0, high=1.0)
    check_number(weight_decay, "weight_decay", low=0.0)
    check_bool(nesterov, "nesterov")
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError(
            f"Expected `momentum` > 0 and `dampening` = 0 with `nesterov=True`, got momentum={momentum!r},"
            f" dampening={dampening!r}."
        )
    return {"lr": lr, "momentum": momentum, "dampening": dampening, "weight_decay": weight_decay, "nesterov": nesterov}


def check_strategy_state(
    strategy: Any, attribute: str, kind: type[T], who: object, wanted: str, *, error: ErrorType = ValueError
) -> T:
    """``strategy.<attribute>`` if it is a ``kind``: what a callback that reads a strategy's state needs.

    Raises:
        error: Naming ``who`` (the callback), the strategy it requires (``wanted``) and the one it got.
    """
    state = getattr(strategy, attribute, None)
    if not isinstance(state, kind):
        raise error(
            f"`{type(who).__name__}` requires `Trainer(strategy={wanted}(...))`, got `{type(strategy).__name__}`."
        )
    return state
