"""Compressor state is training state: every rank's residuals and the compressor's memory resume exactly.

Every fit here runs in one launch of tests/fit_worker.py (two processes under Lightning's default launcher, as a
user's script runs): 4 epochs straight, 2 epochs saving a checkpoint, and 2 more resumed from it, per compressor; then
checkpoints passed between plain ``DDPStrategy`` and ``CompressedDDP``. A launch costs seconds, a fit a fraction of
one, and both CI stages run this file.
"""

import os
import shutil

import pytest
import torch

from lightning_gradcomp.runtime.rank_state import load_rank_state
from tests.fit_worker import assert_same_weights, run_fits, run_name

COMPRESSORS = ["topk", "powersgd-r1", "powersgd-r2"]


def _resumable(strategy, precision=""):
    """The straight run, the run that saves its checkpoint after 2 of 4 epochs, and the run that resumes from it."""
    first = f"{strategy}:{precision}epochs2"
    return [f"{strategy}:{precision}epochs4", first, f"{strategy}:{precision}epochs4+{first}"]


RUNS = [
    *(run for name in COMPRESSORS for run in _resumable(name)),
    *_resumable("powersgd-r2", "bf16-"),
    "topk:epochs4+topk:epochs2:stateless",
    "topk:rotate",
    "topk:epochs4+topk:rotate",
    *_resumable("ddp"),
    "identity:epochs2",
    "identity:epochs4+ddp:epochs2",
    "ddp:epochs4+identity:epochs2",
    "topk:epochs4+ddp:epochs2",
]


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    """The launch's folder, output and every run's records."""
    root = tmp_path_factory.mktemp("checkpoint")
    code, output, records = run_fits(root, 2, RUNS)
    assert code == 0, output[-3000:]
    return root, output, records


def _saved(root, run):
    return torch.load(os.path.join(root, run_name(run), "last.ckpt"), weights_only=False)


def _saved_ranks(root, run, world_size=2):
    """What each rank saved beside the run's last checkpoint (its compressor state)."""
    path = os.path.join(root, run_name(run), "last.ckpt")
    return [load_rank_state(path, "gradcomp", rank).state for rank in range(world_size)]


@pytest.mark.parametrize("name", COMPRESSORS)
def test_resumed_run_ends_bitwise_equal_to_uninterrupted_run(launch, name):
    root, _, records = launch
    straight, first, resumed = _resumable(name)
    assert_same_weights(records[straight], records[resumed])
    assert len(records[resumed][0]["steps"]) == 8, "the resumed run trains epochs 3 and 4"

    saved = _saved(root, first)["gradcomp"]
    assert saved == {"world_size": 2, "step": 8}, "rank 0's checkpoint holds no rank's state"
    ranks = _saved_ranks(root, first)
    residuals = [entry["residuals"] for entry in ranks]
    assert residuals[0].keys() == residuals[1].keys()
    assert residuals[0]
    assert any(not torch.equal(residuals[0][k], residuals[1][k]) for k in residuals[0]), "each rank owes its own error"
    assert ranks[0]["step"] == ranks[1]["step"] == 8
    if name.startswith("powersgd"):
        assert ranks[0]["compressor"]["queries"], "warm-start queries are saved"


def test_a_16_bit_run_resumes_bitwise_with_its_16_bit_residuals(launch):
    """``precision="bf16-true"``: the residuals are bfloat16 (the gradient's dtype), saved and restored as such."""
    root, _, records = launch
    straight, first, resumed = _resumable("powersgd-r2", "bf16-")
    assert records[resumed][0]["params"].dtype == torch.bfloat16
    assert_same_weights(records[straight], records[resumed])
    residuals = _saved_ranks(root, first)[0]["residuals"]
    assert residuals
    assert {r.dtype for r in residuals.values()} == {torch.bfloat16}


