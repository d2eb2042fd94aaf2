"""``DiLoCo``: periodic synchronization for slow links, as a Lightning strategy.

:mod:`~lightning_gradcomp.diloco.strategy` schedules the rounds; :mod:`~lightning_gradcomp.diloco.outer` holds
theta_global and the outer optimizer; :mod:`~lightning_gradcomp.diloco.exchange` averages a pseudo-gradient through a
compressor; :mod:`~lightning_gradcomp.diloco.replicas` averages over two levels.
"""

from lightning_gradcomp.diloco.strategy import DiLoCo

__all__ = ["DiLoCo"]
