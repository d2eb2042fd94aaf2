"""Example configurations of every compressor, for tests and benchmarks; the simulated world, re-exported.

:data:`EXAMPLES` is the one table of compressor configurations the contract suite and the benchmarks run.
:class:`SimulatedWorld`, :func:`simulate_reduce` and :class:`SimulatedHook` live in
:mod:`lightning_gradcomp.ddp.simulation` and are re-exported here, so tests of your own compressor can write::

    from lightning_gradcomp.testing import simulate_reduce
    averages = simulate_reduce([MyCompressor(), MyCompressor()], [g0, g1], layers)
"""

from __future__ import annotations

from collections.abc import Callable

from lightning_gradcomp import compressors as _compressors
from lightning_gradcomp.compressors import (
    BF16,
    DGC,
    FP16,
    LGC,
    QSGD,
    AdaComp,
    EFSignSGD,
    Identity,
    LGCAllReduce,
    MaskedCompressor,
    MinMax,
    OneBit,
    Planned,
    PowerSGD,
    RandomK,
    ScaleCom,
    SignSGD,
    SparseLoCo,
    TernGrad,
    TopK,
    Zen,
)
from lightning_gradcomp.compressors.base import Compressor
from lightning_gradcomp.ddp.simulation import SimulatedHook, SimulatedWorld, simulate_reduce

__all__ = ["EXAMPLES", "SimulatedHook", "SimulatedWorld", "exported_compressor_classes", "simulate_reduce"]

