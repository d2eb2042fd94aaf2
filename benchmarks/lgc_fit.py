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

Example::

    python benchmarks/lgc_fit.py --configs lgc-allreduce-train2x lgc-allreduce-sim0-beta05-train2x --seeds 3
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
from lightning_gradcomp.compressors.exchange import Exchange
from lightning_gradcomp.compressors.lgc_autoencoder import LGCAutoencoder
from lightning_gradcomp.compressors.lgc_base import decode_layers, encode_layers


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


def _worker(rank: int, world_size: int, port: int, configs: list[str], epochs: int, seed: int, out: str) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    results = {}
    for config in configs:
        compressor = RecordingLGC(**convergence.CONFIGS[config][0]().hparams())
        results[config] = convergence.train(rank, world_size, config, epochs, seed, "digits32", compressor=compressor)
        results[config]["fits"] = compressor.fits
        results[config]["decoding"] = compressor.decoding
    if rank == 0:
        torch.save(results, os.path.join(out, "rank0.pt"))
    dist.destroy_process_group()


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
    args = parser.parse_args()
    from lightning_gradcomp.demo.ports import free_port

    runs = {}
    for seed in args.seeds:
        with tempfile.TemporaryDirectory() as out:
            mp.spawn(_worker, args=(2, free_port(), args.configs, args.epochs, seed, out), nprocs=2)
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
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": {str(s): r for s, r in runs.items()}}, f, indent=1)


if __name__ == "__main__":
    main()
