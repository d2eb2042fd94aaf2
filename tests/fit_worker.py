"""Fits of TinyNet and its variants on CPU processes, several in one launch (:func:`run_fits` starts it).

Lightning's spawn launcher pickles the model for its workers, and a compiled model does not pickle (under plain
``DDPStrategy`` too), so this script runs under Lightning's default launcher, which starts the script again for every
further rank, as a user's training script runs. One launch runs several fits, one after another (a launch costs
seconds, a fit of TinyNet a fraction of one), each recorded in its own folder of ``DIRPATH``::

    python -m tests.fit_worker DIRPATH DEVICES RUN ... [--optimize-ddp MODE]

A ``RUN`` is ``STRATEGY:VARIANT``, recorded in ``DIRPATH/STRATEGY-VARIANT``: a fresh model trained from scratch.
``STRATEGY`` is one of :data:`STRATEGIES`, ``VARIANT`` one of :data:`VARIANTS` (the configurations a user of
``DDPStrategy`` may turn on, and the runs that save a checkpoint). ``STRATEGY:VARIANT+EARLIER`` resumes instead from
the checkpoint that the run ``EARLIER`` of the same launch saved (``EARLIER:stateless``: from
a copy edited by :func:`_edited`), recorded in ``DIRPATH/STRATEGY-VARIANT+EARLIER`` (every ``:`` a ``-``).
``+EARLIER@FILE`` resumes from ``EARLIER``'s checkpoint ``FILE.ckpt`` instead of its ``last.ckpt`` (``@epoch=0``: the
one a variant that keeps every epoch's checkpoint wrote after the first epoch).
``--optimize-ddp``, if given, is set as ``torch._dynamo.config.optimize_ddp`` before any model is wrapped.
A variant that tunes (``lr-find``, ``lr-find-callback``) first runs Lightning's learning-rate finder, then fits; every
rank saves what the finder found to ``DIRPATH/RUN/tuned{rank}.pt``, which :func:`run_fits` adds to its record.
"""

import os
import subprocess
import sys
from collections.abc import Callable
from functools import partial
from typing import Any

import lightning.pytorch as pl
import torch
import torch._dynamo
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch.callbacks import LearningRateFinder, LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.tuner import Tuner
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader

from lightning_gradcomp import CompressedDDP, DiLoCo
from lightning_gradcomp.callbacks import CompressionMonitor, DenseWarmup, OuterMonitor
from lightning_gradcomp.compressors import (
    BF16,
    FP16,
    LGC,
    QSGD,
    EFSignSGD,
    Identity,
    LGCAllReduce,
    MinMax,
    PowerSGD,
    RandomK,
    SparseLoCo,
    TopK,
)
from lightning_gradcomp.optim import MuonAdamW, muon_param_groups
from lightning_gradcomp.optim.fused import FusedSGD
from lightning_gradcomp.runtime.rank_state import checkpoint_file
from tests.distributed import child_env, free_port
from tests.models import RecordRanks, RecordRounds, SparseEmbeddingNet, TinyNet, synthetic_classification

#: the paper's outer optimizer (Nesterov SGD, lr 0.7, momentum 0.9), which the references compute: its momentum carries
#: state across rounds and through a resume
PAPER_OUTER = partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)


def _diloco(**fixed: Any) -> Callable[..., DDPStrategy]:
    """A DiLoCo factory with the paper's outer optimizer unless ``fixed`` names one (``defaults=True``: DiLoCo's own
    defaults), dropping the DistributedDataParallel arguments of a variant (DiLoCo does not wrap in DDP)."""
    if not fixed.pop("defaults", False):
        fixed.setdefault("outer_optimizer", PAPER_OUTER)
    return lambda **kwargs: DiLoCo(**fixed, **{k: v for k, v in kwargs.items() if k != "bucket_cap_mb"})


#: LGC's stages: 2 dense steps, 4 of top-k while the autoencoder trains, the code from step 6
_LGC_STAGES = {"ratio": 0.05, "dense_steps": 2, "training_steps": 4}

