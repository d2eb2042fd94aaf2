"""Checkpoints of per-rank state (lightning_gradcomp.runtime.rank_state) and CompressedDDP's use of them, rank by rank.

Each rank is simulated in this process by a strategy whose cluster environment names its rank and world size. Without
a process group the strategy's barrier does nothing and the ranks' comparison of their states sees this rank's alone
(:func:`_compared` stands in for it with every simulated rank's), so what every rank writes and reads can be checked
exactly here. The real two-process runs are in test_checkpoint.py.
"""

import contextlib
import os
import time

import fsspec
import pytest
import torch
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from lightning.pytorch.strategies import DDPStrategy

import lightning_gradcomp.runtime.rank_state as rank_state
from lightning_gradcomp import CompressedDDP, CompressionState
from lightning_gradcomp.compressors import Identity, PowerSGD
from lightning_gradcomp.compressors.base import layers_from_shapes
from lightning_gradcomp.ddp.checkpoint import restore_compression_state, save_compression_state
from lightning_gradcomp.runtime.rank_state import (
    CHECKPOINT_FILE,
    checkpoint_file,
    load_rank_state,
    rank_state_path,
    remove_entry,
    save_rank_state,
    state_checksum,
)
from lightning_gradcomp.testing import EXAMPLES, SimulatedHook
from tests.distributed import run_distributed


def _strategy(rank: int, world_size: int, compressor=None, checkpoint_io=None) -> CompressedDDP:
    environment = LightningEnvironment()
    environment.set_world_size(world_size)
    environment.set_global_rank(rank)
    compressor = compressor or PowerSGD(rank=1)
    devices = [torch.device("cpu")]  # the device of the ranks' comparison of their states
    options = {"cluster_environment": environment, "checkpoint_io": checkpoint_io, "parallel_devices": devices}
    return CompressedDDP(compressor, **options)


@contextlib.contextmanager
def _compared(states: list[dict], own: list[bool]):
    """The ranks' comparison of their states (one all-gather) sees every simulated rank's ``states``.

    The simulated ranks save one after another, rank 0 first: what rank 0 says of the path (its row's last entry)
    holds for every rank's gather.
    """
    rows = torch.tensor([[int(o), 0 if o else state_checksum(s), 0] for s, o in zip(states, own)], dtype=torch.int64)
    calls = []

    def gathered(row):
        if len(calls) % len(states) == 0:  # rank 0's call
            rows[0, 2] = row[2]
        calls.append(row)
        return rows.clone()

    gather = rank_state.gather_rows
    rank_state.gather_rows = gathered
    try:
        yield
    finally:
        rank_state.gather_rows = gather


def _rank_state(rank: int) -> dict:
    """A distinct state per rank: residuals this rank owes; the warm-start query (m x r) every rank shares."""
    return {
        "format": 1,
        "step": 8,
        "compressor_class": "PowerSGD",
        "compressor": {"queries": {"net.0.weight": torch.arange(4.0).view(4, 1)}},
        "residuals": {"net.0.weight": torch.full((2, 2), float(rank + 1))},
        "nonfinite_run": {},
    }


def _save(path, world_size: int) -> None:
    """Save a checkpoint at ``path`` as ``world_size`` ranks of CompressedDDP do, each rank its own state."""
    for rank in range(world_size):
        strategy = _strategy(rank, world_size)
        strategy.compression_state.load_state_dict(_rank_state(rank))
        strategy.save_checkpoint({"loops": {}, "global_step": 8, "state_dict": {}}, path)


def _load_warning_on_rank_0(strategy: CompressedDDP, path, message: str) -> None:
    """Load ``path``; on rank 0 expect ``message`` among the warnings (Lightning's ``rank_zero_warn`` is rank 0's)."""
    if strategy.global_rank != 0:
        strategy.load_checkpoint(path)
        return
    with pytest.warns(UserWarning, match=message):
        strategy.load_checkpoint(path)


def test_each_rank_reads_back_exactly_what_it_saved(tmp_path):
    path = tmp_path / "epoch=1.ckpt"
    for rank in range(3):
        save_rank_state(path, "local", {"weights": torch.full((3,), float(rank))}, rank, 3)
    assert sorted(os.listdir(path)) == [f"local.rank{r}.pt" for r in range(3)]
    for rank in range(3):
        loaded = load_rank_state(path, "local", rank)
        assert (loaded.rank, loaded.world_size) == (rank, 3)
        assert torch.equal(loaded.state["weights"], torch.full((3,), float(rank)))
    assert load_rank_state(path, "local", 3) is None
    assert load_rank_state(path, "other", 0) is None


