"""The bucket's uniform draws: a counter-based hash of (seed, step, rank, layer, position), against a reference."""

import dataclasses

import numpy as np
import pytest
import torch

from lightning_gradcomp.compressors.base import BucketContext, Layer, derive_seed, layers_from_shapes
from lightning_gradcomp.compressors.ops import draws

LAYERS = layers_from_shapes([(3,), (1500,), (7, 7), (300, 11)])


def _ctx(layers=LAYERS, step=3, rank=1, seed=0):
    return BucketContext(index=0, step=step, rank=rank, world_size=2, layers=tuple(layers), seed=seed)


def reference_hashes(ctx: BucketContext, layer: Layer, salt: int = 0) -> np.ndarray:
    """lowbias32(p a + b mod 2^32) for every position p of ``layer``, keys from its index, in Python integers."""
    m = (1 << 32) - 1

    def mix(x: int) -> int:
        x ^= x >> 16
        x = (x * 0x7FEB352D) & m
        x ^= x >> 15
        x = (x * 0x846CA68B) & m
        return x ^ (x >> 16)

    seed = derive_seed(ctx.seed, ctx.step, 0x5EED, ctx.rank, salt) & m
    k = mix((layer.index * 0x9E3779B9 + seed) & m)
    a, b = mix(k) | 1, mix(k ^ 0x68E31DA4)
    return np.array([mix((p * a + b) & m) for p in range(layer.numel)], dtype=np.float64)


@pytest.mark.parametrize(("dtype", "bits"), [(torch.float32, None), (torch.float64, None), (torch.float32, 16)])
def test_draws_are_the_reference_hash_of_every_layers_positions(dtype, bits) -> None:
    ctx = _ctx()
    found = draws.uniform_draws(ctx, dtype, bits)
    for layer in LAYERS:
        h = reference_hashes(ctx, layer)
        expected = (
            (np.floor(h / 2**16) + 0.5) / 2**16
            if bits == 16
            else (h / 2**32 if dtype == torch.float64 else np.floor(h / 2**8) / 2**24)
        )
        assert np.array_equal(layer.flat(found).double().numpy(), expected), layer.name


@pytest.mark.parametrize(("dtype", "bits"), [(torch.float32, None), (torch.float64, None), (torch.float32, 16)])
def test_the_torch_path_draws_what_the_numpy_path_draws(dtype, bits) -> None:
    """Other devices compute the hash in torch's int32: the same values as the CPU's NumPy ``uint32``."""
    ctx = _ctx()
    segments = draws.segments_of(ctx.layers, ctx.device)
    a, b = draws.layer_keys(draws._layer_indices(ctx.layers, ctx.device), draws._step_seed(ctx, 0))
    c = b - segments.starts.to(torch.int32) * a
    on_device = draws._draws_torch(a, c, segments, bits, torch.empty(ctx.numel, dtype=dtype))
    assert torch.equal(on_device, draws.uniform_draws(ctx, dtype, bits))


def test_a_layers_draws_do_not_depend_on_its_bucket_and_differ_by_rank_step_and_layer() -> None:
    ctx = _ctx()
    full = draws.uniform_draws(ctx, torch.float32)
    layer = LAYERS[3]
    alone = dataclasses.replace(ctx, layers=(Layer(layer.name, layer.index, layer.shape, 0),))
    assert torch.equal(draws.uniform_draws(alone, torch.float32), layer.flat(full))
    for other in (dataclasses.replace(ctx, rank=0), dataclasses.replace(ctx, step=4)):
        assert not torch.equal(draws.uniform_draws(other, torch.float32), full)
    assert not torch.equal(layer.flat(full)[:1000], LAYERS[1].flat(full)[:1000])


def test_draws_are_uniform_with_24_bits() -> None:
    ctx = _ctx(layers=layers_from_shapes([(1000, 1000)]))
    u = draws.uniform_draws(ctx, torch.float32).double()
    assert float(u.min()) >= 0
    assert float(u.max()) < 1
    assert abs(float(u.mean()) - 0.5) < 0.002
    assert abs(float(u.var()) - 1 / 12) < 0.001
    k = (u * 2**24).long()
    assert torch.equal(k.double(), u * 2**24)  # multiples of 2^-24
    bits = (k[:, None] >> torch.arange(24)) & 1
    assert float((bits.double().mean(0) - 0.5).abs().max()) < 0.005  # every bit fair (5 sigma at 1e6 draws)
    assert abs(float(torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1])) < 0.005  # neighbours uncorrelated
