"""Every recipe in recipes/ parses and instantiates with LightningCLI(run=False)."""

import glob
import os

import pytest
from lightning.pytorch.cli import LightningCLI

from lightning_gradcomp import CompressedDDP
from lightning_gradcomp.cli import GradcompCLI

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPES = sorted(glob.glob(os.path.join(ROOT, "recipes", "*.yaml")))


def test_there_are_recipes():
    assert os.path.join(ROOT, "recipes", "quickstart.yaml") in RECIPES


@pytest.mark.parametrize("path", RECIPES, ids=[os.path.basename(p) for p in RECIPES])
def test_recipe_parses_and_instantiates(path, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # nothing a recipe writes lands in the repository
    cli = GradcompCLI(args=["--config", path, "--trainer.accelerator", "cpu", "--trainer.devices", "1"], run=False)
    assert isinstance(cli, LightningCLI)
    assert isinstance(cli.trainer.strategy, CompressedDDP), "every recipe trains with CompressedDDP"
    assert cli.model is not None
    assert cli.datamodule is not None
