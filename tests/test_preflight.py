"""The few-outer-steps warning takes the trainer's callbacks into account: no DenseWarmup advice when it has one."""

import warnings

from lightning.pytorch import Trainer

from lightning_gradcomp import DiLoCo
from lightning_gradcomp.callbacks import DenseWarmup
from lightning_gradcomp.diloco.preflight import few_outer_steps
from tests.models import TinyNet


def test_the_warning_suggests_dense_warmup_only_without_one():
    alone = few_outer_steps(184, 10, None)
    assert alone.endswith("use sync_every=9, or start dense with DenseWarmup.")
    warmed = few_outer_steps(184, 10, None, [object(), DenseWarmup(steps=20)])
    assert warmed.endswith("use sync_every=9.")
    assert "DenseWarmup" not in warmed
    assert few_outer_steps(184, 9, None, [DenseWarmup(steps=20)]) is None


def test_a_fit_with_dense_warmup_is_not_told_to_add_one(in_process_ddp, tmp_path):
    trainer = Trainer(
        strategy=DiLoCo(sync_every=4),
        accelerator="cpu",
        devices=1,
        max_steps=8,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        callbacks=[DenseWarmup(steps=2)],
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(TinyNet())
    lines = [str(w.message) for w in caught if "outer step" in str(w.message) and "fewer than 20" in str(w.message)]
    assert len(lines) == 1, [str(w.message) for w in caught]
    assert lines[0].endswith("use sync_every='auto' (H=1 here).")
