"""FP16/BF16: the casts' own numerics (the contract suite covers their shapes, linearity and state)."""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch

from lightning_gradcomp.compressors import BF16
from lightning_gradcomp.compressors.base import Layer
from lightning_gradcomp.compressors.cast import _Cast
from lightning_gradcomp.testing import simulate_reduce


class _CastThenDivide(_Cast):
    """BF16 on the default path: cast, divide in bfloat16 (torch's ``bf16_compress_hook``), all-reduce, cast back."""

    wire_dtype: ClassVar[torch.dtype] = torch.bfloat16


def _gradients(world_size: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """Every rank's gradient: magnitudes from 1e-30 to 1e30, both signs, zeros, and values near bfloat16 ties."""
    g = torch.Generator().manual_seed(world_size)
    out = []
    for _ in range(world_size):
        x = torch.randn(4096, generator=g, dtype=torch.float64) * 10.0 ** torch.randint(-30, 31, (4096,), generator=g)
        x[::97] = 0.0
        x[1::89] = 1.0 + 2.0**-8  # halfway between two bfloat16 neighbours: round-to-nearest-even decides
        out.append(x.to(dtype))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 8])
def test_bf16_is_bitwise_cast_then_divide_at_every_world_size(world_size, dtype):
    """Dividing first (in the gradient's precision, at power-of-two world sizes on the CPU) gives the same bits as
    torch's order, cast then divide in bfloat16, for every quotient in bfloat16's normal range."""
    layers = (Layer("w", 0, (64, 64), 0),)
    grads = _gradients(world_size, dtype)
    fast = simulate_reduce([BF16() for _ in grads], grads, layers)
    plain = simulate_reduce([_CastThenDivide() for _ in grads], grads, layers)
    for a, b in zip(fast, plain):
        assert a.dtype == dtype
        assert torch.equal(a, b)
    # what is compared: rounding happened (ties included), across 60 orders of magnitude
    assert not torch.equal(plain[0], sum(grads) / world_size)
    x = grads[0]
    assert x.abs().max() > 1e29
    assert x[x != 0].abs().min() < 1e-29
