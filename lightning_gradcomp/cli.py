"""The ``lightning-gradcomp`` command: LightningCLI's ``fit``, ``validate`` and ``test``, and ``quickstart``.

::

    lightning-gradcomp fit --config recipes/cifar10_resnet18_powersgd.yaml
    lightning-gradcomp quickstart                  # offline, two CPU processes, under two minutes
    lightning-gradcomp advise --config recipe.yaml # a few steps: the link, the codecs, what compression would pay

Any component can be named by its short class name in a recipe (``class_path: PowerSGD``): importing this module
imports lightning-gradcomp's strategy, compressors, callbacks and tasks first, as LightningCLI requires.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.utilities.rank_zero import rank_zero_only

import lightning_gradcomp
from lightning_gradcomp import callbacks, compressors, tasks  # noqa: F401  (registers short class names)
from lightning_gradcomp.auto.report import advice, plot_speedup
from lightning_gradcomp.callbacks import AutoCompression
from lightning_gradcomp.compressors import Identity
from lightning_gradcomp.strategy import CompressedDDP


class GradcompCLI(LightningCLI):
    """LightningCLI with the subcommands that train or evaluate (``fit``, ``validate``, ``test``)."""

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        """``fit``, ``validate`` and ``test``."""
        return {k: v for k, v in LightningCLI.subcommands().items() if k in ("fit", "validate", "test")}


def _find_recipe(name: str) -> str:
    for base in (Path.cwd(), Path(lightning_gradcomp.__file__).resolve().parents[1]):
        path = base / "recipes" / name
        if path.is_file():
            return str(path)
    raise SystemExit(
        f"lightning-gradcomp quickstart: recipes/{name} not found here or next to the package; pass --config"
        " path/to/quickstart.yaml (it is in the repository's recipes/ folder)."
    )


def short_name(compressor: Any) -> str:
    """``PowerSGD(rank=4)``: the class and its level, for tables."""
    level = getattr(compressor, "level_attribute", None)
    return f"{type(compressor).__name__}({level}={getattr(compressor, level)})" if level else type(compressor).__name__


def _summary_row(label: str, trainer: Any) -> dict[str, Any]:
    metrics = trainer.callback_metrics
    return {
        "run": label,
        "compressor": short_name(trainer.strategy.compressor),
        "val_acc": float(metrics["val_acc"]) if "val_acc" in metrics else float("nan"),
        "steps": int(metrics.get("gradcomp/total_steps", 0)),
        "sent": float(metrics.get("gradcomp/total_bytes_sent", 0)),
        "dense": float(metrics.get("gradcomp/total_bytes_dense", 0)),
    }


def format_quickstart_table(rows: list[dict[str, Any]]) -> str:
    """The quickstart's summary: accuracy against the dense run, bytes each rank sent, compression ratio."""
    dense_acc = next((r["val_acc"] for r in rows if r["run"] == "dense"), float("nan"))
    lines = [
        "| run | compressor | validation accuracy | vs dense (points) | MB sent per rank | compression ratio |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = r["dense"] / r["sent"] if r["sent"] else float("nan")
        delta = 100 * (r["val_acc"] - dense_acc)
        lines.append(
            f"| {r['run']} | {r['compressor']} | {100 * r['val_acc']:.2f}% | {delta:+.2f} | {r['sent'] / 1e6:.3f}"
            f" | {ratio:.1f}x |"
        )
    return "\n".join(lines)


def quickstart(argv: list[str]) -> list[dict[str, Any]]:
    """Train the quickstart recipe with its compressor, then densely (Identity) from the same seed; compare.

    Extra arguments are LightningCLI overrides for both runs, e.g. ``--trainer.max_epochs 3``.
    """
    parser = argparse.ArgumentParser(
        prog="lightning-gradcomp quickstart",
        description="Train a recipe with its compressor and densely, then print accuracy, bytes and ratio.",
    )
    parser.add_argument("--config", default=None, help="recipe (default: recipes/quickstart.yaml)")
    known, overrides = parser.parse_known_args(argv)
    config = known.config or _find_recipe("quickstart.yaml")
    rows = []
    for label in ("compressed", "dense"):
        cli = GradcompCLI(args=["--config", config, *overrides], run=False, save_config_callback=None)
        if label == "dense":
            CompressedDDP.require(cli.trainer, cli).compressor = Identity()
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
        rows.append(_summary_row(label, cli.trainer))
    _print_rank_zero("\n" + format_quickstart_table(rows) + "\n")
    return rows


class _AdviseReport(Callback):
    """Print the advise report and write its plot on rank 0 at the end of the few measured steps."""

    def __init__(self, auto: AutoCompression, png: str | None) -> None:
        self.auto, self.png = auto, png

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        auto = self.auto
        if not trainer.is_global_zero:
            return
        if auto.link is None or auto.timing is None or not auto.buckets:
            print("lightning-gradcomp advise: the run ended before the calibration finished", flush=True)
            return
        names, options = list(auto.candidates), auto.model_options
        print("\n" + advice(auto.buckets, names, auto.link, auto.timing, auto.baseline_step, auto.margin, **options),
              flush=True)  # fmt: skip
        if self.png:
            plot_speedup(self.png, auto.buckets, names, auto.link, auto.timing, **options)
            print(f"\npredicted speed-up against bandwidth: {self.png}", flush=True)


def advise(argv: list[str]) -> None:
    """Run a recipe for a few steps with :class:`AutoCompression` measuring; print what compression would pay.

    Extra arguments are LightningCLI overrides, e.g. ``--trainer.devices 4``.
    """
    parser = argparse.ArgumentParser(
        prog="lightning-gradcomp advise",
        description="Measure the link, the backward pass and each candidate codec for a few steps (no training run);"
        " print the predicted step time of each candidate at several bandwidths and the recommendation.",
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
    trainer_callbacks.append(_AdviseReport(auto, known.png or None))
    trainer.fit_loop.epoch_loop.max_steps = auto.skip_steps + auto.calibration_steps  # a few steps, not a run
    trainer.fit(cli.model, datamodule=cli.datamodule)


@rank_zero_only
def _print_rank_zero(text: str) -> None:
    print(text, flush=True)


def main(args: list[str] | None = None) -> None:
    """Entry point of the ``lightning-gradcomp`` console script."""
    argv = sys.argv[1:] if args is None else args
    if argv and argv[0] == "quickstart":
        quickstart(argv[1:])
        return
    if argv and argv[0] == "advise":
        advise(argv[1:])
        return
    GradcompCLI(args=argv, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":  # pragma: no cover
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
