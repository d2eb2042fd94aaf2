"""AdaComp's bins for a whole bucket at once (adacomp_bins) against a loop over the layers, and bucket-independent."""

import pytest
import torch

from lightning_gradcomp.compressors import AdaComp
from lightning_gradcomp.compressors.base import BucketContext, Layer, layers_from_shapes

# convolutions (bins of 50, some with a short last bin), fully-connected layers and a 1-D one (bins of 500)
SHAPES = [(16, 8, 3, 3), (30, 70), (7,), (5, 3, 3, 3), (4, 1000), (1234,)]


def _context(layers):
    return BucketContext(index=0, step=0, rank=0, world_size=1, layers=tuple(layers))


def _loop(g, h, layers, compressor):
    """The per-layer reference: bin maxima of |G|, |H| >= the bin's (an all-zero bin: none), scale = mean of maxima."""
    chosen = torch.zeros(g.numel(), dtype=torch.bool)
    scales = []
    for layer in layers:
        size = compressor.bin_size(layer)
        gl, hl = layer.flat(g), layer.flat(h)
        maxima = torch.stack([gl[s : s + size].abs().max() for s in range(0, layer.numel, size)])
        bounds = torch.where(maxima > 0, maxima, torch.full_like(maxima, float("inf")))
        layer.flat(chosen).copy_(hl.abs() >= bounds.repeat_interleave(size)[: layer.numel])
        scales.append(maxima.mean())
    return chosen, torch.stack(scales)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_bucket_selects_as_the_loop_over_its_layers(dtype):
    layers = layers_from_shapes(SHAPES)
    ctx = _context(layers)
    gen = torch.Generator().manual_seed(0)
    g = torch.randn(ctx.numel, generator=gen, dtype=dtype)
    g[layers[1].offset + 500 : layers[1].offset + 1000] = 0  # an all-zero bin sends nothing
    h = g + torch.randn(ctx.numel, generator=gen, dtype=dtype)
    compressor = AdaComp()
    codes, scales = compressor.select(g, h, ctx)
    chosen, expected = _loop(g, h, layers, compressor)
    assert torch.equal(codes != 0, chosen)  # the same elements
    assert torch.equal(codes[chosen], torch.where(g[chosen] > 0, 2, 1).to(torch.uint8))
    assert not chosen[layers[1].offset + 500 : layers[1].offset + 1000].any()
    torch.testing.assert_close(scales, expected.float(), rtol=1e-6, atol=0)  # another order of the sum


def test_a_layer_encodes_the_same_alone_and_in_any_bucket():
    """Bins start at every layer's own start: a layer's codes and scale are bitwise the same at any offset."""
    layers = layers_from_shapes(SHAPES)
    ctx = _context(layers)
    gen = torch.Generator().manual_seed(1)
    g, h = torch.randn(ctx.numel, generator=gen), torch.randn(ctx.numel, generator=gen)
    compressor = AdaComp()
    codes, scales = compressor.select(g, h, ctx)
    for i, layer in enumerate(layers):
        alone = Layer(layer.name, layer.index, layer.shape, offset=0)
        own_codes, own_scale = compressor.select(layer.flat(g).clone(), layer.flat(h).clone(), _context([alone]))
        assert torch.equal(own_codes, layer.flat(codes))
        assert torch.equal(own_scale, scales[i : i + 1])