# a fresh compressor for every fit: nothing carries over from one fit of a launch to the next but the checkpoint
STRATEGIES: dict[str, Callable[..., DDPStrategy]] = {
    "ddp": DDPStrategy,
    "identity": lambda **kwargs: CompressedDDP(Identity(), **kwargs),
    # every compressor class of the built-in casts and sparsifiers, on the tensors of 64 elements and more
    "identity-64": lambda **kwargs: CompressedDDP(Identity(), min_compress_numel=64, **kwargs),
    "fp16": lambda **kwargs: CompressedDDP(FP16(), min_compress_numel=64, **kwargs),
    "bf16": lambda **kwargs: CompressedDDP(BF16(), min_compress_numel=64, **kwargs),
    "randomk": lambda **kwargs: CompressedDDP(RandomK(ratio=0.1), min_compress_numel=64, **kwargs),
    "topk": lambda **kwargs: CompressedDDP(TopK(ratio=0.05), min_compress_numel=64, **kwargs),
    "powersgd-r1": lambda **kwargs: CompressedDDP(PowerSGD(rank=1), min_compress_numel=64, **kwargs),
    "powersgd-r2": lambda **kwargs: CompressedDDP(PowerSGD(rank=2), min_compress_numel=64, **kwargs),
    # H = 1 with outer SGD(lr=1) is DDP (the inner step is linear in the gradient); H = 2, 3, 4: DiLoCo's defaults
    "diloco-h1": _diloco(sync_every=1, outer_optimizer=partial(torch.optim.SGD, lr=1.0)),
    "diloco-h2": _diloco(sync_every=2),
    "diloco-h3": _diloco(sync_every=3),
    "diloco-h4": _diloco(sync_every=4),
    "diloco-h4f2": _diloco(sync_every=4, fragments=2),
    "diloco-h4-offload": _diloco(sync_every=4, offload=True),
    # overlap: Streaming DiLoCo's merge with mixing factor 0 (the local work replaced) and 0.5 (the default); eager
    # updates, also with the exchange applied one period late (overlap_steps == sync_every / fragments)
    "diloco-h4t1": _diloco(sync_every=4, overlap_steps=1, merge="mix", mixing_factor=0.0),
    "diloco-h4t1-mix": _diloco(sync_every=4, overlap_steps=1),
    "diloco-h4t1-eager": _diloco(sync_every=4, overlap_steps=1, merge="eager"),
    "diloco-h4t4-eager": _diloco(sync_every=4, overlap_steps=4, merge="eager"),
    "diloco-h4-sigterm-every-step": _diloco(sync_every=4, sigterm_check="step"),
    "diloco-h4f2t1": _diloco(sync_every=4, fragments=2, overlap_steps=1),
    "diloco-h4f2t2": _diloco(sync_every=4, fragments=2, overlap_steps=2, merge="eager"),
    # every argument at its default but the round's length
    "diloco-h4-defaults": _diloco(sync_every=4, defaults=True),
    # with DenseWarmup(steps=W) (WARMUP_STEPS): W steps of plain data parallelism, then the rounds
    "diloco-h2-w3": _diloco(sync_every=2),
    "diloco-h3-w7": _diloco(sync_every=3),
    "diloco-h3-w10": _diloco(sync_every=3),
    # two levels: dense inside groups of 2 ranks, DiLoCo across the groups
    "diloco-h1-g2": _diloco(sync_every=1, outer_optimizer=partial(torch.optim.SGD, lr=1.0), replica_group=2),
    "diloco-h2-g2": _diloco(sync_every=2, replica_group=2),
    # a compressor on the outer exchange (a fresh one per fit: it is training state)
    "diloco-h4-identity": lambda **kw: _diloco(sync_every=4, compressor=Identity())(**kw),
    "diloco-h4-topk": lambda **kw: _diloco(sync_every=4, compressor=TopK(ratio=0.05))(**kw),
    "diloco-h4-powersgd": lambda **kw: _diloco(sync_every=4, compressor=PowerSGD(rank=2))(**kw),
    "diloco-h4-qsgd": lambda **kw: _diloco(sync_every=4, compressor=QSGD())(**kw),
    "diloco-h4-efsignsgd": lambda **kw: _diloco(sync_every=4, compressor=EFSignSGD())(**kw),
    "diloco-h4-minmax8": lambda **kw: _diloco(sync_every=4, compressor=MinMax(bits=8))(**kw),
    "diloco-h4-minmax4": lambda **kw: _diloco(sync_every=4, compressor=MinMax(bits=4))(**kw),
    "diloco-h4-sparseloco": lambda **kw: _diloco(sync_every=4, compressor=SparseLoCo(ratio=0.03, chunk_size=256))(**kw),
    "diloco-h4f2t1-sparseloco": lambda **kw: _diloco(
        sync_every=4, fragments=2, overlap_steps=1, compressor=SparseLoCo(ratio=0.03, chunk_size=256)
    )(**kw),
    "diloco-h4f2t1-randomk": lambda **kw: _diloco(
        sync_every=4, fragments=2, overlap_steps=1, compressor=RandomK(ratio=0.1)
    )(**kw),
    "diloco-h3-powersgd": lambda **kw: _diloco(sync_every=3, compressor=PowerSGD(rank=2))(**kw),
    # LGC through its three stages in a few steps: dense for 2 steps, top-k while the autoencoder trains for 4, then the
    # code (the parameter-server variant, the all-reduce one with either encoder)
    "lgc-ps": lambda **kw: CompressedDDP(LGC(innovation_ratio=0.01, **_LGC_STAGES), min_compress_numel=64, **kw),
    "lgc-allreduce": lambda **kw: CompressedDDP(LGCAllReduce(**_LGC_STAGES), min_compress_numel=64, **kw),
    "lgc-allreduce-linear": lambda **kw: CompressedDDP(
        LGCAllReduce(linear_encoder=True, **_LGC_STAGES), min_compress_numel=64, **kw
    ),
}


