"""``MuonAdamW``: Muon on the hidden layers' matrices and AdamW on the rest, as one optimizer.

Muon (Jordan et al. 2024, "Muon: An optimizer for hidden layers in neural networks"; ``torch.optim.Muon``)
orthogonalizes each 2-D update by Newton-Schulz iterations. It takes only 2-D parameters, and its authors (and
torch's documentation) give the embeddings, the output layer, biases and norms to a standard optimizer such as
AdamW. That is two optimizers, which strategies that step one inner optimizer (DiLoCo) refuse; this class is the
two as one ``torch.optim.Optimizer``: one list of parameter groups (each marked ``use_muon``), one state, one
``state_dict``, so that LR schedulers, checkpoints and DiLoCo's resume see a single optimizer.

MuLoCo (Therien et al. 2025, "MuLoCo: Muon is a practical inner optimizer for DiLoCo", arXiv 2505.23725) uses Muon as
DiLoCo's inner optimizer with inner lr 0.02, outer Nesterov SGD lr 0.7, momentum 0.6 and H = 30 (the authors'
``muloco-1`` package); :data:`MULOCO` holds those values.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

__all__ = ["MULOCO", "MuonAdamW", "muon_param_groups"]

#: MuLoCo's settings (arXiv 2505.23725; bentherien/muloco-1's ``MuLoCo1`` defaults): Muon's lr inside, the outer
#: Nesterov SGD's lr and momentum, and H
MULOCO = {"inner_lr": 0.02, "outer_lr": 0.7, "outer_momentum": 0.6, "sync_every": 30}


def muon_param_groups(module: nn.Module, weight_decay: float = 0.0) -> list[dict[str, Any]]:
    """``module``'s trained parameters as :class:`MuonAdamW`'s groups: Muon for the hidden layers' matrices.

    The weights of ``nn.Linear`` layers go to Muon, except a weight that is also an ``nn.Embedding``'s (a tied output
    layer); embeddings and every other parameter go to AdamW, with ``weight_decay`` on the embeddings and none on
    1-D parameters (biases, norms), as nanoGPT decays.
    """
    embeddings = {id(m.weight) for m in module.modules() if isinstance(m, nn.Embedding)}
    hidden = {
        id(m.weight)
        for m in module.modules()
        if isinstance(m, nn.Linear) and m.weight.dim() == 2 and id(m.weight) not in embeddings
    }
    params = [p for p in module.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if id(p) in hidden], "use_muon": True, "weight_decay": weight_decay},
        {
            "params": [p for p in params if id(p) not in hidden and p.dim() >= 2],
            "use_muon": False,
            "weight_decay": weight_decay,
        },
        {"params": [p for p in params if id(p) not in hidden and p.dim() < 2], "use_muon": False, "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


class MuonAdamW(Optimizer):
    """Muon for the parameter groups marked ``use_muon``, AdamW for the others: one optimizer.

    The groups are torch's own optimizers' (``torch.optim.Muon`` and ``torch.optim.AdamW``, the same dictionaries),
    and so is the state, shared: a scheduler that sets a group's ``lr`` sets it for the optimizer that steps it, and
    ``state_dict``/``load_state_dict`` cover both. A group's ``lr`` is Muon's or AdamW's as its mark says.

    Args:
        params: parameter groups with ``use_muon`` (:func:`muon_param_groups` makes them from a module); a plain
            iterable of tensors is split by shape (2-D to Muon, the rest to AdamW).
        lr: Muon's learning rate (0.02: MuLoCo's, and Keller Jordan's for nanoGPT speedruns).
        momentum, nesterov, ns_steps, adjust_lr_fn: ``torch.optim.Muon``'s.
        weight_decay: the default weight decay of a group that gives none (both optimizers).
        adamw_lr: AdamW's learning rate for the other groups.
        adamw_betas, adamw_eps: AdamW's.

    Raises:
        ValueError: If a Muon group holds a parameter that is not 2-D (``torch.optim.Muon``'s rule), or no group
            holds a parameter.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 0.02,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        adjust_lr_fn: str | None = None,
        weight_decay: float = 0.0,
        adamw_lr: float = 1e-3,
        adamw_betas: tuple[float, float] = (0.9, 0.95),
        adamw_eps: float = 1e-8,
    ) -> None:
        groups = _as_groups(params)
        muon = [g for g in groups if g["use_muon"]]
        adamw = [g for g in groups if not g["use_muon"]]
        self._muon = (
            torch.optim.Muon(
                muon,
                lr=lr,
                momentum=momentum,
                nesterov=nesterov,
                ns_steps=ns_steps,
                adjust_lr_fn=adjust_lr_fn,
                weight_decay=weight_decay,
            )
            if muon
            else None
        )
        self._adamw = (
            torch.optim.AdamW(adamw, lr=adamw_lr, betas=adamw_betas, eps=adamw_eps, weight_decay=weight_decay)
            if adamw
            else None
        )
        inner = [*(self._muon.param_groups if self._muon else []), *(self._adamw.param_groups if self._adamw else [])]
        # the inner optimizers' own group dictionaries (add_param_group keeps the dict it is given)
        super().__init__(inner, {"lr": lr, "weight_decay": weight_decay})
        self._bind()

    def _bind(self) -> None:
        """Point the inner optimizers at this optimizer's groups and state (again after ``load_state_dict``)."""
        n = len(self._muon.param_groups) if self._muon else 0
        if self._muon is not None:
            self._muon.param_groups = self.param_groups[:n]
            self._muon.state = self.state
        if self._adamw is not None:
            self._adamw.param_groups = self.param_groups[n:]
            self._adamw.state = self.state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load as ``torch.optim.Optimizer`` does (new group dictionaries and state), then rebind the two."""
        super().load_state_dict(state_dict)
        self._bind()

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """The closure (once, with gradients on), then Muon's step and AdamW's step on their groups."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for inner in (self._muon, self._adamw):
            if inner is not None:
                inner.step()
        return loss


def _as_groups(params: Iterable[Any]) -> list[dict[str, Any]]:
    """Parameter groups, each with ``use_muon``: given groups keep theirs (default ``False``), tensors by shape."""
    items = list(params)
    if not items:
        raise ValueError("Expected `params` to hold at least one parameter or parameter group, got none.")
    if all(isinstance(item, dict) for item in items):
        return [{**g, "params": list(g["params"]), "use_muon": bool(g.get("use_muon", False))} for g in items]
    tensors = [p for p in items if isinstance(p, torch.Tensor)]
    groups = [
        {"params": [p for p in tensors if p.dim() == 2], "use_muon": True},
        {"params": [p for p in tensors if p.dim() != 2], "use_muon": False},
    ]
    return [g for g in groups if g["params"]]
