"""Fault tolerance across replica groups on torchft: settings, the manager's session, the lighthouse.

:class:`TorchFT` is what ``DiLoCo(fault_tolerance=...)`` takes; :mod:`~lightning_gradcomp.ft.session` wraps torchft's
``Manager`` (:mod:`~lightning_gradcomp.ft.collectives`: the engine's collectives on its process group);
:mod:`~lightning_gradcomp.ft.quorums` asks for each sync's quorum and, with
:mod:`~lightning_gradcomp.ft.membership`, compares the groups' settings and places (integers the caller gives meaning
to); :mod:`~lightning_gradcomp.ft.lighthouse` starts torchft's lighthouse. It knows torchft and the engine, never
Lightning nor DiLoCo. Only the settings import without torchft installed.
"""

from lightning_gradcomp.ft.config import TorchFT

__all__ = ["TorchFT"]