def test_dropping_the_compressor_state_changes_the_result(launch):
    """The control that shows the tests above can fail: resuming without the saved residuals diverges."""
    _, _, records = launch
    dropped = records["topk:epochs4+topk:epochs2:stateless"]
    assert torch.equal(dropped[0]["params"], dropped[1]["params"]), "replicas diverged"
    assert not torch.equal(records["topk:epochs4"][0]["params"], dropped[0]["params"])


def test_checkpoints_pass_between_plain_ddp_and_compressed_ddp(launch):
    """A user switching strategies mid-run: a plain ``DDPStrategy`` checkpoint resumed by ``CompressedDDP(Identity)``
    and the reverse end bitwise where 4 epochs of plain DDP end. Resumed by TopK, it warns that the compressor state
    starts empty and trains compressed from there, with identical replicas."""
    root, output, records = launch
    assert "gradcomp" not in _saved(root, "ddp:epochs2")
    dense = records["ddp:epochs4"]
    # the control: plain DDPStrategy resumed from its own checkpoint ends where it ends uninterrupted
    assert_same_weights(dense, records["ddp:epochs4+ddp:epochs2"], "DDPStrategy resumed by DDPStrategy")
    assert_same_weights(dense, records["identity:epochs4+ddp:epochs2"], "DDPStrategy resumed by Identity")
    assert_same_weights(dense, records["ddp:epochs4+identity:epochs2"], "Identity resumed by DDPStrategy")

    assert "The checkpoint holds no CompressedDDP state" in output, output[-3000:]
    topk = records["topk:epochs4+ddp:epochs2"]
    assert torch.equal(topk[0]["params"], topk[1]["params"]), "replicas diverged"
    assert len(topk[0]["steps"]) == 8
    ratios = [s["stats"].compression_ratio for s in topk[0]["steps"]]
    assert all(ratio > 2 for ratio in ratios), ratios
    assert not torch.equal(topk[0]["params"], dense[0]["params"]), "TopK sent less than all"


def test_checkpoints_removed_by_model_checkpoint_take_their_rank_files_along(launch):
    """``ModelCheckpoint(save_top_k=1, save_last="link")``: the older checkpoint's per-rank files go with it, and a run
    resumed from the ``last.ckpt`` link finds the files of the checkpoint it points to."""
    root, _, records = launch
    folder = os.path.join(root, run_name("topk:rotate"))
    checkpoints = {name for name in os.listdir(folder) if not name.startswith("rank")}
    assert checkpoints == {"epoch=1.ckpt", "epoch=1.ckpt.ranks", "last.ckpt"}
    assert os.path.islink(os.path.join(folder, "last.ckpt"))
    assert sorted(os.listdir(os.path.join(folder, "epoch=1.ckpt.ranks"))) == ["gradcomp.rank0.pt", "gradcomp.rank1.pt"]
    assert_same_weights(records["topk:epochs4"], records["topk:epochs4+topk:rotate"])


def test_a_checkpoint_of_two_ranks_resumes_on_one_with_a_warning(launch, tmp_path):
    """On another world size the step and the compressor's state carry over; the per-rank residuals cannot be mapped
    to the new ranks: they start empty, and the run says so."""
    root, _, _ = launch
    shutil.copytree(os.path.join(root, run_name("powersgd-r2:epochs2")), tmp_path / run_name("powersgd-r2:epochs2"))
    run = "powersgd-r2:epochs4+powersgd-r2:epochs2"
    code, output, records = run_fits(tmp_path, 1, [run])
    assert code == 0, output[-3000:]
    assert "saved by 2 processes, this run has 1" in output
    assert "per-rank error-feedback residuals cannot be mapped" in output
    assert len(records[run][0]["steps"]) == 16, "epochs 3 and 4 at 8 steps each"
    assert torch.isfinite(records[run][0]["params"]).all()
    resumed = _saved_ranks(tmp_path, run, world_size=1)[0]
    assert resumed["step"] == 8 + 16, "the step counter carried over"
