"""Whether ``torch.compile`` helps the codecs' elementwise work on this machine (a benchmark, not a test).

Use ``torch.compile`` where it helps: this measures, on a gradient the size of ResNet-18's compressed
layers (11.2M elements, one thread as each training worker has), the eager and the compiled versions of two
representative chains, and whether they give the same bits:

* ``cast``: cast to bfloat16 and divide by the world size (BF16's encode in torch's order);
* ``sign``: error feedback's ``g + e``, its signs and its mean magnitude (EF-signSGD's encode).

It prints the compile time (the first call; inductor generates and builds C++ on the CPU, so a compiler must be
installed) and the median time of each version. Example::

    python benchmarks/compiled.py
    python benchmarks/compiled.py --world-size 3 --numel 1000000
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch


def _cast(x: torch.Tensor, world_size: int) -> torch.Tensor:
    return x.to(torch.bfloat16).div(world_size)


def _sign(g: torch.Tensor, e: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = g + e
    return x >= 0, x.abs().mean()


def _median_ms(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--numel", type=int, default=11_172_032)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    grad = torch.randn(args.numel, generator=g) * 1e-3
    residual = torch.randn(args.numel, generator=g) * 1e-4
    chains = {
        "cast": (_cast, (grad, args.world_size)),
        "sign": (_sign, (grad, residual)),
    }
    print(f"{args.numel:,} elements, 1 thread, torch {torch.__version__}")
    print(f"{'chain':<6} {'compile s':>9} {'eager ms':>9} {'compiled ms':>11}  same bits")
    for name, (fn, fn_args) in chains.items():
        compiled = torch.compile(fn, dynamic=False)
        start = time.perf_counter()
        out = compiled(*fn_args)
        compile_s = time.perf_counter() - start
        ref = fn(*fn_args)
        outs, refs = (out, ref) if isinstance(out, tuple) else ((out,), (ref,))
        same = all(torch.equal(a, b) for a, b in zip(outs, refs))
        eager_ms = _median_ms(lambda fn=fn, fn_args=fn_args: fn(*fn_args), args.repeats)
        compiled_ms = _median_ms(lambda c=compiled, fn_args=fn_args: c(*fn_args), args.repeats)
        print(f"{name:<6} {compile_s:9.1f} {eager_ms:9.2f} {compiled_ms:11.2f}  {'yes' if same else 'no'}")


if __name__ == "__main__":
    main()