def test_each_rank_removes_its_own_files_and_the_last_one_out_the_directory(tmp_path):
    path = tmp_path / "epoch=1.ckpt"
    for rank in range(2):
        save_rank_state(path, "a", {}, rank, 2)
    TorchCheckpointIO().save_checkpoint({}, path / CHECKPOINT_FILE)
    remove_entry(TorchCheckpointIO(), path, "a", 0)  # rank 0: its own file and Lightning's checkpoint
    assert sorted(os.listdir(path)) == ["a.rank1.pt"]
    remove_entry(TorchCheckpointIO(), path, "a", 1)
    assert not os.path.exists(path)
    remove_entry(TorchCheckpointIO(), path, "a", 1)  # nothing left: nothing to do


def test_a_link_to_a_checkpoint_directory_finds_its_files_and_is_removed_alone(tmp_path):
    path = tmp_path / "epoch=1.ckpt"
    save_rank_state(path, "a", {"x": 1}, 0, 1)
    os.symlink(path.name, tmp_path / "last.ckpt")
    assert load_rank_state(tmp_path / "last.ckpt", "a", 0).state == {"x": 1}
    assert load_rank_state(tmp_path / "last.ckpt" / CHECKPOINT_FILE, "a", 0).state == {"x": 1}
    for rank in (1, 0):
        _strategy(rank, 2).remove_checkpoint(tmp_path / "last.ckpt")
    assert os.listdir(tmp_path) == ["epoch=1.ckpt"]
    assert os.listdir(path) == ["a.rank0.pt"], "the link's target is left as it was"


@pytest.mark.parametrize("key", ["", "a.b", "a/b"])
def test_a_key_that_is_not_a_plain_name_is_refused(tmp_path, key):
    with pytest.raises(ValueError, match="`key`"):
        rank_state_path(tmp_path / "x.ckpt", key, 0)


def test_rank_0_s_checkpoint_holds_no_rank_s_state_and_each_rank_resumes_its_own(tmp_path):
    path = tmp_path / "last.ckpt"
    _save(path, world_size=2)
    assert sorted(os.listdir(path)) == [CHECKPOINT_FILE, "gradcomp.rank0.pt", "gradcomp.rank1.pt"]
    assert torch.load(path / CHECKPOINT_FILE, weights_only=False)["gradcomp"] == {"world_size": 2, "step": 8}
    for rank in range(2):
        strategy = _strategy(rank, 2)
        strategy.load_checkpoint(path)
        restored = strategy.compression_state.state_dict()
        assert torch.equal(restored["residuals"]["net.0.weight"], torch.full((2, 2), float(rank + 1)))
        assert restored["step"] == 8


@pytest.mark.parametrize("world_size", [1, 3])
def test_on_another_world_size_the_shared_state_carries_over_and_the_residuals_start_empty(tmp_path, world_size):
    path = tmp_path / "last.ckpt"
    _save(path, world_size=2)
    for rank in range(world_size):  # rank 2 of 3 has no file of its own: it reads rank 0's shared state
        strategy = _strategy(rank, world_size)
        _load_warning_on_rank_0(strategy, path, "saved by 2 processes, this run has")
        restored = strategy.compression_state.state_dict()
        assert restored["residuals"] == {}
        assert restored["step"] == 8
        assert torch.equal(restored["compressor"]["queries"]["net.0.weight"], torch.arange(4.0).view(4, 1))


def test_missing_or_stale_rank_files_start_the_state_empty_with_a_warning(tmp_path):
    path = tmp_path / "last.ckpt"
    _save(path, world_size=2)
    checkpoint = torch.load(path / CHECKPOINT_FILE, weights_only=False)
    checkpoint["gradcomp"]["step"] = 12  # the files are of step 8: not this checkpoint's
    torch.save(checkpoint, path / CHECKPOINT_FILE)
    strategy = _strategy(0, 2)
    with pytest.warns(UserWarning, match="missing or older than the checkpoint"):
        strategy.load_checkpoint(path)
    assert strategy.compression_state.state_dict()["residuals"] == {}
    assert strategy.compression_state.step == 8  # from global_step
    os.remove(rank_state_path(path, "gradcomp", 1))
    strategy = _strategy(1, 2)
    strategy.load_checkpoint(path)
    assert strategy.compression_state.state_dict()["residuals"] == {}


