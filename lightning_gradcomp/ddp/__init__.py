"""``CompressedDDP``: Lightning's ``DDPStrategy`` with the compressor inside DDP's communication hook.

:mod:`~lightning_gradcomp.ddp.hook` is the hook (torch only, usable with plain DDP);
:mod:`~lightning_gradcomp.ddp.strategy` the Lightning strategy around it.
"""

from lightning_gradcomp.ddp.hook import CompressionState, compression_hook
from lightning_gradcomp.ddp.strategy import CompressedDDP

__all__ = ["CompressedDDP", "CompressionState", "compression_hook"]
