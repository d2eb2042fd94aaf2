"""Automatic compression: measure the link, the backward pass and each codec; compress only what pays.

:mod:`~lightning_gradcomp.auto.timeline` is the model and the planner (pure); the callback that measures and applies
plans is :class:`lightning_gradcomp.callbacks.AutoCompression`; the per-bucket dispatch is
:class:`lightning_gradcomp.compressors.Planned`.
"""

from lightning_gradcomp.auto.timeline import (
    DENSE,
    Bucket,
    Cost,
    Link,
    Plan,
    Prediction,
    Timing,
    allreduce_equivalent,
    exposed_tail,
    fit_link,
    plan_greedy,
    predict,
    speedup_curve,
)

__all__ = [
    "DENSE",
    "Bucket",
    "Cost",
    "Link",
    "Plan",
    "Prediction",
    "Timing",
    "allreduce_equivalent",
    "exposed_tail",
    "fit_link",
    "plan_greedy",
    "predict",
    "speedup_curve",
]
