"""SHA-256 of what every example compressor sends and keeps: the check that a speed change changes nothing.

The rule is that speed never changes what is sent. For each configuration of
``lightning_gradcomp.testing.EXAMPLES`` (or those named), this runs ``--steps`` steps of ``simulate_reduce`` on
ResNet-18's compressed layers, bucketed as DDP buckets them (``benchmarks/codec.py``'s layout), with ``--ranks``
simulated ranks and fresh Gaussian gradients per rank, bucket and step (``--density``: each element kept non-zero with
that probability, as an embedding's gradient is; Zen's input). It hashes, after every step, every rank's output, its
error-feedback residual and its compressor's state (``Compressor.state_dict()``: DGC's momenta, PowerSGD's queries,
LGC's autoencoder), and prints one hash per configuration.

Run it before and after a change, on the same machine: ``--out`` writes the hashes, ``--against`` compares with such
a file and exits with 1 if any configuration differs. The hashes depend on the CPU and the torch version (the BLAS
kernels round differently), so they are not a test of the suite; the unit tests assert the identities themselves.

Example::

    python benchmarks/fingerprint.py --out /tmp/before.txt
    python benchmarks/fingerprint.py --against /tmp/before.txt --ranks 3 --compressors topk dgc
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torchvision
from codec import buckets
from codec_profile import compressed_layers

from lightning_gradcomp.testing import EXAMPLES, simulate_reduce


def _update(digest: Any, value: Any) -> None:
    """Feed ``value`` (tensors, mappings in key order, sequences, plain values) into ``digest``."""
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().contiguous().reshape(-1)
        digest.update(f"{value.dtype}{value.numel()}".encode())
        digest.update(value.view(torch.uint8).numpy().tobytes() if value.numel() else b"")
    elif isinstance(value, Mapping):
        for key in sorted(value, key=str):
            digest.update(str(key).encode())
            _update(digest, value[key])
    elif isinstance(value, (list, tuple)):
        for item in value:
            _update(digest, item)
    else:
        digest.update(repr(value).encode())


def fingerprint(name: str, ranks: int, steps: int, density: float, bucket_mb: float) -> str:
    """The hash of ``name``'s outputs, residuals and states over ``steps`` steps (the first 16 hex digits)."""
    torch.manual_seed(0)
    layout = buckets(compressed_layers(torchvision.models.resnet18(num_classes=10)), bucket_mb)
    sizes = [bucket[-1].offset + bucket[-1].numel for bucket in layout]
    compressors = [EXAMPLES[name]() for _ in range(ranks)]
    feedback = compressors[0].default_error_feedback
    residuals = [[torch.zeros(n) for _ in range(ranks)] if feedback else None for n in sizes]
    digest = hashlib.sha256()
    for step in range(steps):
        for index, bucket in enumerate(layout):
            grads = [torch.randn(sizes[index]) * 1e-3 for _ in range(ranks)]
            if density < 1:
                grads = [g * (torch.rand(g.numel()) < density) for g in grads]
            outputs = simulate_reduce(compressors, grads, bucket, step=step, residuals=residuals[index], index=index)
            _update(digest, outputs)
            _update(digest, residuals[index])
        _update(digest, [c.state_dict() for c in compressors])
    return digest.hexdigest()[:16]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compressors", nargs="+", default=sorted(EXAMPLES), choices=sorted(EXAMPLES), metavar="NAME")
    parser.add_argument("--ranks", type=int, default=2, help="simulated ranks (default 2)")
    parser.add_argument("--steps", type=int, default=3, help="steps per configuration (default 3)")
    parser.add_argument("--density", type=float, default=1.0, help="share of non-zero gradient elements (default 1)")
    parser.add_argument("--bucket-mb", type=float, default=25, help="DDP's bucket cap in MB (default 25)")
    parser.add_argument("--out", help="write 'name hash' lines to this file")
    parser.add_argument("--against", help="compare with a file written by --out; exit 1 on any difference")
    args = parser.parse_args(argv)
    if args.ranks < 1 or args.steps < 1 or not 0 < args.density <= 1:
        parser.error(
            "expected --ranks >= 1, --steps >= 1 and 0 < --density <= 1,"
            f" got {args.ranks}, {args.steps}, {args.density}"
        )
    torch.set_num_threads(1)
    expected = {}
    if args.against:
        with open(args.against) as f:
            expected = dict(line.split() for line in f if line.strip())
    lines, differ = [], []
    for name in args.compressors:
        found = fingerprint(name, args.ranks, args.steps, args.density, args.bucket_mb)
        verdict = ""
        if name in expected:
            verdict = "  same" if expected[name] == found else f"  DIFFERENT (was {expected[name]})"
            if expected[name] != found:
                differ.append(name)
        print(f"{name} {found}{verdict}", flush=True)
        lines.append(f"{name} {found}\n")
    if args.out:
        with open(args.out, "w") as f:
            f.writelines(lines)
    if differ:
        print(f"{len(differ)} configuration(s) differ: {' '.join(differ)}", file=sys.stderr)
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
