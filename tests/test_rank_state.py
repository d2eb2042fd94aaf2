"""Per-rank state beside a checkpoint (lightning_gradcomp.runtime.rank_state) and CompressedDDP's use of it, rank by
rank.

Each rank is simulated in this process by a strategy whose cluster environment names its rank and world size: saving
and loading per-rank state involves no collective (the strategy's barrier does nothing without a process group), so
what every rank writes and reads can be checked exactly here. The real two-process runs are in test_checkpoint.py.
"""

import os
import time

import pytest
import torch
from lightning.fabric.plugins.environments import LightningEnvironment

from lightning_gradcomp import CompressedDDP, CompressionState
from lightning_gradcomp.compressors import PowerSGD
from lightning_gradcomp.compressors.base import layers_from_shapes
from lightning_gradcomp.ddp.checkpoint import restore_compression_state, save_compression_state
from lightning_gradcomp.runtime.rank_state import (
    load_rank_state,
    rank_state_dir,
    rank_state_path,
    remove_rank_states,
    save_rank_state,
)
from lightning_gradcomp.testing import EXAMPLES, SimulatedHook
from tests.distributed import run_distributed


def _strategy(rank: int, world_size: int) -> CompressedDDP:
    environment = LightningEnvironment()
    environment.set_world_size(world_size)
    environment.set_global_rank(rank)
    return CompressedDDP(PowerSGD(rank=1), cluster_environment=environment)


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
    assert sorted(os.listdir(rank_state_dir(path))) == [f"local.rank{r}.pt" for r in range(3)]
    for rank in range(3):
        loaded = load_rank_state(path, "local", rank)
        assert (loaded.rank, loaded.world_size) == (rank, 3)
        assert torch.equal(loaded.state["weights"], torch.full((3,), float(rank)))
    assert load_rank_state(path, "local", 3) is None
    assert load_rank_state(path, "other", 0) is None


def test_removing_a_rank_s_state_leaves_the_others_and_the_last_removes_the_folder(tmp_path):
    path = tmp_path / "epoch=1.ckpt"
    for rank in range(2):
        save_rank_state(path, "a", {}, rank, 2)
        save_rank_state(path, "b", {}, rank, 2)
    remove_rank_states(path, 0)
    assert sorted(os.listdir(rank_state_dir(path))) == ["a.rank1.pt", "b.rank1.pt"]
    remove_rank_states(path, 1)
    assert not os.path.exists(rank_state_dir(path))
    remove_rank_states(path, 1)  # nothing left: nothing to do


def test_a_link_to_a_checkpoint_finds_the_files_of_the_checkpoint_it_points_to(tmp_path):
    path = tmp_path / "epoch=1.ckpt"
    save_rank_state(path, "a", {"x": 1}, 0, 1)
    os.symlink(path.name, tmp_path / "last.ckpt")
    assert load_rank_state(tmp_path / "last.ckpt", "a", 0).state == {"x": 1}


@pytest.mark.parametrize("key", ["", "a.b", "a/b"])
def test_a_key_that_is_not_a_plain_name_is_refused(tmp_path, key):
    with pytest.raises(ValueError, match="`key`"):
        rank_state_path(tmp_path / "x.ckpt", key, 0)


def test_rank_0_s_checkpoint_holds_no_rank_s_state_and_each_rank_resumes_its_own(tmp_path):
    path = tmp_path / "last.ckpt"
    _save(path, world_size=2)
    assert torch.load(path, weights_only=False)["gradcomp"] == {"world_size": 2, "step": 8}
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
    checkpoint = torch.load(path, weights_only=False)
    checkpoint["gradcomp"]["step"] = 12  # the files are of step 8: not this checkpoint's
    torch.save(checkpoint, path)
    strategy = _strategy(0, 2)
    with pytest.warns(UserWarning, match="missing or older than the checkpoint"):
        strategy.load_checkpoint(path)
    assert strategy.compression_state.state_dict()["residuals"] == {}
    assert strategy.compression_state.step == 8  # from global_step
    remove_rank_states(path, 1)
    strategy = _strategy(1, 2)
    strategy.load_checkpoint(path)
    assert strategy.compression_state.state_dict()["residuals"] == {}


def test_removing_a_checkpoint_removes_each_rank_s_files(tmp_path):
    path = tmp_path / "epoch=0.ckpt"
    _save(path, world_size=2)
    for rank in (1, 0):  # every rank removes its own; rank 0 also the checkpoint
        _strategy(rank, 2).remove_checkpoint(path)
    assert os.listdir(tmp_path) == []


def _save_with_a_slow_rank_1(rank: int, world_size: int, path: str) -> tuple[bool, bool]:
    """Save a checkpoint from every rank, rank 1 writing its file a second late; what rank 0 finds on returning."""
    import lightning_gradcomp.ddp.checkpoint as checkpointing

    if rank == 1:
        save = checkpointing.save_rank_state

        def late(*args, **kwargs):
            time.sleep(1.0)  # a loaded machine: this rank reaches its write after rank 0 is done with its own
            return save(*args, **kwargs)

        checkpointing.save_rank_state = late
    strategy = _strategy(rank, world_size)
    strategy.compression_state.load_state_dict(_rank_state(rank))
    strategy.save_checkpoint({"loops": {}, "global_step": 8, "state_dict": {}}, path)
    other = load_rank_state(path, "gradcomp", 1)
    return os.path.exists(path), other is not None and other.state["global_step"] == 8


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
    for rank, state in enumerate(running.states):
        save_compression_state(state, checkpoint, path, rank, 2, barrier=lambda _: None)
    resumed = _hook(name)
    for rank, state in enumerate(resumed.states):
        restore_compression_state(state, checkpoint, path, rank, 2)
    for step in range(3, 6):
        expected, got = running.step(_gradients(step)), resumed.step(_gradients(step))
        assert all(torch.equal(e, g) for e, g in zip(expected, got)), f"step {step} differs"


def test_a_hook_that_does_not_read_its_rank_files_resumes_differently():
    """The control of the test above: TopK started empty (not restored) sends other values after the resume."""
    running, fresh = _hook("topk"), _hook("topk")
    for step in range(3):
        running.step(_gradients(step))
    assert not torch.equal(running.step(_gradients(3))[0], fresh.step(_gradients(3))[0])