#: the strategies above that run with ``DenseWarmup(steps=...)``, and its steps
WARMUP_STEPS = {"diloco-h2-w3": 3, "diloco-h3-w7": 7, "diloco-h3-w10": 10}


class ManualNet(TinyNet):
    """TinyNet with manual optimization: ``manual_backward`` and the optimizer's step in ``training_step``."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        optimizer = self.optimizers()
        optimizer.zero_grad()
        loss = super().training_step(batch, batch_idx)
        self.manual_backward(loss)
        optimizer.step()
        return loss


class FrozenNet(TinyNet):
    """TinyNet with its first convolution frozen (DDP leaves it out of its buckets)."""

    def __init__(self) -> None:
        super().__init__()
        self.net[0].requires_grad_(False)


class UnusedNet(TinyNet):
    """TinyNet with a head used on even steps only (``find_unused_parameters=True``)."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(10, 10)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        out = self(x)
        if batch_idx % 2 == 0:
            out = out + self.head(out)
        return nn.functional.cross_entropy(out, y)


class CheckpointedNet(TinyNet):
    """TinyNet whose convolutions are recomputed in the backward pass (activation checkpointing)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net[3:](checkpoint(self.net[:3], x, use_reentrant=False))


class NaNNet(TinyNet):
    """TinyNet whose loss is NaN on rank 1 at its sixth step (the second round of ``sync_every=4``)."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        if self.trainer.global_rank == 1 and self.trainer.global_step == 5:
            loss = loss * float("nan")
        return loss


class MaskedNet(TinyNet):
    """TinyNet whose logits are mixed by a causal softmax over a constant mask: a float buffer of ``0``/``-inf`` (as
    ``nn.Transformer.generate_square_subsequent_mask`` makes), or with ``boolean`` its bool twin, which builds the
    same float scores at every step. Both train to the same losses: DiLoCo must average neither."""

    def __init__(self, boolean: bool = False) -> None:
        super().__init__()
        causal = torch.triu(torch.ones(10, 10, dtype=torch.bool), diagonal=1)
        mask = causal if boolean else torch.zeros(10, 10).masked_fill(causal, float("-inf"))
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.net(x)
        if self.mask.dtype == torch.bool:
            scores = torch.zeros(10, 10).masked_fill(self.mask, float("-inf"))
        else:
            scores = torch.zeros(10, 10) + self.mask
        return logits + 0.1 * logits @ scores.softmax(-1).T


class ValNet(TinyNet):
    """TinyNet with a validation loop (16 held-out samples)."""

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self(x), y))

    def val_dataloader(self) -> DataLoader:
        return DataLoader(synthetic_classification(16, seed=1), batch_size=8)


def _small_data() -> TinyNet:
    """64 samples, 8 per batch: 4 steps per epoch on 2 ranks."""
    return TinyNet(n=64, batch_size=8)


