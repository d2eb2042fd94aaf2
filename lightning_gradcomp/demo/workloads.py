"""Small real workloads on offline data, shared by the ratio and convergence benchmarks (and their short CI versions).

* ``digits``: scikit-learn's bundled handwritten digits (1797 8x8 images, 10 classes), a fixed stratified-free split
  (a seeded permutation: 1437 training and 360 test images), pixel values scaled to [0, 1].
* ``text``: a character-level language-modelling corpus made of the Python standard library's own source files (the
  ``*.py`` files directly under ``sysconfig.get_paths()["stdlib"]``, sorted by name), mapped to 98 symbols
  (printable ASCII, newline, tab, one "other").

Models: ``DigitsCNN`` (three convolutions and two linear layers, 126k parameters) and ``CharLSTM`` (an embedding, one
LSTM layer and a linear decoder, 325k parameters).
"""

from __future__ import annotations

import glob
import os
import string
import sysconfig

import torch
from torch import nn

SEED = 0


def digits(seed: int = SEED) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x_train, y_train, x_test, y_test)``: 1437 / 360 images of shape (1, 8, 8) in [0, 1], int64 labels."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(data.target, dtype=torch.int64)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    x, y = x[order], y[order]
    return x[:1437], y[:1437], x[1437:], y[1437:]


_SYMBOLS = string.printable[:95] + "\n\t"  # printable ASCII (digits, letters, punctuation, space) + newline, tab
VOCAB = len(_SYMBOLS) + 1  # the last id stands for every other character


def stdlib_text(max_chars: int = 2_000_000) -> torch.Tensor:
    """The standard library's top-level ``*.py`` sources, concatenated, as symbol ids (int64)."""
    table = {c: i for i, c in enumerate(_SYMBOLS)}
    pieces, total = [], 0
    for path in sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py"))):
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
        pieces.append(text)
        total += len(text)
        if total >= max_chars:
            break
    text = "".join(pieces)[:max_chars]
    return torch.tensor([table.get(c, VOCAB - 1) for c in text], dtype=torch.int64)


def text_batch(corpus: torch.Tensor, batch_size: int, seq_len: int, generator: torch.Generator) -> tuple:
    """``batch_size`` random windows of ``seq_len + 1`` characters: inputs and next-character targets."""
    starts = torch.randint(0, corpus.numel() - seq_len - 1, (batch_size,), generator=generator)
    windows = torch.stack([corpus[s : s + seq_len + 1] for s in starts.tolist()])
    return windows[:, :-1], windows[:, 1:]


class DigitsCNN(nn.Module):
    """Three 3x3 convolutions (32, 64, 128 channels) and two linear layers for 8x8 digits (126k parameters)."""

    def __init__(self, seed: int = SEED) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.features = nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(32, 64, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(64, 128, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(128 * 2 * 2, 64), nn.ReLU(), nn.Linear(64, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits."""
        return self.classifier(self.features(x))


class CharLSTM(nn.Module):
    """Character-level language model: embedding (32), one LSTM layer (256 units), linear decoder (325k parameters)."""

    def __init__(self, hidden: int = 256, embedding: int = 32) -> None:
        super().__init__()
        torch.manual_seed(SEED)
        self.embed = nn.Embedding(VOCAB, embedding)
        self.lstm = nn.LSTM(embedding, hidden, batch_first=True)
        self.decoder = nn.Linear(hidden, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits."""
        out, _ = self.lstm(self.embed(x))
        return self.decoder(out)


def layer_kind(name: str, param: torch.Tensor) -> str:
    """``"conv"`` (>= 3-D weights), ``"recurrent"`` (LSTM/GRU/RNN weights), ``"fc"`` (other 2-D), else ``"other"``."""
    if param.ndim >= 3:
        return "conv"
    if param.ndim == 2:
        return "recurrent" if "weight_ih" in name or "weight_hh" in name else "fc"
    return "other"
