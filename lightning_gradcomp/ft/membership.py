"""Who belongs in a run: the settings every replica group must share, compared when the members change.

A group built with another model, schedule, compressor or package version must never average into the others'
theta_global (torchft itself compares nothing but the step). When the quorum's members change, every member
all-gathers one row of integers: its place in the schedule (:class:`Member`) and a :class:`Fingerprint` of the
settings; a group whose settings differ from the others' is refused with one line naming the difference.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["Fingerprint", "Member"]


def _code(value: str | int) -> int:
    """An int as itself; a string as a 62-bit checksum (two CRC32s: collisions need more than luck)."""
    if isinstance(value, int):
        return value
    data = value.encode()
    return (zlib.crc32(data) << 30) ^ zlib.crc32(data[::-1])


@dataclass(frozen=True)
class Fingerprint:
    """The settings a group must share with the others, each with the words that name it in an error.

    Attributes:
        fields: ``(what, value)`` pairs, e.g. ``("sync_every", 500)`` or ``("model (parameter names, shapes and
            dtypes)", "...")``; integers are compared and shown as they are, strings by a checksum.
    """

    fields: tuple[tuple[str, str | int], ...]

    def codes(self) -> list[int]:
        """The fields as integers, in order."""
        return [_code(value) for _, value in self.fields]

    def difference(self, theirs: Sequence[int]) -> str | None:
        """The first field in which ``theirs`` (another member's :meth:`codes`) differs, in words; ``None`` if none."""
        for (what, value), mine, other in zip(self.fields, self.codes(), theirs, strict=True):
            if mine != other:
                shown = f"{value} here, {other} there" if isinstance(value, int) else f"{_short(value)} here"
                return f"another {what} ({shown})"
        return None


def _short(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass(frozen=True)
class Member:
    """One member's place in the schedule, as it enters a quorum.

    Attributes:
        place: where it is in its schedule, as an integer the caller gives meaning to (``None``: at no place yet,
            starting).
        contributes: whether its contribution counts in the average.
        step: torchft's step as it asked for the quorum (before a heal).
        veteran: it was in an earlier quorum of this lighthouse.
        name: the group's name when it is an integer (``REPLICA_GROUP_ID=3``), else -1: what the logs call it.
    """

    place: int | None
    contributes: bool
    step: int
    veteran: bool = False
    name: int = -1

    def row(self, fingerprint: Fingerprint) -> Tensor:
        """The row it all-gathers: its place, then the fingerprint's codes."""
        where = [int(self.place is not None), self.place or 0]
        values = [*where, int(self.contributes), self.step, int(self.veteran), self.name]
        return torch.tensor([*values, *fingerprint.codes()], dtype=torch.int64)

    @staticmethod
    def of(row: Tensor) -> tuple[Member, list[int]]:
        """A gathered row back as a :class:`Member` and its fingerprint's codes."""
        values = [int(v) for v in row.tolist()]
        place = values[1] if values[0] else None
        return Member(place, bool(values[2]), values[3], bool(values[4]), values[5]), values[6:]