class ScheduledNet(TinyNet):
    """``_small_data``'s TinyNet with SGD (momentum, weight decay) and a learning rate that halves every 3 steps;
    ``fused`` picks :class:`~lightning_gradcomp.optim.fused.FusedSGD` instead of torch's SGD."""

    def __init__(self, fused: bool) -> None:
        super().__init__(n=64, batch_size=8)
        self.fused = fused

    def configure_optimizers(self) -> Any:
        factory = FusedSGD if self.fused else torch.optim.SGD
        optimizer = factory(self.parameters(), lr=self.lr, momentum=0.9, weight_decay=1e-3)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class MuonNet(TinyNet):
    """``_small_data``'s TinyNet whose one optimizer is MuonAdamW: Muon on the two linear weights, AdamW on the rest."""

    def __init__(self) -> None:
        super().__init__(n=64, batch_size=8)

    def configure_optimizers(self) -> Any:
        return MuonAdamW(muon_param_groups(self), lr=0.02, adamw_lr=1e-3)


# epochs of _small_data, saving DIRPATH/RUN/last.ckpt at each epoch's end; tiny buckets so that the model spans
# several, and DDP's layout after a resume (one bucket, then rebuilt) differs from an uninterrupted run's
_EPOCHS = {"max_steps": -1, "enable_checkpointing": True}
_BUCKETS = {"bucket_cap_mb": 0.01}

# variant -> (model, Trainer arguments, strategy arguments, compiled)
VARIANTS: dict[str, tuple[Callable[[], TinyNet], dict, dict, bool]] = {
    "eager": (TinyNet, {}, {}, False),
    "compiled": (TinyNet, {}, {}, True),
    "accumulate2": (TinyNet, {"accumulate_grad_batches": 2}, {}, False),
    "bf16-true": (TinyNet, {"precision": "bf16-true"}, {}, False),
    "16-true": (TinyNet, {"precision": "16-true"}, {}, False),
    "static": (TinyNet, {}, {"static_graph": True, "gradient_as_bucket_view": True, **_BUCKETS}, False),
    "sparse": (SparseEmbeddingNet, {}, {}, False),
    "clip": (TinyNet, {"gradient_clip_val": 0.05}, {}, False),
    "fp64": (TinyNet, {"precision": "64-true"}, {}, False),
    "bf16-mixed": (TinyNet, {"precision": "bf16-mixed"}, {}, False),
    "manual": (ManualNet, {}, {}, False),
    "frozen": (FrozenNet, {}, {}, False),
    "unused": (UnusedNet, {}, {"find_unused_parameters": True}, False),
    "checkpointed": (CheckpointedNet, {}, {}, False),
    # the learning-rate finder (20 steps, its model and optimizer restored after them), then 4 steps of fit: through
    # Tuner.lr_find before fit, or as LearningRateFinder's callback inside fit; neither updates the learning rate
    "lr-find": (TinyNet, {"tune": "tuner"}, {}, False),
    "lr-find-callback": (TinyNet, {"tune": "callback"}, {}, False),
    "steps6": (TinyNet, {"max_steps": 6}, {}, False),
    "steps8": (TinyNet, {"max_steps": 8}, {}, False),
    "nan": (NaNNet, {"max_steps": 12}, {}, False),
    "mask": (MaskedNet, {"max_steps": 8}, {}, False),
    "boolmask": (partial(MaskedNet, boolean=True), {"max_steps": 8}, {}, False),
    "val": (ValNet, {"max_steps": 8, "val_check_interval": 3, "num_sanity_val_steps": 0}, {}, False),
    "epochs2": (_small_data, {**_EPOCHS, "max_epochs": 2}, _BUCKETS, False),
    "epochs4": (_small_data, {**_EPOCHS, "max_epochs": 4}, _BUCKETS, False),
    "muon-epochs2": (MuonNet, {**_EPOCHS, "max_epochs": 2}, _BUCKETS, False),
    "muon-epochs4": (MuonNet, {**_EPOCHS, "max_epochs": 4}, _BUCKETS, False),
    "bf16-epochs2": (_small_data, {**_EPOCHS, "max_epochs": 2, "precision": "bf16-true"}, _BUCKETS, False),
    "bf16-epochs4": (_small_data, {**_EPOCHS, "max_epochs": 4, "precision": "bf16-true"}, _BUCKETS, False),
    # ScheduledNet for 4 epochs: torch's SGD; FusedSGD; FusedSGD keeping every epoch's checkpoint, its learning rate
    # logged every step by LearningRateMonitor to DIRPATH/RUN/metrics.csv
    "sgd-scheduled": (partial(ScheduledNet, False), {"max_steps": -1, "max_epochs": 4}, _BUCKETS, False),
    "fused-scheduled": (partial(ScheduledNet, True), {"max_steps": -1, "max_epochs": 4}, _BUCKETS, False),
    "fused-scheduled-logged": (
        partial(ScheduledNet, True),
        {**_EPOCHS, "max_epochs": 4, "checkpointing": {"filename": "{epoch}", "save_top_k": -1}, "log_lr": True},
        _BUCKETS,
        False,
    ),
    # 3 epochs keeping every epoch's checkpoint (DIRPATH/RUN/epoch=E.ckpt), to resume from any of them with @epoch=E
    "epochs3-all": (
        _small_data,
        {**_EPOCHS, "max_epochs": 3, "checkpointing": {"filename": "{epoch}", "save_top_k": -1}},
        _BUCKETS,
        False,
    ),
    # a checkpoint every 3 steps, the older removed (save_top_k=1), last.ckpt a copy of the newest
    "every3": (
        _small_data,
        {
            **_EPOCHS,
            "max_epochs": 2,
            "checkpointing": {"filename": "{step}", "every_n_train_steps": 3, "save_top_k": 1, "save_last": True},
        },
        _BUCKETS,
        False,
    ),
    # a checkpoint per epoch, the older removed (save_top_k=1), last.ckpt a link to the newest
    "rotate": (
        _small_data,
        {**_EPOCHS, "max_epochs": 2, "checkpointing": {"filename": "{epoch}", "save_top_k": 1, "save_last": "link"}},
        _BUCKETS,
        False,
    ),
}


