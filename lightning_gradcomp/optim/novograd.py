"""``NovoGrad``: SGD with momentum on gradients normalised by a per-layer second moment, decoupled weight decay."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_gradcomp.validation import check_bool, check_momentum, check_number

__all__ = ["NovoGrad"]


class NovoGrad(Optimizer):
    """NovoGrad, the rule of the paper and of NVIDIA's own implementations, with no bias correction.

    Ginsburg, Castonguay, Hrinchuk, Kuchaiev, Lavrukhin, Leary, Li, Nguyen, Zhang & Cohen, "Stochastic Gradient
    Methods with Layer-wise Adaptive Moments for Training of Deep Networks" / "Training Deep Networks with Stochastic
    Gradient Normalized by Layerwise Adaptive Second Moments", arXiv:1905.11286. Per parameter tensor (a "layer")
    ``l``, with ``g`` the (data-parallel averaged) gradient::

        v = ||g||^2                                   (the layer's first step: "moment initialization")
        v = beta2 * v + (1 - beta2) * ||g||^2         (later steps; one scalar per tensor)
        d = g / (sqrt(v) + eps) + weight_decay * w    (decay added after the normalisation, not divided by it)
        d = (1 - beta1) * d                           (only with grad_averaging)
        m = beta1 * m + d                             (m starts at 0)
        w = w - lr * m

    Verified against NVIDIA's code (NeMo ``nemo/core/optim/novograd.py``; timm's ``NvNovoGrad``, a port of NVIDIA's
    Jasper example, is the same code): defaults ``betas=(0.95, 0.98)``, ``eps=1e-8``, ``grad_averaging=False``;
    ``v`` starts again from ``||g||^2`` while it is exactly zero (a layer whose gradients were all zero so far), as
    theirs do (``v == 0`` decides it here without a host synchronisation). Unlike theirs, ``p.grad`` is not
    modified. apex's ``FusedNovoGrad`` defaults to a different, Adam-like rule with bias correction; see
    ``docs/optimizers.md`` for a table of the implementations and how they differ.

    Args:
        params: the parameters or parameter groups.
        lr: the learning rate.
        betas: ``(beta1, beta2)``, the momentum and the decay of the per-layer second moment, each in [0, 1).
        eps: added to ``sqrt(v)``.
        weight_decay: the coefficient of ``w`` added to the normalised gradient.
        grad_averaging: multiply the normalised gradient by ``1 - beta1`` before the momentum (an exponential
            moving average instead of a sum).
        amsgrad: normalise by the running maximum of ``v`` (NeMo's option).
        foreach: ``True`` (default) updates every tensor of a group together with ``torch._foreach_*`` kernels;
            ``False`` is the plain per-tensor loop (the same arithmetic, kept as the reference).

    Raises:
        ValueError: If an argument is out of range (naming it).

    Example::

        >>> import torch
        >>> from lightning_gradcomp.optim import NovoGrad
        >>> optimizer = NovoGrad(torch.nn.Linear(4, 2).parameters(), lr=0.01, weight_decay=1e-3)
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.95, 0.98),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        grad_averaging: bool = False,
        amsgrad: bool = False,
        foreach: bool = True,
    ) -> None:
        check_number(lr, "lr", low=0.0)
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ValueError(f"Expected `betas` to be a pair (beta1, beta2), got {betas!r}.")
        check_momentum(betas[0], "betas[0]")
        check_momentum(betas[1], "betas[1]")
        check_number(eps, "eps", low=0.0)
        check_number(weight_decay, "weight_decay", low=0.0)
        check_bool(grad_averaging, "grad_averaging")
        check_bool(amsgrad, "amsgrad")
        check_bool(foreach, "foreach")
        defaults = {
            "lr": lr,
            "betas": tuple(betas),
            "eps": eps,
            "weight_decay": weight_decay,
            "grad_averaging": grad_averaging,
            "amsgrad": amsgrad,
            "foreach": foreach,
        }
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One update of every parameter with a gradient (see the class docstring).

        Args:
            closure: re-evaluates the model and returns the loss, as for any torch optimizer.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            for p in params:
                if p.grad.is_sparse:
                    raise RuntimeError("NovoGrad does not support sparse gradients.")
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros((), dtype=p.dtype, device=p.device)
                    if group["amsgrad"]:
                        state["max_exp_avg_sq"] = torch.zeros((), dtype=p.dtype, device=p.device)
                state["step"] += 1
            if not params:
                continue
            if group["foreach"]:
                for same in _by_device_and_dtype(params).values():
                    self._foreach_update(same, group)
            else:
                for p in params:
                    self._single_update(p, group)
        return loss

    def _single_update(self, p: Tensor, group: dict[str, Any]) -> None:
        """The reference path: one tensor at a time."""
        beta1, beta2 = group["betas"]
        state = self.state[p]
        grad, v, m = p.grad, state["exp_avg_sq"], state["exp_avg"]
        norm_sq = torch.linalg.vector_norm(grad).square()
        v.copy_(torch.where(v == 0, norm_sq, v * beta2 + norm_sq * (1 - beta2)))
        if group["amsgrad"]:
            torch.maximum(state["max_exp_avg_sq"], v, out=state["max_exp_avg_sq"])
            v = state["max_exp_avg_sq"]
        update = grad / (v.sqrt() + group["eps"])  # a new tensor: p.grad stays as it is
        if group["weight_decay"] != 0:
            update.add_(p, alpha=group["weight_decay"])
        if group["grad_averaging"]:
            update.mul_(1 - beta1)
        m.mul_(beta1).add_(update)
        p.add_(m, alpha=-group["lr"])

    def _foreach_update(self, params: list[Tensor], group: dict[str, Any]) -> None:
        """The same arithmetic over every tensor of one device and dtype at once."""
        beta1, beta2 = group["betas"]
        states = [self.state[p] for p in params]
        grads = [p.grad for p in params if p.grad is not None]  # all of them (the caller's filter)
        v_list = [s["exp_avg_sq"] for s in states]
        m_list = [s["exp_avg"] for s in states]
        norm_sq = torch.stack(torch._foreach_norm(grads)).square()
        v = torch.stack(v_list)
        v = torch.where(v == 0, norm_sq, v * beta2 + norm_sq * (1 - beta2))
        torch._foreach_copy_(v_list, v.unbind())
        if group["amsgrad"]:
            max_list = [s["max_exp_avg_sq"] for s in states]
            v = torch.maximum(torch.stack(max_list), v)
            torch._foreach_copy_(max_list, v.unbind())
        denom = (v.sqrt() + group["eps"]).unbind()
        updates = torch._foreach_div(grads, denom)
        if group["weight_decay"] != 0:
            torch._foreach_add_(updates, params, alpha=group["weight_decay"])
        if group["grad_averaging"]:
            torch._foreach_mul_(updates, 1 - beta1)
        torch._foreach_mul_(m_list, beta1)
        torch._foreach_add_(m_list, updates)
        torch._foreach_add_(params, m_list, alpha=-group["lr"])


def _by_device_and_dtype(params: list[Tensor]) -> dict[tuple[torch.device, torch.dtype], list[Tensor]]:
    groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for p in params:
        groups.setdefault((p.device, p.dtype), []).append(p)
    return groups
