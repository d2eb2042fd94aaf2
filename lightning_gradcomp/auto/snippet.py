"""What ``lightning-gradcomp advise`` prints after its recommendation: the code that applies it, and what it leaves out.

The recommendation is a plan over DDP's buckets (:class:`~lightning_gradcomp.auto.timeline.Plan`). One compressor on
every bucket becomes ``CompressedDDP(compressor=...)``; a mix (some buckets dense, or several methods) is what
:class:`~lightning_gradcomp.callbacks.AutoCompression` does at run time, so the snippet adds it with those candidates.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from lightning_gradcomp.auto.timeline import DENSE
from lightning_gradcomp.compressors.base import Compressor

#: measured accuracy costs from the docs, by compressor class (the command is on the page named)
ACCURACY_NOTES = {
    "PowerSGD": "rank 4 ended 1.39 points below dense on the quickstart's small CNN (docs/powersgd.md); with AdamW on a"
    " small transformer, rank 2 +0.20 nats/byte, rank 8 after 20 dense steps +0.015 (docs/guide-transformers.md)",
    "TopK": "with AdamW on a small transformer, 1 % +0.64 and 10 % +0.27 nats/byte (docs/guide-transformers.md); with"
    " SGD see docs/measurements.md",
    "DGC": "with AdamW on a small transformer, +1.06 nats/byte (docs/guide-transformers.md); with SGD see docs/dgc.md",
    "BF16": "no measurable change (docs/fp16.md, docs/guide-transformers.md)",
    "FP16": "no measurable change (docs/fp16.md, docs/guide-transformers.md)",
}


def _compressor_yaml(compressor: Compressor, indent: str) -> list[str]:
    """The recipe's lines for ``compressor``: its class and its level (the other arguments at their defaults)."""
    lines = [f"{indent}class_path: lightning_gradcomp.compressors.{type(compressor).__name__}"]
    level = compressor.level_attribute
    if level is not None:
        lines.append(f"{indent}init_args: {{{level}: {getattr(compressor, level)}}}")
    return lines


def apply_snippet(assignment: Sequence[str], compressors: Mapping[str, Compressor]) -> str:
    """The Python and the recipe (YAML) that apply a plan's per-bucket ``assignment`` of candidate names."""
    used = sorted(set(assignment) - {DENSE})
    if not used:
        return (
            "Plain DDP is the fastest here: train without compression (Lightning's DDPStrategy, or CompressedDDP()"
            " to log the bytes)."
        )
    if len(used) == 1 and DENSE not in assignment:
        compressor = compressors[used[0]]
        python = [
            "from lightning_gradcomp import CompressedDDP",
            f"from lightning_gradcomp.compressors import {type(compressor).__name__}",
            f"trainer = Trainer(..., strategy=CompressedDDP(compressor={compressor!r}))",
        ]
        yaml = [
            "trainer:",
            "  strategy:",
            "    class_path: lightning_gradcomp.CompressedDDP",
            "    init_args:",
            "      compressor:",
            *_compressor_yaml(compressor, "        "),
        ]
    else:
        names = [DENSE, *used]
        python = [
            "from lightning_gradcomp import CompressedDDP",
            "from lightning_gradcomp.callbacks import AutoCompression",
            f"trainer = Trainer(..., strategy=CompressedDDP(), callbacks=[AutoCompression(candidates={names!r})])",
        ]
        yaml = [
            "trainer:",
            "  strategy: compressed_ddp",
            "  callbacks:",
            "    - class_path: lightning_gradcomp.callbacks.AutoCompression",
            f"      init_args: {{candidates: [{', '.join(names)}]}}",
        ]
    return "\n".join(["To apply it in Python:", "", *python, "", "or in a recipe:", "", *yaml])


def accuracy_caveat(assignment: Sequence[str], compressors: Mapping[str, Compressor]) -> str:
    """The reminder that the prediction is of time only, with each method's measured accuracy cost where known."""
    lines = ["Accuracy is not in this model: it predicts step time only. Measured accuracy costs:"]
    for name in sorted(set(assignment) - {DENSE}):
        kind = type(compressors[name]).__name__
        lines.append(f"- {name}: {ACCURACY_NOTES.get(kind, 'not measured in our docs; compare with a dense run')}")
    return "\n".join(lines) if len(lines) > 1 else "Accuracy is not in this model: it predicts step time only."
