"""``DGCSGD``: the optimizer of Deep Gradient Compression, where momentum applies to the weight decay alone."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import torch
from torch.optim import Optimizer

from lightning_gradcomp.validation import sgd_defaults


class DGCSGD(Optimizer):
    """SGD for gradients that already carry their momentum (DGC's momentum correction), with momentum on the decay.

    Lin, Han, Mao, Wang & Dally, "Deep Gradient Compression", ICLR 2018; the update follows the authors' optimizer
    (``DGCSGD`` in synxlin/deep-gradient-compression, ``dgc/optim/sgd.py``), read line by line. The gradient this
    optimizer receives from :class:`~lightning_gradcomp.compressors.DGC` is already the momentum step, so it is
    applied as it is; the weight-decay term ``wd * w``, which DGC never sees, gets the momentum buffer::

        d = wd * w
        buf = d                                (first step)
        buf = momentum * buf + (1 - dampening) * d
        d = d + momentum * buf  (Nesterov)  or  d = buf
        w = w - lr * (grad + d)

    Without weight decay it is plain SGD. With ``torch.optim.SGD(momentum=0, weight_decay=wd)`` instead, the decay has
    no momentum and is about ``1 / (1 - momentum)`` (ten at 0.9) times weaker than the paper's.

    Args:
        params: the parameters or parameter groups.
        lr: the learning rate.
        momentum: the momentum of the weight-decay term (DGC's own momentum, 0.9 in the paper).
        dampening: dampening of that momentum.
        weight_decay: the L2 coefficient.
        nesterov: Nesterov momentum on the decay term.

    Raises:
        ValueError: If an argument is out of range.

    Example::

        >>> import torch
        >>> from lightning_gradcomp.optim import DGCSGD
        >>> optimizer = DGCSGD(torch.nn.Linear(4, 2).parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    """

    #: The momentum here is not applied to the gradient (DGC applies it), so it does not conflict with DGC's.
    applies_momentum_to_gradient: ClassVar[bool] = False

    def __init__(
        self,
        params: Iterable[Any],
        lr: float,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
    ) -> None:
        super().__init__(params, sgd_defaults(lr, momentum, dampening, weight_decay, nesterov))

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
            wd, momentum = group["weight_decay"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                update = p.grad
                if wd != 0:
                    decay = p.mul(wd)
                    if momentum != 0:
                        state = self.state[p]
                        buf = state.get("momentum_buffer")
                        if buf is None:
                            buf = state["momentum_buffer"] = decay.clone()
                        else:
                            buf.mul_(momentum).add_(decay, alpha=1 - group["dampening"])
                        decay = decay.add(buf, alpha=momentum) if group["nesterov"] else buf
                    update = decay.add(p.grad)
                p.add_(update, alpha=-group["lr"])
        return loss
