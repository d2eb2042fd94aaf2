"""Comm: packing, byte accounting, the ordering of later rounds (single process), settling at teardown, gather_rows."""

import time

import pytest
import torch

from lightning_gradcomp.comm import Comm
from lightning_gradcomp.telemetry import Telemetry
from lightning_gradcomp.testing import SimulatedWorld


class ManualBackend:
    """Collectives whose completion the test controls; records the order of issue."""

    rank, world_size = 0, 2

    def __init__(self):
        self.issued = []

    def all_reduce(self, tensor, round, op):
        self.issued.append(("all_reduce", round, tensor.numel()))
        future = torch.futures.Future()
        future.set_result(tensor)
        return future

    all_gather = broadcast = None


def test_later_rounds_are_issued_in_bucket_order_whatever_order_first_rounds_finish():
    backend = ManualBackend()
    comm = Comm(backend, Telemetry(), torch.device("cpu"))
    first = [torch.futures.Future() for _ in range(3)]
    results = [
        comm.after(f, lambda _, n=n: comm.all_reduce((torch.zeros(n + 1),), round=1), round=1)
        for n, f in enumerate(first)
    ]
    first[2].set_result(None)
    first[1].set_result(None)
    assert backend.issued == []  # bucket 0's second round must go first on every rank
    first[0].set_result(None)
    assert backend.issued == [("all_reduce", 1, 1), ("all_reduce", 1, 2), ("all_reduce", 1, 3)]
    assert [r.wait()[0].numel() for r in results] == [1, 2, 3]


def test_a_failed_round_fails_its_future_and_does_not_block_the_next_bucket():
    backend = ManualBackend()
    comm = Comm(backend, Telemetry(), torch.device("cpu"))
    bad, good = torch.futures.Future(), torch.futures.Future()
    failed = comm.after(bad, lambda f: (f.value(), comm.all_reduce((torch.zeros(1),), round=1))[1], round=1)
    ok = comm.after(good, lambda _: comm.all_reduce((torch.zeros(2),), round=1), round=1)
    good.set_result(None)
    bad.set_exception(RuntimeError("connection reset"))
    with pytest.raises(RuntimeError, match="connection reset"):
        failed.wait()
    assert ok.wait()[0].numel() == 2


def test_all_gather_packs_mixed_dtypes_into_one_collective_and_unpacks_them():
    world = SimulatedWorld(2)
    telemetry = [Telemetry(), Telemetry()]
    comms = [Comm(world.backend(r), telemetry[r], torch.device("cpu")) for r in range(2)]
    payloads = [
        (torch.arange(5.0) + 10 * r, torch.arange(3, dtype=torch.int32) - r, torch.tensor([r], dtype=torch.uint8))
        for r in range(2)
    ]
    futures = [comm.all_gather(p) for comm, p in zip(comms, payloads)]
    gathered = futures[0].wait()
    assert len(world.issued) == 2  # one collective per rank
    for r in range(2):
        for got, sent in zip(gathered[r], payloads[r]):
            assert got.dtype == sent.dtype
            assert torch.equal(got, sent)
    # 20 + 12 + 1 bytes, each padded to 8
    assert telemetry[0]._sent == 24 + 16 + 8


def test_all_reduce_packs_same_dtype_tensors_and_keeps_shapes():
    world = SimulatedWorld(2)
    comms = [Comm(world.backend(r), Telemetry(), torch.device("cpu")) for r in range(2)]
    payloads = [
        (torch.full((2, 3), 1.0 + r), torch.full((4,), 2.0 * r), torch.ones(2, dtype=torch.float16)) for r in range(2)
    ]
    futures = [comm.all_reduce(p) for comm, p in zip(comms, payloads)]
    a, b, c = futures[1].wait()
    assert torch.equal(a, torch.full((2, 3), 3.0))
    assert torch.equal(b, torch.full((4,), 2.0))
    assert c.dtype == torch.float16
    assert torch.equal(c, torch.full((2,), 2.0, dtype=torch.float16))
    assert len(world.issued) == 4  # one collective per dtype per rank


def _settle_on_one_rank(rank, world_size):
    """On a real one-rank gloo group: ``settle`` waits for a tracked collective that ends later on another thread,
    and returns (with a warning) when one never ends."""
    import logging
    import threading

    from lightning_gradcomp import comm

    collectives = comm.TorchCollectives()
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
    comm.log.addHandler(handler)
    collectives.settle(timeout_s=0.1)
    comm.log.removeHandler(handler)
    never.set_result(None)
    return {"ended_on_return": ended_on_return, "warnings": [r.getMessage() for r in records],
            "left": len(collectives._running)}  # fmt: skip


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

    from lightning_gradcomp import comm

    real, held = comm._all_gather_single, []

    def gather_then_hold(out, mine, group):
        real(out, mine, group=group)
        held.extend([weakref.ref(out), weakref.ref(mine)])
        # like gloo's worker thread, which drops its references a moment after the collective completed
        keeper = threading.Thread(target=lambda tensors: time.sleep(0.3), args=((out, mine),))
        keeper.start()

    comm._all_gather_single = gather_then_hold
    started = time.monotonic()
    rows = comm.gather_rows(torch.arange(6, dtype=torch.float64).reshape(2, 3) + 100 * rank)
    return {"rows": rows, "seconds": time.monotonic() - started, "alive": sum(ref() is not None for ref in held)}


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
    from lightning_gradcomp.comm import gather_rows

    tensor = torch.arange(4.0)
    rows = gather_rows(tensor)
    assert rows.shape == (1, 4)
    assert torch.equal(rows[0], tensor)
    rows[0, 0] = 7.0
    assert tensor[0] == 0.0  # a copy: the caller's tensor is never handed to a collective
