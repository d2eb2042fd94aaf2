"""Per-layer reductions and group layouts over a bucket's flat tensor, against layer-by-layer references."""

from __future__ import annotations

import pytest
import torch

from lightning_gradcomp.compressors.ops.packing import max_magnitudes
from lightning_gradcomp.compressors.ops.segments import ROW, segments_of
from lightning_gradcomp.engine.context import layers_from_shapes

# layers smaller than a row, spanning rows, ending mid-row and at a row's end, and a tail shorter than a row
SHAPES = [(3,), (1500,), (7, 7), (5000, 3), (2,), (1,), (ROW + 100,), (3000,)]


@pytest.fixture
def layers():  # type: ignore[no-untyped-def]
    return layers_from_shapes(SHAPES)


def _flat(layers) -> torch.Tensor:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    return torch.randn(layers[-1].offset + layers[-1].numel)


def test_sums_and_norms_match_each_layer_to_rounding(layers) -> None:  # type: ignore[no-untyped-def]
    x = _flat(layers)
    segments = segments_of(layers, x.device)
    exact_sums = torch.stack([layer.flat(x).double().sum() for layer in layers])
    exact_l1 = torch.stack([layer.flat(x).double().abs().sum() for layer in layers])
    torch.testing.assert_close(segments.sums(x, torch.float32).double(), exact_sums, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(segments.l1(x, torch.float32).double(), exact_l1, rtol=1e-6, atol=0)


def test_counts_and_maxima_are_exact(layers) -> None:  # type: ignore[no-untyped-def]
    x = _flat(layers)
    x[4] = float("nan")  # in the second layer: its maximum is NaN, as the infinity norm's
    segments = segments_of(layers, x.device)
    assert torch.equal(segments.counts(x >= 0), torch.stack([(layer.flat(x) >= 0).sum() for layer in layers]))
    expected = max_magnitudes([layer.flat(x) for layer in layers], torch.float32)
    found = segments.max_magnitudes(x, torch.float32)
    assert found[1].isnan()
    assert expected[1].isnan()
    assert torch.equal(found.nan_to_num(-1.0), expected.nan_to_num(-1.0))


@pytest.mark.parametrize("width", [1, 2, 4, 8])
def test_group_layout_marks_every_element_of_a_boundary_group(layers, width: int) -> None:  # type: ignore[no-untyped-def]
    segments = segments_of(layers, torch.device("cpu"))
    layer_of = torch.cat([torch.full((layer.numel,), i) for i, layer in enumerate(layers)])
    groups = segments.groups(width)
    assert torch.equal(groups.group_layer.long(), layer_of[::width])
    by_group = groups.group_layer.long().repeat_interleave(width)[: layer_of.numel()]
    wrong = torch.nonzero(by_group != layer_of).squeeze(1)
    assert torch.equal(groups.fix_positions, wrong)
    assert torch.equal(groups.fix_layer, layer_of[wrong])


def test_expand_repeats_each_layer_value(layers) -> None:  # type: ignore[no-untyped-def]
    segments = segments_of(layers, torch.device("cpu"))
    values = torch.arange(len(layers), dtype=torch.float32)
    assert torch.equal(
        segments.expand(values), torch.cat([torch.full((layer.numel,), float(i)) for i, layer in enumerate(layers)])
    )


@pytest.mark.parametrize("neighbours", [(0, 0), (1, 5), (ROW - 1, 700), (3 * ROW + 17, 2 * ROW)])
def test_a_layers_values_are_bitwise_the_same_alone_and_in_any_bucket(neighbours: tuple[int, int]) -> None:
    """Rows start at every layer's own start: its sum, 1-norm, count and maximum do not depend on its neighbours."""
    torch.manual_seed(1)
    before, after = neighbours
    for numel in (1, ROW, 5 * ROW + 3, ROW * ROW + 2 * ROW + 5):  # one level, two, and three
        shapes = [s for s in ((before,), (numel,), (after,)) if s[0]]
        bucket = layers_from_shapes(shapes)
        mine = bucket[1 if before else 0]
        x = torch.randn(sum(layer.numel for layer in bucket)) * 1e-3
        alone_x = mine.flat(x).clone()
        alone = segments_of(layers_from_shapes([(numel,)]), x.device)
        together = segments_of(bucket, x.device)
        i = 1 if before else 0
        for reduce in ("sums", "l1", "max_magnitudes"):
            found = getattr(together, reduce)(x, torch.float32)[i]
            assert torch.equal(found, getattr(alone, reduce)(alone_x, torch.float32)[0])
        assert torch.equal(together.counts(x > 0)[i], alone.counts(alone_x > 0)[0])
        # and a sum of rows of rows is the sum, to rounding
        torch.testing.assert_close(alone.sums(alone_x, torch.float64).float(), alone_x.double().sum().float().view(1))


def test_block_rows_reduce_every_block_of_every_layer(layers) -> None:  # type: ignore[no-untyped-def]
    x = _flat(layers)
    rows, lengths = segments_of(layers, x.device).block_rows(512)
    norms = rows.reduce(x, lambda r: torch.linalg.vector_norm(r, dim=1), lambda r: r)
    blocks = [block for layer in layers for block in layer.flat(x).split(512)]
    torch.testing.assert_close(norms, torch.stack([torch.linalg.vector_norm(block) for block in blocks]))
    assert torch.equal(lengths, torch.tensor([block.numel() for block in blocks]))


def test_an_empty_segment_reduces_to_its_padding_and_the_others_are_unchanged() -> None:
    """A parameter with no elements (a zero-size layer) is a segment of length 0: one value, the reduction of the
    padding (a sum of 0), and the levels still end; the other segments' values are what they are without it."""
    from lightning_gradcomp.compressors.ops.segments import AlignedRows

    torch.manual_seed(0)
    x = torch.randn(3000)
    with_empty = AlignedRows([0, 1000, 1000, 3000], [1000, 0, 2000, 0], 64, x.device)
    without = AlignedRows([0, 1000], [1000, 2000], 64, x.device)
    sums = with_empty.reduce(x, lambda rows: rows.sum(dim=1), lambda rows: rows.sum(dim=1))
    expected = without.reduce(x, lambda rows: rows.sum(dim=1), lambda rows: rows.sum(dim=1))
    assert torch.equal(sums, torch.stack([expected[0], torch.tensor(0.0), expected[1], torch.tensor(0.0)]))