def test_removing_a_checkpoint_removes_each_rank_s_files(tmp_path):
    path = tmp_path / "epoch=0.ckpt"
    _save(path, world_size=2)
    for rank in (1, 0):  # every rank removes its own; rank 0 also the checkpoint
        _strategy(rank, 2).remove_checkpoint(path)
    assert os.listdir(tmp_path) == []


class _RecordingIO(TorchCheckpointIO):
    """Lightning's CheckpointIO that notes every file it writes, reads and removes (a user's own, say)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, str]] = []

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        self.calls.append(("save", os.path.basename(str(path))))
        super().save_checkpoint(checkpoint, path, storage_options)

    def load_checkpoint(self, path, map_location=None, weights_only=None):
        self.calls.append(("load", os.path.basename(str(path))))
        return super().load_checkpoint(path, map_location, weights_only)

    def remove_checkpoint(self, path):
        self.calls.append(("remove", os.path.basename(str(path))))
        super().remove_checkpoint(path)


def _save_ranks(path, compressor, world_size=2, ios=None):
    """Save a checkpoint at ``path`` from ``world_size`` simulated ranks of ``CompressedDDP(compressor())``."""
    strategies = [_strategy(r, world_size, compressor(), ios[r] if ios else None) for r in range(world_size)]
    states = []
    for rank, strategy in enumerate(strategies):
        if isinstance(strategy.compressor, PowerSGD):
            strategy.compression_state.load_state_dict(_rank_state(rank))
        states.append({**strategy.compression_state.state_dict(), "global_step": 8})
    with _compared(states, [bool(state["residuals"]) for state in states]):
        for strategy in strategies:
            strategy.save_checkpoint({"loops": {}, "global_step": 8, "state_dict": {"w": torch.ones(2)}}, path)
    return strategies


def test_without_state_of_their_own_the_ranks_write_one_file_as_ddp_strategy_does(tmp_path):
    """Identity: rank 0 writes DDPStrategy's file (with the shared compressor state), no other rank writes anything."""
    ios = [_RecordingIO(), _RecordingIO()]
    _save_ranks(tmp_path / "epoch=0.ckpt", Identity, ios=ios)
    assert os.listdir(tmp_path) == ["epoch=0.ckpt"]
    assert os.path.isfile(tmp_path / "epoch=0.ckpt")
    assert ios[0].calls == [("save", "epoch=0.ckpt")]
    assert ios[1].calls == [], "rank 1 writes nothing"
    ours = torch.load(tmp_path / "epoch=0.ckpt", weights_only=False)
    DDPStrategy().save_checkpoint({"loops": {}, "global_step": 8, "state_dict": {"w": torch.ones(2)}}, tmp_path / "d")
    plain = torch.load(tmp_path / "d", weights_only=False)
    assert ours.keys() - plain.keys() == {"gradcomp"}
    assert ours["gradcomp"]["state"]["compressor_class"] == "Identity"
    assert ours["gradcomp"]["state"]["step"] == 0
    strategy = _strategy(1, 2, Identity())
    strategy.compression_state.step = 5
    strategy.load_checkpoint(tmp_path / "epoch=0.ckpt")
    assert strategy.compression_state.step == 0, "restored from the checkpoint's shared state"


def test_a_checkpoint_io_of_the_user_writes_reads_and_removes_every_file(tmp_path):
    path = tmp_path / "epoch=0.ckpt"
    ios = [_RecordingIO(), _RecordingIO()]
    _save_ranks(path, lambda: PowerSGD(rank=1), ios=ios)
    assert ios[0].calls == [("save", "gradcomp.rank0.pt"), ("save", CHECKPOINT_FILE)]
    assert ios[1].calls == [("save", "gradcomp.rank1.pt")], "rank 1 writes its own file, not Lightning's checkpoint"
    strategies = [_strategy(rank, 2, PowerSGD(rank=1), io) for rank, io in enumerate(ios)]
    for rank, (strategy, io) in enumerate(zip(strategies, ios)):
        io.calls.clear()
        strategy.load_checkpoint(path)
        assert io.calls == [("load", CHECKPOINT_FILE), ("load", f"gradcomp.rank{rank}.pt")]
        io.calls.clear()
    for strategy in strategies:
        strategy.remove_checkpoint(path)
    assert ios[0].calls == [("remove", "gradcomp.rank0.pt"), ("remove", CHECKPOINT_FILE)]
    assert ios[1].calls == [("remove", "gradcomp.rank1.pt")]
    assert os.listdir(tmp_path) == []


