"""The round's training state: what is the same on every worker, what is each worker's own, and a heal's share.

A checkpoint saves both (:mod:`lightning_gradcomp.diloco.checkpoint`) so that a run resumes bit for bit, also in the
middle of a round; a replica group that heals from a live peer loads the shared part only
(:mod:`lightning_gradcomp.diloco.elastic`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_map

from lightning_gradcomp.diloco.exchange import InFlight
from lightning_gradcomp.diloco.membership import LoopState, Participation, Place

__all__ = [
    "Pending",
    "load_own_state",
    "load_peer_state",
    "load_shared_state",
    "own_state",
    "peer_state",
    "shared_state",
]


@dataclass
class Pending:
    """A fragment's exchange in flight (Streaming DiLoCo's overlap).

    Attributes:
        fragment: the fragment whose pseudo-gradient is on the wire.
        remaining: inner steps until its outer step is applied.
        exchange: the collectives in flight (``None`` after a resume, until they are sent again).
        contribution: this rank's pseudo-gradient, kept to send it again when a run resumes mid-exchange.
        part: who takes part in it.
    """

    fragment: int
    remaining: int
    exchange: InFlight | None = None
    contribution: list[Tensor] | None = None
    part: Participation = field(default_factory=lambda: Participation(Place()))


def shared_state(round: Any) -> dict[str, Any]:
    """Everything the outer loop needs to resume exactly that is the same on every worker."""
    weights, pending = round.weights_of(), round.pending
    return {
        "params": [p.clone() for p in weights.params],
        "buffers": [b.clone() for b in weights.buffers],
        "optimizer": weights.optimizer.state_dict(),
        "phase": round.phase,
        "dirty": list(round.dirty),
        "pending": None if pending is None else {"fragment": pending.fragment, "remaining": pending.remaining},
        "syncs": round.syncs,
        "skipped": round.skipped,
        "bytes_sent": round.exchange.bytes_sent,
        "bytes_received": round.exchange.bytes_received,
    }


def load_shared_state(round: Any, state: dict[str, Any]) -> None:
    """Restore :func:`shared_state` into an attached round (theta_global copied in place).

    An exchange that was in flight is pending again, without its collectives: :func:`load_own_state` sends this
    worker's contribution again.
    """
    weights = round.weights_of()
    with torch.no_grad():
        for mine, saved in zip(weights.params, state["params"], strict=True):
            mine.copy_(saved)
        for mine, saved in zip(weights.buffers, state["buffers"], strict=True):
            mine.copy_(saved)
    weights.optimizer.load_state_dict(state["optimizer"])
    round.phase, round.syncs, round.skipped = state["phase"], state["syncs"], state["skipped"]
    round.dirty = list(state["dirty"])
    round.exchange.bytes_sent, round.exchange.bytes_received = state["bytes_sent"], state["bytes_received"]
    pending = state["pending"]
    round.pending = None if pending is None else Pending(pending["fragment"], pending["remaining"])
    round.others, round.others_workers = {}, {}  # each worker's own: restored by load_own_state


def own_state(round: Any) -> dict[str, Any]:
    """This worker's own state, on the CPU: its contribution in flight, its exchange's residuals and counter."""
    contribution = round.pending.contribution if round.pending is not None else None
    return {
        "contribution": [t.to("cpu", copy=True) for t in contribution] if contribution is not None else None,
        "exchange": round.exchange.state_dict(),
        "others": {k: [t.to("cpu", copy=True) for t in v] for k, v in round.others.items()},
        "others_workers": dict(round.others_workers),
    }


def load_own_state(round: Any, own: dict[str, Any], device: torch.device) -> None:
    """Restore :func:`own_state`, and send the exchange that was in flight again, with the same values.

    Where the members of that exchange may be gone (a membership whose ``resumes_in_flight`` is false), it is
    discarded instead: the fragment goes back to theta_global.
    """
    round.exchange.load_state_dict(own["exchange"])
    round.others = {int(k): [t.to(device) for t in v] for k, v in own.get("others", {}).items()}
    workers = {int(k): int(v) for k, v in own.get("others_workers", {}).items()}
    round.others_workers = workers or dict.fromkeys(round.others, round.exchange.workers)
    pending = round.pending
    if pending is None:
        return
    if not round.membership.resumes_in_flight:
        round.pending = None
        round.weights_of().copy_to(round.fragment_params[pending.fragment])
        round.dirty[pending.fragment] = False
        round.membership.discarded += 1
        return
    contribution = [t.to(device) for t in own["contribution"]]
    pending.contribution = [t.clone() for t in contribution]
    layouts = round.weights_of().pseudo_gradients(round.fragment_params[pending.fragment])[1]
    pending.part = round.membership.enter(Place(pending.fragment))
    pending.exchange = round.exchange.start(contribution, layouts)


def peer_state(round: Any, loop: LoopState) -> dict[str, Any]:
    """What a replica group that heals from this one receives, as copies (taken on torchft's quorum thread).

    The shared state (nothing in flight), the exchange's shared state with no residuals, the front door's loop state.
    """
    exchange = {**round.exchange.state_dict(), "residuals": {}}
    state = {"round": {**shared_state(round), "pending": None}, "exchange": exchange, "lightning": loop.take()}
    return tree_map(lambda t: t.detach().clone() if isinstance(t, Tensor) else t, state)


def load_peer_state(round: Any, state: dict[str, Any], phase: int, loop: LoopState) -> None:
    """Load :func:`peer_state` of a live peer and go on at ``phase`` of the round: the model set to theta_global.

    The exchange's byte counters stay this group's own (what it moved), and so do its residuals (empty).
    """
    own = round.exchange.bytes_sent, round.exchange.bytes_received
    load_shared_state(round, {**state["round"], "pending": None})
    round.exchange.bytes_sent, round.exchange.bytes_received = own
    round.exchange.load_state_dict(state["exchange"])
    round.phase = phase
    round.weights_of().copy_to()
    round.weights_of().restore_buffers()
    loop.load(state["lightning"])
