"""The round groups' lifetime and exit safety: settling at teardown, gather_rows (real gloo groups)."""

import time

import pytest
import torch


def _settle_on_one_rank(rank, world_size):
    """On a real one-rank gloo group: ``settle`` waits for a tracked collective that ends later on another thread,
    and returns (with a warning) when one never ends."""
    import logging
    import threading

    from lightning_gradcomp.engine import collectives as process_groups

    collectives = process_groups.TorchCollectives()
    later = torch.futures.Future()
    collectives._track(later)
    timer = threading.Timer(0.2, later.set_result, args=(None,))
    timer.start()
    collectives.settle()
    ended_on_return = later.done()
    timer.join()
    never = torch.futures.Future()
    collectives._track(never)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    process_groups.log.addHandler(handler)
    collectives.settle(timeout_s=0.1)
    process_groups.log.removeHandler(handler)
    never.set_result(None)
    return {
        "ended_on_return": ended_on_return,
        "warnings": [r.getMessage() for r in records],
        "left": len(collectives._running),
    }


@pytest.mark.slow
def test_settle_waits_for_the_collectives_still_running():
    from tests.distributed import run_distributed

    (result,) = run_distributed(_settle_on_one_rank, world_size=1)
    assert result["ended_on_return"], "settle returned before the tracked collective ended"
    assert len(result["warnings"]) == 1
    assert "still running" in result["warnings"][0]
    assert result["left"] == 0


def _gather_rows_released_late(rank: int, world_size: int) -> dict:
    """gather_rows on two ranks, with torch's late release of a collective's tensors made slow on purpose."""
    import threading
    import weakref

    from lightning_gradcomp.engine import collectives as process_groups

    real, held = process_groups._all_gather_single, []

    def gather_then_hold(out, mine, group):
        real(out, mine, group=group)
        held.extend([weakref.ref(out), weakref.ref(mine)])
        # like gloo's worker thread, which drops its references a moment after the collective completed
        keeper = threading.Thread(target=lambda tensors: time.sleep(0.3), args=((out, mine),))
        keeper.start()

    process_groups._all_gather_single = gather_then_hold
    started = time.monotonic()
    rows = process_groups.gather_rows(torch.arange(6, dtype=torch.float64).reshape(2, 3) + 100 * rank)
    return {"rows": rows, "seconds": time.monotonic() - started, "alive": sum(ref() is not None for ref in held)}


@pytest.mark.slow
def test_gather_rows_returns_every_ranks_rows_once_the_collectives_tensors_are_released():
    from tests.distributed import run_distributed

    results = run_distributed(_gather_rows_released_late, world_size=2)
    expected = torch.stack([torch.arange(6, dtype=torch.float64).reshape(2, 3) + 100 * r for r in range(2)])
    for result in results:
        assert torch.equal(result["rows"], expected)
        # the collective's own tensors were gone when it returned: no thread of torch's can drop them at exit
        assert result["alive"] == 0
        assert result["seconds"] >= 0.3


def test_gather_rows_without_a_process_group_is_the_tensor_as_one_row():
    from lightning_gradcomp.engine.collectives import gather_rows

    tensor = torch.arange(4.0)
    rows = gather_rows(tensor)
    assert rows.shape == (1, 4)
    assert torch.equal(rows[0], tensor)
    rows[0, 0] = 7.0
    assert tensor[0] == 0.0  # a copy: the caller's tensor is never handed to a collective


def _groups_made_beside(rank, world_size):
    import datetime

    import torch.distributed as dist

    from lightning_gradcomp.engine import collectives as process_groups

    base = dist.new_group([0], timeout=datetime.timedelta(seconds=17))
    side = process_groups.side_group(base)
    collectives = process_groups.TorchCollectives(base)
    collectives.ensure_rounds(2)
    timeouts = {
        "side": process_groups._timeout_of(side),
        "round 1": process_groups._timeout_of(collectives._groups[1]),
        "plain new_group": process_groups._timeout_of(dist.new_group([0])),  # the control: the backend's default
    }
    again = process_groups.side_group(base) is side
    process_groups.release_round_groups(base)
    process_groups._release_side_groups()
    return {"timeouts": {k: v.total_seconds() for k, v in timeouts.items()}, "reused": again}


def test_groups_made_beside_a_group_keep_its_timeout_and_the_side_group_is_made_once():
    """A rank that stops answering must be found within the strategy's timeout on every group the package makes, not
    within the backend's default (30 minutes for gloo), which ``new_group`` would otherwise take."""
    from tests.distributed import run_distributed

    (result,) = run_distributed(_groups_made_beside, world_size=1)
    assert result["timeouts"]["side"] == result["timeouts"]["round 1"] == 17.0
    assert result["timeouts"]["plain new_group"] > 17.0
    assert result["reused"]
