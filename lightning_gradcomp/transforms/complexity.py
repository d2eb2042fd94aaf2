"""Parameter and multiply-accumulate counts of a model, before and after factorization (Pufferfish's report).

Multiply-accumulates are counted for the layers factorization changes (linear and convolution layers, LSTMs, and
multi-head attention, whose score and weighting products are included), from the shapes seen in one forward pass.
Each layer reports two numbers: what it costs now, and what its full-rank original costs, so one pass over a
factorized model gives both sides of the comparison. Normalisation, activations and pooling are not counted.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence

from lightning_gradcomp.transforms.lowrank import (
    FactorizedConv,
    FactorizedLinear,
    FactorizedLSTM,
    FactorizedMultiheadAttention,
)

_UNITS = (
    nn.Linear,
    nn.modules.conv._ConvNd,
    nn.LSTM,
    nn.MultiheadAttention,
    FactorizedLinear,
    FactorizedConv,
    FactorizedMultiheadAttention,
)


def count_parameters(module: nn.Module) -> int:
    """Number of parameter elements (shared parameters counted once)."""
    return sum(p.numel() for p in module.parameters())


def _linear(module: nn.Linear | FactorizedLinear, out: Tensor) -> tuple[int, int]:
    tokens = out.numel() // module.out_features
    full = tokens * module.in_features * module.out_features
    if isinstance(module, FactorizedLinear):
        return full, tokens * module.rank * (module.in_features + module.out_features)
    return full, full


def _conv(module: nn.modules.conv._ConvNd | FactorizedConv, out: Tensor) -> tuple[int, int]:
    positions = out.numel() // module.out_channels
    taps = math.prod(module.kernel_size)
    if isinstance(module, FactorizedConv):
        full = positions * module.out_channels * module.in_channels * taps
        return full, positions * module.rank * (module.in_channels * taps + module.out_channels)
    full = positions * module.out_channels * (module.in_channels // module.groups) * taps
    return full, full


def _lstm(module: nn.LSTM, inputs: Tensor | PackedSequence) -> tuple[int, int]:
    data = inputs.data if isinstance(inputs, PackedSequence) else inputs
    tokens = data.numel() // module.input_size
    directions = 2 if module.bidirectional else 1
    h = module.hidden_size
    per_token = 0
    for layer in range(module.num_layers):
        width = module.input_size if layer == 0 else h * directions
        per_token += directions * 4 * h * (width + h)
    full = tokens * per_token
    if not isinstance(module, FactorizedLSTM):
        return full, full
    # the gate matrices are composed once per forward pass: 4 gates x (h x r) @ (r x cols) per factorized weight
    compose = sum(4 * h * r * getattr(module, f"{name}_u").shape[-1] for name, r in module._factor_ranks.items())
    return full, full + compose


def _attention(
    module: nn.MultiheadAttention | FactorizedMultiheadAttention, query: Tensor, key: Tensor, batch_first: bool
) -> tuple[int, int]:
    e = module.embed_dim
    tgt = query.shape[1 if batch_first else 0] if query.dim() == 3 else query.shape[0]
    src = key.shape[1 if batch_first else 0] if key.dim() == 3 else key.shape[0]
    batch = query.numel() // (tgt * e)
    attention = 2 * batch * tgt * src * e  # scores and weighted sum, over all heads
    full = batch * (tgt * e * e * 2 + src * e * (module.kdim + module.vdim)) + attention
    if not isinstance(module, FactorizedMultiheadAttention):
        return full, full
    projections = 0
    for proj, tokens in ((module.q_proj, tgt), (module.k_proj, src), (module.v_proj, src), (module.out_proj, tgt)):
        projections += batch * tokens * proj.rank * (proj.in_features + proj.out_features)
    return full, projections + attention


def _units(module: nn.Module, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    for name, child in module.named_children():
        if isinstance(child, _UNITS):
            yield prefix + name, child
        else:
            yield from _units(child, f"{prefix}{name}.")


class MacCounter:
    """Counts multiply-accumulates of the forward passes run while it is attached.

    Example::

        >>> import torch
        >>> from lightning_gradcomp.models import CifarResNet18
        >>> counter = MacCounter(CifarResNet18())
        >>> with counter.attached():
        ...     _ = counter.module(torch.randn(1, 3, 32, 32))
        >>> counter.full_rank == counter.total  # nothing factorized
        True
    """

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.full_rank = 0
        self.total = 0

    def _hook(self, unit: nn.Module) -> Callable[..., None]:
        def hook(mod: nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> None:
            if isinstance(mod, (nn.Linear, FactorizedLinear)):
                full, now = _linear(mod, output)
            elif isinstance(mod, (nn.modules.conv._ConvNd, FactorizedConv)):
                full, now = _conv(mod, output)
            elif isinstance(mod, nn.LSTM):
                full, now = _lstm(mod, args[0] if args else kwargs["input"])
            elif isinstance(mod, (nn.MultiheadAttention, FactorizedMultiheadAttention)):
                query = args[0] if args else kwargs["query"]
                key = args[1] if len(args) > 1 else kwargs["key"]
                full, now = _attention(mod, query, key, mod.batch_first)
            else:  # not a unit (_UNITS): never hooked
                return
            self.full_rank += full
            self.total += now

        return hook

    @contextmanager
    def attached(self) -> Iterator[MacCounter]:
        """Count while inside the ``with`` block."""
        handles = [unit.register_forward_hook(self._hook(unit), with_kwargs=True) for _, unit in _units(self.module)]
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()


def count_macs(module: nn.Module, *inputs: Any, **kwargs: Any) -> tuple[int, int]:
    """``(full-rank MACs, MACs)`` of one forward pass ``module(*inputs, **kwargs)`` (in eval mode, without grad)."""
    import torch

    counter = MacCounter(module)
    training = module.training
    fastpath = torch.backends.mha.get_fastpath_enabled()
    module.eval()
    # the transformer's inference fast path runs fused kernels that bypass the submodules' hooks
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with torch.no_grad(), counter.attached():
            module(*inputs, **kwargs)
    finally:
        module.train(training)
        torch.backends.mha.set_fastpath_enabled(fastpath)
    return counter.full_rank, counter.total
