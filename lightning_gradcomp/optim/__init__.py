"""Optimizers that belong with a compression method (the methods' own update rules)."""

from lightning_gradcomp.optim.dgc_sgd import DGCSGD

__all__ = ["DGCSGD"]
