"""Compressor state is training state: every rank's residuals and the compressor's memory resume exactly; the
checkpoints are laid out as Lightning writes them.

Every fit here runs in one launch of tests/fit_worker.py (two processes under Lightning's default launcher, as a
user's script runs): 4 epochs straight, 2 epochs saving a checkpoint, and 2 more resumed from it, per compressor; then
checkpoints passed between plain ``DDPStrategy`` and ``CompressedDDP``, and ``ModelCheckpoint``'s rotations. A launch
costs seconds, a fit a fraction of one, and both CI stages run this file.
"""

import math
import os
import shutil

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy

from lightning_gradcomp import CompressedDDP
from lightning_gradcomp.compressors import TopK
from lightning_gradcomp.runtime.rank_state import CHECKPOINT_FILE, checkpoint_file, load_rank_state
from tests.fit_worker import ValNet, assert_same_weights, run_fits, run_name
from tests.models import TinyNet

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
    "ddp:rotate",
    "identity:rotate",
    *(f"{strategy}:every3" for strategy in ("ddp", "identity", "fp16", "topk", "powersgd-r2")),
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
    """Lightning's checkpoint of the run's ``last.ckpt`` (the file, or the one in its directory)."""
    return torch.load(checkpoint_file(os.path.join(root, run_name(run), "last.ckpt")), weights_only=False)


def _saved_ranks(root, run, world_size=2):
    """What each rank saved in the run's last checkpoint (its compressor state)."""
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
    """``ModelCheckpoint(save_top_k=1, save_last="link")``: each checkpoint is one directory, the older removed with
    every rank's file in it, and a run resumed from the ``last.ckpt`` link finds the files of the checkpoint it points
    to."""
    root, _, records = launch
    folder = os.path.join(root, run_name("topk:rotate"))
    checkpoints = {name for name in os.listdir(folder) if not name.startswith("rank")}
    assert checkpoints == {"epoch=1.ckpt", "last.ckpt"}
    assert os.path.islink(os.path.join(folder, "last.ckpt"))
    files = sorted(os.listdir(os.path.join(folder, "epoch=1.ckpt")))
    assert files == [CHECKPOINT_FILE, "gradcomp.rank0.pt", "gradcomp.rank1.pt"]
    assert_same_weights(records["topk:epochs4"], records["topk:epochs4+topk:rotate"])


def _entries(root, run):
    folder = os.path.join(root, run_name(run))
    names = [name for name in os.listdir(folder) if not name.startswith("rank")]  # not the records of the ranks
    return {name: os.path.isdir(os.path.join(folder, name)) for name in names}


def test_without_state_of_the_ranks_own_the_checkpoint_folder_is_plain_ddp_s(launch):
    """Identity (and FP16, without error feedback) write exactly the checkpoint files DDPStrategy writes, from rank 0
    alone, under ``ModelCheckpoint``'s ``save_top_k``, ``save_last`` (a link and a copy) and ``every_n_train_steps``;
    with residuals (TopK, PowerSGD) each checkpoint is one directory of the same name, in which rank 1 writes its file
    and nothing else."""
    root, _, records = launch
    for variant in ("rotate", "every3"):
        plain = _entries(root, f"ddp:{variant}")
        assert not any(plain.values()), plain
        assert _entries(root, f"identity:{variant}") == plain, variant
    plain = _entries(root, "ddp:every3")
    assert set(plain) == {"step=6.ckpt", "last.ckpt"}, "step 3's checkpoint was removed"
    assert _entries(root, "fp16:every3") == plain
    for name in ("topk", "powersgd-r2"):
        assert _entries(root, f"{name}:every3") == dict.fromkeys(plain, True), name
    for name in ("ddp", "identity", "fp16"):
        ranks = records[f"{name}:every3"]
        assert ranks[0]["checkpoints_written"] == ["step=3.ckpt", "last.ckpt", "step=6.ckpt", "last.ckpt"], name
        assert ranks[1]["checkpoints_written"] == [], f"{name}: a rank other than 0 wrote a file"
    saves = ("step=3.ckpt", "last.ckpt", "step=6.ckpt", "last.ckpt")
    ranks = records["topk:every3"]
    assert ranks[1]["checkpoints_written"] == [f"{c}/gradcomp.rank1.pt" for c in saves]
    rank_0 = [f"{c}/{f}" for c in saves for f in ("gradcomp.rank0.pt", CHECKPOINT_FILE)]
    assert ranks[0]["checkpoints_written"] == rank_0
    saved = _saved(root, "identity:every3")
    assert saved["gradcomp"]["state"]["compressor_class"] == "Identity", "the shared state is in the one file"
    assert saved["gradcomp"]["state"]["step"] == 6


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


def _trainer(root, max_steps, checkpointing):
    return Trainer(
        accelerator="cpu",
        devices=1,
        strategy=CompressedDDP(TopK(ratio=0.05)),
        max_steps=max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(root),
        callbacks=[checkpointing],
    )


def test_lightning_finds_resumes_validates_and_loads_a_checkpoint_directory(tmp_path, in_process_ddp):
    """One process (no launch): TopK's residuals make each checkpoint a directory. ``ckpt_path="last"`` finds it and
    resumes the step count and the residuals, ``validate(ckpt_path=...)`` and ``load_from_checkpoint`` read it, and
    plain ``DDPStrategy`` reads the file inside it."""
    folder = tmp_path / "ckpt"
    every2 = {"dirpath": folder, "filename": "{step}", "every_n_train_steps": 2, "save_top_k": -1, "save_last": True}
    first = _trainer(tmp_path, 4, ModelCheckpoint(**every2))
    first.fit(TinyNet(n=64))
    assert sorted(os.listdir(folder)) == ["last.ckpt", "step=2.ckpt", "step=4.ckpt"]
    assert all(os.path.isdir(folder / name) for name in os.listdir(folder))
    saved = {k: v.clone() for k, v in first.lightning_module.state_dict().items()}
    residuals = first.strategy.compression_state.state_dict()["residuals"]
    assert residuals

    resumed = _trainer(tmp_path, 6, ModelCheckpoint(**every2))
    model = TinyNet(n=64)
    state = resumed.strategy.compression_state
    loaded = []
    resumed.strategy.load_checkpoint = _spy(resumed.strategy.load_checkpoint, loaded, state)
    resumed.fit(model, ckpt_path="last")
    assert loaded == [(str(folder / "last.ckpt"), 4)], "resumed from last.ckpt's step 4 with its residuals"
    assert resumed.global_step == 6
    assert state.step == 6

    metrics = resumed.validate(ValNet(), ckpt_path=str(folder / "step=4.ckpt"), verbose=False)
    assert metrics
    assert math.isfinite(metrics[0]["val_loss"])
    inside = folder / "step=4.ckpt" / CHECKPOINT_FILE
    for path in (folder / "step=4.ckpt", str(folder / "step=4.ckpt"), inside):  # the directory, or the file inside
        restored = TinyNet.load_from_checkpoint(path, n=64)
        assert all(torch.equal(v, restored.state_dict()[k]) for k, v in saved.items()), path
    plain = DDPStrategy().load_checkpoint(inside)
    assert all(torch.equal(v, plain["state_dict"][k]) for k, v in saved.items())


def _spy(load, loaded, state):
    """``load`` (a strategy's ``load_checkpoint``) that notes the path it was given and the step it restored."""

    def spied(path, *args, **kwargs):
        checkpoint = load(path, *args, **kwargs)
        loaded.append((str(path), state.step))
        assert state.state_dict()["residuals"], "the residuals were restored"
        return checkpoint

    return spied
