"""DiLoCo's summary line over this process's own steps: what a healed or resumed run did, not the run's global step.

A fault-tolerant group that (re)joins heals Lightning's ``global_step`` from a live peer, and a resumed run restores
it (and the exchange's byte counters) from its checkpoint; dividing this process's time and bytes by that global step
would understate both per step (a group that trained 320 of 600 steps read about 1.9x too little).
"""

from __future__ import annotations

import time

from lightning_gradcomp.diloco.round import Round
from lightning_gradcomp.engine import wire

__all__ = ["own_summary"]


def own_summary(
    global_step: int,
    own: tuple[int, int, int],
    started: tuple[float, int] | None,
    outer: Round,
    dense_per_step: int,
    world_size: int,
    now: float | None = None,
) -> str:
    """One line: this process's optimizer steps, the syncs, its bytes since training started, and its time per step.

    Args:
        global_step: the trainer's global step at the end (the run's, healed or resumed).
        own: this process's optimizer steps since training started, and the exchange's bytes sent and received then.
        started: ``(perf_counter, global_step)`` when training started (``None``: no time per step).
        outer: the round, with the syncs and the byte counters now.
        dense_per_step: the bytes of the parameters, which plain DDP's ring all-reduces at every step.
        world_size: the workers plain DDP would average over.
        now: the ``perf_counter`` at the end (``None``: now).
    """
    steps, sent0, received0 = own
    moved = wire.Wire(outer.bytes_sent - sent0, outer.bytes_received - received0)
    dense = wire.all_reduce(dense_per_step, world_size)
    ratio = wire.compression_ratio(dense, moved.scaled(1 / max(steps, 1)))
    moved_from = started[1] if started is not None else global_step - steps
    note = f" (global step {global_step}: healed or resumed)" if global_step != moved_from + steps else ""
    elapsed = ((time.perf_counter() if now is None else now) - started[0]) if started is not None else None
    per_step = f"; {elapsed / steps * 1e3:,.1f} ms per optimizer step." if elapsed is not None and steps else "."
    return (
        f"gradcomp summary (DiLoCo): {steps} optimizer steps{note}, {outer.syncs} syncs ({outer.skipped} skipped"
        f"{outer.membership.summary()}); {moved.sent / 1e6:,.3f} MB sent, {moved.received / 1e6:,.3f} MB received"
        f" ({moved.moved / max(steps, 1) / 1e6:,.4f} MB moved per step, plain DDP's ring {dense.moved / 1e6:,.4f}:"
        f" {ratio:,.1f}x less){per_step}"
    )
