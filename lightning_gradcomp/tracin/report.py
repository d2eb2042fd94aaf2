"""TracIn's report: a CSV of every training example's self-influence and a PNG grid of the most influential.

Kept apart from :mod:`lightning_gradcomp.tracin.scoring` (the scoring): the report is the only part that draws, and
matplotlib is an optional dependency (the ``influence`` extra), imported only when a PNG is asked for.
"""

from __future__ import annotations

import csv
import math
import os
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import Dataset

__all__ = ["write_report"]


def _label(value: Any) -> str:
    if isinstance(value, Tensor):
        return str(value.item()) if value.numel() == 1 else "x".join(map(str, value.shape))
    return str(value)


def _image(x: Tensor, image_shape: Sequence[int] | None) -> Tensor:
    x = x.detach().cpu().float()
    if image_shape is not None:
        x = x.reshape(*image_shape)
    elif x.dim() == 1 and math.isqrt(x.numel()) ** 2 == x.numel():
        side = math.isqrt(x.numel())
        x = x.reshape(side, side)
    if x.dim() == 3 and x.shape[0] in (1, 3):
        x = x.permute(1, 2, 0)
    if x.dim() == 3 and x.shape[-1] == 1:
        x = x[..., 0]
    if x.dim() == 3 and x.shape[-1] == 3:
        lo, hi = x.min(), x.max()
        return (x - lo) / (hi - lo) if hi > lo else x * 0
    if x.dim() != 2:
        raise ValueError(
            f"Cannot show an example of shape {tuple(x.shape)} as an image; pass `image_shape` (e.g. [28, 28])."
        )
    return x


def write_report(
    dirpath: str,
    scores: Tensor,
    dataset: Dataset,
    top_n: int = 64,
    columns: dict[str, Tensor] | None = None,
    image_shape: Sequence[int] | None = None,
    title: str = "Most self-influential training examples",
) -> tuple[str, str | None]:
    """Write ``self_influence.csv`` (every example, most influential first) and ``top_self_influence.png``.

    The CSV has ``rank, index, label, self_influence`` and any extra ``columns`` (e.g. the final loss). The PNG is
    a grid of the ``top_n`` most self-influential examples, each titled with its index and label (matplotlib, Agg
    backend; imported only here). Returns the two paths (the PNG's is ``None`` when ``top_n`` is 0).
    """
    os.makedirs(dirpath, exist_ok=True)
    order = torch.argsort(scores, descending=True, stable=True)
    columns = columns or {}
    csv_path = os.path.join(dirpath, "self_influence.csv")
    labels: dict[int, str] = {}
    with open(csv_path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["rank", "index", "label", "self_influence", *columns])
        for position, index in enumerate(order.tolist()):
            labels[index] = _label(dataset[index][-1])
            row = [position, index, labels[index], f"{float(scores[index]):.9g}"]
            writer.writerow(row + [f"{float(values[index]):.9g}" for values in columns.values()])
    if top_n <= 0:
        return csv_path, None
    try:
        import matplotlib
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise ImportError(
            "TracIn's PNG report needs matplotlib: pip install 'lightning-gradcomp[influence]' (or pass top_n=0 for"
            " the CSV alone)."
        ) from error

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = order[:top_n].tolist()
    cols = min(8, len(shown))
    rows = math.ceil(len(shown) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(1.6 * cols, 1.8 * rows + 0.4), squeeze=False)
    for ax in axes.flat:
        ax.axis("off")
    for ax, index in zip(axes.flat, shown):
        image = _image(dataset[index][0], image_shape)
        ax.imshow(image.numpy(), cmap="gray" if image.dim() == 2 else None)
        ax.set_title(f"#{index} y={labels[index]}", fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    png_path = os.path.join(dirpath, "top_self_influence.png")
    fig.savefig(png_path, dpi=80)
    plt.close(fig)
    return csv_path, png_path
