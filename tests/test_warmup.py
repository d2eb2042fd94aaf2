"""DenseWarmup: dense steps are plain DDP bitwise, then the compressor (after an optional DGC ramp); survives resume."""

import math
import os
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_gradcomp import CompressedDDP, DiLoCo
from lightning_gradcomp.callbacks import DGC_RAMP, DenseWarmup
from lightning_gradcomp.compressors import Identity, PowerSGD, TopK
from lightning_gradcomp.compressors.base import keep_count
from lightning_gradcomp.demo.digits import fit
from tests.models import TinyNet

# 64 samples, 8 per batch, 2 ranks: 4 steps per epoch, 3 epochs. Dense for steps 0-5, then keep-ratios 0.25 (steps
# 6-7), 0.1 (8-9), then the compressor's 0.05 (10-11). Tiny buckets: the model spans several.
DATA = {"n": 64, "batch_size": 8}
DENSE_STEPS, RAMP, TARGET = 6, (0.25, 0.1), 0.05
SPAWN = {"start_method": "spawn", "bucket_cap_mb": 0.01}
MIN_NUMEL = 64


def _warmup_strategy():
    return CompressedDDP(TopK(ratio=TARGET), min_compress_numel=MIN_NUMEL, **SPAWN)


def _topk_bytes(ratio: float) -> int:
    """Payload bytes per step of TinyNet under TopK(ratio) (formula of docs/compressors.md), bucket by bucket."""
    from lightning_gradcomp.compressors.base import Layer

    total = 0
    for i, p in enumerate(TinyNet().parameters()):
        if TopK(ratio).compresses(Layer("", i, p.shape), MIN_NUMEL):
            k = keep_count(p.numel(), ratio)
            total += 2 * math.ceil(4 * k / 8) * 8  # values and int32 indices, 8-byte aligned
        else:
            total += 4 * p.numel()
    return total


def _dense_bytes() -> int:
    return 4 * sum(p.numel() for p in TinyNet().parameters())


def _expected_ratio(step: int) -> float | None:
    if step < DENSE_STEPS:
        return None
    stage = (step - DENSE_STEPS) // 2
    return RAMP[stage] if stage < len(RAMP) else TARGET


@pytest.fixture(scope="module")
def warmup_run(tmp_path_factory):
    """One warm-up run with a checkpoint every epoch, the Identity run, and a resume from inside the dense phase."""
    tmp = tmp_path_factory.mktemp("warmup")
    ckpt_dir = str(tmp / "ckpt")
    callbacks = [
        DenseWarmup(steps=DENSE_STEPS, ramp=list(RAMP), ramp_length=2),
        ModelCheckpoint(dirpath=ckpt_dir, filename="{epoch}", save_top_k=-1, every_n_epochs=1),
    ]
    _, warm = fit(
        TinyNet(**DATA),
        _warmup_strategy(),
        str(tmp / "warm"),
        callbacks=callbacks,
        max_epochs=3,
        enable_checkpointing=True,
    )
    identity = CompressedDDP(Identity(), **SPAWN)
    _, dense = fit(TinyNet(**DATA), identity, str(tmp / "identity"), max_steps=DENSE_STEPS + 1)
    resume_from = os.path.join(ckpt_dir, "epoch=0.ckpt")  # after step 4: inside the dense phase
    _, resumed = fit(
        TinyNet(**DATA),
        _warmup_strategy(),
        str(tmp / "resumed"),
        max_epochs=3,
        ckpt_path=resume_from,
        callbacks=[DenseWarmup(steps=DENSE_STEPS, ramp=list(RAMP), ramp_length=2)],
    )
    return warm, dense, resumed


def test_dense_steps_are_bitwise_identity_then_compressed(warmup_run):
    warm, dense, _ = warmup_run
    for rank in range(2):
        for step in range(DENSE_STEPS):
            for name, value in warm[rank]["weights"][step].items():
                assert torch.equal(value, dense[rank]["weights"][step][name]), f"rank {rank} step {step} {name}"
        # the first compressed step leaves different weights
        first = warm[rank]["weights"][DENSE_STEPS]
        assert any(not torch.equal(v, dense[rank]["weights"][DENSE_STEPS][k]) for k, v in first.items())
    params = [name for name, _ in TinyNet().named_parameters()]  # batch-norm statistics are each rank's own
    assert all(torch.equal(warm[0]["final"][k], warm[1]["final"][k]) for k in params), "replicas differ"


