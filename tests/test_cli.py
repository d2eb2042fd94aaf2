"""The lightning-gradcomp command: the quickstart end to end (short), and the subcommands it offers."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_gradcomp.auto.snippet import accuracy_caveat, apply_snippet
from lightning_gradcomp.cli import (
    OWN_SUBCOMMANDS,
    GradcompCLI,
    _resolve_configs,
    did_it_pay,
    find_recipe,
    format_quickstart_table,
)
from lightning_gradcomp.compressors import BF16, Identity, PowerSGD
from tests.distributed import child_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


#: the console script's view: only its own directory on sys.path, never the current one (``-P``), as the installed
#: ``lightning-gradcomp`` launcher has it
CONSOLE_SCRIPT = [sys.executable, "-P", "-c", "from lightning_gradcomp.cli import main; main()"]


def _run(*args: str, timeout: int = 300, cwd: str = ROOT, console_script: bool = False) -> subprocess.CompletedProcess:
    env = child_env(OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    command = CONSOLE_SCRIPT if console_script else [sys.executable, "-m", "lightning_gradcomp"]
    return subprocess.run([*command, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_quickstart_trains_compressed_and_dense_and_says_whether_it_paid():
    result = _run("quickstart", "--trainer.max_epochs", "2")  # piped: the progress bar is off by itself
    assert result.returncode == 0, result.stderr[-4000:]
    number = r"([\d.]+)"
    rows = re.findall(
        rf"^\| (compressed|dense) \| (\S+) \| {number}% \| ([+-][\d.]+) \| {number} \| {number}x \|"
        rf" {number} \| {number}x \|$",
        result.stdout,
        flags=re.M,
    )
    assert [r[0] for r in rows] == ["compressed", "dense"], result.stdout[-3000:]
    compressed, dense = rows
    assert compressed[1] == "PowerSGD(rank=4)"
    assert dense[1] == "Identity"
    assert float(compressed[7]) > 10
    assert float(dense[7]) == 1.0
    assert float(dense[6]) > 10 * float(compressed[6])
    assert float(compressed[2]) > 80
    assert float(dense[2]) > 80
    assert float(compressed[4]) > 0  # step times in ms
    assert float(dense[4]) > 0
    assert float(dense[5]) == 1.0
    assert abs(float(compressed[5]) - float(compressed[4]) / float(dense[4])) < 0.01
    verdict = re.search(
        r"^Compression (paid|did not pay|neither paid nor cost) on this machine's link: a step took"
        r" ([\d.]+)x plain DDP's time",
        result.stdout,
        flags=re.M,
    )
    assert verdict is not None, result.stdout[-3000:]
    assert verdict[2] == compressed[5]
    assert "lightning-gradcomp advise --config " in result.stdout
    assert "gradcomp summary" in result.stdout + result.stderr  # the end-of-fit table of each run
    assert len(result.stdout) + len(result.stderr) < 5000  # no progress-bar redraws


def test_the_verdict_follows_the_step_times():
    def rows(compressed_ms: float) -> list[dict]:
        return [
            {"run": "compressed", "val_acc": 0.95, "step_ms": compressed_ms},
            {"run": "dense", "val_acc": 0.97, "step_ms": 100.0},
        ]

    assert did_it_pay(rows(80.0), "r.yaml").startswith("Compression paid on this machine's link: a step took 0.80x")
    assert did_it_pay(rows(130.0), "r.yaml").startswith("Compression did not pay on this machine's link")
    assert did_it_pay(rows(101.0), "r.yaml").startswith("Compression neither paid nor cost")
    assert "-2.00 points" in did_it_pay(rows(80.0), "r.yaml")
    assert did_it_pay(rows(80.0), "r.yaml").endswith("lightning-gradcomp advise --config r.yaml")


def test_help_lists_every_subcommand_without_lightnings_args_warning():
    result = _run("--help", timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    for name in ("fit", "validate", "test", "quickstart", "advise", "lighthouse"):
        line = re.search(rf"^    {name} +(\S.*)$", result.stdout, flags=re.M)
        assert line, result.stdout
        assert re.search(r"[.]$", line[1]) or name in OWN_SUBCOMMANDS, line[1]  # one whole line, not cut short
    assert "--overwrite-config" in result.stdout
    assert "args parameter" not in result.stderr + result.stdout


def test_a_refused_yaml_value_is_one_line_naming_its_key(tmp_path):
    recipe = Path(ROOT, "recipes", "quickstart.yaml").read_text()
    bad = recipe.replace("lightning_gradcomp.compressors.PowerSGD", "lightning_gradcomp.compressors.TopK")
    (tmp_path / "bad.yaml").write_text(bad.replace("rank: 4", "ratio: 5"))
    result = _run("fit", "--config", str(tmp_path / "bad.yaml"), timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        "lightning-gradcomp: error: trainer.strategy.init_args.compressor.init_args.ratio: Expected `ratio` to be a"
        " finite number in (0, 1], got 5.0."
    )
    assert "Traceback" not in result.stderr
    assert len(result.stderr) < 300  # the line and Lightning's "Seed set to 0", no dump of the configuration
    assert "args parameter" not in result.stderr + result.stdout


def test_a_fault_tolerant_recipe_without_a_lighthouse_is_one_line_naming_the_key_and_the_variable(tmp_path):
    result = _run("fit", "--config", os.path.join(ROOT, "recipes", "lm_diloco_ft.yaml"), timeout=120, cwd=str(tmp_path))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        "lightning-gradcomp: error: trainer.strategy.init_args.fault_tolerance.lighthouse: Expected"
        " `lighthouse` to be an address 'http://HOST:PORT' or the TORCHFT_LIGHTHOUSE variable set (start one with"
        " `lightning-gradcomp lighthouse --min-replicas N`), got None."
    )
    assert "Traceback" not in result.stderr


def test_a_recipe_names_a_class_of_the_current_directory_under_the_console_script(tmp_path):
    (tmp_path / "mymod.py").write_text(
        "from lightning_gradcomp.tasks import ImageClassifier\n\n\nclass MyClassifier(ImageClassifier):\n    pass\n"
    )
    recipe = Path(ROOT, "recipes", "quickstart.yaml").read_text()
    mine = recipe.replace("lightning_gradcomp.tasks.ImageClassifier", "mymod.MyClassifier")
    (tmp_path / "mine.yaml").write_text(mine)
    result = _run("fit", "--config", "mine.yaml", "--print_config", cwd=str(tmp_path), console_script=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "class_path: mymod.MyClassifier" in result.stdout


@pytest.mark.slow
def test_fit_keeps_an_earlier_runs_config_unless_told_to_overwrite(tmp_path):
    (tmp_path / "config.yaml").write_text("earlier: run\n")
    overrides = [
        "--trainer.default_root_dir",
        str(tmp_path),
        "--trainer.devices",
        "1",
        "--trainer.max_steps",
        "1",
        "--trainer.limit_val_batches",
        "0",
    ]
    refused = _run("fit", "--config", "recipes/quickstart.yaml", *overrides, timeout=180)
    assert refused.returncode == 2
    assert "config.yaml exists" in refused.stderr
    assert "--overwrite-config" in refused.stderr
    assert (tmp_path / "config.yaml").read_text() == "earlier: run\n"
    replaced = _run("fit", "--config", "recipes/quickstart.yaml", *overrides, "--overwrite-config", timeout=180)
    assert replaced.returncode == 0, replaced.stderr[-3000:]
    assert "max_steps: 1" in (tmp_path / "config.yaml").read_text()


@pytest.mark.slow
def test_only_fit_validate_and_test_are_offered():
    assert set(GradcompCLI.subcommands()) == {"fit", "validate", "test"}
    result = _run("predict", "--help", timeout=120)
    assert result.returncode != 0


def test_advise_snippets_apply_the_plan_and_name_the_accuracy_cost(tmp_path):
    compressors = {"dense": Identity(), "powersgd-r1": PowerSGD(rank=1), "bf16": BF16()}
    one = apply_snippet(("powersgd-r1", "powersgd-r1"), compressors)
    assert "strategy=CompressedDDP(compressor=PowerSGD(rank=1, " in one
    assert "class_path: lightning_gradcomp.compressors.PowerSGD\n        init_args: {rank: 1}" in one
    mixed = apply_snippet(("dense", "powersgd-r1", "bf16"), compressors)
    assert "callbacks=[AutoCompression(candidates=['dense', 'bf16', 'powersgd-r1'])]" in mixed
    assert "init_args: {candidates: [dense, bf16, powersgd-r1]}" in mixed
    assert apply_snippet(("dense",), compressors).startswith("Plain DDP is the fastest here")
    caveat = accuracy_caveat(("dense", "powersgd-r1"), compressors)
    assert "- powersgd-r1: rank 4 ended 1.39 points below dense" in caveat
    # the recipe's lines, in place of the quickstart's strategy, are a recipe LightningCLI accepts
    recipe = Path(ROOT, "recipes", "quickstart.yaml").read_text()
    strategy = one.split("or in a recipe:\n\n")[1].split("\n", 1)[1] + "\n"  # without its "trainer:" line
    applied = recipe[: recipe.index("  strategy:")] + strategy + recipe[recipe.index("model:") :]
    (tmp_path / "applied.yaml").write_text(applied)
    cli = GradcompCLI(args=["--config", str(tmp_path / "applied.yaml")], run=False, save_config_callback=None)
    assert repr(cli.trainer.strategy.compressor) == repr(PowerSGD(rank=1))


def test_quickstart_table_reports_points_and_time_against_dense():
    rows = [
        {
            "run": "compressed",
            "compressor": "TopK(ratio=0.01)",
            "val_acc": 0.95,
            "steps": 4,
            "sent": 1e5,
            "received": 1e5,
            "dense_moved": 4e6,
            "step_ms": 30.0,
        },
        {
            "run": "dense",
            "compressor": "Identity",
            "val_acc": 0.97,
            "steps": 4,
            "sent": 2e6,
            "received": 2e6,
            "dense_moved": 4e6,
            "step_ms": 40.0,
        },
    ]
    table = format_quickstart_table(rows)
    assert "| compressed | TopK(ratio=0.01) | 95.00% | -2.00 | 30.0 | 0.75x | 0.100 | 20.0x |" in table
    assert "| dense | Identity | 97.00% | +0.00 | 40.0 | 1.00x | 2.000 | 1.0x |" in table


@pytest.mark.slow
@pytest.mark.parametrize("missing", ["nonexistent.yaml"])
def test_quickstart_names_the_missing_recipe(missing, tmp_path):
    result = _run("quickstart", "--config", str(tmp_path / missing), timeout=120)
    assert result.returncode != 0


@pytest.mark.slow
def test_advise_measures_a_few_steps_and_prints_the_prediction_and_the_recommendation(tmp_path):
    png = tmp_path / "advise.png"
    result = _run(
        "advise",
        "--config",
        "recipes/quickstart.yaml",
        "--calibration-steps",
        "2",
        "--png",
        str(png),
        "--candidates",
        "dense",
        "bf16",
        "powersgd-r1",
        "--trainer.enable_progress_bar",
        "false",
    )
    assert result.returncode == 0, result.stderr[-4000:]
    out = result.stdout
    assert "link (fitted on timed all-reduces): alpha" in out
    assert re.search(r"^\| powersgd-r1 \| [\d.]+ \| [\d.]+ \| [\d.]+ \| [\d.]+x \|$", out, flags=re.M), out[-3000:]
    assert "| candidate | measured | 100 Mbit/s | 1 Gbit/s | 10 Gbit/s | 100 Gbit/s |" in out
    assert re.search(r"^\| \*\*auto\*\* \|( [\d.]+ \|){5}$", out, flags=re.M)
    for label in ("measured", "100 Mbit/s", "1 Gbit/s", "10 Gbit/s", "100 Gbit/s"):
        assert f"recommendation at {label}: " in out
    assert re.search(r"^\| H=100 8-bit \|( [\d.]+ \|){5}$", out, flags=re.M), "DiLoCo's rows"
    assert "Periodic synchronization" in out
    # DiLoCo's compute utilisation by payload and schedule, and the constructor to paste, which builds
    assert re.search(r"^\| 8-bit \| one-step delay \|( \d+ % \|){4}$", out, flags=re.M), out[-3000:]
    call = re.search(r"^    trainer = Trainer\(\.\.\., strategy=(DiLoCo\(.*\))\)$", out, flags=re.M)[1]
    from lightning_gradcomp import DiLoCo
    from lightning_gradcomp.compressors import MinMax, SparseLoCo

    assert isinstance(eval(call, {"DiLoCo": DiLoCo, "MinMax": MinMax, "SparseLoCo": SparseLoCo}), DiLoCo)
    measured = re.search(r"^recommendation at measured: (.*);", out, flags=re.M)[1]
    if measured.startswith("plain DDP"):
        assert "Plain DDP is the fastest here" in out
    else:
        assert "To apply it in Python:" in out
        assert "class_path: lightning_gradcomp" in out  # the recipe's lines
    assert "Accuracy is not in this model: it predicts step time only." in out
    assert png.stat().st_size > 1000


def test_a_recipe_is_found_by_name_where_the_package_installed_it(tmp_path, monkeypatch):
    import sysconfig

    installed = tmp_path / "prefix" / "share" / "lightning-gradcomp" / "recipes"
    installed.mkdir(parents=True)
    (installed / "only_installed.yaml").write_text("trainer: {}\n")
    real = sysconfig.get_path
    monkeypatch.setattr(
        sysconfig, "get_path", lambda name, *a: str(tmp_path / "prefix") if name == "data" else real(name, *a)
    )
    monkeypatch.chdir(tmp_path)
    assert find_recipe("only_installed") == str(installed / "only_installed.yaml")
    assert find_recipe("only_installed.yaml") == str(installed / "only_installed.yaml")
    assert find_recipe("no_such_recipe") is None
    assert _resolve_configs(["fit", "--config", "only_installed"]) == ["fit", "--config", find_recipe("only_installed")]
    assert _resolve_configs(["fit", "--config", "./mine.yaml"]) == ["fit", "--config", "./mine.yaml"]  # a path


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """The package's wheel, built from this checkout as ``pip`` builds it for an install."""
    tmp_path = tmp_path_factory.mktemp("wheel")
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "lightning_gradcomp", "recipes"):
        (source / name).symlink_to(Path(ROOT, name))
    build = [sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "-q", "-w", str(tmp_path / "dist")]
    import setuptools

    if int(setuptools.__version__.split(".")[0]) >= 77:  # pyproject.toml's build requirement is installed here
        build.append("--no-build-isolation")
    result = subprocess.run(build, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    (built,) = (tmp_path / "dist").glob("*.whl")
    return built


def test_the_wheel_ships_every_recipe(wheel):
    import zipfile

    shipped = {Path(n).name for n in zipfile.ZipFile(wheel).namelist() if "/share/lightning-gradcomp/recipes/" in n}
    assert shipped == {p.name for p in Path(ROOT, "recipes").glob("*.yaml")}


@pytest.mark.slow
def test_an_install_under_another_prefix_finds_its_recipes_by_name(wheel, tmp_path):
    """``pip install --prefix``: the recipes are where the install's record says, not under this Python's prefix."""
    prefix = tmp_path / "prefix"
    # --ignore-installed: without it pip uninstalls this environment's own install of the package (the checkout's
    # editable one) before installing the wheel under the prefix, and every later import of the package fails
    install = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--no-deps",
        "--no-index",
        "-q",
        "--ignore-installed",
        "--prefix",
        str(prefix),
    ]
    result = subprocess.run([*install, str(wheel)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    (site,) = prefix.glob("lib/python*/site-packages")
    elsewhere = tmp_path / "elsewhere"  # no recipes/ folder here
    elsewhere.mkdir()
    show = "import lightning_gradcomp; from lightning_gradcomp.cli import find_recipe as f; print(lightning_gradcomp.__file__); print(f('quickstart'))"  # noqa: E501
    env = child_env(PYTHONPATH=str(site))
    result = subprocess.run(
        [sys.executable, "-P", "-c", show], cwd=elsewhere, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    package, recipe = result.stdout.split()
    assert Path(package).is_relative_to(site)  # control: the installed copy, not this checkout, was imported
    assert recipe == str((prefix / "share" / "lightning-gradcomp" / "recipes" / "quickstart.yaml").resolve())
    # this environment's own install is untouched: the package still imports from a folder that is not the checkout
    check = subprocess.run(
        [sys.executable, "-P", "-c", "import lightning_gradcomp"],
        cwd=elsewhere,
        env={k: v for k, v in child_env().items() if k != "PYTHONPATH"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert check.returncode == 0, check.stderr[-3000:]


@pytest.mark.parametrize(
    ("override", "line"),
    [
        (
            ["--trainer.strategy.init_args.sync_evry", "10"],
            "lightning-gradcomp: error: --trainer.strategy.init_args.sync_evry: lightning_gradcomp.DiLoCo has no"
            " argument `sync_evry`. Did you mean `sync_every`?",
        ),
        (
            ["--trainer.max_stepz", "10"],
            "lightning-gradcomp: error: --trainer.max_stepz: not an option of this command. Did you mean"
            " `--trainer.max_steps`?",
        ),
    ],
)
def test_a_misspelt_key_on_the_command_line_is_one_line_naming_the_nearest_key(override, line, tmp_path):
    recipe = os.path.join(ROOT, "recipes", "lm_diloco.yaml")
    result = _run("fit", "--config", recipe, *override, "--print_config", cwd=str(tmp_path), timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [line]
