"""The ``lightning-gradcomp`` command: LightningCLI's ``fit``, ``validate``, ``test``, and three of its own.

``quickstart``, ``advise`` and ``lighthouse``:

::

    lightning-gradcomp fit --config recipes/cifar10_resnet18_powersgd_warmup.yaml
    lightning-gradcomp quickstart                  # offline, two CPU processes, a few minutes
    lightning-gradcomp advise --config recipe.yaml # a few steps: the link, the codecs, what compression would pay
    lightning-gradcomp lighthouse --min-replicas 2 # torchft's lighthouse for DiLoCo(fault_tolerance=TorchFT(...))

Any component can be named by its short class name in a recipe (``class_path: PowerSGD``): importing this module
imports lightning-gradcomp's strategy, compressors, callbacks and tasks first, as LightningCLI requires. The current
directory is importable, as under ``python -m``, so a recipe can name a class of the user's own module.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import re
import statistics
import sys
import sysconfig
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from jsonargparse import ArgumentParser
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities.rank_zero import rank_zero_only

import lightning_gradcomp
from lightning_gradcomp import callbacks, compressors, tasks  # noqa: F401  (registers short class names)
from lightning_gradcomp.auto.measure import outer_costs, outer_payloads
from lightning_gradcomp.auto.report import advice, plot_speedup
from lightning_gradcomp.auto.run_length import run_steps
from lightning_gradcomp.auto.snippet import accuracy_caveat, apply_snippet
from lightning_gradcomp.auto.timeline import plan_greedy
from lightning_gradcomp.callbacks import AutoCompression, ProgressLines
from lightning_gradcomp.cli_errors import options_of, raising_parse_errors, short_parse_error
from lightning_gradcomp.compressors import Identity
from lightning_gradcomp.ddp.strategy import CompressedDDP

#: LightningCLI's subcommands, with their line in ``--help`` (Lightning's own cuts the one of ``test`` short)
LIGHTNING_SUBCOMMANDS = {
    "fit": "Train a recipe (LightningCLI's fit).",
    "validate": "Evaluate a recipe's model on its validation set.",
    "test": "Evaluate a recipe's model on its test set.",
}
#: the subcommands that are not LightningCLI's, with their line in ``--help``
OWN_SUBCOMMANDS = {
    "quickstart": "Train a small CNN on two CPU processes with PowerSGD and densely; say whether compression paid.",
    "advise": "Run a recipe for a few steps and predict what compression would pay on this link and on others.",
    "lighthouse": "Run torchft's lighthouse for fault-tolerant DiLoCo (on loopback unless given --host) until Ctrl+C.",
}
#: the flag ``fit`` needs to replace a config.yaml an earlier run wrote
OVERWRITE_FLAG = "--overwrite-config"
DESCRIPTION = (
    "Communication-efficient data-parallel training for PyTorch Lightning. fit, validate and test are LightningCLI's"
    " (a recipe: --config path/to/recipe.yaml, or --config NAME for one that ships with the package, e.g."
    f" quickstart); fit keeps an earlier run's config.yaml unless given {OVERWRITE_FLAG}."
)
#: the one-line wording of every refused value (lightning_gradcomp.validation): `name`, what is accepted, what was given
_REFUSAL = re.compile(r"Expected `(?P<name>[^`]+)` to be (?P<accepted>.+?), got (?P<given>.+?)\.$", re.M)


class GradcompCLI(LightningCLI):
    """LightningCLI with the subcommands that train or evaluate (``fit``, ``validate``, ``test``).

    Its ``--help`` lists ``quickstart`` and ``advise`` too (:func:`main` runs them); a value a component refuses is
    reported in one line naming its YAML key; the progress bar is off when stdout is not a terminal, and a
    :class:`~lightning_gradcomp.callbacks.ProgressLines` prints a line every minute instead (unless the recipe has
    one); ``fit`` does not replace a ``config.yaml`` an earlier run wrote unless given ``--overwrite-config``.
    """

    def __init__(self, *args: Any, overwrite_config: bool = False, **kwargs: Any) -> None:
        self.overwrite_config = overwrite_config
        if not sys.stdout.isatty():  # piped to a file: progress-bar redraws would be nearly all of the output
            kwargs["trainer_defaults"] = {"enable_progress_bar": False, **kwargs.get("trainer_defaults", {})}
        kwargs.setdefault("save_config_kwargs", {"overwrite": overwrite_config})
        kwargs.setdefault("parser_kwargs", {"prog": "lightning-gradcomp", "description": DESCRIPTION})
        super().__init__(*args, **kwargs)

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        """``fit``, ``validate`` and ``test``."""
        return {k: v for k, v in LightningCLI.subcommands().items() if k in ("fit", "validate", "test")}

    def _add_subcommands(self, parser: LightningArgumentParser, **kwargs: Any) -> None:
        super()._add_subcommands(parser, **kwargs)
        assert parser._subcommands_action is not None
        for choice in parser._subcommands_action._choices_actions:
            choice.help = LIGHTNING_SUBCOMMANDS.get(choice.dest, choice.help)
        for name, line in OWN_SUBCOMMANDS.items():  # listed in --help; main() runs them before LightningCLI parses
            parser._subcommands_action.add_subcommand(name, ArgumentParser(description=line), help=line)

    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        """Parse as LightningCLI does, without its warning that ``args`` and ``sys.argv`` are both given.

        A key or value the parser refuses is one line naming the nearest accepted key (:mod:`~lightning_gradcomp.
        cli_errors`), exit status 2.

        :func:`main` passes the command line it read as ``args``, so the warning would be printed on every call.
        """
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended")
            try:
                with raising_parse_errors(parser):
                    super().parse_arguments(parser, args)
            except argparse.ArgumentError as err:  # one line naming the nearest key, not the usage and every type
                argv = [str(a) for a in args] if isinstance(args, list) else sys.argv[1:]
                sub = next((a for a in argv if a in self.subcommands()), None)
                line = short_parse_error(str(err), argv, options_of(parser, sub))
                print(f"lightning-gradcomp: error: {line}", file=sys.stderr, flush=True)
                raise SystemExit(2) from None

    def instantiate_classes(self) -> None:
        """Instantiate as LightningCLI does; a refused value becomes one line naming its YAML key (exit status 2).

        jsonargparse would report it inside a traceback of every type it tried, ending in a dump of the whole
        configuration.
        """
        try:
            super().instantiate_classes()
        except Exception as err:
            refusal = _REFUSAL.search(str(err))
            if refusal is None:
                raise
            key = _yaml_key(self.config, refusal["name"], refusal["given"]) or refusal["name"]
            print(f"lightning-gradcomp: error: {key}: {refusal.group(0)}", file=sys.stderr, flush=True)
            raise SystemExit(2) from None

    def instantiate_trainer(self, **kwargs: Any) -> Any:
        """The trainer, with a line of progress every minute when stdout is not a terminal (a log file, a pipe)."""
        trainer = super().instantiate_trainer(**kwargs)
        trainer_callbacks: list[Callback] = getattr(trainer, "callbacks")  # set at init, undeclared on Trainer
        if not sys.stdout.isatty() and not any(isinstance(c, ProgressLines) for c in trainer_callbacks):
            trainer_callbacks.append(ProgressLines())
        return trainer

    def before_fit(self) -> None:
        """Refuse to replace the ``config.yaml`` of an earlier run in the same directory, before training starts."""
        path = Path(self.trainer.default_root_dir) / self.save_config_kwargs.get("config_filename", "config.yaml")
        unversioned = self.trainer.logger is None  # a logger writes the config into a new version directory
        # rank 0 only: the other ranks of a script launch run this after rank 0 has written the file
        first = getattr(rank_zero_only, "rank", 0) == 0  # set from RANK/LOCAL_RANK/SLURM_PROCID at import
        if first and self.save_config_callback and unversioned and path.exists() and not self.overwrite_config:
            print(
                f"lightning-gradcomp: error: {path} exists (an earlier run's configuration); pass {OVERWRITE_FLAG}"
                " to replace it, or --trainer.default_root_dir DIR to write elsewhere",
                file=sys.stderr,
                flush=True,
            )
            raise SystemExit(2)


def _yaml_key(config: Any, name: str, given: str) -> str | None:
    """The dotted key of ``config`` that ends in ``name`` and holds ``given`` (a repr), without the subcommand."""
    matches = [key for key, value in config.items() if key.split(".")[-1] == name and repr(value) == given]
    matches = matches or [key for key, _ in config.items() if key.split(".")[-1] == name]
    if not matches:
        return None
    key = matches[0]
    return key.split(".", 1)[1] if key.split(".")[0] in ("fit", "validate", "test") else key


def _installed_recipe_dirs() -> list[Path]:
    """Where the installer put the recipes, read from the distribution's record of its files.

    Whatever the install scheme (a virtual environment, ``--user``, ``--prefix``, conda): the data files land beside
    the scheme's ``share/`` folder, and the record says where.
    """
    try:
        files = importlib.metadata.files("lightning-gradcomp") or []
    except importlib.metadata.PackageNotFoundError:
        return []
    recipes = [f for f in files if f.parent.name == "recipes" and f.suffix == ".yaml"]
    return sorted({Path(str(f.locate())).resolve().parent for f in recipes})


def recipe_dirs() -> list[Path]:
    """Where recipes are looked for: ``./recipes``, a clone's ``recipes/``, then where the package installed them."""
    data = {sysconfig.get_path("data"), sysconfig.get_path("data", f"{os.name}_user")}
    return [
        Path.cwd() / "recipes",
        Path(lightning_gradcomp.__file__).resolve().parents[1] / "recipes",
        *_installed_recipe_dirs(),
        *(Path(d) / "share" / "lightning-gradcomp" / "recipes" for d in sorted(data)),
    ]


