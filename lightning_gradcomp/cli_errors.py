"""A command-line value or key that ``lightning-gradcomp`` refuses, in one line naming the nearest accepted key.

jsonargparse reports a misspelt key (``--trainer.strategy.init_args.sync_evry 10``) with the subcommand's whole usage
and every type of the union it tried: about 60 lines, the key that was meant in none of them. The same typo in Python
gives one line with "Did you mean `sync_every`?" (:func:`~lightning_gradcomp.runtime.arguments.unexpected_keyword`).
:func:`short_parse_error` turns the parser's message into that line.
"""

from __future__ import annotations

import contextlib
import difflib
import importlib
import inspect
import re
from collections.abc import Iterator, Sequence
from typing import Any

from lightning.pytorch.strategies import DDPStrategy

from lightning_gradcomp.runtime.arguments import STRATEGY_KWARGS

__all__ = ["options_of", "raising_parse_errors", "short_parse_error"]

_NOT_ACCEPTED = re.compile(r"class_path '(?P<cls>[\w.]+)':\s*Option '(?P<name>\w+)' is not accepted")
_UNRECOGNIZED = re.compile(r"unrecognized arguments: (?P<args>.+)", re.I)


@contextlib.contextmanager
def raising_parse_errors(parser: Any) -> Iterator[None]:
    """While parsing, the parser and its subcommands' raise ``argparse.ArgumentError`` instead of printing usage."""
    parsers = [parser]
    action = getattr(parser, "_subcommands_action", None)
    if action is not None:
        parsers += list(action._name_parser_map.values())
    saved = [p.exit_on_error for p in parsers]
    for p in parsers:
        p.exit_on_error = False
    try:
        yield
    finally:
        for p, value in zip(parsers, saved, strict=True):
            p.exit_on_error = value


def short_parse_error(message: str, argv: Sequence[str], options: Sequence[str]) -> str:
    """The parser's ``message`` in one line: the key as given, what was wrong, and the nearest accepted key.

    Args:
        message: the parser's error message (many lines).
        argv: the command line it parsed (to name the key as the user typed it).
        options: the subcommand's accepted options (``--trainer.max_steps``, ...).
    """
    refused = _NOT_ACCEPTED.search(message)
    if refused is not None:
        name, cls = refused["name"], refused["cls"]
        given = next((a.split("=")[0] for a in argv if a.lstrip("-").split("=")[0].endswith(f".{name}")), name)
        close = difflib.get_close_matches(name, _arguments_of(cls), n=1, cutoff=0.6)
        hint = f" Did you mean `{close[0]}`?" if close else ""
        return f"{given}: {cls} has no argument `{name}`.{hint}"
    unrecognized = _UNRECOGNIZED.search(message)
    if unrecognized is not None:
        first = unrecognized["args"].split()[0].split("=")[0]
        close = difflib.get_close_matches(first, list(options), n=1, cutoff=0.6)
        hint = f" Did you mean `{close[0]}`?" if close else ""
        return f"{first}: not an option of this command.{hint}"
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    return lines[0] if len(lines) < 2 else f"{lines[0]} ... {lines[-1]}"


def _arguments_of(class_path: str) -> list[str]:
    """The keyword arguments ``class_path`` takes (a strategy's ``**kwargs`` add DDPStrategy's own)."""
    module, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
        parameters = inspect.signature(cls).parameters
    except (ImportError, AttributeError, ValueError, TypeError):
        return []
    names = [n for n, p in parameters.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
    takes_kwargs = any(p.kind == p.VAR_KEYWORD for p in parameters.values())
    if takes_kwargs and isinstance(cls, type) and issubclass(cls, DDPStrategy):
        names += STRATEGY_KWARGS
    return names


def options_of(parser: Any, subcommand: str | None) -> list[str]:
    """The long options a (sub)command's parser accepts."""
    action = getattr(parser, "_subcommands_action", None)
    if subcommand is not None and action is not None and subcommand in action._name_parser_map:
        parser = action._name_parser_map[subcommand]
    return [o for o in getattr(parser, "_option_string_actions", {}) if o.startswith("--")]
