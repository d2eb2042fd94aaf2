"""Language models (an LSTM, a GPT-style transformer) and a text DataModule (byte-level, offline by default)."""

from __future__ import annotations

import glob
import math
import os
import re
import sysconfig
from collections import Counter
from functools import partial
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_gradcomp.models.gpt import GPT
from lightning_gradcomp.optim import FusedAdaLomo, FusedSGD, MuonAdamW, NovoGrad, muon_param_groups
from lightning_gradcomp.tasks.classification import check_milestones
from lightning_gradcomp.validation import check_bool, check_choice, check_int, check_number, check_positive_int

_OPTIMIZERS = {"sgd": torch.optim.SGD, "novograd": NovoGrad, "fused_sgd": FusedSGD, "fused_adalomo": FusedAdaLomo}
_WORD = re.compile(rb"\w+|[^\w\s]")  # words and single punctuation marks, on bytes


class TextDataModule(pl.LightningDataModule):
    """Text as bytes (or words), cut into sequences for next-token prediction.

    By default the corpus is Python's own standard library (its ``.py`` files), which every installation ships: a
    real, offline text. Pass ``files`` to train on something else (e.g. WikiText-2's ``wiki.train.tokens``).

    With ``tokens="words"`` the text is split into words and punctuation marks, and the ``vocab_size - 1`` most
    frequent ones get an id (by count, then alphabetically: the same on every rank), the rest share id 0: a
    word-level vocabulary whose embedding gradients are mostly zero rows (what Zen is for).

    Args:
        files: text files (glob patterns allowed); ``None`` for the standard library's sources.
        max_bytes: read at most this many bytes of text.
        seq_len: tokens per training sequence.
        batch_size: sequences per batch and process.
        val_fraction: the last fraction of the text is held out.
        tokens: ``"bytes"`` (256 ids) or ``"words"``.
        vocab_size: the number of word ids with ``tokens="words"`` (the model's ``vocab_size``).

    Raises:
        MisconfigurationException: If an argument is out of range or no text is found.
    """

    vocab_size = 256

    def __init__(
        self,
        files: list[str] | None = None,
        max_bytes: int = 2_000_000,
        seq_len: int = 128,
        batch_size: int = 32,
        val_fraction: float = 0.05,
        tokens: str = "bytes",
        vocab_size: int = 10_000,
    ) -> None:
        super().__init__()
        check_choice(tokens, "tokens", ("bytes", "words"), error=MisconfigurationException)
        check_int(vocab_size, "vocab_size", low=2, error=MisconfigurationException)
        check_int(seq_len, "seq_len", low=2, error=MisconfigurationException)
        check_positive_int(batch_size, "batch_size", error=MisconfigurationException)
        check_int(max_bytes, "max_bytes", low=1024, error=MisconfigurationException)
        check_number(
            val_fraction,
            "val_fraction",
            low=0.0,
            high=0.5,
            low_open=True,
            high_open=True,
            error=MisconfigurationException,
        )
        self.files, self.max_bytes, self.seq_len = files, max_bytes, seq_len
        self.batch_size, self.val_fraction = batch_size, val_fraction
        self.tokens = tokens
        if tokens == "words":
            self.vocab_size = vocab_size

    def _paths(self) -> list[str]:
        if self.files is None:
            return sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
        paths = sorted(p for pattern in self.files for p in glob.glob(os.path.expanduser(pattern)))
        if not paths:
            raise MisconfigurationException(f"No file matches `files`={self.files!r}.")
        return paths

    def setup(self, stage: str | None = None) -> None:
        """Read the bytes (the same on every rank), split, and cut into sequences."""
        data = bytearray()
        for path in self._paths():
            with open(path, "rb") as f:
                data += f.read(self.max_bytes - len(data))
            if len(data) >= self.max_bytes:
                break
        if self.tokens == "words":
            tokens = self._word_ids(bytes(data))
        else:
            tokens = torch.frombuffer(data, dtype=torch.uint8).long()  # a copy (long) of a writable buffer
        split = int(len(tokens) * (1 - self.val_fraction))
        self.train_set = self._sequences(tokens[:split])
        self.val_set = self._sequences(tokens[split:])

    def _word_ids(self, data: bytes) -> torch.Tensor:
        words = _WORD.findall(data)
        ranked = sorted(Counter(words).items(), key=lambda item: (-item[1], item[0]))[: self.vocab_size - 1]
        ids = {word: i + 1 for i, (word, _) in enumerate(ranked)}
        return torch.tensor([ids.get(word, 0) for word in words], dtype=torch.long)

    def _sequences(self, tokens: torch.Tensor) -> TensorDataset:
        n = (len(tokens) - 1) // self.seq_len
        if n < 1:
            raise MisconfigurationException("The text is shorter than one sequence: add files or lower `seq_len`.")
        x = tokens[: n * self.seq_len].view(n, self.seq_len)
        y = tokens[1 : n * self.seq_len + 1].view(n, self.seq_len)
        return TensorDataset(x, y)

    def train_dataloader(self) -> DataLoader:
        """Shuffled sequences."""
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        """Held-out sequences."""
        return DataLoader(self.val_set, batch_size=self.batch_size)