def find_recipe(name: str) -> str | None:
    """The path of recipe ``name`` (``quickstart`` or ``quickstart.yaml``) in :func:`recipe_dirs`, or ``None``."""
    filename = name if name.endswith((".yaml", ".yml")) else f"{name}.yaml"
    return next((str(d / filename) for d in recipe_dirs() if (d / filename).is_file()), None)


def _resolve_configs(argv: list[str]) -> list[str]:
    """``--config NAME`` for a recipe that is not a file here becomes the path of the recipe of that name."""
    resolved = list(argv)
    for i, arg in enumerate(argv[:-1]):
        value = argv[i + 1]
        if arg in ("--config", "-c") and not Path(value).exists() and "/" not in value:
            resolved[i + 1] = find_recipe(value) or value
    return resolved


def short_name(compressor: Any) -> str:
    """``PowerSGD(rank=4)``: the class and its level, for tables."""
    level = getattr(compressor, "level_attribute", None)
    return f"{type(compressor).__name__}({level}={getattr(compressor, level)})" if level else type(compressor).__name__


class StepTimer(Callback):
    """Median wall time of a training step (forward, backward with its communication, optimizer step).

    Put in ``trainer.callback_metrics["quickstart/step_ms"]`` at the end of fitting.
    The first ``skip`` steps are left out (DDP builds its buckets, threads and caches warm up). The metric travels
    back from a spawned rank 0 with the other callback metrics.
    """

    def __init__(self, skip: int = 5) -> None:
        self.skip = skip
        self._start = 0.0
        self._times: list[float] = []

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:  # noqa: D102
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:  # noqa: D102
        self._times.append(time.perf_counter() - self._start)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:  # noqa: D102
        times = self._times[self.skip :] or self._times
        if times:
            trainer.callback_metrics["quickstart/step_ms"] = torch.tensor(1e3 * statistics.median(times))