#: Example configurations of every exported compressor, as factories (compressors keep state: each use builds fresh
#: ones). The entry named after a method is its default configuration (what the benchmarks run); the others vary
#: the options the contract suite and the hook tests must cover. One table for the tests and the benchmarks;
#: ``tests/test_contract.py`` fails when an exported compressor has no entry here.
EXAMPLES: dict[str, Callable[[], Compressor]] = {
    "identity": lambda: Identity(),
    "fp16": lambda: FP16(),
    "bf16": lambda: BF16(),
    "topk": lambda: TopK(ratio=0.01),
    "topk-10%": lambda: TopK(ratio=0.1),
    "topk-all": lambda: TopK(ratio=1.0),
    "randomk": lambda: RandomK(ratio=0.01),
    "randomk-10%": lambda: RandomK(ratio=0.1),
    "randomk-unbiased": lambda: RandomK(ratio=0.3, rescale=True),
    "powersgd": lambda: PowerSGD(rank=2),
    "powersgd-r1": lambda: PowerSGD(rank=1),
    "powersgd-r2-cold": lambda: PowerSGD(rank=2, warm_start=False),
    "powersgd-r4-qr": lambda: PowerSGD(rank=4, min_compression_rate=1.0),
    "powersgd-batched": lambda: PowerSGD(rank=2, batch_same_shape=True),
    "powersgd-torch-init": lambda: PowerSGD(rank=2, init="torch"),
    # the auto planner's dispatch: a bucket goes to the candidate of its largest assigned layer (param1: TopK;
    # param0 only: PowerSGD, two rounds; nothing assigned: the default)
    "planned": lambda: Planned(
        {"dense": Identity(), "topk": TopK(ratio=0.1), "powersgd": PowerSGD(rank=2)},
        {"param1": "topk", "param0": "powersgd"},
    ),
    "planned-powersgd": lambda: Planned({"dense": Identity(), "powersgd": PowerSGD(rank=2)}, {"param0": "powersgd"}),
    "planned-default": lambda: Planned({"topk": TopK(ratio=0.1), "bf16": BF16()}),
    "masked": lambda: MaskedCompressor(Identity()),
    "masked-topk": lambda: MaskedCompressor(TopK(ratio=0.2)),
    "dgc": lambda: DGC(),
    "dgc-no-momentum": lambda: DGC(ratio=0.01, momentum=0.0),
    "dgc-bitmap": lambda: DGC(ratio=0.05, strided_sample=False, momentum_masking=False),
    "dgc-warmup-nesterov-clip": lambda: DGC(ratio=0.01, warmup_steps=1, nesterov=True, clip_norm=0.5),
    "adacomp": lambda: AdaComp(),
    "adacomp-small-bins": lambda: AdaComp(bin_size_conv=4, bin_size_fc=6),
    "scalecom": lambda: ScaleCom(ratio=0.01),
    "scalecom-lowpass": lambda: ScaleCom(ratio=0.1, beta=0.5),
    "signsgd": lambda: SignSGD(),
    "signum": lambda: SignSGD(momentum=0.9),
    "efsignsgd": lambda: EFSignSGD(),
    "onebit": lambda: OneBit(),
    "qsgd": lambda: QSGD(),
    "qsgd-2bit-small-buckets": lambda: QSGD(levels=1, bucket_size=100),
    "qsgd-8bit": lambda: QSGD(levels=127, bucket_size=2048),
    "qsgd-16bit-draws": lambda: QSGD(random_bits=16),
    "terngrad": lambda: TernGrad(),
    "terngrad-unclipped": lambda: TernGrad(clip=None),
    "terngrad-allgather": lambda: TernGrad(aggregation="allgather"),
    "terngrad-allreduce": lambda: TernGrad(aggregation="allreduce"),
    "terngrad-16bit-draws": lambda: TernGrad(random_bits=16),
    # LGC's stages follow the step: the defaults are dense for 200 steps; short stages cross all three within the
    # contract suite's few steps, and the others start in stage 2 or 3 (the ratios are large for the tiny layers)
    "lgc": lambda: LGC(),
    "lgc-allreduce": lambda: LGCAllReduce(),
    "lgc-ps-stages": lambda: LGC(ratio=0.05, innovation_ratio=0.005, dense_steps=1, training_steps=2),
    "lgc-allreduce-stages": lambda: LGCAllReduce(ratio=0.05, dense_steps=1, training_steps=2),
    "lgc-ps-gather-stages": lambda: LGC(
        ratio=0.05, innovation_ratio=0.005, dense_steps=1, training_steps=2, leader="rotating", ps_form="gather"
    ),
    # the all-reduce variant's accounting that telescopes (its default, "own", drops the ranks' deviations), with
    # ScaleCom's low-pass memory, and with the variant's first defaults (index order, the code-similarity term)
    "lgc-allreduce-average-stages": lambda: LGCAllReduce(
        ratio=0.05, dense_steps=1, training_steps=2, residual="average"
    ),
    "lgc-allreduce-lowpass-stages": lambda: LGCAllReduce(
        ratio=0.05, dense_steps=1, training_steps=2, beta=0.5, residual="average"
    ),
    "lgc-allreduce-index-stages": lambda: LGCAllReduce(
        ratio=0.05,
        dense_steps=1,
        training_steps=2,
        order="index",
        similarity_weight=0.5,
        residual="average",
    ),
    "lgc-ps-stage2": lambda: LGC(ratio=0.05, innovation_ratio=0.005, dense_steps=0, training_steps=100),
    "lgc-allreduce-stage2": lambda: LGCAllReduce(ratio=0.05, dense_steps=0, training_steps=100),
    "lgc-ps-stage3": lambda: LGC(
        ratio=0.05,
        innovation_ratio=0.005,
        dense_steps=0,
        training_steps=0,
        leader="rotating",
        optimizer="sgd",
        momentum=0.9,
    ),
    "lgc-allreduce-stage3-linear": lambda: LGCAllReduce(
        ratio=0.05,
        dense_steps=0,
        training_steps=0,
        linear_encoder=True,
        leader="fixed",
        project=False,
    ),
    "lgc-allreduce-stage3": lambda: LGCAllReduce(ratio=0.05, dense_steps=0, training_steps=0),
    "zen": lambda: Zen(),
    "zen-always": lambda: Zen(dense_threshold=1.0),
    "zen-bitmap": lambda: Zen(dense_threshold=1.0, index_encoding="bitmap"),
    "topk-zen": lambda: TopK(ratio=0.01, transport="zen"),
    "topk-auto": lambda: TopK(ratio=0.1, transport="zen-auto"),
    "dgc-zen": lambda: DGC(ratio=0.01, transport="zen"),
    "adacomp-allgather": lambda: AdaComp(transport="allgather"),
    # the outer exchange's quantizers (INTELLECT-1's 8 bits, Streaming DiLoCo's 4) and SparseLoCo's top-k in 2 bits;
    # small chunks so that the contract suite's layers span several
    "minmax8": lambda: MinMax(bits=8),
    "minmax4": lambda: MinMax(bits=4),
    # the two-phase exchange at any world size (the defaults take it from 3 ranks on, signSGD's from 4), and the
    # all-gather where the default would take the two-phase exchange
    "signsgd-two-phase": lambda: SignSGD(transport="two_phase"),
    "signum-two-phase": lambda: SignSGD(momentum=0.9, transport="two_phase"),
    "efsignsgd-two-phase": lambda: EFSignSGD(transport="two_phase"),
    "onebit-two-phase": lambda: OneBit(transport="two_phase"),
    "qsgd-two-phase": lambda: QSGD(transport="two_phase"),
    "qsgd-2bit-two-phase": lambda: QSGD(levels=1, bucket_size=100, transport="two_phase"),
    "terngrad-two-phase": lambda: TernGrad(aggregation="two_phase"),
    "minmax8-two-phase": lambda: MinMax(bits=8, transport="two_phase"),
    "minmax4-two-phase": lambda: MinMax(bits=4, transport="two_phase"),
    "adacomp-two-phase": lambda: AdaComp(bin_size_conv=4, bin_size_fc=6, transport="two_phase"),
    # the sparsifiers' two-phase exchange: pairs to their owners, the owners' re-selections gathered
    "topk-two-phase": lambda: TopK(ratio=0.1, transport="two_phase"),
    "dgc-two-phase": lambda: DGC(ratio=0.1, momentum=0.0, transport="two_phase"),
    "sparseloco-two-phase": lambda: SparseLoCo(ratio=0.03, chunk_size=256, transport="two_phase"),
    "efsignsgd-allgather": lambda: EFSignSGD(transport="allgather"),
    "qsgd-allgather": lambda: QSGD(transport="allgather"),
    "sparseloco": lambda: SparseLoCo(),
    "sparseloco-small-chunks": lambda: SparseLoCo(ratio=0.03, chunk_size=256),
}


def exported_compressor_classes() -> list[type[Compressor]]:
    """Every concrete :class:`Compressor` that ``lightning_gradcomp.compressors`` exports."""
    exported = (getattr(_compressors, name) for name in _compressors.__all__)
    return [c for c in exported if isinstance(c, type) and issubclass(c, Compressor) and c is not Compressor]
