"""Which compressors a finite gradient spike leaves with non-finite state (a diagnostic, not a test).

A finite gradient that a payload or the compressor's arithmetic cannot hold (a value above FP16's range, a square
that overflows fp32, fp16 gradients near their own limit) must cost at most its step, as a NaN does: the step is
finite, or non-finite on every rank, and nothing non-finite stays in a residual or in the compressor's state, where
error feedback and warm starts would carry it to every later step. ``tests/test_contract.py`` asserts this for the
spikes the package handles (``test_a_finite_spike_never_reaches_the_state``); this script explores further: every
configuration of ``lightning_gradcomp.testing.EXAMPLES`` (or those named), with error feedback wherever it is
accepted, two simulated ranks, four steps on a conv weight and four matrices, a spike at the second step, in the
gradient dtype ``--dtype``. It prints one line per configuration and case where a clean step after the spike is not
finite, or where a residual or the compressor's state (``state_dict``) holds a NaN or an infinity; nothing when all
are clean. Exit status 1 if any line was printed.

Cases (``--magnitudes`` scales them): ``one``, one element of the last layer on the last rank set to the magnitude;
``all``, that rank's whole gradient multiplied by it (Gaussian values of order ``1e-3`` otherwise).

With ``--hook`` the same spikes go through the real communication hook (``testing.SimulatedHook``, every layer
compressed that the compressor takes) for twenty steps, with ``CompressionState``'s default ``reset_state_after=3``
(``--reset-state-after``; ``0``: never): state that makes every later step non-finite is then reset after three such
steps. It prints one line per configuration and case whose last two steps are still not finite (training stalled);
nothing when every run goes on.

Example::

    python benchmarks/spikes.py                                      # fp32: 1e5, 3e19, 1e38
    python benchmarks/spikes.py --dtype float16 --magnitudes 3e6 1e7 --cases all   # fp16 values of order 3e3, 1e4
    python benchmarks/spikes.py --hook --dtype float16 --magnitudes 3e6 1e7 --cases all   # does training go on?
"""

from __future__ import annotations

import argparse
import copy
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from lightning_gradcomp import CompressionState
from lightning_gradcomp.compressors.base import Layer, layers_from_shapes
from lightning_gradcomp.testing import EXAMPLES, SimulatedHook, simulate_reduce

# the shapes of tests/test_contract.py: a conv weight, two same-shape matrices apart, a tall and a wide matrix
SHAPES = [(16, 4, 3, 3), (48, 64), (96, 24), (48, 64), (24, 96)]
DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _finite(value: Any) -> bool:
    """Whether every floating-point tensor in ``value`` (tensors, mappings, sequences) is finite."""
    if isinstance(value, torch.Tensor):
        return not value.is_floating_point() or bool(torch.isfinite(value).all())
    if isinstance(value, Mapping):
        return all(_finite(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return all(_finite(v) for v in value)
    return True


def _gradients(
    step: int,
    case: str,
    magnitude: float,
    dtype: torch.dtype,
    layers: Sequence[Layer],
    ranks: int,
    generator: torch.Generator,
) -> list[torch.Tensor]:
    """Every rank's gradient at ``step`` (Gaussian of order 1e-3); at step 1 the last rank's carries the spike."""
    numel = sum(layer.numel for layer in layers)
    grads = [(torch.randn(numel, generator=generator) * 1e-3).to(dtype) for _ in range(ranks)]
    if step == 1:
        if case == "one":
            grads[-1][layers[-1].offset] = magnitude
        else:
            grads[-1] = (grads[-1].double() * magnitude).to(dtype)
    return grads


def _run(name: str, case: str, magnitude: float, dtype: torch.dtype, ranks: int = 2) -> list[str]:
    """What is left non-finite after ``case`` at ``magnitude`` (empty: nothing)."""
    compressor = EXAMPLES[name]()
    kept = [layer for layer in layers_from_shapes(SHAPES) if compressor.compresses(layer, 0)]
    # laid out contiguously, as the hook hands a compressor its layers
    layers = layers_from_shapes([layer.shape for layer in kept], [layer.name for layer in kept])
    offset = sum(layer.numel for layer in layers)
    compressors = [copy.deepcopy(compressor) for _ in range(ranks)]
    residuals = [torch.zeros(offset, dtype=dtype) for _ in range(ranks)] if _accepts_feedback(compressor) else None
    generator = torch.Generator().manual_seed(0)
    found = []
    for step in range(4):
        grads = _gradients(step, case, magnitude, dtype, layers, ranks, generator)
        outs = simulate_reduce(compressors, grads, layers, step=step, residuals=residuals)
        if step > 1 and not all(_finite(out) for out in outs):
            found.append(f"step {step}: output not finite")
        if residuals is not None and not all(_finite(r) for r in residuals):
            found.append(f"step {step}: residual not finite")
        if not all(_finite(c.state_dict()) for c in compressors):
            found.append(f"step {step}: state not finite")
    return found


def _stalls(
    name: str,
    case: str,
    magnitude: float,
    dtype: torch.dtype,
    reset_state_after: int | None = 3,
    ranks: int = 2,
    steps: int = 20,
) -> list[str]:
    """Through the hook: whether the last two steps are still not finite (empty: training went on)."""
    compressor = EXAMPLES[name]()
    layers = layers_from_shapes(SHAPES)
    feedback = _accepts_feedback(compressor)
    states = [
        CompressionState(
            copy.deepcopy(compressor),
            min_compress_numel=0,
            error_feedback=feedback,
            reset_state_after=reset_state_after,
        )
        for _ in range(ranks)
    ]
    hook = SimulatedHook(states, layers)
    generator = torch.Generator().manual_seed(0)
    finite = []
    for step in range(steps):
        grads = _gradients(step, case, magnitude, dtype, layers, ranks, generator)
        finite.append(all(_finite(out) for out in hook.step(grads)))
    if any(finite[-2:]):
        return []
    steps_seen = "".join("." if ok else "x" for ok in finite)
    return [f"stalled: steps {steps_seen} (x: not finite), {states[0].telemetry.total_state_resets} reset(s)"]


def _accepts_feedback(compressor: Any) -> bool:
    try:
        compressor.check_error_feedback(True)
    except ValueError:
        return False
    return True


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compressors", nargs="+", choices=sorted(EXAMPLES), default=sorted(EXAMPLES))
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="the gradients' dtype")
    parser.add_argument("--magnitudes", nargs="+", type=float, default=[1e5, 3e19, 1e38])
    parser.add_argument("--cases", nargs="+", choices=["one", "all"], default=["one", "all"])
    parser.add_argument("--hook", action="store_true", help="through the hook: print the runs that stall")
    parser.add_argument(
        "--reset-state-after",
        type=int,
        default=3,
        help="with --hook: reset_state_after (default 3, the default; 0: never)",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    dtype = DTYPES[args.dtype]
    bad = 0
    for name in args.compressors:
        for case in args.cases:
            for magnitude in args.magnitudes:
                if args.hook:
                    found = _stalls(name, case, magnitude, dtype, args.reset_state_after or None)
                else:
                    found = _run(name, case, magnitude, dtype)
                for line in found[:1]:  # the first step where it shows
                    print(f"{name} {case}={magnitude:g} ({args.dtype}): {line}")
                    bad += 1
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
