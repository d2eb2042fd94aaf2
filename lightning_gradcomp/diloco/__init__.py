"""``DiLoCo``: periodic synchronization for slow links, as a Lightning strategy.

:mod:`~lightning_gradcomp.diloco.strategy` is the Lightning strategy, which tells the round when an inner step was
taken; :mod:`~lightning_gradcomp.diloco.round` holds theta_global, the outer optimizer and the phase, and does the
outer step; :mod:`~lightning_gradcomp.diloco.exchange` averages the pseudo-gradient over the workers (plain, over two
levels, or through a compressor); :mod:`~lightning_gradcomp.diloco.replicas` makes the two levels' process groups.
"""

from lightning_gradcomp.diloco.strategy import DiLoCo

__all__ = ["DiLoCo"]
