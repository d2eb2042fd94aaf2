"""Optimizers that belong with a compression method (the methods' own update rules)."""

from lightning_gradcomp.optim.dgc_sgd import DGCSGD
from lightning_gradcomp.optim.novograd import NovoGrad

__all__ = ["DGCSGD", "NovoGrad"]