def test_an_asynchronous_checkpoint_io_writes_every_rank_s_file(tmp_path):
    """Lightning's ``AsyncCheckpointIO`` writes in a thread of its own; once it is done every file is there."""
    path = tmp_path / "epoch=0.ckpt"
    ios = [AsyncCheckpointIO(), AsyncCheckpointIO()]
    strategies = _save_ranks(path, lambda: PowerSGD(rank=1), ios=ios)
    for strategy in strategies:
        strategy.checkpoint_io.teardown()  # waits for its writes
    assert sorted(os.listdir(path)) == [CHECKPOINT_FILE, "gradcomp.rank0.pt", "gradcomp.rank1.pt"]
    for rank in range(2):
        residual = load_rank_state(path, "gradcomp", rank).state["residuals"]["net.0.weight"]
        assert torch.equal(residual, torch.full((2, 2), float(rank + 1)))


def test_a_remote_checkpoint_through_fsspec_saves_loads_and_is_removed(tmp_path):
    """A ``memory://`` path stands for a remote store (s3://, gs://) here: fsspec's file system of the path is used."""
    fs = fsspec.filesystem("memory")
    per_rank = [CHECKPOINT_FILE, "gradcomp.rank0.pt", "gradcomp.rank1.pt"]
    for name, compressor, files in (
        ("memory://ckpts/a.ckpt", lambda: PowerSGD(rank=1), per_rank),
        ("memory://ckpts/b.ckpt", Identity, None),
    ):
        _save_ranks(name, compressor)
        if files is None:
            assert fs.isfile(name)
        else:
            assert sorted(os.path.basename(f) for f in fs.ls(name, detail=False)) == files
        for rank in range(2):
            strategy = _strategy(rank, 2, compressor())
            strategy.load_checkpoint(name)
            if files is not None:
                residual = strategy.compression_state.state_dict()["residuals"]["net.0.weight"]
                assert torch.equal(residual, torch.full((2, 2), float(rank + 1)))
        for rank in (1, 0):
            _strategy(rank, 2, compressor()).remove_checkpoint(name)
        assert not fs.exists(name)


def test_a_path_changes_layout_when_the_ranks_state_does(tmp_path):
    """One path written with state of the ranks' own, then without (a compressor switched to Identity), then with."""
    path = tmp_path / "last.ckpt"
    for compressor, per_rank in ((lambda: PowerSGD(rank=1), True), (Identity, False), (lambda: PowerSGD(rank=1), True)):
        _save_ranks(path, compressor)
        assert os.path.isdir(path) == per_rank
        assert os.listdir(tmp_path) == ["last.ckpt"]
        checkpoint = torch.load(checkpoint_file(path), weights_only=False)
        assert ("state" not in checkpoint["gradcomp"]) == per_rank


def test_plain_ddp_strategy_loads_the_checkpoint_inside_a_checkpoint_directory(tmp_path):
    path = tmp_path / "epoch=0.ckpt"
    _save_ranks(path, lambda: PowerSGD(rank=1))
    loaded = DDPStrategy().load_checkpoint(path / CHECKPOINT_FILE)
    assert torch.equal(loaded["state_dict"]["w"], torch.ones(2))
    with pytest.raises(IsADirectoryError):  # the directory itself is no file for DDPStrategy (docs/concepts.md says)
        DDPStrategy().load_checkpoint(path)


def test_a_directory_without_lightning_s_checkpoint_is_refused_in_one_line(tmp_path):
    save_rank_state(tmp_path / "epoch=0.ckpt", "gradcomp", {}, 0, 1)  # rank 0 never wrote its checkpoint.ckpt
    with pytest.raises(FileNotFoundError, match=r"epoch=0.ckpt is a directory without checkpoint.ckpt: not a"):
        _strategy(0, 1).load_checkpoint(tmp_path / "epoch=0.ckpt")


def test_the_checksum_tells_states_apart_by_any_value_or_dtype():
    state = {"a": torch.arange(4.0), "b": [1, "x", None], "c": {"d": torch.zeros(2, dtype=torch.bfloat16)}}
    same = {"a": torch.arange(4.0), "b": [1, "x", None], "c": {"d": torch.zeros(2, dtype=torch.bfloat16)}}
    assert state_checksum(state) == state_checksum(same)
    for other in (
        {**same, "a": torch.tensor([0.0, 1.0, 2.0, 3.5])},
        {**same, "a": torch.arange(4.0).double()},
        {**same, "a": torch.arange(4.0).view(2, 2)},
        {**same, "b": [1, "x", 0]},
        {**same, "c": {"d": torch.zeros(2, dtype=torch.float16)}},
    ):
        assert state_checksum(state) != state_checksum(other)


