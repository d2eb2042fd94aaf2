"""Every recipe in recipes/ parses and instantiates with LightningCLI(run=False)."""

import glob
import os
import re

import pytest
import torch
import yaml

from lightning_gradcomp import CompressedDDP, DiLoCo, ShardedDiLoCo
from lightning_gradcomp.cli import GradcompCLI

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPES = sorted(glob.glob(os.path.join(ROOT, "recipes", "*.yaml")))


def test_there_are_recipes():
    assert os.path.join(ROOT, "recipes", "quickstart.yaml") in RECIPES


@pytest.mark.parametrize("path", RECIPES, ids=[os.path.basename(p) for p in RECIPES])
def test_recipe_parses_and_instantiates(path, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # nothing a recipe writes lands in the repository
    # a fault-tolerant recipe takes the lighthouse and its group's name from the environment, as its jobs do
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://127.0.0.1:29510")
    monkeypatch.setenv("REPLICA_GROUP_ID", "1")
    cli = GradcompCLI(args=["--config", path, "--trainer.accelerator", "cpu", "--trainer.devices", "1"], run=False)
    with open(path) as f:
        config = yaml.safe_load(f)
    strategy = config["trainer"]["strategy"]
    if strategy["class_path"].endswith("DiLoCo"):
        assert isinstance(cli.trainer.strategy, (DiLoCo, ShardedDiLoCo))
        assert cli.trainer.strategy.sync_every == strategy.get("init_args", {}).get("sync_every", "auto")
        fault_tolerance = strategy.get("init_args", {}).get("fault_tolerance")
        if fault_tolerance is not None:
            settings = cli.trainer.strategy.fault_tolerance
            assert (settings.lighthouse, settings.name) == ("http://127.0.0.1:29510", "1")
            assert settings.start_replicas == fault_tolerance["init_args"]["start_replicas"]
            # the recipe's groups read different parts of the data: group 1 the second of two
            assert (settings.groups, settings.group_index) == (fault_tolerance["init_args"]["num_groups"], 1)
        else:
            assert cli.trainer.strategy.fault_tolerance is None
    else:
        assert isinstance(cli.trainer.strategy, CompressedDDP), "the other recipes train with CompressedDDP"
        # the compressor the recipe names is the one the strategy holds (Identity when it names none)
        named = strategy.get("init_args", {}).get("compressor", {}).get("class_path", "Identity")
        assert type(cli.trainer.strategy.compressor).__name__ == named.rpartition(".")[2]
    assert cli.trainer.max_epochs == config["trainer"]["max_epochs"]
    assert cli.trainer.max_steps == config["trainer"].get("max_steps", -1)
    assert cli.model is not None
    assert cli.datamodule is not None


CIFAR = [p for p in RECIPES if os.path.basename(p).startswith("cifar10_")]


def _documented_decay_epochs(path: str) -> list[int]:
    with open(path) as f:
        found = re.search(r"divided by 10 at epochs (\d+) and (\d+)", f.read())
    assert found, f"{path} documents its learning-rate decay"
    return [int(found[1]), int(found[2])]


@pytest.mark.parametrize("path", CIFAR, ids=[os.path.basename(p) for p in CIFAR])
def test_cifar_recipes_decay_the_learning_rate_at_the_documented_epochs(path, monkeypatch, tmp_path):
    """The warm-up must not shift the step decay (SequentialLR restarts the decay scheduler's epoch count)."""
    monkeypatch.chdir(tmp_path)
    cli = GradcompCLI(args=["--config", path, "--trainer.accelerator", "cpu", "--trainer.devices", "1"], run=False)
    config = cli.model.configure_optimizers()
    optimizer, scheduler = config["optimizer"], config["lr_scheduler"]["scheduler"]
    assert config["lr_scheduler"]["interval"] == "epoch"
    lrs = []
    for _ in range(cli.trainer.max_epochs):  # the learning rate each epoch trains with, as Lightning steps it
        lrs.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    base, warmup = cli.model.hparams.lr, cli.model.hparams.warmup_epochs
    first, second = _documented_decay_epochs(path)
    assert lrs[0] == pytest.approx(base / 10), "the warm-up starts at lr / 10"
    assert lrs[warmup] == pytest.approx(base), "the warm-up ends at the base learning rate"
    drops = [e for e in range(warmup + 1, len(lrs)) if lrs[e] < lrs[e - 1] * 0.5]
    assert drops == [first, second]
    assert lrs[first] == pytest.approx(base / 10)
    assert lrs[second] == pytest.approx(base / 100)
    assert lrs[-1] == pytest.approx(base / 100)


def test_the_diloco_recipe_is_diloco_at_its_defaults_and_an_outer_class_without_settings_is_caught(
    monkeypatch, tmp_path
):
    """The recipe sets nothing but ``sync_every: auto``: the default outer optimizer. An outer optimizer named by its
    class alone on the command line gets torch's lr (0.001), which DiLoCo warns about when fitting starts."""
    from lightning_gradcomp.diloco.preflight import low_outer_lr

    monkeypatch.chdir(tmp_path)
    path = os.path.join(ROOT, "recipes", "lm_diloco.yaml")
    args = ["--config", path, "--trainer.accelerator", "cpu", "--trainer.devices", "1"]
    cli = GradcompCLI(args=args, run=False)
    assert cli.trainer.strategy.sync_every == "auto"
    outer = cli.trainer.strategy.outer_state.outer_optimizer([torch.zeros(3, requires_grad=True)])
    assert isinstance(outer, torch.optim.SGD)
    assert (outer.defaults["lr"], outer.defaults["momentum"], outer.defaults["nesterov"]) == (0.5, 0.5, True)
    assert low_outer_lr(outer) is None
    bare = GradcompCLI(args=[*args, "--trainer.strategy.init_args.outer_optimizer", "torch.optim.SGD"], run=False)
    outer = bare.trainer.strategy.outer_state.outer_optimizer([torch.zeros(3, requires_grad=True)])
    assert "the outer optimizer's lr is 0.001" in low_outer_lr(outer)


def test_the_lgc_recipe_switches_to_the_all_reduce_variant_as_its_header_says(monkeypatch, tmp_path):
    """The header's override builds ``LGCAllReduce`` with the recipe's shared arguments and the class's own defaults.

    ``innovation_ratio`` is the parameter-server variant's alone (``LGCAllReduce`` refuses it): switching the class
    must drop it, not fail.
    """
    from lightning_gradcomp.compressors import LGCAllReduce

    monkeypatch.chdir(tmp_path)
    path = os.path.join(ROOT, "recipes", "cifar10_resnet18_lgc.yaml")
    with open(path) as f:
        header = f.read()
    override = "--trainer.strategy.init_args.compressor lightning_gradcomp.compressors.LGCAllReduce"
    assert override in header
    cli = GradcompCLI(
        args=["--config", path, *override.split(), "--trainer.accelerator", "cpu", "--trainer.devices", "1"], run=False
    )
    compressor = cli.trainer.strategy.compressor
    assert type(compressor) is LGCAllReduce
    recipe = yaml.safe_load(header)["trainer"]["strategy"]["init_args"]["compressor"]["init_args"]
    expected = LGCAllReduce(**{k: v for k, v in recipe.items() if k != "innovation_ratio"})
    assert vars(compressor) == vars(expected)