class _NextTokenModel(pl.LightningModule):
    """Training and validation steps of a next-token language model (``forward`` gives logits per position)."""

    def _loss(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x).flatten(0, 1), y.flatten())

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        """Cross-entropy of the next token."""
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        """Held-out loss and perplexity."""
        loss = self._loss(batch)
        self.log("val_loss", loss, sync_dist=True)
        self.log("val_ppl", torch.exp(loss), sync_dist=True, prog_bar=True)


class LSTMLanguageModel(_NextTokenModel):
    """A multi-layer LSTM language model, input and output embeddings tied by default (Zaremba et al.; Press & Wolf).

    The shape of the model the PowerSGD and Pufferfish papers compress (2 layers, embedding = hidden, tied weights,
    dropout, SGD with a large learning rate and gradient clipping); on bytes rather than WikiText-2's words unless
    given word-level data. Logs ``train_loss``, ``val_loss`` and ``val_ppl`` (per byte).

    Args:
        vocab_size: number of tokens (256 for bytes).
        hidden: embedding and hidden size (tied weights need them equal).
        num_layers: LSTM layers.
        dropout: dropout between layers.
        lr: the learning rate.
        milestones: epochs at which the learning rate is divided by 4.
        optimizer: ``"sgd"`` (``torch.optim.SGD``, the papers' setting), ``"novograd"``
            (:class:`~lightning_gradcomp.optim.NovoGrad`), or a step fused into ``CompressedDDP``'s hook:
            ``"fused_sgd"`` (:class:`~lightning_gradcomp.optim.FusedSGD`) or ``"fused_adalomo"``
            (:class:`~lightning_gradcomp.optim.FusedAdaLomo`).
        weight_decay: the optimizer's weight decay.
        clip_grad_norm: for the fused optimizers only, clipping by the previous step's global gradient norm (they
            refuse the Trainer's ``gradient_clip_val``, which is the clipping for ``"sgd"``: 0.25 in the papers'
            runs).

        tie_weights: share the embedding with the output layer. Untied, the embedding's gradient has non-zero rows
            only for the batch's tokens (a sparse gradient, for :class:`~lightning_gradcomp.compressors.Zen`).

    Raises:
        MisconfigurationException: If an argument is out of range, or ``clip_grad_norm`` is given for an optimizer
            that is not fused.
    """

    def __init__(
        self,
        vocab_size: int = 256,
        hidden: int = 256,
        num_layers: int = 2,
        dropout: float = 0.2,
        lr: float = 20.0,
        milestones: list[int] | None = None,
        tie_weights: bool = True,
        optimizer: Literal["sgd", "novograd", "fused_sgd", "fused_adalomo"] = "sgd",
        weight_decay: float = 0.0,
        clip_grad_norm: float | None = None,
    ) -> None:
        super().__init__()
        check_positive_int(vocab_size, "vocab_size", error=MisconfigurationException)
        check_positive_int(hidden, "hidden", error=MisconfigurationException)
        check_positive_int(num_layers, "num_layers", error=MisconfigurationException)
        check_number(dropout, "dropout", low=0, high=1, high_open=True, error=MisconfigurationException)
        check_number(lr, "lr", low=0, low_open=True, error=MisconfigurationException)
        check_milestones(milestones, 0)
        check_choice(optimizer, "optimizer", tuple(_OPTIMIZERS), error=MisconfigurationException)
        check_number(weight_decay, "weight_decay", low=0, error=MisconfigurationException)
        check_number(
            clip_grad_norm, "clip_grad_norm", low=0, low_open=True, allow_none=True, error=MisconfigurationException
        )
        if clip_grad_norm is not None and not optimizer.startswith("fused_"):
            raise MisconfigurationException(
                f"`clip_grad_norm` is for the fused optimizers; with optimizer={optimizer!r} clip with the Trainer's"
                f" `gradient_clip_val`, got clip_grad_norm={clip_grad_norm!r}."
            )
        check_bool(tie_weights, "tie_weights", error=MisconfigurationException)
        self.save_hyperparameters()
        self.embedding = nn.Embedding(vocab_size, hidden)
        self.lstm = nn.LSTM(hidden, hidden, num_layers=num_layers, dropout=dropout, batch_first=True)
        self.drop = nn.Dropout(dropout)
        self.decoder = nn.Linear(hidden, vocab_size)
        if tie_weights:
            self.decoder.weight = self.embedding.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Next-token logits for every position."""
        out, _ = self.lstm(self.drop(self.embedding(x)))
        return self.decoder(self.drop(out))

    def configure_optimizers(self) -> Any:
        """The chosen optimizer (plain SGD: the papers' LSTM setting) with a step decay by 4."""
        hp = self.hparams
        name = hp.get("optimizer", "sgd")
        kwargs: dict[str, Any] = {"lr": hp["lr"], "weight_decay": hp.get("weight_decay", 0.0)}
        if name.startswith("fused_"):
            kwargs["clip_grad_norm"] = hp.get("clip_grad_norm")
        optimizer = _OPTIMIZERS[name](self.parameters(), **kwargs)
        decay = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=list(hp["milestones"] or []), gamma=0.25)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": decay, "interval": "epoch"}}


