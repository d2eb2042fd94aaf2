"""Pairs of CPU operations that give the same bits at different speeds: the choices the codecs make (a benchmark).

Each pair computes one result two ways, checks that the two results are bitwise equal, and times both on one thread
with the operands out of cache (a 64 MiB buffer is written before every call, as the codec's other passes evict the
gradient between two uses of it). Medians of ``--repeats`` calls. The pairs:

* ``gather``: ``x[idx]`` (advanced indexing) against ``x.index_select(0, idx)``: ``--k`` sorted indices into a
  bucket of ``--numel`` elements (the values TopK, RandomK, DGC, ScaleCom, Zen and LGC send);
* ``count``: ``mask.sum()`` of a bool mask (torch converts it to int64 first) against ``torch.count_nonzero(mask)``
  (OneBit's count of non-negative entries, per layer of ``--layer`` elements);
* ``magnitude``: ``x.abs() > t`` against ``x > t or x < -t`` (``compressors.packing.magnitude_above``, the
  candidates of a sampled top-k threshold);
* ``l1``: ``torch.linalg.vector_norm(x, 1)`` against ``x.abs().sum()``: *not* the same bits (the sums run in another
  order), shown for the cost EF-signSGD and OneBit keep for their scales' bits; after the table, each one's relative
  error against the sum in float64 (the layer's Gaussian values), and whether ``vector_norm`` is bitwise the strictly
  sequential fp32 sum of ``|x|`` (NumPy's ``cumsum``, one element after the other): if so, every add waits for the
  one before, and its time per element is an add's latency, which no kernel giving the same bits can beat;
* ``rows``: ``torch.index_select`` of 16-byte rows (4 fp32) of a 256-row table against
  ``compressors.packing.lookup_rows`` (each row gathered as one ``complex128``): the sign family's tables, a row per
  byte of ``--layer`` elements' bits;
* ``codes``: two ranks' bits side by side, 4 elements' bits of each rank in one byte (the rows of the sign family's
  2-rank sums and of signSGD's vote), by a lookup and an OR per rank against six elementwise byte operations
  (``compressors.sign._rank_codes``), over the packed bits of ``--layer`` elements;
* ``argsort``: ``torch.argsort`` of ``--k`` distinct random indices into a layer against
  ``compressors.packing.argsort_distinct`` (NumPy's sort of ``index << 32 | position`` keys): the ordering of a
  bitmap-encoded sparse layer;
* ``inf_norm``: ``torch.linalg.vector_norm(x, inf)`` against ``compressors.packing.max_magnitudes`` (one
  ``aminmax``): TernGrad's scaler without clipping;
* ``nonzero``: NumPy's ``flatnonzero`` of a bool mask of ``--layer`` elements with ``--density`` of them set
  (``|x|`` above a quantile: a top-k's candidates at 1 % are about 1.5 %) against ``compressors.packing.flat_nonzero``
  (occupied 8-byte words first);
* ``topk``: ``torch.topk(|x|, k)`` against ``compressors.sparsify.topk_indices`` (the sampled bound) at ``k``
  ``--topk-ratio`` of the layer (a tenth by default): the same set of indices in another order (compared sorted).

Example::

    python benchmarks/torch_ops.py
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from lightning_gradcomp.compressors.ops.packing import (
    argsort_distinct,
    flat_nonzero,
    lookup_rows,
    magnitude_above,
    max_magnitudes,
)
from lightning_gradcomp.compressors.sign import _looked_up_codes, _rank_codes
from lightning_gradcomp.compressors.sparsify import topk_indices


def timed(fn: Callable[[], torch.Tensor], evict: torch.Tensor, repeats: int) -> tuple[float, torch.Tensor]:
    """Median ms of ``fn()`` over ``repeats`` calls, each after writing ``evict``; and the last result."""
    result = fn()
    times = []
    for _ in range(repeats):
        evict.fill_(1.0)
        start = time.perf_counter()
        result = fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times), result


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (``-0.0`` and NaN payloads included)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--numel", type=int, default=6_317_248, help="bucket elements (ResNet-18's first bucket)")
    parser.add_argument("--k", type=int, default=63_164, help="gathered indices (1 %% of the bucket)")
    parser.add_argument("--layer", type=int, default=2_359_296, help="layer elements (ResNet-18's 512x512x3x3)")
    parser.add_argument("--topk-ratio", type=float, default=0.1, help="k of the topk pair, as a share of the layer")
    parser.add_argument("--density", type=float, default=0.015, help="set elements of the nonzero pair's mask")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    evict = torch.empty(16 * 1024 * 1024)
    bucket = torch.randn(args.numel, generator=generator)
    indices = torch.randperm(args.numel, generator=generator)[: args.k].sort().values
    layer = torch.randn(args.layer, generator=generator)
    mask = layer >= 0
    threshold = torch.tensor(2.5)

    table = torch.randn(256, 4, generator=generator)
    rows = torch.randint(0, 256, (args.layer // 4,), generator=generator, dtype=torch.int32)
    out_first, out_second = torch.empty(rows.numel(), 4), torch.empty(rows.numel(), 4)
    packed = [torch.randint(0, 256, (args.layer // 8,), generator=generator, dtype=torch.uint8) for _ in range(2)]
    scattered = torch.randperm(args.layer, generator=generator)[: args.k]
    if not 0 < args.topk_ratio <= 0.5:
        parser.error(f"expected 0 < --topk-ratio <= 0.5 (the sampled bound's range), got {args.topk_ratio}")
    top = int(args.topk_ratio * args.layer)
    if not 0 < args.density < 1:
        parser.error(f"expected 0 < --density < 1, got {args.density}")
    unset = int((1 - args.density) * args.layer)
    candidates = magnitude_above(layer, layer.abs().kthvalue(max(unset, 1)).values)

    def ascending(t: torch.Tensor) -> torch.Tensor:
        return t.sort().values

    # name: (first, second, what the comparison reads of each result)
    pairs = {
        "gather": (lambda: bucket[indices], lambda: bucket.index_select(0, indices), None),
        "count": (lambda: mask.sum(), lambda: torch.count_nonzero(mask), None),
        "magnitude": (lambda: layer.abs() > threshold, lambda: magnitude_above(layer, threshold), None),
        "l1": (lambda: torch.linalg.vector_norm(layer, 1), lambda: layer.abs().sum(), None),
        "rows": (
            lambda: torch.index_select(table, 0, rows, out=out_first),
            lambda: lookup_rows(table, rows, out_second),
            None,
        ),
        "codes": (lambda: _looked_up_codes(packed, 4), lambda: _rank_codes(packed, 4), None),
        "argsort": (lambda: torch.argsort(scattered), lambda: argsort_distinct(scattered), None),
        "inf_norm": (
            lambda: torch.linalg.vector_norm(layer, float("inf")),
            lambda: max_magnitudes([layer], torch.float32)[0],
            None,
        ),
        "nonzero": (
            lambda: torch.from_numpy(np.flatnonzero(candidates.numpy())),
            lambda: flat_nonzero(candidates),
            None,
        ),
        "topk": (
            lambda: torch.topk(layer.abs(), top, sorted=False).indices,
            lambda: topk_indices(layer, top),
            ascending,
        ),
    }
    print(f"one thread; bucket {args.numel:,} elements, {args.k:,} indices, layer {args.layer:,} elements")
    print(f"{'pair':<10} {'first ms':>9} {'second ms':>10} {'ratio':>6}  same bits")
    first_times = {}
    for name, (first, second, read) in pairs.items():
        first_ms, a = timed(first, evict, args.repeats)
        first_times[name] = first_ms
        second_ms, b = timed(second, evict, args.repeats)
        if read is not None:
            a, b = read(a), read(b)
        print(f"{name:<10} {first_ms:9.3f} {second_ms:10.3f} {first_ms / second_ms:6.1f}  {same_bits(a, b)}")
    exact = layer.double().abs().sum()
    errors = [((total().double() - exact).abs() / exact).item() for total in pairs["l1"][:2]]
    print(f"l1 relative error against float64: vector_norm {errors[0]:.1e}, abs().sum() {errors[1]:.1e}")
    sequential = np.cumsum(np.abs(layer.numpy()), dtype=np.float32)[-1:]  # each add rounded to fp32 in turn
    print(
        f"l1: vector_norm is the sequential fp32 sum: {same_bits(pairs['l1'][0](), torch.from_numpy(sequential)[0])};"
        f" {first_times['l1'] * 1e6 / args.layer:.2f} ns per element"
    )


if __name__ == "__main__":
    main()
