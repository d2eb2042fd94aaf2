"""What error feedback keeps: how its residual grows, and what it loses in 16 bits (a diagnostic, not a test).

**Growth.** Error feedback keeps a bounded residual when the compressor is a contraction, ``E ||C(x) - x||^2 < ||x||^2``
(``Compressor.error_feedback_growth`` names the configurations that need not be, and the strategy warns when error
feedback is switched on for them). ``--table growth`` prints, for each configuration named, rank 0's residual norm
over its gradient's after 1, 5, 20 and 60 steps of two simulated ranks with unit Gaussian gradients on a 256 x 256
matrix, in float64, and whether the configuration gives a reason.

**16 bits.** Error feedback delays what a compressor does not send; it should lose nothing: over ``T`` steps, what was
applied plus what is still owed equals what was computed, ``sum_t avg_t + mean_r e_r = mean_r sum_t g_{r,t}``
(``tests/test_contract.py`` checks it in float64). In 16-bit training (``precision="bf16-true"`` or ``"16-true"``)
the residual has the gradient's dtype, as in torch's ``powerSGD_hook``, and every ``g + e`` rounds: a gradient much
smaller than what is owed loses its low bits. ``--table precision`` measures that loss against plain DDP's own: each
configuration of ``lightning_gradcomp.testing.EXAMPLES`` named (it must take error feedback) averages
``--steps`` steps of two simulated ranks' gradients (a fixed direction plus Gaussian noise ten times larger, on a
256 x 256 matrix) in each dtype, and prints the share of the exact sum that is neither applied nor owed,
``||sum g - sum avg - mean e|| / ||sum g||``. The ``identity`` row is plain DDP's averaging in that dtype (no
residual): what 16-bit training loses anyway. DGC is left out by default: its momentum correction accumulates
something other than the gradient, so the identity does not apply to it.

Example::

    python benchmarks/error_feedback.py --table growth --compressors topk randomk randomk-unbiased qsgd qsgd-8bit \
        terngrad terngrad-unclipped
    python benchmarks/error_feedback.py --table precision --steps 200
"""

from __future__ import annotations

import argparse
import copy

import torch

from lightning_gradcomp.compressors.base import layers_from_shapes
from lightning_gradcomp.testing import EXAMPLES, simulate_reduce

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
LAYERS = layers_from_shapes([(256, 256)])


def lost_share(name: str, dtype: torch.dtype, steps: int, seed: int = 0) -> float:
    """The share of the exact gradient sum that ``name`` neither applied nor owes after ``steps`` steps."""
    compressor = EXAMPLES[name]()
    numel = LAYERS[0].numel
    compressors = [copy.deepcopy(compressor) for _ in range(2)]
    residuals = None if name == "identity" else [torch.zeros(numel, dtype=dtype) for _ in range(2)]
    g = torch.Generator().manual_seed(seed)
    direction = torch.randn(numel, generator=g) * 0.1  # gradients keep a direction under the noise
    applied = torch.zeros(numel, dtype=torch.float64)
    computed = torch.zeros(numel, dtype=torch.float64)
    for step in range(steps):
        xs = [(direction + torch.randn(numel, generator=g)).to(dtype) for _ in range(2)]
        averaged = simulate_reduce(compressors, xs, LAYERS, step=step, residuals=residuals)
        applied += averaged[0].double()
        computed += (xs[0].double() + xs[1].double()) / 2
    owed = torch.zeros(numel, dtype=torch.float64)
    if residuals is not None:
        owed = (residuals[0].double() + residuals[1].double()) / 2
    return ((computed - applied - owed).norm() / computed.norm()).item()


def residual_growth(name: str, steps: tuple[int, ...] = (1, 5, 20, 60), seed: int = 0) -> list[float]:
    """Rank 0's residual norm over its gradient's after each of ``steps`` (float64, unit Gaussian gradients)."""
    compressors = [EXAMPLES[name]() for _ in range(2)]
    numel = LAYERS[0].numel
    residuals = [torch.zeros(numel, dtype=torch.float64) for _ in range(2)]
    g = torch.Generator().manual_seed(seed)
    ratios = []
    for step in range(max(steps)):
        xs = [torch.randn(numel, generator=g, dtype=torch.float64) for _ in range(2)]
        simulate_reduce(compressors, xs, LAYERS, step=step, residuals=residuals)
        if step + 1 in steps:
            ratios.append((residuals[0].norm() / xs[0].norm()).item())
    return ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--table", choices=["growth", "precision"], default="precision")
    parser.add_argument("--steps", type=int, default=200, help="--table precision: steps averaged")
    parser.add_argument(
        "--compressors",
        nargs="+",
        default=["identity", "topk", "topk-10%", "randomk", "powersgd", "scalecom", "efsignsgd", "qsgd"],
    )
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    args = parser.parse_args()
    unknown = [name for name in args.compressors if name not in EXAMPLES]
    if unknown:
        parser.error(f"unknown --compressors {unknown}; known: {', '.join(EXAMPLES)}")
    for name in args.compressors:
        try:
            EXAMPLES[name]().check_error_feedback(True)
        except ValueError as err:
            parser.error(f"--compressors {name}: {err}")
    if args.table == "growth":
        print("rank 0's residual norm over its gradient's (2 ranks, 256 x 256, float64)\n")
        print("| configuration | warns (error_feedback=True) | 1 step | 5 steps | 20 steps | 60 steps |")
        print("|---|---|---|---|---|---|")
        for name in args.compressors:
            warns = "yes" if EXAMPLES[name]().error_feedback_growth(True) is not None else "no"
            ratios = residual_growth(name)
            print(f"| {name} | {warns} | " + " | ".join(f"{r:.3g}" for r in ratios) + " |", flush=True)
        return
    print(f"share of the gradient sum neither applied nor owed after {args.steps} steps (2 ranks, 256 x 256)\n")
    print("| configuration | " + " | ".join(args.dtypes) + " |")
    print("|---|" + "---|" * len(args.dtypes))
    for name in args.compressors:
        shares = [lost_share(name, DTYPES[dtype], args.steps) for dtype in args.dtypes]
        print(f"| {name} | " + " | ".join(f"{share:.2e}" for share in shares) + " |", flush=True)


if __name__ == "__main__":
    main()
