"""Which cases the default run selects: the core examples of the contract, and what a module fixture must compute.

The costly tests (many steps, every rank count, a distributed launch per example) are marked
``@pytest.mark.slow_beyond_core(argname)``: their cases whose ``argname`` names an example outside
:data:`CORE_EXAMPLES` are marked ``slow`` at collection (``tests/conftest.py``), so ``pytest`` runs the core and
``pytest -m slow`` the rest. Every cheap contract test still runs every example in the default run.
"""

from __future__ import annotations

import pytest

#: One configuration per compressor and per exchange, of ``lightning_gradcomp.testing.EXAMPLES``. The other examples
#: are variants of these (another ratio, rank, bit width, stage or option).
CORE_EXAMPLES = frozenset(
    {
        "identity",
        "fp16",
        "bf16",
        "topk",
        "randomk",
        "powersgd",
        "planned",
        "masked",
        "dgc",
        "adacomp",
        "scalecom",
        "signsgd",
        "signum",
        "efsignsgd",
        "onebit",
        "qsgd",
        "terngrad",
        "lgc",
        "lgc-allreduce",
        "lgc-ps-stages",
        "lgc-allreduce-stages",
        "zen",
        "topk-zen",
        "minmax8",
        "efsignsgd-two-phase",
        "qsgd-two-phase",
        "terngrad-two-phase",
        "sparseloco",
    }
)


def beyond_core(item: pytest.Item) -> bool:
    """Whether ``item`` is a case of a ``slow_beyond_core(argname)`` test whose example is not a core one."""
    from lightning_gradcomp.testing import EXAMPLES

    marker = item.get_closest_marker("slow_beyond_core")
    callspec = getattr(item, "callspec", None)
    if marker is None or callspec is None:
        return False
    name = callspec.params.get(marker.args[0])
    # names a test adds for itself (plain DDP as a control, a configuration of its own) are not variants: they stay
    return name in EXAMPLES and name not in CORE_EXAMPLES


def selected_params(request: pytest.FixtureRequest, argname: str, *tests: object) -> list:
    """The values of ``argname`` among the selected cases of ``tests`` (test functions of the requesting module), in
    order: what a module fixture that computes every case in one launch has to compute in this run."""
    names = {test.__name__ for test in tests}  # type: ignore[attr-defined]
    values = []
    for item in request.session.items:
        callspec = getattr(item, "callspec", None)
        if callspec is None or getattr(item, "originalname", None) not in names or item.module is not request.module:
            continue
        value = callspec.params[argname]
        if value not in values:
            values.append(value)
    return values
