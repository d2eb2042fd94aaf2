"""Optimizers whose step ``CompressedDDP`` applies inside its communication hook, bucket by bucket (LOMO's idea).

LOMO (Lv et al., "Full Parameter Fine-tuning for Large Language Models with Limited Resources", ACL 2024,
arXiv:2306.09782) fuses the parameter update into the backward pass; AdaLomo (Lv et al., "AdaLomo: Low-memory
Optimization with Adaptive Learning Rate", arXiv:2310.10195) adds a factored second moment. Their own code updates
each parameter from its *local* gradient (it never all-reduces outside DeepSpeed ZeRO-3), so under data parallelism
the replicas drift apart. Here the update runs where it is correct: in a ``.then`` callback on the future of a
bucket's averaged (possibly compressed) gradient, which is torch's ``_hook_then_optimizer`` pattern generalised to
compressed reductions. Each bucket's parameters are updated as soon as its reduction is done, while the backward
pass goes on with the next buckets.

Use: return a :class:`FusedSGD` or :class:`FusedAdaLomo` from ``configure_optimizers`` (with any LR scheduler) and
train with :class:`~lightning_gradcomp.CompressedDDP`; nothing else changes. The strategy binds the optimizer to its
hook at setup; its ``step`` then only runs Lightning's closure (forward and backward, during which the hook updated
the parameters), and its ``param_groups`` stay the place the learning rate is read from, every bucket, every step,
so schedulers and ``LearningRateMonitor`` work as usual. Not bound (plain DDP, one device), ``step`` applies the same
update from ``p.grad`` after the backward pass, as any optimizer does.

What is not offered, and why (see ``docs/optimizers.md``): LOMO's exact global-norm clipping needs a second
backward pass and a second reduction of the gradient (its two-pass scheme), so clipping is by value or by the
*previous* step's global norm; fp16 with a dynamic loss scaler cannot undo the updates of earlier buckets when a
later one overflows, so it is refused (bf16 and fp32 need no scaler); gradient accumulation has no accumulated
gradient to step on, so it is refused. Under DDP the gradient buffers stay allocated (DDP's buckets), so LOMO's
memory headline, which comes from freeing each gradient right after its update, does not carry over.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import Tensor
from torch.optim import Optimizer

from lightning_gradcomp.validation import check_number, sgd_defaults

__all__ = ["FusedAdaLomo", "FusedOptimizer", "FusedSGD", "bind_fused_optimizer"]


def sparse_gradient_modules(module: torch.nn.Module) -> list[str]:
    """The names of ``module``'s submodules whose weight gets a sparse gradient (``sparse=True`` embeddings).

    The same test DDP makes when it gives a parameter a bucket of its own for a sparse gradient.
    """
    kinds = (torch.nn.Embedding, torch.nn.EmbeddingBag)
    return [name for name, m in module.named_modules() if isinstance(m, kinds) and m.sparse]


class FusedOptimizer(Optimizer, ABC):
    """The common part: gradient clipping, the step counter, and the per-bucket entry point the hook calls.

    Subclasses implement :meth:`_update` (one parameter from its averaged gradient). Clipping applies to the averaged
    gradient, first by value, then by ``min(1, clip_grad_norm / (norm + 1e-6))`` where ``norm`` is the global L2 norm
    of the *previous* step's averaged gradient (before clipping; the same on every rank). The first step, with no
    previous norm, is not norm-clipped.

    Args:
        params: the parameters or parameter groups.
        defaults: the per-group hyper-parameters.
        clip_grad_value: clip each element of the averaged gradient to ``[-v, v]``; ``None``: off.
        clip_grad_norm: scale the averaged gradient by the previous step's global-norm coefficient; ``None``: off.
    """

    def __init__(
        self,
        params: Iterable[Any],
        defaults: dict[str, Any],
        clip_grad_value: float | None,
        clip_grad_norm: float | None,
    ) -> None:
        check_number(clip_grad_value, "clip_grad_value", low=0.0, low_open=True, allow_none=True)
        check_number(clip_grad_norm, "clip_grad_norm", low=0.0, low_open=True, allow_none=True)
        super().__init__(params, defaults)
        self.clip_grad_value = clip_grad_value
        self.clip_grad_norm = clip_grad_norm
        self._bound = False
        self._step = 0
        self._last_norm: Tensor | None = None  # the global norm of the last finished step
        self._norm_parts: dict[int, Tensor] = {}  # this step's squared norm, one entry per bucket
        self._coef: Tensor | None = None  # this step's norm-clipping coefficient
        self._groups: dict[int, dict[str, Any]] = {}  # parameter id -> its group, rebuilt each step

    @property
    def bound(self) -> bool:
        """Whether ``CompressedDDP`` applies this optimizer in its hook (then :meth:`step` only runs the closure)."""
        return self._bound

    def bind(self) -> Callable[[dist.GradBucket, torch.futures.Future], torch.futures.Future]:
        """Hand the update over to the hook: returns :meth:`bucket_step`; :meth:`step` then only runs its closure."""
        self._bound = True
        return self.bucket_step

    def unbind(self) -> None:
        """Take the update back: :meth:`step` updates from ``p.grad`` again."""
        self._bound = False

    # ------------------------------------------------------------------------------------------------------------
    # The two ways in: Lightning's step, and the hook's bucket callback
    # ------------------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Run ``closure``; when not bound to ``CompressedDDP``'s hook, also update every parameter from ``p.grad``.

        Args:
            closure: re-evaluates the model and returns the loss (Lightning passes forward and backward).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._bound:
            return loss  # the hook updated every parameter during the backward pass
        params = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
        if params:
            self._begin_step()
            self._apply(params, [p.grad for p in params], key=0)
        return loss

    def bucket_step(self, bucket: dist.GradBucket, reduced: torch.futures.Future[Tensor]) -> torch.futures.Future:
        """Chain the update of ``bucket``'s parameters after its reduction; what the hook calls for every bucket.

        Args:
            bucket: DDP's bucket (its parameters, in the layout of its flat buffer).
            reduced: the future of the bucket's averaged gradient, as the communication hook returns it.

        Returns:
            A future of the same averaged gradient (DDP copies it into ``.grad``), done once the update is applied.
        """
        params = bucket.parameters()
        index = bucket.index()
        if index == 0:  # DDP reduces its buckets in index order: bucket 0 opens a step
            self._begin_step()

        def apply(fut: torch.futures.Future[Tensor]) -> Tensor:
            flat = fut.value()
            grads, offset = [], 0
            for p in params:
                grads.append(flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
            with torch.no_grad():
                self._apply(params, grads, key=index)
            return flat

        return reduced.then(apply)

    # ------------------------------------------------------------------------------------------------------------
    # Shared machinery
    # ------------------------------------------------------------------------------------------------------------
    def _begin_step(self) -> None:
        """Advance the step; this step's norm coefficient comes from the last one's norm (no host sync)."""
        self._step += 1
        self._groups = {id(p): group for group in self.param_groups for p in group["params"]}
        if self._norm_parts:
            self._last_norm = torch.stack(list(self._norm_parts.values())).sum().sqrt()
            self._norm_parts = {}
        self._coef = None
        if self.clip_grad_norm is not None and self._last_norm is not None:
            self._coef = (self.clip_grad_norm / (self._last_norm + 1e-6)).clamp(max=1.0)

    def _apply(self, params: Sequence[Tensor], grads: Sequence[Tensor], key: int) -> None:
        """Clip and apply the update of ``params`` (one bucket, or all of them) from their averaged ``grads``."""
        if self.clip_grad_norm is not None and grads:
            # the callbacks of different buckets may run on different threads: one slot each, summed next step
            norms = torch._foreach_norm([g.float() for g in grads])
            self._norm_parts[key] = torch.stack(norms).square().sum()
        for p, g in zip(params, grads):
            group = self._groups.get(id(p))
            if group is None:
                continue  # not this optimizer's parameter (bind_fused_optimizer refuses that setup)
            if self.clip_grad_value is not None:
                g = g.clamp(-self.clip_grad_value, self.clip_grad_value)
            if self._coef is not None:
                g = g * self._coef.to(g.dtype)
            self._update(p, g, group)

    @abstractmethod
    def _update(self, p: Tensor, grad: Tensor, group: dict[str, Any]) -> None:
        """Update ``p`` in place from its averaged (clipped) gradient ``grad``, a view that must not be written."""

    # ------------------------------------------------------------------------------------------------------------
    # Checkpoints: per-parameter state is torch's (Lightning saves it); the step and the last norm travel with it
    # ------------------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Torch's optimizer state plus ``"fused"``: the step count and the global norm the next step clips with."""
        state = super().state_dict()
        last = self._last_norm
        if self._norm_parts:
            last = torch.stack(list(self._norm_parts.values())).sum().sqrt()
        state["fused"] = {"step": self._step, "last_norm": None if last is None else last.detach().cpu().clone()}
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (the norm on the parameters' device)."""
        state_dict = dict(state_dict)
        fused = state_dict.pop("fused", None)
        super().load_state_dict(state_dict)
        if fused is not None:
            device = self.param_groups[0]["params"][0].device
            self._step = int(fused["step"])
            last = fused["last_norm"]
            self._last_norm = None if last is None else last.to(device)
            self._norm_parts = {}


class FusedSGD(FusedOptimizer):
    """SGD (with optional momentum and L2 weight decay) applied in the hook: LOMO's update, made data-parallel.

    The arithmetic is ``torch.optim.SGD``'s, tensor by tensor (so it gives its weights bit for bit)::

        d = g + weight_decay * w
        buf = d (first step),  buf = momentum * buf + (1 - dampening) * d
        d = d + momentum * buf (Nesterov)  or  d = buf
        w = w - lr * d

    LOMO's own rule is the case ``momentum=0``, with its decay ``w *= 1 - lr * wd`` (the same as L2 decay in plain
    SGD). With ``momentum=0`` there is no optimizer state.

    Args:
        params: the parameters or parameter groups (every trainable parameter of the model).
        lr: the learning rate (read from the parameter group every step, so schedulers apply).
        momentum: momentum factor in [0, 1).
        dampening: dampening of the momentum.
        weight_decay: the L2 coefficient.
        nesterov: Nesterov momentum.
        clip_grad_value: clip the averaged gradient elementwise to ``[-v, v]``.
        clip_grad_norm: clip by the previous step's global norm (see :class:`FusedOptimizer`).

    Raises:
        ValueError: If an argument is out of range (naming it).

    Example::

        >>> import torch
        >>> from lightning_gradcomp.optim.fused import FusedSGD
        >>> optimizer = FusedSGD(torch.nn.Linear(4, 2).parameters(), lr=0.1, momentum=0.9)
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        clip_grad_value: float | None = None,
        clip_grad_norm: float | None = None,
    ) -> None:
        defaults = sgd_defaults(lr, momentum, dampening, weight_decay, nesterov)
        super().__init__(params, defaults, clip_grad_value, clip_grad_norm)

    def _update(self, p: Tensor, grad: Tensor, group: dict[str, Any]) -> None:
        # torch.optim.SGD's single-tensor arithmetic; ``grad`` is a view of DDP's reduced buffer: never written
        if group["weight_decay"] != 0:
            grad = grad.add(p, alpha=group["weight_decay"])
        momentum = group["momentum"]
        if momentum != 0:
            state = self.state[p]
            buf = state.get("momentum_buffer")
            if buf is None:
                buf = state["momentum_buffer"] = torch.clone(grad).detach()
            else:
                buf.mul_(momentum).add_(grad, alpha=1 - group["dampening"])
            grad = grad.add(buf, alpha=momentum) if group["nesterov"] else buf
        p.add_(grad, alpha=-group["lr"])


class FusedAdaLomo(FusedOptimizer):
    """AdaLomo's update (factored second moment, grouped update normalisation, relative step) applied in the hook.

    Lv, Yan, Guo, Yang, Qiu et al., "AdaLomo: Low-memory Optimization with Adaptive Learning Rate", arXiv:2310.10195;
    the rule follows the authors' ``lomo_optim/adalomo.py`` (OpenLMLab/LOMO), read line by line. Per parameter, with
    ``g`` the averaged gradient in fp32 and ``t`` the step (from 1)::

        beta2 = 1 - t ** decay_rate                             (0 at the first step)
        u = g^2 + eps[0]
        matrices: r = beta2 r + (1 - beta2) mean_last(u),  c = beta2 c + (1 - beta2) mean_second_last(u)
                  update = g * rsqrt(r / mean(r)) (x) rsqrt(c)  (Adafactor's factored estimate)
        vectors:  v = beta2 v + (1 - beta2) u,  update = g / sqrt(v)
        update = update / max(1, RMS(update) / clip_threshold) (grouped update normalisation)
        step = lr * max(eps[1], RMS(w))                         (relative step size)
        w = w * (1 - step * weight_decay) - step * update

    No first moment. Our choices where the reference is silent or broken: tensors of more than two dimensions
    (convolutions) are factored as a matrix of ``shape[0]`` rows and ``numel / shape[0]`` columns (the reference
    allocates ``shape[0]``/``shape[1]`` vectors, which do not match its own ``mean(dim=-1)`` for such tensors;
    Adafactor factors over the last two dimensions instead, which for a 3x3 kernel keeps two thirds of the tensor's
    size as state); 0-d tensors use the unfactored path; ``max(eps[1], RMS(w))`` is a tensor ``clamp`` (no host
    synchronisation); state is created on the parameter's device, in fp32. The reference's fixed loss scale (2**10,
    for fp16) is not offered: train in bf16 or fp32.

    Args:
        params: the parameters or parameter groups (every trainable parameter of the model).
        lr: the learning rate (read from the parameter group every step, so schedulers apply).
        eps: ``(eps1, eps2)``: added to the squared gradient, and the floor of the parameter RMS in the step size.
        clip_threshold: the RMS the update is normalised to at most.
        decay_rate: the exponent of the second-moment decay schedule (negative).
        weight_decay: decoupled decay, scaled by the relative step.
        clip_grad_value: clip the averaged gradient elementwise to ``[-v, v]``.
        clip_grad_norm: clip by the previous step's global norm (see :class:`FusedOptimizer`).

    Raises:
        ValueError: If an argument is out of range (naming it).
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        eps: tuple[float, float] = (1e-30, 1e-3),
        clip_threshold: float = 1.0,
        decay_rate: float = -0.8,
        weight_decay: float = 0.0,
        clip_grad_value: float | None = None,
        clip_grad_norm: float | None = None,
    ) -> None:
        check_number(lr, "lr", low=0.0)
        if not isinstance(eps, (tuple, list)) or len(eps) != 2:
            raise ValueError(f"Expected `eps` to be a pair (eps1, eps2), got {eps!r}.")
        check_number(eps[0], "eps[0]", low=0.0)
        check_number(eps[1], "eps[1]", low=0.0)
        check_number(clip_threshold, "clip_threshold", low=0.0, low_open=True)
        check_number(decay_rate, "decay_rate", high=0.0, high_open=True)
        check_number(weight_decay, "weight_decay", low=0.0)
        defaults = {
            "lr": lr,
            "eps": tuple(eps),
            "clip_threshold": clip_threshold,
            "decay_rate": decay_rate,
            "weight_decay": weight_decay,
        }
        super().__init__(params, defaults, clip_grad_value, clip_grad_norm)

    def _update(self, p: Tensor, grad: Tensor, group: dict[str, Any]) -> None:
        eps1, eps2 = group["eps"]
        beta2 = 1.0 - math.pow(self._step, group["decay_rate"])
        g = grad.float()
        if p.dim() > 2:  # a convolution: viewed as a matrix of shape[0] rows (see the class docstring)
            g = g.reshape(p.shape[0], -1)
        u = g.square().add_(eps1)
        state = self.state[p]
        if g.dim() == 2:
            if not state:
                state["exp_avg_sq_row"] = torch.zeros(g.shape[0], dtype=torch.float32, device=p.device)
                state["exp_avg_sq_col"] = torch.zeros(g.shape[1], dtype=torch.float32, device=p.device)
            row, col = state["exp_avg_sq_row"], state["exp_avg_sq_col"]
            row.mul_(beta2).add_(u.mean(dim=-1), alpha=1.0 - beta2)
            col.mul_(beta2).add_(u.mean(dim=-2), alpha=1.0 - beta2)
            del u  # a full-size temporary: freed before the update (another one) is built
            r_factor = (row / row.mean(dim=-1, keepdim=True)).rsqrt_().unsqueeze(-1)
            update = (r_factor * col.unsqueeze(-2).rsqrt()).mul_(g).view_as(p)
        else:
            if not state:
                state["exp_avg_sq"] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
            v = state["exp_avg_sq"]
            v.mul_(beta2).add_(u, alpha=1.0 - beta2)
            update = v.rsqrt().mul_(g)
        update.div_((_rms(update) / group["clip_threshold"]).clamp_(min=1.0))
        p32 = p if p.dtype == torch.float32 else p.float()
        step = _rms(p32).clamp(min=eps2).mul_(group["lr"])  # a 0-d tensor: no host sync
        if group["weight_decay"] != 0:
            p32.mul_(1.0 - step * group["weight_decay"])
        p32.sub_(update.mul_(step))
        if p32 is not p:
            p.copy_(p32)


def _rms(tensor: Tensor) -> Tensor:
    return torch.linalg.vector_norm(tensor) / math.sqrt(tensor.numel())


# ----------------------------------------------------------------------------------------------------------------
# Binding to the strategy
# ----------------------------------------------------------------------------------------------------------------
def bind_fused_optimizer(
    optimizers: Sequence[Any], trainer: Any, module: torch.nn.Module, scaler: Any
) -> FusedOptimizer | None:
    """The fused optimizer among ``optimizers``, checked against the run, or ``None`` if there is none.

    Called by ``CompressedDDP`` when fitting starts, before the first step; it refuses every setting the update in
    the hook could not honour.

    Args:
        optimizers: the optimizers ``configure_optimizers`` returned.
        trainer: the trainer (its gradient clipping, accumulation and callbacks are checked).
        module: the LightningModule (every trainable parameter must be the fused optimizer's).
        scaler: the precision plugin's gradient scaler, if any.

    Raises:
        MisconfigurationException: If a fused optimizer is combined with another optimizer, misses a trainable
            parameter, the model has sparse embeddings (``sparse=True``), or the run uses a gradient scaler (fp16),
            gradient accumulation or Lightning's gradient clipping.
    """
    fused = [o for o in optimizers if isinstance(o, FusedOptimizer)]
    if not fused:
        return None
    name = type(fused[0]).__name__
    if len(optimizers) > 1:
        raise MisconfigurationException(
            f"{name} updates the parameters inside CompressedDDP's communication hook and must be the only"
            f" optimizer, got {len(optimizers)}: {', '.join(type(o).__name__ for o in optimizers)}."
        )
    optimizer = fused[0]
    own = {id(p) for group in optimizer.param_groups for p in group["params"]}
    missing = [n for n, p in module.named_parameters() if p.requires_grad and id(p) not in own]
    if missing:
        raise MisconfigurationException(
            f"{name} must hold every trainable parameter of the model (the hook updates whole buckets); missing:"
            f" {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}. Freeze them (requires_grad=False) or"
            " pass them to the optimizer."
        )
    sparse = sparse_gradient_modules(module)
    if sparse:
        raise MisconfigurationException(
            f"{name} updates each bucket from its flat averaged gradient, and a sparse gradient has none: the"
            f" embeddings {', '.join(sparse[:5])}{' ...' if len(sparse) > 5 else ''} have `sparse=True`. Build them"
            " with `sparse=False`, or use a torch optimizer (CompressedDDP averages sparse gradients as DDP does)."
        )
    if scaler is not None:
        raise MisconfigurationException(
            f"{name} cannot train with a gradient scaler (fp16 mixed precision): an overflow found in a later bucket"
            " cannot undo the updates already applied to earlier ones. Use `precision='bf16-mixed'` or 32."
        )
    if trainer.accumulate_grad_batches != 1 or any(
        type(cb).__name__ == "GradientAccumulationScheduler" for cb in trainer.callbacks
    ):
        raise MisconfigurationException(
            f"{name} applies each step's update as its gradient is reduced, so there is no accumulated gradient to"
            f" step on: `accumulate_grad_batches` must be 1, got {trainer.accumulate_grad_batches} (and no"
            " GradientAccumulationScheduler)."
        )
    if trainer.gradient_clip_val not in (None, 0, 0.0):
        raise MisconfigurationException(
            f"Lightning clips after the backward pass, when {name} has already updated the parameters:"
            f" `gradient_clip_val` must be None, got {trainer.gradient_clip_val!r}. Use the optimizer's"
            " `clip_grad_value=` or `clip_grad_norm=` (the previous step's global norm) instead."
        )
    return optimizer