def test_logged_bytes_follow_dense_phase_then_ramp_then_target(warmup_run):
    warm, _, _ = warmup_run
    for rank in range(2):
        steps = warm[rank]["steps"]
        assert len(steps) == 12
        for step, record in enumerate(steps):
            ratio = _expected_ratio(step)
            assert record["bytes_dense"] == _dense_bytes()
            if ratio is None:
                assert record["bytes_sent"] == _dense_bytes(), f"step {step} must be dense"
                assert not record["compression_enabled"]
            else:
                # the non-finite flags ride along (counted as sent): the payload is the rest
                payload = record["bytes_sent"] - record["bytes_guard"]
                assert payload == _topk_bytes(ratio), f"step {step} must use keep-ratio {ratio}"
    ratios = [s["bytes_dense"] / s["bytes_sent"] for s in warm[0]["steps"]]
    assert ratios[DENSE_STEPS - 1] == 1.0 < ratios[DENSE_STEPS] < ratios[DENSE_STEPS + 2] < ratios[DENSE_STEPS + 4]


def test_resume_inside_the_dense_phase_follows_the_restored_step(warmup_run):
    warm, _, resumed = warmup_run
    for rank in range(2):
        # the resumed run made steps 4..11 exactly as the uninterrupted one: dense 4-5, then the ramp
        assert [s["bytes_sent"] for s in resumed[rank]["steps"]] == [s["bytes_sent"] for s in warm[rank]["steps"][4:]]
        for name, value in warm[rank]["final"].items():
            assert torch.equal(value, resumed[rank]["final"][name]), f"rank {rank}: {name} differs after resume"


# ------------------------------------------------------------------------------------------------------------------
# Schedule and configuration (no processes)
# ------------------------------------------------------------------------------------------------------------------
def test_phase_schedule():
    warmup = DenseWarmup(epochs=1, ramp="dgc")
    assert warmup.ramp == DGC_RAMP == (0.25, 0.0625, 0.015625, 0.004)
    assert [warmup.phase(e) for e in range(7)] == [
        (False, None),
        (True, 0),
        (True, 1),
        (True, 2),
        (True, 3),
        (True, None),
        (True, None),
    ]
    assert [DenseWarmup(steps=3).phase(s) for s in range(5)] == [(False, None)] * 3 + [(True, None)] * 2
    assert DenseWarmup(steps=0).phase(0) == (True, None)
    assert [DenseWarmup(steps=0, ramp=[0.5], ramp_length=3).phase(s)[1] for s in range(5)] == [0, 0, 0, None, None]


def _trainer_stub(strategy, global_step=0, current_epoch=0):
    return SimpleNamespace(strategy=strategy, global_step=global_step, current_epoch=current_epoch)


def test_ramp_sets_ratio_never_below_the_target_and_teardown_restores_it():
    strategy = CompressedDDP(TopK(ratio=0.01))
    warmup = DenseWarmup(steps=2, ramp=[0.25, 0.004])
    warmup.setup(_trainer_stub(strategy), None, "fit")
    seen = []
    for step in range(5):
        warmup.on_train_batch_start(_trainer_stub(strategy, global_step=step), None, None, 0)
        seen.append((strategy.compression_enabled, strategy.compressor.ratio))
    # 0.004 is harder than the target 0.01: the ramp stops at the target
    assert seen == [(False, 0.01), (False, 0.01), (True, 0.25), (True, 0.01), (True, 0.01)]
    warmup.on_train_batch_start(_trainer_stub(strategy, global_step=2), None, None, 0)
    assert strategy.compressor.ratio == 0.25
    warmup.teardown(None, None, "fit")
    assert strategy.compressor.ratio == 0.01


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({}, "exactly one of `epochs` and `steps`"),
        ({"epochs": 1, "steps": 1}, "exactly one of `epochs` and `steps`"),
        ({"epochs": -1}, "`epochs`"),
        ({"steps": 1.5}, "`steps`"),
        ({"steps": 1, "ramp": "linear"}, "`ramp`"),
        ({"steps": 1, "ramp": []}, "`ramp`"),
        ({"steps": 1, "ramp": [0.5, 1.5]}, "`ramp`"),
        ({"steps": 1, "ramp": [0.5], "ramp_length": 0}, "`ramp_length`"),
        ({"steps": 1, "ramp_length": 2}, "`ramp_length` is set but there is no `ramp`"),
    ],
)
def test_bad_arguments_fail_at_construction(kwargs, match):
    with pytest.raises(MisconfigurationException, match=match):
        DenseWarmup(**kwargs)


