"""Compressor state is training state: every rank's residuals and the compressor's memory resume exactly."""

import os

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_gradcomp import CompressedDDP
from lightning_gradcomp.compressors import PowerSGD, TopK
from tests.models import TinyNet, fit

# 64 samples, 8 per batch, 2 ranks: 4 steps per epoch; tiny buckets so the model spans several of them, and DDP's
# layout after the resume (one bucket, then rebuilt) differs from the uninterrupted run's
DATA = {"n": 64, "batch_size": 8}
DDP_KWARGS = {"bucket_cap_mb": 0.01, "start_method": "spawn"}
COMPRESSORS = {"topk": TopK(ratio=0.05), "powersgd-r1": PowerSGD(rank=1), "powersgd-r2": PowerSGD(rank=2)}


def _strategy(compressor):
    return CompressedDDP(compressor, min_compress_numel=64, **DDP_KWARGS)


def _resume(tmp_path, compressor, edit_checkpoint=None, **trainer_kwargs):
    ckpt_dir = str(tmp_path / "ckpt")
    fit(_strategy(compressor), str(tmp_path / "first"), model=TinyNet(**DATA), max_steps=-1, max_epochs=2,
        enable_checkpointing=True, callbacks=[ModelCheckpoint(dirpath=ckpt_dir, filename="last")],
        **trainer_kwargs)  # fmt: skip
    path = os.path.join(ckpt_dir, "last.ckpt")
    if edit_checkpoint is not None:
        checkpoint = torch.load(path, weights_only=False)
        edit_checkpoint(checkpoint)
        torch.save(checkpoint, path)
    _, _, ranks = fit(_strategy(compressor), str(tmp_path / "resumed"), model=TinyNet(**DATA), max_steps=-1,
                      max_epochs=4, ckpt_path=path, **trainer_kwargs)  # fmt: skip
    return path, ranks


@pytest.mark.parametrize("name", list(COMPRESSORS))
def test_resumed_run_ends_bitwise_equal_to_uninterrupted_run(tmp_path, name):
    compressor = COMPRESSORS[name]
    _, _, straight = fit(_strategy(compressor), str(tmp_path / "straight"), model=TinyNet(**DATA), max_steps=-1,
                         max_epochs=4)  # fmt: skip
    path, resumed = _resume(tmp_path, compressor)
    for rank in range(2):
        assert torch.equal(straight[rank]["params"], resumed[rank]["params"]), f"rank {rank} differs"

    saved = torch.load(path, weights_only=False)["gradcomp"]
    assert saved["world_size"] == 2
    assert len(saved["ranks"]) == 2
    residuals = [entry["residuals"] for entry in saved["ranks"]]
    assert residuals[0].keys() == residuals[1].keys()
    assert residuals[0]
    assert any(not torch.equal(residuals[0][k], residuals[1][k]) for k in residuals[0]), "each rank owes its own error"
    assert saved["ranks"][0]["step"] == 8
    if isinstance(compressor, PowerSGD):
        assert saved["ranks"][0]["compressor"]["queries"], "warm-start queries are saved"


def test_a_16_bit_run_resumes_bitwise_with_its_16_bit_residuals(tmp_path):
    """``precision="bf16-true"``: the residuals are bfloat16 (the gradient's dtype), saved and restored as such."""
    compressor = COMPRESSORS["powersgd-r2"]
    _, _, straight = fit(_strategy(compressor), str(tmp_path / "straight"), model=TinyNet(**DATA), max_steps=-1,
                         max_epochs=4, precision="bf16-true")  # fmt: skip
    path, resumed = _resume(tmp_path, compressor, precision="bf16-true")
    for rank in range(2):
        assert resumed[rank]["params"].dtype == torch.bfloat16
        assert torch.equal(straight[rank]["params"], resumed[rank]["params"]), f"rank {rank} differs"
    residuals = torch.load(path, weights_only=False)["gradcomp"]["ranks"][0]["residuals"]
    assert residuals
    assert {r.dtype for r in residuals.values()} == {torch.bfloat16}


def test_dropping_the_compressor_state_changes_the_result(tmp_path):
    """The control that shows the test above can fail: resuming without the saved residuals diverges."""
    compressor = COMPRESSORS["topk"]
    _, _, straight = fit(_strategy(compressor), str(tmp_path / "straight"), model=TinyNet(**DATA), max_steps=-1,
                         max_epochs=4)  # fmt: skip
    _, resumed = _resume(tmp_path, compressor, edit_checkpoint=lambda ckpt: ckpt.pop("gradcomp"))
    assert not torch.equal(straight[0]["params"], resumed[0]["params"])