def run_name(run: str) -> str:
    """The folder of ``DIRPATH`` that records ``run``."""
    return run.replace(":", "-")


def train(run: str, root: str, devices: int) -> None:
    """One fit of ``run`` (``STRATEGY:VARIANT[+EARLIER]``), recorded in ``root/run_name(run)``."""
    spec, _, earlier = run.partition("+")
    name, variant = spec.split(":")
    make_model, trainer_kwargs, strategy_kwargs, compiled = VARIANTS[variant]
    dirpath = os.path.join(root, run_name(run))
    os.makedirs(dirpath, exist_ok=True)
    ckpt_path = None
    if earlier:
        earlier, _, saved_file = earlier.partition("@")
        saved_name, saved_variant, *edit = earlier.split(":")
        ckpt_path = os.path.join(root, run_name(f"{saved_name}:{saved_variant}"), f"{saved_file or 'last'}.ckpt")
        if edit:
            ckpt_path = _edited(ckpt_path, edit[0], dirpath)
    strategy = STRATEGIES[name](**strategy_kwargs)
    if ckpt_path is not None and type(strategy) is DDPStrategy:
        ckpt_path = checkpoint_file(ckpt_path)  # plain DDPStrategy reads one file: the one in a checkpoint directory
    # DiLoCo's monitor given before the recorder, whose on_fit_end then sees the monitor's totals
    monitor = [CompressionMonitor()] if isinstance(strategy, CompressedDDP) else []
    monitor += [OuterMonitor()] if isinstance(strategy, DiLoCo) else []
    monitor += [DenseWarmup(steps=WARMUP_STEPS[name])] if name in WARMUP_STEPS else []
    trainer_kwargs = dict(trainer_kwargs)
    tune = trainer_kwargs.pop("tune", None)
    finder = LearningRateFinder(num_training_steps=_LR_FIND_STEPS, update_attr=False)
    monitor += [finder] if tune == "callback" else []
    checkpointing = {"filename": "last", **trainer_kwargs.pop("checkpointing", {})}
    if trainer_kwargs.pop("log_lr", False):
        logging = {"logger": CSVLogger(dirpath, name="", version=""), "log_every_n_steps": 1}
        trainer_kwargs.update(logging, callbacks=[LearningRateMonitor()])
    record = RecordRounds(dirpath) if isinstance(strategy, DiLoCo) else RecordRanks(dirpath)
    strategy.checkpoint_io = RecordingCheckpointIO(dirpath)
    saving = [ModelCheckpoint(dirpath=dirpath, **checkpointing)] if trainer_kwargs.get("enable_checkpointing") else []
    trainer = pl.Trainer(
        **{
            "accelerator": "cpu",
            "devices": devices,
            "strategy": strategy,
            "max_steps": 4,
            "logger": False,
            "enable_checkpointing": False,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            **trainer_kwargs,
            "callbacks": [*trainer_kwargs.get("callbacks", []), *monitor, *saving, record],
        }
    )
    model = make_model()
    if tune == "tuner":
        found = Tuner(trainer).lr_find(model, num_training=_LR_FIND_STEPS, update_attr=False)
        _save_tuned(found, dirpath, trainer.global_rank)
    trainer.fit(torch.compile(model) if compiled else model, ckpt_path=ckpt_path)
    if tune == "callback":
        _save_tuned(finder.optimal_lr, dirpath, trainer.global_rank)


