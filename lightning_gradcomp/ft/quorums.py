"""A replica group's quorums: torchft's session, asked at every sync, and the check of who is in each quorum.

torchft's lighthouse decides which groups take part in a step, and its manager compares nothing but their steps. Each
quorum here is the group's :class:`Sync`: whether it contributes, over how many the mean is taken, and at which place
of the schedule the groups at the highest step are (an integer the caller gives meaning to). When the members change,
every member all-gathers its place and its settings (:mod:`lightning_gradcomp.ft.membership`), and a group whose
settings differ from the run's is refused in one line before it averages anything.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lightning_gradcomp.ft.config import TorchFT
from lightning_gradcomp.ft.membership import Fingerprint, Member

if TYPE_CHECKING:
    from lightning_gradcomp.ft.session import Quorum, Session

__all__ = ["MembershipError", "Quorums", "Sync"]

_START_POLL_S = 0.2  # how often a group asks again for a first quorum with more groups in it


class MembershipError(RuntimeError):
    """This replica group does not belong in the run it joined (its settings differ), or would reset it."""


@dataclass
class Sync:
    """The quorum of one sync, as this group acts on it.

    Attributes:
        quorum: torchft's answer.
        place: where the members at the highest step are (``None``: at no place: everyone is starting).
        contributes: whether this group's pseudo-gradient counts in the average.
        contributors: how many count (the mean's divisor); members: the quorum's groups (the collectives' size).
        top_step: the highest torchft step in the quorum.
        new_in_a_used_lighthouse: the lighthouse formed quorums before this one, and no member was in them.
        failed: why this sync cannot commit here (``""``: it can).
        skip: no member runs the exchange (every member saw the same reason not to): nothing waits for a peer.
        changed: the members changed at this quorum (they compared their settings and places).
        names: the members' integer names (-1 for a name that is not one), when they changed.
    """

    quorum: Quorum
    place: int | None
    contributes: bool
    contributors: int
    members: int
    top_step: int = 0
    new_in_a_used_lighthouse: bool = False
    failed: str = ""
    skip: bool = False
    changed: bool = False
    names: tuple[int, ...] = ()


class Quorums:
    """The quorums one replica group asks for, through its torchft session.

    Args:
        config: the run's :class:`~lightning_gradcomp.ft.TorchFT` settings.
        info: how the one-line reports are logged.

    Attributes:
        session: torchft's manager for this rank (set by the round's ``attach``).
        fingerprint: the settings every group of the run must share.
    """

    def __init__(self, config: TorchFT, info: Callable[[str], Any]) -> None:
        self.config, self.info = config, info
        self.session: Session | None = None
        self.fingerprint = Fingerprint(())
        self._first_quorum: int | None = None  # the id of the first quorum this group was in
        self._waiting_logged = False

    def session_of(self) -> Session:
        """The session (after the round's ``attach``)."""
        if self.session is None:
            raise RuntimeError("The session must be started before the first quorum.")
        return self.session

    def enter(self, place: int | None) -> Sync:
        """Ask for the quorum; when its members changed, compare settings and places with every member.

        ``place``: where this group is (``None``: starting, at no place).

        Raises:
            MembershipError: If this group's settings differ from those of the members at the highest step.
        """
        session = self.session_of()
        before = session.step
        quorum = session.quorum()
        quorum_id = session.groups.quorum_id or 0
        if self._first_quorum is None:
            self._first_quorum = quorum_id
        healed = quorum.peer_state is not None
        contributes = place is not None and not healed and not quorum.errored
        sync = Sync(quorum, place, contributes, quorum.members, quorum.members)
        sync.top_step = quorum.step
        if quorum.errored:
            sync.failed = "the quorum's process group or heal failed here"
        if not quorum.reconfigured:
            return sync  # the same members as at the last sync: all at this place, none healing
        sync.changed = True
        veteran = self._first_quorum < quorum_id
        name = self.config.group_index if self.config.group_index is not None else -1
        rows = session.all_gather(Member(place, contributes, before, veteran, name).row(self.fingerprint))
        if rows is None:
            sync.failed, sync.skip = "the members' check failed (a group left during it)", True
            return sync
        members = [Member.of(row) for row in rows]
        sync.names = tuple(member.name for member, _ in members)
        top = sync.top_step = max(member.step for member, _ in members)
        sync.new_in_a_used_lighthouse = quorum_id > 1 and not any(member.veteran for member, _ in members)
        leaders = [(member, codes) for member, codes in members if member.step == top]
        reference = leaders[0][1]  # the first group at the highest step (by name): the run's settings
        difference = self.fingerprint.difference(reference)
        if difference is not None:
            raise MembershipError(
                f"TorchFT: replica group '{self.config.name}' does not belong in the run at {self.config.lighthouse}:"
                f" {difference}. It is refused before it averages anything."
            )
        if any(codes != reference for _, codes in members):
            sync.failed, sync.skip = "a group that does not belong was refused", True
        places = {member.place for member, _ in leaders if member.place is not None}
        if len(places) > 1:
            sync.failed = sync.failed or f"the groups at the highest step are at different places {sorted(places)}"
            sync.skip = True
        sync.place = min(places) if places else None
        sync.contributors = sum(member.contributes for member, _ in members)
        if sync.place is None:
            sync.contributes = False
        return sync

    def wait_for_more(self, sync: Sync, deadline: float) -> None:
        """Before asking again for a first quorum with more groups: at most ``quorum_timeout`` in all.

        Raises:
            NoQuorumError: If the deadline passed.
        """
        from lightning_gradcomp.ft.session import NoQuorumError

        wanted = self.config.starting_replicas
        if time.monotonic() > deadline:
            raise NoQuorumError(
                f"TorchFT: replica group '{self.config.name}' found {sync.members} of the {wanted} groups a run starts"
                f" or resumes with (`start_replicas`) within {self.config.quorum_timeout:g} s at"
                f" {self.config.lighthouse}."
            )
        if not self._waiting_logged:
            self.info(f"DiLoCo: replica group '{self.config.name}' waits for {wanted} groups to start the run.")
            self._waiting_logged = True
        time.sleep(_START_POLL_S)
