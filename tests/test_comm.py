"""Comm: packing, byte accounting, the ordering of later rounds (single process)."""

import pytest
import torch

from lightning_gradcomp.engine.comm import Comm
from lightning_gradcomp.engine.telemetry import Telemetry
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
