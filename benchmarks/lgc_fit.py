"""LGC's all-reduce variant looked into: held-out accuracy after every epoch, how much of each decoded average stage 3
kept, and how far the decoded average is from the true one.

In stage 3 the all-reduce variant scales each layer's decoded average ``x_hat`` by its least-squares fit to the true
average, ``<mean_i x_i, x_hat> / |x_hat|^2``, clamped to [0, 1] (``project``, on by default). The raw factor says how
good the decoding was: near 1, the decoded average points where the true one does; 0 or below, it is no better than
no update at all, and the clamp sends nothing. This script trains one or more of ``benchmarks/convergence.py``'s LGC
all-reduce configurations on the CIFAR-shaped digits, through the same training function (so the final accuracy is
that script's, bit for bit), and records every raw factor on rank 0.

Every stage-3 step it also records how far the decoded average ``D(mean_i E(x_i))`` is from the true average
``mean_i x_i`` (relative error and cosine over the bucket's slots, before the projection), next to the average of
per-rank decodings ``mean_i D(E(x_i))``, which would need every rank's values on the wire: whether the averaged code
loses what the decoder needs, or the decoder is poor on any code.

It is how the all-reduce variant's failure on seed 3 was traced (docs/lgc.md): stage 2 stalls (stage 2 is ScaleCom's
CLT-k, ``tests/test_lgc.py::test_allreduce_stage_2_is_scalecom_with_its_memory``), and with the code-similarity term
most of stage 3's factors are at or below 0.

With ``--trace`` it also records every step, per rank: the gradient's and the error-feedback memory's norms, the
aggregate against the true average of the ranks' compensated gradients, what error feedback lost (applied by no step,
owed by no rank), and stage 3's decoded average and factors per layer (docs/lgc.md, "What the all-reduce variant's
stage 3 drops").

Example::

    python benchmarks/lgc_fit.py --configs lgc-allreduce-train2x lgc-allreduce-sim0-beta05-train2x --seeds 3
    python benchmarks/lgc_fit.py --configs lgc-allreduce-lr002 lgc-allreduce-stage2-only-lr002 --seeds 3 --trace t.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import tempfile

import convergence
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor

from lightning_gradcomp.compressors import LGCAllReduce
from lightning_gradcomp.compressors.base import BucketContext
from lightning_gradcomp.compressors.lgc.autoencoder import LGCAutoencoder
from lightning_gradcomp.compressors.lgc.base import decode_layers, encode_layers
from lightning_gradcomp.engine.context import ResidualBuffers
from lightning_gradcomp.engine.driver import _DECLARATIONS, settle
from lightning_gradcomp.engine.requests import Exchange


class RecordingLGC(LGCAllReduce):
    """LGCAllReduce keeping each raw projection factor it computes (a host read per layer and step: benchmark only),
    and, every stage-3 step, how far the decoded average is from the true average next to what decoding every
    rank's own code and averaging the results would give (the per-rank decoding the all-reduce cannot do: each
    rank's values are encoded and decoded with the same autoencoder and scales, and averaged over a side group
    outside the exchange, so nothing the training sees changes)."""

    def __init__(self, **hparams: object) -> None:
        super().__init__(**hparams)  # type: ignore[arg-type]
        self.fits: list[tuple[int, float]] = []  # (step, raw factor), in layer order
        # (step, relative error and cosine of the decoded average, the same of the average of per-rank decodings,
        # the mean over the ranks of each rank's own relative decoding error), over the bucket's slots
        self.decoding: list[tuple[int, float, float, float, float, float]] = []
        self._shared_scales: Tensor | None = None
        self._model_seen: LGCAutoencoder | None = None
        self._side: object = None

    def _exchange_code(self, tensor: Tensor, ctx: BucketContext, model: LGCAutoencoder) -> Exchange:
        inner, response, first = super()._exchange_code(tensor, ctx, model), None, True
        self._model_seen = model
        try:
            while True:
                request = inner.send(response)
                response = yield request
                if first:  # the leader's broadcast: its index blob and the scales every rank encodes with
                    self._shared_scales, first = response[1], False
        except StopIteration as stop:
            return stop.value

    def _dots(self, x: Tensor, decoded: Tensor, ctx: BucketContext) -> Tensor:
        if self._shared_scales is not None and ctx.world_size > 1:
            self._record_decoding(x, decoded, ctx)
        return super()._dots(x, decoded, ctx)

    def _record_decoding(self, x: Tensor, decoded: Tensor, ctx: BucketContext) -> None:
        model, segments, scales = self._model_seen, self._segments(ctx), self._shared_scales
        own = decode_layers(model, 0, encode_layers(model, x, scales, segments), scales, segments)
        if self._side is None:
            self._side = dist.new_group(backend="gloo")  # every rank reaches its first stage-3 step together
        both = torch.stack([x, own, ((own - x).norm() / x.norm().clamp_min(1e-30)).expand_as(x)]) / ctx.world_size
        dist.all_reduce(both, group=self._side)
        true, per_rank, own_error = both[0], both[1], float(both[2, 0])
        self._last_true, self._last_decoded = true, decoded  # for the per-step trace (TracingLGC)

        def error_and_cosine(estimate: Tensor) -> tuple[float, float]:
            scale = true.norm().clamp_min(1e-30)
            cosine = torch.dot(estimate, true) / (estimate.norm() * scale).clamp_min(1e-30)
            return float((estimate - true).norm() / scale), float(cosine)

        self.decoding.append((ctx.step, *error_and_cosine(decoded), *error_and_cosine(per_rank), own_error))
        self._shared_scales = None

    def _factors(self, decoded: Tensor, dots: Tensor, ctx: BucketContext) -> list[Tensor]:
        for i, (_, at, k) in enumerate(self._segments(ctx)):
            part = decoded[at : at + k]
            norm = float(torch.dot(part, part))
            self.fits.append((ctx.step, float(dots[i]) / norm if norm > 0 else 0.0))
        return super()._factors(decoded, dots, ctx)


class TracingLGC(RecordingLGC):
    """RecordingLGC that also traces every step, per rank: the gradient's norm, the error-feedback memory's norm
    after the step, the aggregate against the true average of the ranks' compensated gradients, what the step lost
    (neither applied nor kept in any rank's memory), and in stage 3 the decoded average against the true average at
    the leader's slots with each layer's raw and clamped projection factor.

    The memory is rebuilt from what the exchange declares with the driver's own ``settle`` (``x - sent``, low-pass
    filtered with ``beta``); the averages go over a side group outside the exchange, so nothing the training sees
    changes.
    """

    def __init__(self, **hparams: object) -> None:
        super().__init__(**hparams)
        self.trace: list[dict] = []
        self._memory: dict[int, Tensor] = {}  # this rank's residual after the last step, per bucket
        self._defect: dict[int, Tensor] = {}  # the sum over the steps of what was lost
        self._gradient_sum: dict[int, Tensor] = {}  # the sum over the steps of the ranks' mean gradient
        self._layer_fits: list[tuple[float, float]] = []

    def exchange(self, tensor: Tensor, ctx: BucketContext, out: Tensor) -> Exchange:
        x = tensor.detach().float().clone()  # error feedback's input, gradient + memory
        previous = self._memory.get(ctx.index)
        if previous is None or previous.shape != x.shape:
            previous = torch.zeros_like(x)
        self._layer_fits, self._last_true = [], None
        memory = torch.zeros_like(x)  # the residual after the step, as the driver writes it (``settle``)
        inner, response = super().exchange(tensor, ctx, out), None
        try:
            while True:
                item = inner.send(response)
                if isinstance(item, _DECLARATIONS):
                    settle(item, x, ResidualBuffers(previous, memory), self, ctx)
                response = yield item
        except StopIteration as stop:
            update = stop.value
        self._memory[ctx.index] = memory
        self._record_step(ctx, x, x - previous, memory, update.detach().float())
        return update

    def _record_step(self, ctx: BucketContext, x: Tensor, gradient: Tensor, memory: Tensor, update: Tensor) -> None:
        n = ctx.world_size
        norms = torch.stack([gradient.norm(), memory.norm(), x.norm()])
        everyone = [torch.empty_like(norms) for _ in range(n)]
        dist.all_gather(everyone, norms, group=self._side)
        means = torch.stack([x, gradient, memory]) / n
        dist.all_reduce(means, group=self._side)
        mean_x, mean_gradient, mean_memory = means
        defect = mean_x - update - mean_memory  # neither applied nor owed: the step's loss to error feedback
        self._defect[ctx.index] = self._defect.get(ctx.index, torch.zeros_like(x)) + defect
        self._gradient_sum[ctx.index] = self._gradient_sum.get(ctx.index, torch.zeros_like(x)) + mean_gradient
        row = {
            "step": ctx.step,
            "bucket": ctx.index,
            "stage": self.stage(ctx.step),
            "leader": self.leader_of(ctx),
            "gradient_norm": [float(e[0]) for e in everyone],
            "memory_norm": [float(e[1]) for e in everyone],
            "input_norm": [float(e[2]) for e in everyone],
            "mean_input_norm": float(mean_x.norm()),
            "mean_gradient_norm": float(mean_gradient.norm()),
            "update_norm": float(update.norm()),
            "cos_update_input": _cosine(update, mean_x),
            "cos_update_gradient": _cosine(update, mean_gradient),
            "lost_norm": float(defect.norm()),
            "cos_lost_input": _cosine(defect, mean_x),
            "lost_sum_norm": float(self._defect[ctx.index].norm()),
            "gradient_sum_norm": float(self._gradient_sum[ctx.index].norm()),
        }
        if self._last_true is not None:  # stage 3: the decoded average against the true one at the slots
            true, decoded = self._last_true, self._last_decoded
            row["slots_true_norm"] = float(true.norm())
            row["slots_share_of_input"] = float(true.norm() / mean_x.norm().clamp_min(1e-30))
            row["decoded_norm"] = float(decoded.norm())
            row["cos_decoded_true"] = _cosine(decoded, true)
            row["layers"] = [
                {
                    "raw_factor": raw,
                    "factor": clamped,
                    "cos_decoded_true": _cosine(decoded[at : at + k], true[at : at + k]),
                    "decoded_over_true": float(decoded[at : at + k].norm() / true[at : at + k].norm().clamp_min(1e-30)),
                }
                for (raw, clamped), (_, at, k) in zip(self._layer_fits, self._segments(ctx))
            ]
        self.trace.append(row)

    def _factors(self, decoded: Tensor, dots: Tensor, ctx: BucketContext) -> list[Tensor]:
        factors = super()._factors(decoded, dots, ctx)
        raws = [raw for _, raw in self.fits[-len(factors) :]] if factors else []
        self._layer_fits = [(raw, float(f)) for raw, f in zip(raws, factors)]
        return factors


def _cosine(a: Tensor, b: Tensor) -> float:
    return float(torch.dot(a, b) / (a.norm() * b.norm()).clamp_min(1e-30))


def _worker(
    rank: int, world_size: int, port: int, configs: list[str], epochs: int, seed: int, out: str, trace: bool
) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    side = dist.new_group(backend="gloo")  # the recorders' own averages, outside the exchange
    results = {}
    for config in configs:
        recorder = TracingLGC if trace else RecordingLGC
        compressor = recorder(**convergence.CONFIGS[config][0]().hparams())
        compressor._side = side
        results[config] = convergence.train(rank, world_size, config, epochs, seed, "digits32", compressor=compressor)
        results[config]["fits"] = compressor.fits
        results[config]["decoding"] = compressor.decoding
        if isinstance(compressor, TracingLGC):
            results[config]["trace"] = compressor.trace
    if rank == 0:
        torch.save(results, os.path.join(out, "rank0.pt"))
    dist.destroy_process_group()


def trace_summary(result: dict) -> list[str]:
    """Per epoch, the means over its steps of the trace's columns (markdown rows; ``--trace``)."""
    rows = []
    steps = result["steps"] // len(result["epoch_accuracy"])
    for epoch, accuracy in enumerate(result["epoch_accuracy"]):
        part = [r for r in result["trace"] if epoch * steps <= r["step"] < (epoch + 1) * steps]
        if not part:
            continue

        def mean(key: str, i: int | None = None) -> float:
            return statistics.mean(r[key] if i is None else r[key][i] for r in part)

        cells = [
            f"{epoch + 1}",
            f"{part[-1]['stage']}",
            f"{100 * accuracy:.1f}",
            f"{mean('gradient_norm', 0):.2f} / {mean('gradient_norm', 1):.2f}",
            f"{mean('memory_norm', 0):.2f} / {mean('memory_norm', 1):.2f}",
            f"{mean('mean_input_norm'):.2f}",
            f"{mean('update_norm'):.2f}",
            f"{mean('cos_update_input'):+.2f}",
            f"{mean('cos_update_gradient'):+.2f}",
            f"{statistics.mean(r['lost_norm'] / r['mean_input_norm'] for r in part):.2f}",
            f"{part[-1]['lost_sum_norm']:.1f} / {part[-1]['gradient_sum_norm']:.1f}",
        ]
        coded = [r for r in part if "layers" in r]
        if coded:
            layers = [layer for r in coded for layer in r["layers"]]
            raws = [layer["raw_factor"] for layer in layers]
            cells += [
                f"{statistics.mean(r['slots_share_of_input'] for r in coded):.2f}",
                f"{statistics.mean(r['decoded_norm'] / r['slots_true_norm'] for r in coded):.2f}",
                f"{statistics.mean(r['cos_decoded_true'] for r in coded):+.2f}",
                f"{statistics.median(raws):.2f} ({min(raws):.2f} - {max(raws):.2f})",
                f"{100 * sum(0 < layer['factor'] < layer['raw_factor'] for layer in layers) / len(layers):.0f}%"
                f" / {100 * sum(layer['raw_factor'] <= 0 for layer in layers) / len(layers):.0f}%",
            ]
        else:
            cells += [""] * 5
        rows.append("| " + " | ".join(cells) + " |")
    return rows