def _save_with_a_slow_rank_1(rank: int, world_size: int, path: str) -> tuple[bool, bool]:
    """Save a checkpoint from every rank, rank 1 writing its file a second late; what rank 0 finds on returning."""
    if rank == 1:
        save = rank_state.save_rank_state

        def late(*args, **kwargs):
            time.sleep(1.0)  # a loaded machine: this rank reaches its write after rank 0 is done with its own
            return save(*args, **kwargs)

        rank_state.save_rank_state = late
    strategy = _strategy(rank, world_size)
    strategy.compression_state.load_state_dict(_rank_state(rank))
    strategy.save_checkpoint({"loops": {}, "global_step": 8, "state_dict": {}}, path)
    other = load_rank_state(path, "gradcomp", 1)
    return os.path.exists(os.path.join(path, CHECKPOINT_FILE)), other is not None and other.state["global_step"] == 8


@pytest.mark.slow
def test_rank_0_writes_the_checkpoint_only_once_every_rank_has_written_its_file(tmp_path):
    """The order that keeps a checkpoint whole when the ranks run at different speeds: when rank 0 has written the
    checkpoint, a slower rank's file of the same step is already there (without the barrier it is not)."""
    path = str(tmp_path / "last.ckpt")
    (written, found), _ = run_distributed(_save_with_a_slow_rank_1, path)
    assert written
    assert found, "rank 0 wrote the checkpoint before rank 1 had written its file"


# a conv weight, a tall and a wide matrix, a bias: every compressor of EXAMPLES compresses some of them
_LAYERS = layers_from_shapes([(16, 4, 3, 3), (48, 64), (24, 96), (24,)])
_REFUSE_ERROR_FEEDBACK = {"signsgd", "signum"}  # the majority vote refuses error feedback


def _hook(name: str) -> SimulatedHook:
    feedback = False if name in _REFUSE_ERROR_FEEDBACK else None
    states = [CompressionState(EXAMPLES[name](), min_compress_numel=0, error_feedback=feedback) for _ in range(2)]
    return SimulatedHook(states, _LAYERS)


def _gradients(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    numel = sum(layer.numel for layer in _LAYERS)
    return [torch.randn(numel, generator=g) for _ in range(2)]


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_every_compressor_resumes_bitwise_from_its_rank_files(tmp_path, name):
    """Each rank's state written beside a checkpoint and read back by a fresh hook (as CompressedDDP's save and load
    do) continues exactly as the uninterrupted ranks: the same averages, bit for bit, at every later step."""
    path = tmp_path / "last.ckpt"
    running = _hook(name)
    for step in range(3):
        running.step(_gradients(step))
    checkpoint = {"loops": {}, "global_step": 3}
    states = [{**state.state_dict(), "global_step": 3} for state in running.states]
    layouts = set()
    with _compared(states, [bool(s["residuals"]) for s in states]):
        for rank, state in enumerate(running.states):
            where = (TorchCheckpointIO(), rank, 2, lambda _: None, torch.device("cpu"))
            layouts.add(save_compression_state(state, checkpoint, path, *where))
    assert len(layouts) == 1, "every rank chose the same layout"
    if layouts == {False}:  # one file: the state every rank holds, in the checkpoint
        assert not os.path.exists(path)
        assert state_checksum(states[0]) == state_checksum(states[1])
    resumed = _hook(name)
    for rank, state in enumerate(resumed.states):
        restore_compression_state(state, checkpoint, path, TorchCheckpointIO(), rank, 2)
    for step in range(3, 6):
        expected, got = running.step(_gradients(step)), resumed.step(_gradients(step))
        assert all(torch.equal(e, g) for e, g in zip(expected, got)), f"step {step} differs"


def test_a_hook_that_does_not_read_its_rank_files_resumes_differently():
    """The control of the test above: TopK started empty (not restored) sends other values after the resume."""
    running, fresh = _hook("topk"), _hook("topk")
    for step in range(3):
        running.step(_gradients(step))
    assert not torch.equal(running.step(_gradients(3))[0], fresh.step(_gradients(3))[0])
