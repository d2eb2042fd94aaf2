"""``Trainer(strategy="compressed_ddp")`` and its presets, ``compressor="auto"``, and any backend torch knows."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_gradcomp import CompressedDDP
from lightning_gradcomp.callbacks import AutoCompression
from lightning_gradcomp.compressors import BF16, FP16, Identity, PowerSGD
from lightning_gradcomp.ddp.arguments import check_backend
from lightning_gradcomp.ddp.names import PRESETS
from tests.models import TinyNet

EXPECTED = {
    "compressed_ddp": (Identity, "popen"),
    "compressed_ddp_spawn": (Identity, "spawn"),
    "compressed_ddp_powersgd": (PowerSGD, "popen"),
    "compressed_ddp_fp16": (FP16, "popen"),
    "compressed_ddp_bf16": (BF16, "popen"),
    "compressed_ddp_auto": (Identity, "popen"),
}


def _trainer(strategy: object, **kwargs: object) -> Trainer:
    return Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        **kwargs,
    )


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_a_registered_name_resolves_to_compressed_ddp_with_its_preset(name):
    compressor_type, start_method = EXPECTED[name]
    strategy = _trainer(name).strategy
    assert type(strategy) is CompressedDDP
    assert type(strategy.compressor) is compressor_type
    assert strategy._start_method == start_method
    assert strategy._auto == (name == "compressed_ddp_auto")


def test_every_preset_is_tested_and_the_class_follows_lightnings_convention():
    assert set(PRESETS) == set(EXPECTED)
    assert CompressedDDP.strategy_name == "compressed_ddp"
    assert "register_strategies" in vars(CompressedDDP)


def test_two_trainers_do_not_share_a_presets_compressor():
    first, second = (_trainer("compressed_ddp_powersgd").strategy for _ in range(2))
    assert first.compressor is not second.compressor
    assert first.compressor.rank == second.compressor.rank == 2


def test_registration_keeps_a_users_own_entry_of_the_same_name():
    registry = _StrategyRegistry()
    registry.register("compressed_ddp", DDPStrategy, description="the user's own", find_unused_parameters=True)
    CompressedDDP.register_strategies(registry)
    assert registry["compressed_ddp"]["strategy"] is DDPStrategy  # kept, not overridden
    assert registry["compressed_ddp"]["init_params"] == {"find_unused_parameters": True}
    assert set(registry) == set(PRESETS)  # the other names are registered
    # control: in an empty registry the name is CompressedDDP's
    fresh = _StrategyRegistry()
    CompressedDDP.register_strategies(fresh)
    assert type(fresh.get("compressed_ddp")) is CompressedDDP
    CompressedDDP.register_strategies(fresh)  # again: no "already present" error


def test_lightnings_registry_holds_the_names_after_import():
    assert {"compressed_ddp", "compressed_ddp_auto", "ddp"} <= set(StrategyRegistry.available_strategies())


def _fit(
    tmp_path: object,
    strategy: CompressedDDP,
    callbacks: list | None = None,
    steps: int = 1,
    model: TinyNet | None = None,
) -> Trainer:
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        callbacks=callbacks,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        default_root_dir=str(tmp_path),
    )
    trainer.fit(model or TinyNet())
    return trainer


def test_compressor_auto_adds_auto_compression_when_fitting(tmp_path, in_process_ddp):
    strategy = CompressedDDP(compressor="auto")
    assert isinstance(strategy.compressor, Identity)
    trainer = _fit(tmp_path, strategy)
    assert sum(isinstance(cb, AutoCompression) for cb in trainer.callbacks) == 1
    plain = _fit(tmp_path, CompressedDDP())  # control: nothing is added without "auto"
    assert not any(isinstance(cb, AutoCompression) for cb in plain.callbacks)


def test_compressor_auto_keeps_the_users_own_auto_compression(tmp_path, in_process_ddp):
    own = AutoCompression(calibration_steps=3)
    trainer = _fit(tmp_path, CompressedDDP(compressor="auto"), callbacks=[own])
    assert [cb for cb in trainer.callbacks if isinstance(cb, AutoCompression)] == [own]


@pytest.mark.parametrize("name", ["powersgd", "AUTO", ""])
def test_another_string_names_auto_and_the_callback(name):
    with pytest.raises(MisconfigurationException, match=r"`compressor`.*'auto'.*AutoCompression.*got") as info:
        CompressedDDP(compressor=name)
    assert repr(name) in str(info.value)


def test_assigning_auto_later_is_refused():
    with pytest.raises(MisconfigurationException, match="`compressor`"):
        CompressedDDP().compressor = "auto"


@pytest.mark.parametrize("backend", ["hccl", "ccl", "cpu:gloo,cuda:hccl"])
def test_any_backend_name_is_accepted_at_construction_as_ddp_strategy_accepts_it(backend):
    assert DDPStrategy(process_group_backend=backend).process_group_backend == backend
    assert CompressedDDP(process_group_backend=backend).process_group_backend == backend


def test_a_backend_registered_with_torch_passes_and_an_unknown_one_names_torchs_list():
    with pytest.raises(MisconfigurationException, match=r"`process_group_backend`.*gloo.*got 'lightning_gc_test'"):
        check_backend("lightning_gc_test")
    if "lightning_gc_test" not in dist.Backend.backend_list:
        dist.Backend.register_backend("lightning_gc_test", lambda *args: None, devices=["cpu"])
    check_backend("lightning_gc_test")
    check_backend("cpu:lightning_gc_test,cuda:nccl")
    with pytest.raises(MisconfigurationException, match="got 'cpu:gloo,cuda:ncl'"):
        check_backend("cpu:gloo,cuda:ncl")


def test_an_unknown_backend_fails_before_the_process_group_starts(tmp_path, in_process_ddp):
    with pytest.raises(MisconfigurationException, match="`process_group_backend`.*got 'ncl'"):
        _fit(tmp_path, CompressedDDP(process_group_backend="ncl"))
    assert not torch.distributed.is_initialized()


class _NetWithUnusedLayer(TinyNet):
    def __init__(self) -> None:
        super().__init__()
        self.unused = torch.nn.Linear(4, 4)  # never in the loss: DDP fails in the second step


def test_an_unused_parameter_suggests_find_unused_parameters_on_compressed_ddp(tmp_path, in_process_ddp):
    with pytest.raises(RuntimeError) as info:
        _fit(tmp_path, CompressedDDP(), steps=3, model=_NetWithUnusedLayer())
    message = str(info.value)
    assert "`strategy=CompressedDDP(..., find_unused_parameters=True)`" in message
    assert "`strategy=DDPStrategy(find_unused_parameters=True)`" not in message  # Lightning's, which drops compression


def test_a_recipe_names_the_strategy_by_its_registered_name():
    from lightning_gradcomp.cli import GradcompCLI

    cli = GradcompCLI(
        args=["--config", "recipes/quickstart.yaml", "--trainer.strategy", "compressed_ddp_powersgd"],
        run=False,
        save_config_callback=None,
    )
    assert type(cli.trainer.strategy) is CompressedDDP
    assert type(cli.trainer.strategy.compressor) is PowerSGD


def test_the_setup_line_mentions_dense_layers_only_when_there_are_some():
    from lightning_gradcomp.ddp.hook import CompressionState
    from lightning_gradcomp.ddp.strategy import _describe

    every = _describe(TinyNet(), CompressionState(Identity()), 2)
    assert "elements);" in every
    assert "averaged densely" not in every
    some = _describe(TinyNet(), CompressionState(PowerSGD(rank=2), min_compress_numel=1024), 2)
    assert "elements; the rest are averaged densely);" in some
