"""``DiLoCo``: periodic synchronization for slow links: a torch-only core and its Lightning front door.

The core imports nothing from Lightning: :mod:`~lightning_gradcomp.diloco.round` is the schedule and the sync,
:mod:`~lightning_gradcomp.diloco.weights` theta_global beside the model, :mod:`~lightning_gradcomp.diloco.membership`
who takes part (plain DiLoCo's static policy; :mod:`~lightning_gradcomp.diloco.elastic` the replica groups of a
fault-tolerant run), :mod:`~lightning_gradcomp.diloco.exchange` the average over the workers (plain, two levels, or
through a compressor), :mod:`~lightning_gradcomp.diloco.merge` the overlap's merges.
:mod:`~lightning_gradcomp.diloco.strategy` is the front door over Lightning's ``DDPStrategy``, which calls the round
at each optimizer step, and :mod:`~lightning_gradcomp.diloco.monitor` logs it.
"""

from lightning_gradcomp.diloco.strategy import DiLoCo

__all__ = ["DiLoCo"]
