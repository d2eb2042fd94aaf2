"""FP16/BF16: the casts' own numerics (the contract suite covers their shapes, linearity and state)."""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch

from lightning_gradcomp import CompressionState
from lightning_gradcomp.compressors import BF16, FP16, Identity, MaskedCompressor, Planned, PowerSGD, TopK
from lightning_gradcomp.compressors.base import Layer
from lightning_gradcomp.compressors.cast import _Cast
from lightning_gradcomp.testing import SimulatedWorld, simulate_reduce


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


def _model(dtype: torch.dtype) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 4)).to(dtype)


@pytest.mark.parametrize("cast", [FP16(), BF16()], ids=repr)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_cast_refuses_16_bit_gradients_naming_the_layer_and_what_it_accepts(cast, dtype):
    """A cast of 16-bit gradients (``precision="16-true"`` or ``"bf16-true"``) would save nothing; between the two
    formats it would also lose range (float16 overflows at 65504) or bits (bfloat16 keeps 8 of 11)."""
    with pytest.raises(ValueError, match="would save nothing") as raised:
        cast.check_gradient_dtype(Layer("fc.weight", 3, torch.Size([32, 64])), dtype)
    message = str(raised.value)
    for part in (repr(cast), "'fc.weight'", str(dtype), "save nothing", "float32, float64", "Identity()"):
        assert part in message
    loses = {(torch.bfloat16, torch.float16): "65504", (torch.float16, torch.bfloat16): "8 of float16's 11"}
    clause = loses.get((dtype, cast.wire_dtype))
    assert (clause in message) if clause else ("65504" not in message and "significant" not in message)


@pytest.mark.parametrize("cast", [FP16(), BF16()], ids=repr)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_cast_accepts_gradients_wider_than_16_bits(cast, dtype):
    cast.check_gradient_dtype(Layer("fc.weight", 3, torch.Size([32, 64])), dtype)
    CompressionState(cast).attach(_model(dtype), backend=SimulatedWorld(1).backend(0))


def test_the_hook_state_checks_every_compressed_layer_when_it_attaches():
    """``attach`` asks the compressor about each layer it compresses, by name; layers it leaves dense are not asked
    (``Planned``'s unassigned layers, ``MaskedCompressor``'s inner compressor decides)."""
    backend = SimulatedWorld(1).backend(0)
    with pytest.raises(ValueError, match=r"FP16\(\) sends float16 .* gradient of '0.weight' is torch.bfloat16"):
        CompressionState(FP16()).attach(_model(torch.bfloat16), backend=backend)
    with pytest.raises(ValueError, match=r"gradient of '1.weight'"):  # only layer 1 goes to the cast
        CompressionState(
            Planned({"dense": Identity(), "bf16": BF16()}, {"1.weight": "bf16"}), min_compress_numel=1
        ).attach(_model(torch.float16), backend=backend)
    with pytest.raises(ValueError, match=r"BF16\(\) sends bfloat16"):
        CompressionState(MaskedCompressor(BF16())).attach(_model(torch.bfloat16), backend=backend)
    for compressor in (Identity(), TopK(ratio=0.1), PowerSGD(rank=2), Planned({"dense": Identity(), "bf16": BF16()})):
        CompressionState(compressor, min_compress_numel=1).attach(_model(torch.bfloat16), backend=backend)
