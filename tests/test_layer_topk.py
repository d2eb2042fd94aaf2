"""Every layer's top-k at once (layer_topk) and the whole-bucket index blob (sparse_blob) against per-layer loops."""

import pytest
import torch

from lightning_gradcomp.compressors.base import layers_from_shapes
from lightning_gradcomp.compressors.ops import layer_topk as module
from lightning_gradcomp.compressors.ops.layer_topk import layer_topk
from lightning_gradcomp.compressors.ops.sparse import decode_sparse, encode_sparse, sparse_layout
from lightning_gradcomp.compressors.ops.sparse_blob import decode_blob, encode_full_blob
from lightning_gradcomp.engine.context import Layer
from tests.test_host_sync import HostReads

# small layers (sorted whole) and two large enough for the CPU's sampled bound
SHAPES = [(64, 3, 3, 3), (64,), (300, 300), (10,), (128, 64, 3, 3), (7, 7)]


def _reference(values, layers, ks):
    """Per layer: the k largest magnitudes by a stable descending sort (ties: lowest index first)."""
    out = []
    for layer, k in zip(layers, ks):
        flat = layer.flat(values)
        out.append(torch.sort(flat.abs(), descending=True, stable=True).indices[:k] + layer.offset)
    return torch.cat(out)


@pytest.fixture(params=["sampled", "sorted"])
def path(request, monkeypatch):
    """The CPU's sampled bound, or the whole-bucket sort a GPU takes (no layer large enough to sample)."""
    module._PLANS.clear()
    if request.param == "sorted":
        monkeypatch.setattr(module, "SAMPLED_MIN_NUMEL", 1 << 40)
    yield request.param
    module._PLANS.clear()


@pytest.mark.parametrize("ratio", [0.001, 0.01, 0.3, 0.6, 1.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_every_layer_keeps_its_k_largest_magnitudes(path, ratio, dtype):
    layers = layers_from_shapes(SHAPES)
    numel = layers[-1].offset + layers[-1].numel
    values = torch.randn(numel, generator=torch.Generator().manual_seed(3), dtype=dtype)
    ks = [max(1, int(ratio * layer.numel)) for layer in layers]
    found = layer_topk(values, layers, ks)
    assert torch.equal(found, _reference(values, layers, ks))  # the same elements, in the same order
    # and the set torch.topk selects (distinct magnitudes)
    expected = torch.cat(
        [torch.topk(layer.flat(values).abs(), k).indices + layer.offset for layer, k in zip(layers, ks)]
    )
    assert torch.equal(found.sort().values, expected.sort().values)


def test_ties_keep_the_lowest_indices(path):
    layers = layers_from_shapes([(100_000,), (50,), (70_000,)])
    values = torch.zeros(170_050)
    values[::7] = torch.randn(len(range(0, 170_050, 7))).sign()  # many ties at magnitude 1, the rest 0
    ks = [1000, 5, 20_000]  # the last keeps more than its 10,000 non-zeros: zeros, the lowest first
    found = layer_topk(values, layers, ks)
    assert torch.equal(found, _reference(values, layers, ks))


def test_a_layer_selects_the_same_alone_and_in_any_bucket(path):
    """The selection depends on the layer's elements only: bucket composition and offset change nothing."""
    layers = layers_from_shapes(SHAPES)
    numel = layers[-1].offset + layers[-1].numel
    values = torch.randn(numel, generator=torch.Generator().manual_seed(5))
    ks = [max(1, int(0.01 * layer.numel)) for layer in layers]
    together = layer_topk(values, layers, ks)
    at = 0
    for layer, k in zip(layers, ks):
        alone = Layer(layer.name, layer.index, layer.shape, offset=3)
        shifted = torch.cat([torch.randn(3), layer.flat(values)])
        assert torch.equal(layer_topk(shifted, [alone], [k]) - 3 + layer.offset, together[at : at + k])
        at += k


def test_layers_apart_and_nan(path):
    """Layers with gaps between them select among their own elements; NaN counts as the largest magnitude."""
    a, b = layers_from_shapes([(300, 300), (20, 20)])
    a, b = Layer(a.name, 0, a.shape, offset=10), Layer(b.name, 1, b.shape, offset=10 + a.numel + 5)
    values = torch.randn(b.offset + b.numel + 4, generator=torch.Generator().manual_seed(1))
    values[10 + 17] = float("nan")
    values[b.offset - 5 : b.offset] = 1e6  # the gap: never selected
    found = layer_topk(values, [a, b], [900, 4])
    assert torch.equal(found, _reference(values, [a, b], [900, 4]))
    assert int(found[0]) == 27


def test_too_few_candidates_fall_back_to_the_whole_layer():
    """A large layer with fewer non-zeros than k: the sample's bound is 0, the layer is sorted whole."""
    module._PLANS.clear()
    layers = layers_from_shapes([(100_000,), (80_000,)])
    values = torch.randn(180_000, generator=torch.Generator().manual_seed(2))
    values[:100_000] = 0
    values[:100_000:1000] = torch.linspace(-1, 1, 100)
    found = layer_topk(values, layers, [1000, 800])
    assert torch.equal(found, _reference(values, layers, [1000, 800]))


@pytest.mark.parametrize("ratio", [0.02, 0.2])  # int32 lists; bitmaps (and the small layers' lists)
def test_the_whole_bucket_blob_is_the_per_layer_blob(ratio):
    layers = layers_from_shapes([(40, 50), (8, 4, 3, 3), (30, 30), (3,), (1000,)])
    numel = layers[-1].offset + layers[-1].numel
    values = torch.randn(numel, generator=torch.Generator().manual_seed(0))
    slots = [max(1, int(ratio * layer.numel)) for layer in layers]
    layout = sparse_layout(layers, slots)
    assert any(s.bitmap for s in layout.segments) == (ratio == 0.2)
    picked = layer_topk(values, layers, slots)
    per_layer, at = [], 0
    for layer, k in zip(layers, slots):
        per_layer.append(picked[at : at + k] - layer.offset)
        at += k
    blob = encode_full_blob(layout, picked)
    assert torch.equal(blob, encode_sparse(layout, per_layer, None, values)[0])
    decoded = decode_sparse(layout, blob)
    listed = [d for s, d in zip(layout.segments, decoded) if not s.bitmap]
    mapped = [d for s, d in zip(layout.segments, decoded) if s.bitmap]
    assert torch.equal(decode_blob(layout, blob), torch.cat(listed + mapped))


def test_the_sorted_path_reads_nothing_on_the_host(path):
    """The path a GPU takes: no host read and no operator whose output size depends on the data."""
    if path != "sorted":
        pytest.skip("the sampled bound runs on the CPU only (it reads the candidates' number)")
    layers = layers_from_shapes(SHAPES)
    values = torch.randn(layers[-1].offset + layers[-1].numel)
    ks = [max(1, int(0.01 * layer.numel)) for layer in layers]
    layer_topk(values, layers, ks)  # the layout's index tensors are built once, outside the hook path
    reads = HostReads()
    with reads:
        layer_topk(values, layers, ks)
    assert not reads.found, dict(reads.found)