_LR_FIND_STEPS = 20


def _save_tuned(found: Any, dirpath: str, rank: int) -> None:
    """What the learning-rate finder found on this rank (it returned here): its suggestion and its curve."""
    record = {"suggestion": found.suggestion(), "lr": found.results["lr"], "loss": found.results["loss"]}
    torch.save(record, os.path.join(dirpath, f"tuned{rank}.pt"))


def _edited(ckpt_path: str, edit: str, dirpath: str) -> str:
    """A copy of the checkpoint at ``ckpt_path`` edited as ``edit`` says, in ``dirpath``; its path.

    ``stateless``: without the compressor state (as a checkpoint of plain ``DDPStrategy``: one file, also of a
    checkpoint directory). Each rank edits a copy of its own: no rank reads a file that another is writing.
    """
    saved = torch.load(checkpoint_file(ckpt_path), weights_only=False)  # the file, or the one in its directory
    if edit == "stateless":
        saved.pop("gradcomp", None)  # CompressedDDP's state
        saved.pop("diloco", None)  # DiLoCo's
    else:
        raise ValueError(f"unknown edit of a checkpoint: {edit!r}")
    edited = os.path.join(dirpath, f"{edit}-rank{os.environ.get('LOCAL_RANK', '0')}.ckpt")
    torch.save(saved, edited)
    return edited


class RecordingCheckpointIO(TorchCheckpointIO):
    """Lightning's checkpoint writer, which remembers the files this rank wrote, by their path relative to ``dirpath``
    (:class:`~tests.models.RecordRanks` and :class:`~tests.models.RecordRounds` save them)."""

    def __init__(self, dirpath: str) -> None:
        super().__init__()
        self.dirpath = dirpath
        self.written: list[str] = []

    def save_checkpoint(self, checkpoint: dict, path: Any, storage_options: Any = None) -> None:
        self.written.append(os.path.relpath(str(path), self.dirpath))
        super().save_checkpoint(checkpoint, path, storage_options=storage_options)


def assert_same_weights(a: list[dict], b: list[dict], what: str = "") -> None:
    """Every rank of run ``b`` ends with run ``a``'s parameters and buffers, bit for bit (records as :func:`run_fits`
    returns them; ``what`` names the comparison in a failure)."""
    assert len(a) == len(b)
    for rank, (x, y) in enumerate(zip(a, b)):
        same = all(torch.equal(x["state_dict"][k], y["state_dict"][k]) for k in x["state_dict"])
        assert same, f"{what}: rank {rank} differs" if what else f"rank {rank} differs"


def run_fits(dirpath: Any, devices: int, runs: list[str], optimize_ddp: str | None = None) -> tuple[int, str, dict]:
    """Launch this script under Lightning's default launcher: its return code, its output, and for each of ``runs``
    every rank's record (none when it failed)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = child_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1")
    for key in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE"):  # the launcher sets them for the ranks it starts
        env.pop(key, None)
    command = [sys.executable, "-m", "tests.fit_worker", str(dirpath), str(devices), *runs]
    if optimize_ddp is not None:
        command += ["--optimize-ddp", optimize_ddp]
    done = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    output = done.stdout + done.stderr
    if done.returncode:
        return done.returncode, output, {}
    records = {}
    for run in runs:
        folder = os.path.join(dirpath, run_name(run))
        records[run] = [torch.load(os.path.join(folder, f"rank{r}.pt"), weights_only=False) for r in range(devices)]
        for rank, record in enumerate(records[run]):
            tuned = os.path.join(folder, f"tuned{rank}.pt")
            if os.path.exists(tuned):
                record["tuned"] = torch.load(tuned, weights_only=False)
    return 0, output, records


if __name__ == "__main__":
    args = sys.argv[1:]
    if "--optimize-ddp" in args:
        at = args.index("--optimize-ddp")
        torch._dynamo.config.optimize_ddp = args[at + 1]
        del args[at : at + 2]
    root, devices, *runs = args
    torch.set_num_threads(1)
    for run in runs:
        train(run, root, int(devices))
