"""Optimizers that belong with a compression method (the methods' own update rules).

``FusedSGD`` and ``FusedAdaLomo`` (defined in :mod:`lightning_gradcomp.optim.fused`) are applied by ``CompressedDDP``
inside its communication hook, bucket by bucket; ``NovoGrad`` and ``DGCSGD`` step after the backward pass as usual.
``MuonAdamW`` is Muon and AdamW as one optimizer, for strategies that step one inner optimizer (MuLoCo inside DiLoCo).
"""

from lightning_gradcomp.optim.dgc_sgd import DGCSGD
from lightning_gradcomp.optim.fused import FusedAdaLomo, FusedSGD
from lightning_gradcomp.optim.muon import MULOCO, MuonAdamW, muon_param_groups
from lightning_gradcomp.optim.novograd import NovoGrad

__all__ = ["DGCSGD", "MULOCO", "FusedAdaLomo", "FusedSGD", "MuonAdamW", "NovoGrad", "muon_param_groups"]