TRACE_HEADER = (
    "| epoch | stage | held-out accuracy (%) | \\|gradient\\|: rank 0 / 1 | \\|memory\\| after the step: rank 0 / 1 |"
    " \\|mean input\\| | \\|update\\| | cos(update, mean input) | cos(update, mean gradient) |"
    " \\|lost\\| / \\|mean input\\| | \\|sum of lost\\| / \\|sum of mean gradients\\| (end of epoch) |"
    " slots' share of \\|mean input\\| | \\|decoded\\| / \\|true\\| at the slots | cos(decoded, true) |"
    " raw factor: median (range) | factors clamped at the upper bound / at 0 |\n" + "|---" * 16 + "|"
)


def summary(result: dict) -> str:
    """One table row's cells: accuracy every second epoch, then the stage-3 factors' share <= 0, median, mean kept."""
    fits = [f for _, f in result["fits"]]
    accuracy = " ".join(f"{100 * a:.0f}" for a in result["epoch_accuracy"][1::2])
    if not fits:
        return f"{accuracy} | {100 * result['accuracy']:.1f} | (no stage 3) | | | | | |"
    at_most_zero = sum(f <= 0 for f in fits) / len(fits)
    kept = sum(min(max(f, 0.0), 1.0) for f in fits) / len(fits)
    decoding = [statistics.mean(column) for column in list(zip(*result.get("decoding", [])))[1:]] or [math.nan] * 5
    return (
        f"{accuracy} | {100 * result['accuracy']:.1f} | {100 * at_most_zero:.0f}% of {len(fits)} |"
        f" {statistics.median(fits):+.2f} | {kept:.3f} | {decoding[0]:.2f}, {decoding[1]:+.2f} |"
        f" {decoding[2]:.2f}, {decoding[3]:+.2f} | {decoding[4]:.2f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    lgc_allreduce = [name for name in convergence.CONFIGS if name.startswith("lgc-allreduce")]
    parser.add_argument("--configs", nargs="+", default=["lgc-allreduce-train2x"], choices=lgc_allreduce)
    parser.add_argument("--seeds", type=int, nargs="+", default=[3])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--json", default=None, help="also write every factor and accuracy here")
    parser.add_argument(
        "--trace",
        default=None,
        help="trace every step, per rank (gradient and memory norms, the aggregate against the true average, what was"
        " lost, stage 3's decoded average and factors per layer), write it here as JSON and print it per epoch",
    )
    args = parser.parse_args()
    from lightning_gradcomp.demo.ports import free_port

    runs = {}
    for seed in args.seeds:
        with tempfile.TemporaryDirectory() as out:
            mp.spawn(
                _worker, args=(2, free_port(), args.configs, args.epochs, seed, out, args.trace is not None), nprocs=2
            )
            runs[seed] = torch.load(os.path.join(out, "rank0.pt"))
    print(
        "| seed | configuration | held-out accuracy (%), every second epoch | final | stage-3 factors <= 0 |"
        " median factor | mean kept (clamped) | decoded average: error, cosine | average of per-rank decodings:"
        " error, cosine | each rank's own decoding error |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for seed, results in runs.items():
        for config, result in results.items():
            print(f"| {seed} | {config} | {summary(result)}")
    if args.trace:
        for seed, results in runs.items():
            for config, result in results.items():
                print(f"\n{config}, seed {seed}, per epoch (means over its steps):\n\n{TRACE_HEADER}")
                print("\n".join(trace_summary(result)))
        traces = {str(s): {c: r.pop("trace") for c, r in results.items()} for s, results in runs.items()}
        accuracy = {str(s): {c: r["epoch_accuracy"] for c, r in results.items()} for s, results in runs.items()}
        with open(args.trace, "w") as f:
            json.dump({"args": vars(args), "accuracy": accuracy, "trace": traces}, f)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": {str(s): r for s, r in runs.items()}}, f, indent=1)


if __name__ == "__main__":
    main()
