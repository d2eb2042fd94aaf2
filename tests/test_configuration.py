"""Bad configurations of the strategy and the callbacks are refused before training, naming the argument.

The cases of the reliability probe (sections 1 and 2) that used to be accepted, plus their neighbours: each must
raise Lightning's ``MisconfigurationException`` (the strategy's and the callbacks' one exception type) with a message
that names the argument.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_gradcomp import CompressedDDP, PacTrain, Pufferfish
from lightning_gradcomp.callbacks import Accordion, CompressionMonitor, DenseWarmup, TracIn
from lightning_gradcomp.compressors import QSGD, PowerSGD, TopK
from lightning_gradcomp.tasks import ImageClassifier
from tests.models import TinyNet


def _setter(obj: Any, name: str, value: Any) -> Callable[[], None]:
    return lambda: setattr(obj, name, value)


def _accordion_setup(compressor: Any, **kwargs: Any) -> Callable[[], None]:
    """Accordion's setup (where levels meet the compressor) on a stub trainer."""
    from types import SimpleNamespace

    def run() -> None:
        module = TinyNet()
        strategy = CompressedDDP(compressor, min_compress_numel=64)
        trainer = SimpleNamespace(strategy=strategy, callbacks=[], accumulate_grad_batches=1)
        Accordion(**kwargs).setup(trainer, module, "fit")

    return run


CASES: dict[str, tuple[Callable[[], Any], str]] = {
    # the strategy, and what its **kwargs pass to DDPStrategy and DistributedDataParallel
    "misspelt-compressor": (lambda: CompressedDDP(compresor=TopK()), "compresor"),
    "misspelt-ddp-kwarg": (lambda: CompressedDDP(static_graf=True), "static_graf"),
    "timeout-int": (lambda: CompressedDDP(timeout=30), "timeout"),
    "bucket-cap-negative": (lambda: CompressedDDP(bucket_cap_mb=-1), "bucket_cap_mb"),
    "bucket-cap-nan": (lambda: CompressedDDP(bucket_cap_mb=math.nan), "bucket_cap_mb"),
    "start-method-threads": (lambda: CompressedDDP(start_method="threads"), "start_method"),
    "device-ids": (lambda: CompressedDDP(device_ids=[0]), "device_ids"),
    "static-graph-not-bool": (lambda: CompressedDDP(static_graph="yes"), "static_graph"),
    "monitor-not-bool": (lambda: CompressedDDP(monitor=1), "monitor"),
    "seed-float": (lambda: CompressedDDP(seed=1.5), "seed"),
    "reset-state-after-zero": (lambda: CompressedDDP(reset_state_after=0), "reset_state_after"),
    "enabled-not-bool": (_setter(CompressedDDP(), "compression_enabled", 1), "compression_enabled"),
    # callbacks
    "accordion-low-nan": (lambda: Accordion(low_compression_level=math.nan), "low_compression_level"),
    "accordion-high-inf": (lambda: Accordion(high_compression_level=math.inf), "high_compression_level"),
    "accordion-eta-nan": (lambda: Accordion(eta=math.nan), "eta"),
    "accordion-qsgd-swapped": (
        _accordion_setup(QSGD(levels=4), low_compression_level=2, high_compression_level=8),
        "low_compression_level",
    ),
    "accordion-powersgd-swapped": (
        _accordion_setup(PowerSGD(rank=1), low_compression_level=1, high_compression_level=2),
        "low_compression_level",
    ),
    "warmup-negative-epochs-after": (_setter(DenseWarmup(epochs=2), "epochs", -1), "epochs"),
    "warmup-negative-steps-after": (_setter(DenseWarmup(steps=2), "steps", -3), "steps"),
    "warmup-ramp-length-after": (_setter(DenseWarmup(epochs=1, ramp="dgc"), "ramp_length", 0), "ramp_length"),
    "warmup-ramp-nan": (lambda: DenseWarmup(epochs=1, ramp=[0.5, math.nan]), "ramp"),
    "monitor-prog-bar": (lambda: CompressionMonitor(prog_bar="yes"), "prog_bar"),
    "tracin-top-n": (lambda: TracIn("x", top_n=-1), "top_n"),
    "tracin-loss": (lambda: TracIn("x", loss="hinge"), "loss"),
    "pactrain-sparsity-nan": (lambda: PacTrain(sparsity=math.nan), "sparsity"),
    "pactrain-end-before-start": (lambda: PacTrain(start_step=10, end_step=5), "end_step"),
    "pufferfish-rank-ratio": (lambda: Pufferfish(warmup_epochs=1, rank_ratio=math.inf), "rank_ratio"),
    # tasks
    "classifier-milestone-in-warmup": (lambda: ImageClassifier(milestones=[3], warmup_epochs=5), "milestones"),
    "classifier-lr-nan": (lambda: ImageClassifier(lr=math.nan), "lr"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_configuration_is_refused_naming_the_argument(case):
    make, argument = CASES[case]
    with pytest.raises(MisconfigurationException, match=f"`{argument}`"):
        make()


def test_a_misspelt_keyword_names_the_closest_valid_one():
    with pytest.raises(MisconfigurationException, match="Did you mean `compressor`"):
        CompressedDDP(compresor=TopK())


def test_valid_ddp_arguments_still_pass():
    strategy = CompressedDDP(
        timeout=timedelta(minutes=5),
        bucket_cap_mb=1,
        start_method="spawn",
        process_group_backend="gloo",
        broadcast_buffers=False,
    )
    assert strategy._timeout == timedelta(minutes=5)
    assert strategy._ddp_kwargs == {"bucket_cap_mb": 1, "broadcast_buffers": False}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_nccl_without_cuda_is_refused_before_the_process_group_starts(tmp_path, in_process_ddp):
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        strategy=CompressedDDP(process_group_backend="nccl"),
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        default_root_dir=str(tmp_path),
    )
    with pytest.raises(MisconfigurationException, match="`process_group_backend='nccl'`"):
        trainer.fit(TinyNet())
    assert not torch.distributed.is_initialized()


def test_a_monitor_on_the_wrong_strategy_says_which_it_requires_in_one_line():
    from types import SimpleNamespace

    from lightning.pytorch.strategies import DDPStrategy

    from lightning_gradcomp import CompressedDDP, DiLoCo
    from lightning_gradcomp.callbacks import CompressionMonitor, OuterMonitor

    for monitor, wrong, right, wanted in [
        (CompressionMonitor(), DDPStrategy(), CompressedDDP(), "CompressedDDP"),
        (OuterMonitor(), CompressedDDP(), DiLoCo(), "DiLoCo"),
    ]:
        with pytest.raises(MisconfigurationException) as error:
            monitor._state(SimpleNamespace(strategy=wrong))
        requires = f"`{type(monitor).__name__}` requires `Trainer(strategy={wanted}(...))`"
        assert str(error.value) == f"{requires}, got `{type(wrong).__name__}`."
        assert monitor._state(SimpleNamespace(strategy=right)) is not None  # the control: the right strategy passes
