"""A fresh CPU tensor against a kept one, by size: where allocations start paying page faults (a benchmark).

glibc serves an allocation above its mmap threshold (128 KiB at first, raised to the size of a freed mapping, at
most 32 MiB on 64-bit Linux) with a fresh mapping, and every 4 KiB page of it faults on first write; below the
threshold the memory comes from the heap, where only what was trimmed back to the system since faults again. torch's
CPU allocator allocates through glibc, so a codec's fresh gradient-sized temporary costs more above 32 MiB than
below. This is why ``benchmarks/codec.py`` lays the layers out in DDP's 25 MiB buckets, as training has them. One
thread; per size, the median of ``--repeats`` fills of ``torch.empty(n)`` against the same fill of a tensor
allocated once, and the minor page faults per fresh fill (``getrusage``) against the tensor's pages.

Example::

    python benchmarks/page_faults.py --sizes 8 25 31 33 44
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time
from collections.abc import Callable

import torch


def fills(make: Callable[[], torch.Tensor], repeats: int) -> tuple[float, float]:
    """Median ms of ``make().fill_(1)`` over ``repeats`` calls after one warm-up, and minor page faults per call."""
    make().fill_(1.0)
    times, before = [], resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(repeats):
        start = time.perf_counter()
        make().fill_(1.0)
        times.append((time.perf_counter() - start) * 1e3)
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / repeats
    return statistics.median(times), faults


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=float, nargs="+", default=[8, 25, 31, 33, 44], help="MiB of fp32")
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"{'MiB':>5} {'fresh ms':>9} {'kept ms':>8} {'faults per fresh fill':>22} {'pages':>6}")
    for mib in args.sizes:
        n = int(mib * 2**20) // 4
        kept = torch.empty(n)
        fresh, faults = fills(lambda n=n: torch.empty(n), args.repeats)
        reused, _ = fills(lambda kept=kept: kept, args.repeats)
        print(f"{mib:5.0f} {fresh:9.2f} {reused:8.2f} {faults:22.0f} {4 * n // 4096:6d}")


if __name__ == "__main__":
    main()
