"""A pytest plugin that stands ``CompressedDDP`` in for Lightning's ``DDPStrategy`` (for ``lightning_suite.py``).

Loaded with ``-p _lightning_swap`` before any test module is imported, it reads ``GRADCOMP_SWAP``:

- ``ddp``: nothing is swapped (Lightning's own ``DDPStrategy``, the baseline);
- ``identity``: ``CompressedDDP(Identity())``;
- ``powersgd``: ``CompressedDDP(PowerSGD(rank=2))``.

The stand-in is a subclass of ``CompressedDDP`` with ``DDPStrategy``'s signature, as a user who swaps the class would
write it: it takes the place of ``DDPStrategy`` in ``lightning.pytorch.strategies`` and its ``ddp`` module, and in every
entry of Lightning's strategy registry (``"ddp"``, ``"ddp_spawn"``, ``"ddp_find_unused_parameters_true"``, ...), so a
test that names the class, a string or ``strategy="auto"`` on two devices gets it. Lightning's own modules keep the
original class for their ``isinstance`` checks, which the subclass passes.

With ``GRADCOMP_TOUCHED`` set to a file, every construction of a ``DDPStrategy`` (the stand-in or the original)
appends the running test's id to it: the tests the swap can change. With ``GRADCOMP_OUTCOMES`` set to a file, the
outcome of every test (``passed``, ``failed``, ``error``, ``skipped``) is appended to it as ``ID<TAB>OUTCOME``, by the
pytest process the runner started only (the ranks a ``popen`` launcher starts run pytest again).
"""

from __future__ import annotations

import datetime
import functools
import os
from collections.abc import Callable
from typing import Any

import lightning.pytorch.strategies as strategies
import lightning.pytorch.strategies.ddp as ddp_module
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry

from lightning_gradcomp import CompressedDDP
from lightning_gradcomp.compressors import Compressor, Identity, PowerSGD

SWAPS: dict[str, Callable[[], Compressor] | None] = {
    "ddp": None,
    "identity": Identity,
    "powersgd": lambda: PowerSGD(rank=2),
}


#: the pytest process the runner started (inherited by the ranks a test's launcher starts, which record nothing)
_MAIN_PID = os.environ.setdefault("GRADCOMP_SUITE_PID", str(os.getpid()))


#: the id of the test running in this process (set by :func:`pytest_runtest_logstart`)
_current = {"test": ""}


def _record(test_file: str | None) -> None:
    if test_file is None or int(_MAIN_PID) != os.getpid():
        return
    # not PYTEST_CURRENT_TEST: a test that patches os.environ with a copy taken at import (``mock.patch.dict(os.environ,
    # os.environ.copy(), clear=True)``, as Lightning's standalone tests do) runs without it
    test = _current["test"]
    if test:
        with open(test_file, "a") as f:
            f.write(test + "\n")


class SwappedDDPStrategy(CompressedDDP):
    """``CompressedDDP`` with ``GRADCOMP_SWAP``'s compressor, called as ``DDPStrategy`` is (its signature).

    At module level, so that Lightning's spawn launcher can pickle it for its workers.
    """

    strategy_name = "ddp"

    def __init__(
        self,
        accelerator: Any = None,
        parallel_devices: Any = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
        ddp_comm_state: object | None = None,
        ddp_comm_hook: Callable | None = None,
        ddp_comm_wrapper: Callable | None = None,
        model_averaging_period: int | None = None,
        process_group_backend: str | None = None,
        timeout: datetime.timedelta | None = datetime.timedelta(seconds=1800),
        start_method: str = "popen",
        **kwargs: Any,
    ) -> None:
        _record(os.environ.get("GRADCOMP_TOUCHED"))
        make = SWAPS[os.environ.get("GRADCOMP_SWAP", "identity")] or Identity
        super().__init__(
            compressor=make(),
            ddp_comm_state=ddp_comm_state,
            ddp_comm_hook=ddp_comm_hook,
            ddp_comm_wrapper=ddp_comm_wrapper,
            model_averaging_period=model_averaging_period,
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
            **kwargs,
        )


# the name Lightning's tests see (their parametrized ids hold it: `test_x[...-DDPStrategy-...]`); pickling for the
# spawn launcher goes by ``__qualname__``, which stays this module's
SwappedDDPStrategy.__name__ = "DDPStrategy"


def _spy_on_ddp(test_file: str) -> None:
    """Record the tests that build Lightning's own ``DDPStrategy`` (the baseline: nothing else changes)."""
    original = DDPStrategy.__init__

    @functools.wraps(original)  # its signature stays DDPStrategy's (LightningCLI reads it)
    def __init__(self: DDPStrategy, *args: Any, **kwargs: Any) -> None:
        if type(self) is DDPStrategy:
            _record(test_file)
        original(self, *args, **kwargs)

    DDPStrategy.__init__ = __init__  # type: ignore[method-assign]


def _swap() -> None:
    name = os.environ.get("GRADCOMP_SWAP", "ddp")
    if name not in SWAPS:
        raise ValueError(f"GRADCOMP_SWAP must be one of {sorted(SWAPS)}, got {name!r}.")
    if SWAPS[name] is None:
        test_file = os.environ.get("GRADCOMP_TOUCHED")
        if test_file:
            _spy_on_ddp(test_file)
        return
    strategies.DDPStrategy = SwappedDDPStrategy  # type: ignore[misc]
    ddp_module.DDPStrategy = SwappedDDPStrategy  # type: ignore[misc]
    for entry in StrategyRegistry.values():
        if entry["strategy"] is DDPStrategy:
            entry["strategy"] = SwappedDDPStrategy


def pytest_runtest_logstart(nodeid: str, location: Any) -> None:
    """Note the id of the test about to run (every plugin's hook is called, unlike ``pytest_runtest_protocol``)."""
    _current["test"] = nodeid


def pytest_runtest_logreport(report: Any) -> None:
    """Append the test's outcome to ``GRADCOMP_OUTCOMES`` (a later phase's failure overrides a pass)."""
    path = os.environ.get("GRADCOMP_OUTCOMES")
    if not path or int(_MAIN_PID) != os.getpid():
        return
    if report.when == "call":
        outcome = report.outcome
    elif report.failed:
        outcome = "error"  # a fixture's setup or teardown failed
    elif report.when == "setup" and report.skipped:
        outcome = "skipped"
    else:
        return
    with open(path, "a") as f:
        f.write(f"{report.nodeid}\t{outcome}\n")


_swap()