def test_setup_requires_compressed_ddp_and_a_ratio_for_the_ramp():
    with pytest.raises(MisconfigurationException, match="requires `Trainer\\(strategy=CompressedDDP"):
        DenseWarmup(steps=1).setup(_trainer_stub(DDPStrategy()), None, "fit")
    with pytest.raises(MisconfigurationException, match="sparsifying compressor"):
        DenseWarmup(steps=1, ramp="dgc").setup(_trainer_stub(CompressedDDP(PowerSGD(rank=1))), None, "fit")
    DenseWarmup(steps=1).setup(_trainer_stub(CompressedDDP(PowerSGD(rank=1))), None, "fit")  # no ramp: any compressor


def test_with_diloco_the_dense_phase_is_synchronous_and_a_ramp_is_refused():
    strategy = DiLoCo(sync_every=4)
    warmup = DenseWarmup(steps=2)
    warmup.setup(_trainer_stub(strategy), None, "fit")
    seen = []
    for step in range(4):
        warmup.on_train_batch_start(_trainer_stub(strategy, global_step=step), None, None, 0)
        seen.append(strategy.synchronous)
    assert seen == [True, True, False, False]
    with pytest.raises(MisconfigurationException, match="with DiLoCo give no ramp, got ramp=\\[0.5\\]"):
        DenseWarmup(steps=1, ramp=[0.5]).setup(_trainer_stub(strategy), None, "fit")
    with pytest.raises(MisconfigurationException, match="Expected `synchronous` to be True or False, got 1"):
        strategy.synchronous = 1


def _dense_phase(compressor_factory, steps=3):
    """Through the real hook on simulated ranks with compression off (DenseWarmup's dense phase)."""
    from lightning_gradcomp.compressors.base import layers_from_shapes
    from lightning_gradcomp.ddp.hook import CompressionState
    from lightning_gradcomp.testing import SimulatedHook

    layers = layers_from_shapes([(32, 40), (16,)])
    numel = sum(layer.numel for layer in layers)
    hook = SimulatedHook([CompressionState(compressor_factory(), enabled=False) for _ in range(2)], layers)
    grads = [
        [torch.randn(numel, generator=torch.Generator().manual_seed(10 * s + r)) for r in range(2)]
        for s in range(steps)
    ]
    return [hook.step(g) for g in grads], [(g[0] + g[1]) / 2 for g in grads]


def test_dense_warmup_keeps_dgc_momentum():
    """DGC's momentum lives in the compressor (the optimizer has none): the dense phase is momentum SGD, not SGD."""
    from lightning_gradcomp.compressors import DGC

    outs, averages = _dense_phase(lambda: DGC(momentum=0.9))
    u = torch.zeros_like(averages[0])
    for out, average in zip(outs, averages):
        u = 0.9 * u + average
        torch.testing.assert_close(out[0], u, rtol=1e-6, atol=1e-6)
        assert torch.equal(out[0], out[1])


def test_dense_warmup_keeps_the_sign_step():
    """signSGD's learning rate is a per-coordinate step: the dense phase takes the sign of the exact average."""
    from lightning_gradcomp.compressors import SignSGD

    outs, averages = _dense_phase(SignSGD)
    for out, average in zip(outs, averages):
        assert torch.equal(out[0], torch.sign(average))


def test_dense_warmup_is_plain_averaging_for_other_methods():
    from lightning_gradcomp.compressors import PowerSGD, TopK

    for factory in (TopK, PowerSGD):
        outs, averages = _dense_phase(factory)
        for out, average in zip(outs, averages):
            torch.testing.assert_close(out[0], average, rtol=0, atol=1e-6)
