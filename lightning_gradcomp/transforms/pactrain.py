"""PacTrain-style pruning: the schedule and the magnitude masks (the callback is :class:`lightning_gradcomp.PacTrain`).

Wang, Wu, Li & Kutscher, "PacTrain: Pruning and Adaptive Sparse Gradient Compression for Efficient Collective
Communication in Distributed Deep Learning", arXiv:2505.18563 (2025). Only its abstract could be read: active pruning
makes weights and gradients sparse; since all workers know the sparsity pattern, gradients can be compressed in an
all-reduce compatible way. Everything below is this package's own choice, not checked against the paper's text or
code, and every such choice is an argument of :class:`~lightning_gradcomp.PacTrain`:

* the pruning is gradual magnitude pruning (Zhu & Gupta, "To prune, or not to prune", 2017): from ``start_step`` to
  ``end_step``, every ``frequency`` steps, the sparsity follows ``s_t = s_f + (s_0 - s_f) (1 - p)^3`` with
  ``p = (t - start) / (end - start)`` (or linearly), and each layer keeps its largest-magnitude weights (or whole
  output channels / rows of largest L2 norm); pruned weights never come back;
* biases and normalisation layers are not pruned; pruned weights are zero after every optimizer step (re-masked
  after each step, and the optimizer's per-weight state of pruned weights is zeroed when they are pruned);
* gradients go through :class:`~lightning_gradcomp.compressors.MaskedCompressor`: only the surviving entries are
  gathered into a compact buffer and all-reduced (no indices), then scattered back; the strategy's compressor is
  stacked on the compact buffer; layers denser than ``dense_threshold`` are not compacted.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence
from typing import Literal

import torch
from torch import Tensor, nn

from lightning_gradcomp.compressors.masked import Masks

_NORMS = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm, nn.LocalResponseNorm, nn.RMSNorm)
Schedule = Literal["cubic", "linear"]
Granularity = Literal["element", "channel"]
Scope = Literal["layer", "global"]


def sparsity_at(
    step: int, final: float, start: int, end: int, initial: float = 0.0, schedule: Schedule = "cubic"
) -> float:
    """The target sparsity at ``step`` (0 before ``start``, ``final`` from ``end`` on)."""
    if step < start:
        return 0.0
    if step >= end:
        return final
    progress = (step - start) / (end - start)
    if schedule == "cubic":
        return final + (initial - final) * (1.0 - progress) ** 3
    return initial + (final - initial) * progress


def prunable_parameters(module: nn.Module, exclude: Sequence[str] = ()) -> dict[str, nn.Parameter]:
    """Parameters pruning applies to: >= 2-D, trainable, not of a normalisation layer, not matching ``exclude``."""
    skipped = {id(p) for m in module.modules() if isinstance(m, _NORMS) for p in m.parameters(recurse=False)}
    return {
        name: p
        for name, p in module.named_parameters()
        if p.dim() >= 2
        and p.requires_grad
        and id(p) not in skipped
        and not any(fnmatch.fnmatchcase(name, pattern) for pattern in exclude)
    }


def _keep(n: int, sparsity: float) -> int:
    return max(1, n - int(sparsity * n))


def magnitude_masks(
    weights: Mapping[str, Tensor],
    sparsity: float,
    previous: Mapping[str, Tensor] | Masks | None = None,
    granularity: Granularity = "element",
    scope: Scope = "layer",
) -> dict[str, Tensor]:
    """Masks keeping the largest-magnitude weights (``"element"``) or rows of largest L2 norm (``"channel"``).

    ``scope="layer"`` prunes every layer to ``sparsity``; ``"global"`` (elements only) keeps the largest magnitudes of
    all layers together. Entries pruned in ``previous`` stay pruned (they rank below every survivor). Every layer
    keeps at least one entry (row).
    """
    scores: dict[str, Tensor] = {}
    for name, w in weights.items():
        score = w.detach().abs().float()
        if granularity == "channel":
            score = score.reshape(w.shape[0], -1).norm(dim=1)
        if previous is not None and name in previous:
            kept = previous[name].to(score.device)
            if granularity == "channel":
                kept = kept.reshape(w.shape[0], -1).any(dim=1)
            score = torch.where(kept.reshape(score.shape), score, torch.full_like(score, -1.0))
        scores[name] = score.reshape(-1)
    if scope == "global":
        flat = torch.cat(list(scores.values()))
        keep = _keep(flat.numel(), sparsity)
        chosen = torch.zeros(flat.numel(), dtype=torch.bool, device=flat.device)
        chosen[torch.topk(flat, keep, sorted=False).indices] = True
        out, offset = {}, 0
        for name, w in weights.items():
            mask = chosen[offset : offset + w.numel()].reshape(w.shape)
            offset += w.numel()
            if not mask.any():
                mask.view(-1)[scores[name].argmax()] = True
            out[name] = mask
        return out
    out = {}
    for name, w in weights.items():
        score = scores[name]
        chosen = torch.zeros(score.numel(), dtype=torch.bool, device=score.device)
        chosen[torch.topk(score, _keep(score.numel(), sparsity), sorted=False).indices] = True
        out[name] = (
            chosen.reshape(w.shape[0], *([1] * (w.dim() - 1))).expand(w.shape).clone()
            if (granularity == "channel")
            else chosen.reshape(w.shape)
        )
    return out