def _summary_row(label: str, trainer: Any) -> dict[str, Any]:
    metrics = trainer.callback_metrics
    return {
        "run": label,
        "compressor": short_name(trainer.strategy.compressor),
        "val_acc": float(metrics["val_acc"]) if "val_acc" in metrics else float("nan"),
        "steps": int(metrics.get("gradcomp/total_steps", 0)),
        "sent": float(metrics.get("gradcomp/total_bytes_sent", 0)),
        "received": float(metrics.get("gradcomp/total_bytes_received", 0)),
        "dense_moved": float(metrics.get("gradcomp/total_bytes_dense_moved", 0)),
        "step_ms": float(metrics.get("quickstart/step_ms", float("nan"))),
    }


def format_quickstart_table(rows: list[dict[str, Any]]) -> str:
    """The quickstart's summary: accuracy and step time against the dense run, bytes each rank sent, ratio."""
    dense = next((r for r in rows if r["run"] == "dense"), None)
    dense_acc = dense["val_acc"] if dense else float("nan")
    dense_ms = dense["step_ms"] if dense else float("nan")
    lines = [
        "| run | compressor | validation accuracy | vs dense (points) | step (ms) | vs dense (time) | MB sent per rank"
        " | compression ratio |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        moved = r["sent"] + r["received"]  # against plain DDP's ring at this world size, both directions
        ratio = r["dense_moved"] / moved if moved else float("nan")
        delta = 100 * (r["val_acc"] - dense_acc)
        lines.append(
            f"| {r['run']} | {r['compressor']} | {100 * r['val_acc']:.2f}% | {delta:+.2f} | {r['step_ms']:.1f}"
            f" | {r['step_ms'] / dense_ms:.2f}x | {r['sent'] / 1e6:.3f} | {ratio:.1f}x |"
        )
    return "\n".join(lines)


def did_it_pay(rows: list[dict[str, Any]], config: str, margin: float = 0.03) -> str:
    """One sentence: whether the compressed step was faster than plain DDP's here, and where to look for other links.

    Args:
        rows: the compressed and the dense row of :func:`format_quickstart_table`.
        config: the recipe, named in the ``advise`` command.
        margin: a step time within this fraction of plain DDP's counts as neither faster nor slower (noise).
    """
    compressed, dense = (next(r for r in rows if r["run"] == run) for run in ("compressed", "dense"))
    ratio = compressed["step_ms"] / dense["step_ms"]
    if ratio < 1 - margin:
        verdict = f"Compression paid on this machine's link: a step took {ratio:.2f}x plain DDP's time"
    elif ratio > 1 + margin:
        verdict = (
            f"Compression did not pay on this machine's link: a step took {ratio:.2f}x plain DDP's time"
            " (encoding and decoding cost more than the bytes it saved here)"
        )
    else:
        verdict = f"Compression neither paid nor cost on this machine's link: a step took {ratio:.2f}x plain DDP's time"
    points = 100 * (compressed["val_acc"] - dense["val_acc"])
    return (
        f"{verdict}, at {points:+.2f} points of validation accuracy. On a slower link it pays sooner; to predict"
        f" this recipe's step time at other bandwidths: lightning-gradcomp advise --config {config}"
    )


def quickstart(argv: list[str]) -> list[dict[str, Any]]:
    """Train the quickstart recipe with its compressor, then densely (Identity) from the same seed; compare.

    Extra arguments are LightningCLI overrides for both runs, e.g. ``--trainer.max_epochs 3``.
    """
    parser = argparse.ArgumentParser(
        prog="lightning-gradcomp quickstart",
        description="Train a recipe with its compressor and densely, then print accuracy, step time, bytes and"
        " ratio, and whether compression paid on this machine.",
    )
    parser.add_argument("--config", default=None, help="recipe (default: recipes/quickstart.yaml)")
    known, overrides = parser.parse_known_args(argv)
    config = known.config or find_recipe("quickstart.yaml")
    if config is None:
        raise SystemExit(
            "lightning-gradcomp quickstart: the quickstart recipe is not installed; pass --config"
            " path/to/quickstart.yaml (it is in the repository's recipes/ folder)."
        )
    rows = []
    for label in ("compressed", "dense"):
        cli = GradcompCLI(args=["--config", config, *overrides], run=False, save_config_callback=None)
        if label == "dense":
            CompressedDDP.require(cli.trainer, cli).compressor = Identity()
        trainer_callbacks: list[Callback] = getattr(cli.trainer, "callbacks")  # set at init, undeclared on Trainer
        trainer_callbacks.append(StepTimer())
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
        rows.append(_summary_row(label, cli.trainer))
    _print_rank_zero("\n" + format_quickstart_table(rows) + "\n\n" + did_it_pay(rows, config) + "\n")
    return rows


class _AdviseReport(Callback):
    """Print the advise report and write its plot on rank 0 at the end of the few measured steps."""

    def __init__(self, auto: AutoCompression, png: str | None, length: tuple[int, int | None] = (-1, None)) -> None:
        self.auto, self.png = auto, png
        self.length = length  # the recipe's max_steps and max_epochs, before advise cut the run to a few steps

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        auto = self.auto
        if not trainer.is_global_zero:
            return
        if auto.link is None or auto.timing is None or not auto.buckets:
            print("lightning-gradcomp advise: the run ended before the calibration finished", flush=True)
            return
        names, options = list(auto.candidates), auto.model_options
        numel = sum(b.numel for b in auto.buckets)
        outer = outer_costs(numel, trainer.world_size, outer_payloads())
        total = run_steps(*self.length, trainer.num_training_batches, trainer.accumulate_grad_batches)
        report = advice(
            auto.buckets,
            names,
            auto.link,
            auto.timing,
            auto.baseline_step,
            auto.margin,
            **options,
            outer=outer,
            total_steps=total,
        )
        print("\n" + report, flush=True)
        plan = plan_greedy(auto.buckets, names, auto.link, auto.timing, auto.margin, **options)  # at the measured link
        print(
            "\n"
            + apply_snippet(plan.assignment, auto.candidates)
            + "\n\n"
            + accuracy_caveat(plan.assignment, auto.candidates),
            flush=True,
        )
        if self.png:
            plot_speedup(self.png, auto.buckets, names, auto.link, auto.timing, **options)
            print(f"\npredicted speed-up against bandwidth: {self.png}", flush=True)


def advise(argv: list[str]) -> None:
    """Run a recipe for a few steps with :class:`AutoCompression` measuring; print what compression would pay.

    Extra arguments are LightningCLI overrides, e.g. ``--trainer.devices 4``.
    """
    parser = argparse.ArgumentParser(
        prog="lightning-gradcomp advise",
        description="Train the recipe for a few steps only (AutoCompression's skip steps and calibration steps, 7 by"
        " default) while measuring the link, the backward pass and each candidate"
        " codec; print each candidate's predicted step time at several bandwidths, the recommendation, the code that"
        " applies it (Python and YAML) and what the prediction leaves out (accuracy).",
    )
    parser.add_argument("--config", required=True, help="recipe (a LightningCLI YAML)")
    parser.add_argument("--png", default="advise_speedup.png", help="where to write the plot ('' for none)")
    parser.add_argument("--calibration-steps", type=int, default=5)
    parser.add_argument("--candidates", nargs="+", default=None, help="candidate names (AutoCompression's)")
    known, overrides = parser.parse_known_args(argv)
    cli = GradcompCLI(args=["--config", known.config, *overrides], run=False, save_config_callback=None)
    trainer = cli.trainer
    trainer_callbacks: list[Callback] = getattr(trainer, "callbacks")  # set at init, undeclared on Trainer
    auto = next((cb for cb in trainer_callbacks if isinstance(cb, AutoCompression)), None)
    if auto is None:
        auto = AutoCompression(candidates=known.candidates, calibration_steps=known.calibration_steps)
        trainer_callbacks.append(auto)
    auto.measure = "all"  # the report predicts every candidate at other bandwidths: time them on every bucket
    length = (trainer.fit_loop.epoch_loop.max_steps, trainer.max_epochs)
    trainer_callbacks.append(_AdviseReport(auto, known.png or None, length))
    trainer.fit_loop.epoch_loop.max_steps = auto.skip_steps + auto.calibration_steps  # a few steps, not a run
    trainer.fit(cli.model, datamodule=cli.datamodule)


def lighthouse(argv: list[str]) -> None:
    """Run torchft's lighthouse until SIGINT or SIGTERM (:mod:`lightning_gradcomp.ft.lighthouse`)."""
    parser = argparse.ArgumentParser(
        prog="lightning-gradcomp lighthouse",
        description="torchft's lighthouse (as torchft_lighthouse): the replica groups of a DiLoCo(fault_tolerance="
        "TorchFT(...)) run ask it for each sync's quorum. It has no authentication: whoever reaches its port can join"
        " a quorum, so it listens on 127.0.0.1 unless --host says otherwise.",
    )
    parser.add_argument("--min-replicas", type=int, required=True, help="the fewest groups a new quorum needs")
    parser.add_argument("--port", type=int, default=29510)
    parser.add_argument("--host", default="127.0.0.1", help="the address to listen on (0.0.0.0: every interface)")
    parser.add_argument("--join-timeout-ms", type=int, default=60_000, help="wait for healthy stragglers")
    parser.add_argument("--heartbeat-timeout-ms", type=int, default=5_000, help="a silent group is dead after")
    known = parser.parse_args(argv)
    from lightning_gradcomp.ft.lighthouse import Lighthouse, serve

    if known.min_replicas < 1:
        parser.error(f"--min-replicas must be >= 1, got {known.min_replicas}")
    server = Lighthouse(
        known.min_replicas,
        known.port,
        known.host,
        join_timeout_ms=known.join_timeout_ms,
        heartbeat_timeout_ms=known.heartbeat_timeout_ms,
    )
    serve(server, announce=lambda line: print(line, flush=True))


@rank_zero_only
def _print_rank_zero(text: str) -> None:
    print(text, flush=True)


def main(args: list[str] | None = None) -> None:
    """Entry point of the ``lightning-gradcomp`` console script."""
    argv = sys.argv[1:] if args is None else list(args)
    # as under `python -m`: a recipe's class_path may name a module of the current directory; the console script
    # would have only its own bin directory on sys.path
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    argv = _resolve_configs(argv)
    if argv and argv[0] == "quickstart":
        quickstart(argv[1:])
        return
    if argv and argv[0] == "advise":
        advise(argv[1:])
        return
    if argv and argv[0] == "lighthouse":
        lighthouse(argv[1:])
        return
    overwrite = OVERWRITE_FLAG in argv
    GradcompCLI(args=[a for a in argv if a != OVERWRITE_FLAG], overwrite_config=overwrite)


if __name__ == "__main__":  # pragma: no cover
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
