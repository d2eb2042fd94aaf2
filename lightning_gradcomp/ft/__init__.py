"""Fault tolerance across replica groups on torchft: settings, the manager's session, the lighthouse.

:class:`TorchFT` is what ``DiLoCo(fault_tolerance=...)`` takes; :mod:`~lightning_gradcomp.ft.session` wraps torchft's
``Manager`` (:mod:`~lightning_gradcomp.ft.collectives`: the engine's collectives on its process group);
:mod:`~lightning_gradcomp.ft.quorums` asks for each sync's quorum and, with
:mod:`~lightning_gradcomp.ft.membership`, compares the groups' settings; :mod:`~lightning_gradcomp.ft.loops` moves
Lightning's training state to a healing group; :mod:`~lightning_gradcomp.ft.lighthouse` starts torchft's lighthouse.
Only the settings import without torchft installed.
"""

from lightning_gradcomp.ft.config import TorchFT

__all__ = ["TorchFT"]
