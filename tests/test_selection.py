"""The default run's core examples: every name exists, and every exported compressor has one (with a control)."""

import pytest

from lightning_gradcomp.testing import EXAMPLES, exported_compressor_classes
from tests.selection import CORE_EXAMPLES, beyond_core


def _uncovered(core):
    covered = {type(EXAMPLES[name]()) for name in core}
    return [cls.__name__ for cls in exported_compressor_classes() if cls not in covered]


def test_every_core_example_is_an_example():
    """A renamed example would drop out of the default run's costly tests without a word."""
    assert sorted(CORE_EXAMPLES - set(EXAMPLES)) == []


def test_every_exported_compressor_goes_through_the_costly_tests_by_default():
    assert _uncovered(CORE_EXAMPLES) == []
    # the control: without its core examples a compressor is reported
    without = CORE_EXAMPLES - {"adacomp", "efsignsgd", "efsignsgd-two-phase"}
    assert sorted(_uncovered(without)) == ["AdaComp", "EFSignSGD"]


@pytest.mark.parametrize(("name", "slow"), [("topk", False), ("topk-10%", True), ("not-an-example", False)])
def test_a_case_beyond_the_core_is_slow(name, slow):
    class Item:  # the parts of a pytest item the selection reads
        callspec = type("CallSpec", (), {"params": {"case": name}})()

        @staticmethod
        def get_closest_marker(marker):
            return pytest.mark.slow_beyond_core("case").mark if marker == "slow_beyond_core" else None

    assert beyond_core(Item()) is slow
