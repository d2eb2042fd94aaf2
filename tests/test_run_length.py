"""``advise`` never recommends a DiLoCo setting that DiLoCo's own preflight then warns about."""

import re

import pytest

from lightning_gradcomp import DiLoCo
from lightning_gradcomp.auto.periodic import SYNC_EVERY
from lightning_gradcomp.auto.report import diloco_recommendation
from lightning_gradcomp.auto.run_length import run_steps, sync_every_choices
from lightning_gradcomp.auto.timeline import Cost, Link, Timing
from lightning_gradcomp.compressors import MinMax, SparseLoCo
from lightning_gradcomp.diloco.defaults import auto_sync_every
from lightning_gradcomp.diloco.preflight import few_outer_steps


def test_the_run_length_is_lightnings_estimate():
    assert run_steps(-1, 8, 23, 1) == 184  # the quickstart recipe: 8 epochs of 23 batches per rank
    assert run_steps(100, 8, 23, 1) == 100
    assert run_steps(-1, 4, 23, 2) == 48
    assert run_steps(-1, -1, 23, 1) is None
    assert run_steps(-1, None, 23, 1) is None


def test_the_rounds_priced_are_those_the_preflight_accepts():
    assert sync_every_choices(None) == SYNC_EVERY
    assert sync_every_choices(10_000) == SYNC_EVERY  # 500 gives 20 outer steps
    assert sync_every_choices(2_000) == (10, 30, 100)
    assert sync_every_choices(184) == (auto_sync_every(184),)


@pytest.mark.parametrize("total_steps", [184, 700, 2_000])
def test_the_recommended_constructor_draws_no_few_outer_steps_warning(total_steps):
    # a slow link: without the run's length the recommendation would be a long round
    costs = {"fp32": Cost(0.0, 0.0, 4e6, 1), "8-bit": Cost(0.01, 0.0, 1e6, 2), "SparseLoCo": Cost(0.02, 0.0, 1e5, 1)}
    lines = diloco_recommendation(Timing(0.02, 0.05, 0.01), Link(0.0, 1e6), costs, total_steps)
    call = next(line for line in lines if "strategy=DiLoCo(" in line)
    code = re.search(r"strategy=(DiLoCo\(.*\))\)$", call.strip()).group(1)
    strategy = eval(code, {"DiLoCo": DiLoCo, "MinMax": MinMax, "SparseLoCo": SparseLoCo})
    assert few_outer_steps(total_steps, strategy.sync_every, None) is None, code
    assert all(few_outer_steps(total_steps, h, None) is None for h in sync_every_choices(total_steps))
    # without the run's length: H = 30, which the preflight would warn about on the two shorter runs
    unrestricted = diloco_recommendation(Timing(0.02, 0.05, 0.01), Link(0.0, 1e6), costs)
    assert "strategy=DiLoCo(sync_every=30," in next(line for line in unrestricted if "strategy=DiLoCo(" in line)
    assert (few_outer_steps(total_steps, 30, None) is None) == (total_steps >= 600)