class GPTLanguageModel(_NextTokenModel):
    """A GPT-style transformer language model (nanoGPT's model and AdamW setting), on bytes by default.

    DiLoCo (arXiv 2311.08105) and its successors report on decoder-only transformers trained with AdamW, a linear
    warm-up and a cosine decay; this is that setting at a size that trains on CPUs: the defaults (4 blocks, width
    256, 4 heads, 128 positions, 256 byte tokens) have 3.2 million parameters. Logs ``train_loss``, ``val_loss`` and
    ``val_ppl`` (per token).

    Args:
        vocab_size: number of tokens (256 for bytes).
        block_size: the longest sequence (``TextDataModule``'s ``seq_len`` must not exceed it).
        n_layer: transformer blocks.
        n_head: attention heads (must divide ``n_embd``).
        n_embd: the model's width.
        dropout: dropout in the blocks.
        lr: AdamW's peak learning rate.
        weight_decay: AdamW's weight decay, on matrices and embeddings only (not on biases and norms, as nanoGPT).
        warmup_steps: optimizer steps of linear warm-up from 0 to ``lr``.
        min_lr_ratio: the cosine decay ends at ``min_lr_ratio * lr`` at the trainer's last step.
        optimizer: ``"adamw"``, or ``"muon"``: :class:`~lightning_gradcomp.optim.MuonAdamW`, Muon with
            ``muon_lr`` on the blocks' matrices and AdamW with ``lr`` on the embeddings, biases and norms (one
            optimizer; MuLoCo's inner optimizer, arXiv 2505.23725). The same schedule scales both.
        muon_lr: Muon's peak learning rate (0.02: MuLoCo's).

    Raises:
        MisconfigurationException: If an argument is out of range, or ``n_head`` does not divide ``n_embd``.
    """

    def __init__(
        self,
        vocab_size: int = 256,
        block_size: int = 128,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 256,
        dropout: float = 0.0,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        warmup_steps: int = 100,
        min_lr_ratio: float = 0.1,
        optimizer: str = "adamw",
        muon_lr: float = 0.02,
    ) -> None:
        super().__init__()
        for name, value in (
            ("vocab_size", vocab_size),
            ("block_size", block_size),
            ("n_layer", n_layer),
            ("n_head", n_head),
            ("n_embd", n_embd),
        ):
            check_positive_int(value, name, error=MisconfigurationException)
        if n_embd % n_head:
            raise MisconfigurationException(f"Expected `n_head` to divide `n_embd` ({n_embd}), got n_head={n_head}.")
        check_number(dropout, "dropout", low=0, high=1, high_open=True, error=MisconfigurationException)
        check_number(lr, "lr", low=0, low_open=True, error=MisconfigurationException)
        check_number(weight_decay, "weight_decay", low=0, error=MisconfigurationException)
        check_int(warmup_steps, "warmup_steps", low=0, error=MisconfigurationException)
        check_number(min_lr_ratio, "min_lr_ratio", low=0, high=1, error=MisconfigurationException)
        check_choice(optimizer, "optimizer", ("adamw", "muon"), error=MisconfigurationException)
        check_number(muon_lr, "muon_lr", low=0, low_open=True, error=MisconfigurationException)
        self.save_hyperparameters()
        self.model = GPT(vocab_size, block_size, n_layer, n_head, n_embd, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Next-token logits for every position."""
        return self.model(x)

    def configure_optimizers(self) -> Any:
        """AdamW (betas 0.9, 0.95; decay on matrices only) or Muon with AdamW, linear warm-up then cosine decay."""
        hp = self.hparams
        optimizer: torch.optim.Optimizer
        if hp.get("optimizer", "adamw") == "muon":
            groups = muon_param_groups(self, weight_decay=hp["weight_decay"])
            optimizer = MuonAdamW(groups, lr=hp["muon_lr"], adamw_lr=hp["lr"], adamw_betas=(0.9, 0.95))
        else:
            params = [p for p in self.parameters() if p.requires_grad]
            groups = [
                {"params": [p for p in params if p.dim() >= 2], "weight_decay": hp["weight_decay"]},
                {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
            ]
            optimizer = torch.optim.AdamW(groups, lr=hp["lr"], betas=(0.9, 0.95))
        total = max(int(self.trainer.estimated_stepping_batches), 1) if self._trainer is not None else 1
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, partial(_warmup_cosine, warmup=hp["warmup_steps"], total=total, floor=hp["min_lr_ratio"])
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def _warmup_cosine(step: int, warmup: int, total: int, floor: float) -> float:
    """The learning rate's factor at ``step``: linear from 0 over ``warmup`` steps, then cosine down to ``floor``."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    progress = min((step - warmup) / max(total - warmup, 1), 1.0)
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
