"""CompressedDDP inside Lightning's Trainer: two CPU processes on gloo."""

import math

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.tuner import Tuner
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from lightning_gradcomp import CompressedDDP, DiLoCo, compression_hook
from lightning_gradcomp.compressors import BF16, FP16, QSGD, Identity, PowerSGD, RandomK, TopK
from lightning_gradcomp.compressors.base import Layer, keep_count
from tests.fit_worker import assert_same_weights, run_fits
from tests.models import SparseEmbeddingNet, TinyNet, fit, synthetic_classification

SPAWN = {"start_method": "spawn"}


# One launch of tests/fit_worker.py (Lightning's default launcher, as a user's script runs) for the tests below that
# compare a configuration under plain DDPStrategy, Identity and a compressor: a launch costs seconds, a fit a fraction
# of one. Each fit is a fresh model, strategy and compressor, 4 optimizer steps.
FEATURES = ["clip", "fp64", "bf16-mixed", "manual", "frozen", "unused", "checkpointed"]
PRECISIONS = ["bf16-true", "16-true"]
LAUNCH = [
    # Lightning's learning-rate finder, then a fit (tests/fit_worker.py's lr-find variants). First: only the first fit
    # of a launch has the launcher that starts (and may stop) the other ranks; the later ones find them running
    *("identity:lr-find", "ddp:lr-find", "identity:lr-find-callback", "powersgd-r2:lr-find", "powersgd-r2:eager"),
    *(f"{strategy}:{variant}" for variant in FEATURES + PRECISIONS for strategy in ("ddp", "identity", "topk")),
    *(f"{strategy}:{variant}" for variant in ("eager", "accumulate2") for strategy in ("ddp", "identity")),
    *("ddp:static", "identity:static", "powersgd-r2:static"),
    *("ddp:sparse", "identity:sparse", "topk:sparse"),
]
# CompressedDDP's compressors of the formulas in _expected_bytes, 8 steps each (fit_worker's names; min 64 elements)
COMPRESSORS = {
    "identity": (Identity(), "identity-64"),
    "fp16": (FP16(), "fp16"),
    "bf16": (BF16(), "bf16"),
    "topk": (TopK(ratio=0.05), "topk"),
    "randomk": (RandomK(ratio=0.1), "randomk"),
    "powersgd": (PowerSGD(rank=2), "powersgd-r2"),
}
LAUNCH += [f"{run}:steps8" for _, run in COMPRESSORS.values()]


@pytest.fixture(scope="module")
def fits(tmp_path_factory):
    """Every rank's record of each run of ``LAUNCH``."""
    code, output, records = run_fits(tmp_path_factory.mktemp("fits"), 2, LAUNCH)
    assert code == 0, output[-3000:]
    return records


@pytest.mark.parametrize("variant", ["eager", "accumulate2"])
def test_identity_is_bitwise_plain_ddp(fits, variant):
    """Identity gives exactly DDPStrategy's weights, also with gradient accumulation (hook only on the sync step)."""
    ours = fits[f"identity:{variant}"]
    assert_same_weights(fits[f"ddp:{variant}"], ours)
    # one reduction per optimizer step, on the micro-batch that synchronises, never on the others
    accumulate = 2 if variant == "accumulate2" else 1
    assert ours[0]["total_steps"] == 4
    assert [s["reductions"] for s in ours[0]["steps"]] == [(i + 1) // accumulate for i in range(4 * accumulate)]


@pytest.mark.slow
def test_identity_is_bitwise_plain_ddp_at_3_ranks_under_the_spawn_launcher(tmp_path):
    """At 3 ranks scaling by ``1 / 3`` and dividing by 3 round differently (DDP's reducer scales)."""
    dense, _, dense_ranks = fit(DDPStrategy(**SPAWN), str(tmp_path / "dense"), devices=3)
    ours, _, our_ranks = fit(CompressedDDP(Identity(), **SPAWN), str(tmp_path / "ours"), devices=3)
    assert all(torch.equal(v, ours.state_dict()[k]) for k, v in dense.state_dict().items())  # the main process's
    assert_same_weights(dense_ranks, our_ranks)
    assert our_ranks[0]["total_steps"] == 6


@pytest.mark.parametrize("precision", PRECISIONS)
def test_16_bit_training_runs_as_plain_ddp_does_and_sends_16_bit_payloads(fits, precision):
    """With 16-bit gradients Identity is still bitwise DDPStrategy, the bytes counted are 2 per element, and TopK
    with its 16-bit residual keeps the replicas identical, sending 2-byte values next to its int32 indices."""
    dtype = {"bf16-true": torch.bfloat16, "16-true": torch.float16}[precision]
    dense, ours, ranks = (fits[f"{strategy}:{precision}"] for strategy in ("ddp", "identity", "topk"))
    assert_same_weights(dense, ours)
    assert ours[0]["params"].dtype == dtype
    numel = _dense_bytes(TinyNet()) // 4
    assert all(step["stats"].bytes_sent == step["stats"].bytes_dense == 2 * numel for step in ours[0]["steps"])

    topk = TopK(ratio=0.05)
    assert ranks[0]["params"].dtype == dtype
    assert torch.isfinite(ranks[0]["params"]).all()
    assert torch.equal(ranks[0]["params"], ranks[1]["params"]), "replicas diverged"
    assert ranks[0]["steps"][-1]["residuals"] > 0, "error feedback carries what was not sent"
    layers = [(p.shape, p.numel()) for p in TinyNet().parameters()]
    compressed = [n for i, (s, n) in enumerate(layers) if topk.compresses(Layer("", i, s), 64)]
    k = sum(keep_count(n, topk.ratio) for n in compressed)
    expected = 2 * (numel - sum(compressed)) + math.ceil(2 * k / 8) * 8 + math.ceil(4 * k / 8) * 8
    assert len(ranks[0]["steps"]) == 4
    for step in ranks[0]["steps"]:
        assert step["stats"].bytes_sent - step["stats"].bytes_guard == expected


def _dataset_loss(model):
    x, y = synthetic_classification(model.n).tensors
    with torch.no_grad():
        return torch.nn.functional.cross_entropy(model.train()(x), y).item()


def _dense_bytes(model):
    return sum(p.numel() for p in model.parameters()) * 4


def _expected_bytes(model, compressor, min_numel):
    """Payload bytes per step, from the formulas in docs/compressors.md (one bucket: the model is < 1 MB)."""
    layers = [(p.shape, p.numel()) for p in model.parameters()]
    compressed = [(s, n) for i, (s, n) in enumerate(layers) if compressor.compresses(Layer("", i, s), min_numel)]
    dense = sum(n for _, n in layers) - sum(n for _, n in compressed)
    if isinstance(compressor, Identity):
        return _dense_bytes(model)
    if isinstance(compressor, (FP16, BF16)):
        return sum(n for _, n in layers) * 2
    if isinstance(compressor, TopK):
        k = sum(keep_count(n, compressor.ratio) for _, n in compressed)
        return dense * 4 + 2 * math.ceil(4 * k / 8) * 8  # values and int32 indices, each 8-byte aligned
    if isinstance(compressor, RandomK):
        return dense * 4 + 4 * sum(keep_count(n, compressor.ratio) for _, n in compressed)
    if isinstance(compressor, PowerSGD):
        return dense * 4 + 4 * sum((s[0] + n // s[0]) * min(s[0], n // s[0], compressor.rank) for s, n in compressed)
    raise AssertionError(compressor)


@pytest.mark.parametrize("name", list(COMPRESSORS))
def test_every_compressor_trains_with_identical_replicas_and_logs_true_bytes(fits, name):
    compressor, run = COMPRESSORS[name]
    ranks = fits[f"{run}:steps8"]
    assert torch.equal(ranks[0]["params"], ranks[1]["params"]), "replicas diverged"
    assert ranks[0]["comm_hook"] == compression_hook.__qualname__  # registered on CPU/gloo too
    assert len(ranks[0]["steps"]) == 8
    model = TinyNet()
    model.load_state_dict(ranks[0]["state_dict"])
    assert _dataset_loss(model) < _dataset_loss(TinyNet()), "training must make progress"
    expected = _expected_bytes(TinyNet(), compressor, 64)
    for rank in ranks:
        for step in rank["steps"]:
            assert step["stats"].bytes_sent - step["stats"].bytes_guard == expected
            assert step["stats"].bytes_dense == _dense_bytes(TinyNet())
    metrics = ranks[0]["callback_metrics"]  # rank 0's, as the logger has them
    sent = expected + ranks[0]["steps"][-1]["stats"].bytes_guard  # the non-finite flags, counted as sent
    assert metrics["gradcomp/bytes_sent"].item() == sent
    received = ranks[0]["steps"][-1]["stats"].bytes_received  # at two ranks, what the other rank sent
    assert metrics["gradcomp/bytes_received"].item() == received
    # plain DDP's ring at two ranks sends and receives the buckets once each way
    ratio = 2 * _dense_bytes(TinyNet()) / (sent + received)
    assert metrics["gradcomp/compression_ratio"].item() == pytest.approx(ratio)
    last = ranks[0]["steps"][-1]["stats"]  # rank 0's last step, as the monitor logged it
    for key in ("encode_ms", "decode_ms"):
        logged = metrics[f"gradcomp/{key}"].item()
        assert logged > 0, f"{key}: the codec's time is measured"
        assert logged == pytest.approx(getattr(last, key), rel=1e-5), f"{key}: the logged time is the telemetry's"


def test_sparse_gradients_are_averaged_as_plain_ddp_averages_them(fits):
    """``nn.Embedding(sparse=True)``: DDP gives its sparse gradient a bucket of its own. Identity is bitwise
    DDPStrategy; with TopK the dense layers are compressed and the embedding's rows averaged as they are, replicas
    identical. Every step counts the rows each rank's batch touched (int64 index and 10 fp32 values each) as sent and
    as what plain DDP sends (the hook failed in the first backward pass before: as_strided on a sparse buffer)."""
    dense, ours, ranks = (fits[f"{strategy}:sparse"] for strategy in ("ddp", "identity", "topk"))
    assert_same_weights(dense, ours)
    initial = SparseEmbeddingNet().embedding.weight
    assert not torch.equal(dense[0]["state_dict"]["embedding.weight"], initial), "the embedding trained"

    net, row = TinyNet(), 8 + 10 * 4  # a row of the sparse gradient: its int64 index and 10 fp32 values
    for record in ours:
        rows = [row * n for n in record["touched_rows"]]
        assert [s["stats"].bytes_dense for s in record["steps"]] == [_dense_bytes(net) + r for r in rows]
        assert [s["stats"].bytes_sent for s in record["steps"]] == [_dense_bytes(net) + r for r in rows]
    assert ours[0]["touched_rows"] != ours[1]["touched_rows"], "the ranks' batches touch different rows"

    topk = TopK(ratio=0.05)
    assert torch.equal(ranks[0]["params"], ranks[1]["params"]), "replicas diverged"
    for record in ranks:
        sent = [s["stats"].bytes_sent - s["stats"].bytes_guard for s in record["steps"]]
        assert len(sent) == 4
        assert sent == [_expected_bytes(net, topk, 64) + row * n for n in record["touched_rows"]]


def test_static_graph_and_bucket_views_pass_through(fits):
    dense, ours, powersgd = (fits[f"{strategy}:static"] for strategy in ("ddp", "identity", "powersgd-r2"))
    assert_same_weights(dense, ours)
    for record in (ours[0], powersgd[0]):
        assert record["static_graph"]
        assert record["gradient_as_bucket_view"]
    assert torch.equal(powersgd[0]["params"], powersgd[1]["params"])
    assert len(powersgd[0]["steps"]) == 4
    assert all(s["stats"].compression_ratio > 1 for s in powersgd[0]["steps"])


@pytest.mark.slow
def test_a_compiled_model_trains_compressed_as_its_eager_self_does(tmp_path):
    """``trainer.fit(torch.compile(model))`` (Lightning's default launcher; its spawn launcher cannot pickle a
    compiled model, for DDPStrategy too): Identity is bitwise plain DDPStrategy on the compiled model, and TopK runs
    through the hook on every step, with identical replicas, TopK's bytes, and the eager run's weights up to the
    compiled kernels' float rounding."""
    code, output, runs = run_fits(tmp_path, 2, ["ddp:compiled", "identity:compiled", "topk:compiled", "topk:eager"])
    assert code == 0, output[-3000:]
    for dense, ours in zip(runs["ddp:compiled"], runs["identity:compiled"]):
        assert torch.equal(dense["params"], ours["params"])
    compiled, eager = runs["topk:compiled"], runs["topk:eager"]
    assert torch.equal(compiled[0]["params"], compiled[1]["params"]), "replicas diverged"
    assert compiled[0]["comm_hook"] == compression_hook.__qualname__
    assert compiled[0]["total_steps"] == 4
    expected = _expected_bytes(TinyNet(), TopK(ratio=0.05), 64)
    assert [s["stats"].bytes_sent - s["stats"].bytes_guard for s in compiled[0]["steps"]] == [expected] * 4
    assert not torch.equal(compiled[0]["params"], runs["ddp:compiled"][0]["params"]), "TopK sent less than all"
    torch.testing.assert_close(compiled[0]["params"], eager[0]["params"], rtol=1e-5, atol=1e-6)


def test_trainer_features_train_compressed_as_they_train_under_plain_ddp(fits):
    """What a user of ``DDPStrategy`` may turn on: gradient clipping, ``precision="64-true"`` and ``"bf16-mixed"``
    (autocast; the gradients stay float32), manual optimization, a frozen layer, a head unused on odd steps
    (``find_unused_parameters``), activation checkpointing (tests/fit_worker.py's variants). For each, Identity is
    bitwise plain ``DDPStrategy``, and TopK compresses every step with identical replicas."""
    for feature in FEATURES:
        dense, identity, topk = (fits[f"{strategy}:{feature}"] for strategy in ("ddp", "identity", "topk"))
        assert_same_weights(dense, identity, f"{feature}: identity")
        assert torch.equal(topk[0]["params"], topk[1]["params"]), f"{feature}: TopK's replicas diverged"
        assert topk[0]["total_steps"] == 4, feature
        assert all(s["stats"].compression_ratio > 2 for s in topk[0]["steps"]), feature
        assert not torch.equal(topk[0]["params"], dense[0]["params"]), f"{feature}: TopK sent less than all"
    assert fits["topk:fp64"][0]["params"].dtype == torch.float64
    frozen = "net.0.weight"
    initial = TinyNet().state_dict()[frozen]
    assert all(torch.equal(fits[f"{s}:frozen"][0]["state_dict"][frozen], initial) for s in ("ddp", "topk"))


def test_the_learning_rate_finder_returns_on_every_rank_with_plain_ddp_s_suggestion(fits):
    """``Tuner.lr_find`` under CompressedDDP returns on every rank (Lightning's tuner ends its ``fit`` with an exception
    the launcher must let through, not take for a failure); with Identity its curve and suggestion are bitwise
    plain DDP's. The fit that follows (here or after ``LearningRateFinder``'s search inside ``fit``) trains exactly as
    one without the search: the finder's restore of its checkpoint leaves no trace of its 20 steps."""
    dense = [rank["tuned"] for rank in fits["ddp:lr-find"]]
    assert dense[0]["suggestion"] is not None
    assert len(dense[0]["loss"]) == 20
    for run in ("identity:lr-find", "identity:lr-find-callback", "powersgd-r2:lr-find"):
        tuned = [rank.get("tuned") for rank in fits[run]]
        assert all(t is not None for t in tuned), f"{run}: a rank did not return from the finder"
        assert tuned[0]["suggestion"] == tuned[1]["suggestion"], run
        if run.startswith("identity"):
            assert tuned[0]["loss"] == dense[0]["loss"], f"{run}: the finder's curve is not plain DDP's"
            assert tuned[0]["suggestion"] == dense[0]["suggestion"], run
    assert_same_weights(fits["ddp:eager"], fits["ddp:lr-find"], "DDPStrategy after the finder")
    assert_same_weights(fits["identity:eager"], fits["identity:lr-find"], "Identity after the finder")
    assert_same_weights(fits["identity:eager"], fits["identity:lr-find-callback"], "Identity after the callback")
    assert_same_weights(fits["powersgd-r2:eager"], fits["powersgd-r2:lr-find"], "PowerSGD after the finder")
    assert not torch.equal(fits["powersgd-r2:eager"][0]["params"], fits["ddp:eager"][0]["params"]), "it compressed"


def test_the_batch_size_finder_refuses_every_distributed_strategy_as_it_refuses_ddp(tmp_path):
    """Lightning's batch-size finder does not run under a distributed strategy (each rank would try sizes of its own);
    CompressedDDP and DiLoCo get DDPStrategy's error, raised before anything runs."""
    for strategy in (DDPStrategy(), CompressedDDP(PowerSGD(rank=2)), DiLoCo()):
        trainer = Trainer(accelerator="cpu", devices=1, strategy=strategy, default_root_dir=tmp_path, logger=False)
        with pytest.raises(ValueError, match="not supported with distributed strategies"):
            Tuner(trainer).scale_batch_size(TinyNet())


@pytest.mark.slow
def test_a_python_reducer_is_refused_before_the_first_step(tmp_path):
    """``torch._dynamo.config.optimize_ddp = "python_reducer"`` makes DDP call communication hooks per parameter
    with ``(grad, param)`` instead of per bucket; the compression hook would fail in the first backward pass
    (``'tuple' object has no attribute 'buffer'``). It is refused when the model is wrapped, naming the setting; the
    other modes train."""
    code, output, _ = run_fits(tmp_path / "refused", 1, ["topk:eager"], "python_reducer")
    assert code != 0
    assert "ValueError: Expected a DistributedDataParallel model that reduces its gradients in buckets" in output
    assert "optimize_ddp = 'python_reducer'" in output
    assert "has no attribute 'buffer'" not in output
    accepted = "python_reducer_without_compiled_forward"
    code, output, runs = run_fits(tmp_path / "accepted", 1, ["topk:eager"], accepted)
    assert code == 0, output[-3000:]
    assert runs["topk:eager"][0]["total_steps"] == 4


class _SwitchAt(Callback):
    """Between steps, on every rank, what callbacks will do: TopK at steps 2-3, Identity at 4-5, TopK at 6, then off."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        step = trainer.global_step
        if step in (2, 6):
            trainer.strategy.compressor = TopK(ratio=0.05)
        if step == 4:
            trainer.strategy.compressor = Identity()
        if step == 7:
            trainer.strategy.compression_enabled = False


@pytest.mark.slow
def test_compressor_and_switch_can_change_between_steps(tmp_path):
    strategy = CompressedDDP(Identity(), min_compress_numel=64, **SPAWN)
    _, _, ranks = fit(strategy, str(tmp_path), callbacks=[_SwitchAt()], max_steps=8)
    for rank in ranks:
        ratios = [round(s["stats"].compression_ratio, 3) for s in rank["steps"]]
        assert ratios[:2] == [1.0, 1.0]
        assert all(r > 2 for r in ratios[2:4])
        assert ratios[4:6] == [1.0, 1.0]
        assert ratios[6] > 2
        assert ratios[7] == 1.0
        owed = [s["residuals"] for s in rank["steps"]]
        assert all(o > 0 for o in owed[2:4]), "top-k leaves an error-feedback residual"
        assert owed[4] == 0, "a compressor without error feedback pays the residual it inherits"
        assert owed[6] > 0
        assert owed[7] == 0, "switching compression off pays the residual into the dense step"
    assert torch.equal(ranks[0]["params"], ranks[1]["params"])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"ddp_comm_hook": allreduce_hook}, "ddp_comm_hook"),
        ({"ddp_comm_state": object()}, "ddp_comm_state"),
        ({"ddp_comm_wrapper": lambda h: h}, "ddp_comm_wrapper"),
        ({"model_averaging_period": 4}, "model_averaging_period"),
        ({"compressor": "powersgd"}, "compressor"),
        ({"compressor": PowerSGD}, "compressor"),
        ({"error_feedback": "yes"}, "error_feedback"),
        ({"min_compress_numel": -1}, "min_compress_numel"),
        ({"seed": 1.5}, "seed"),
        ({"reset_state_after": 0}, "reset_state_after"),
        ({"reset_state_after": True}, "reset_state_after"),
        ({"reset_state_after": "3"}, "reset_state_after"),
    ],
)
def test_bad_strategy_arguments_fail_before_training_naming_the_argument(kwargs, match):
    with pytest.raises(MisconfigurationException, match=f"`{match}`"):
        CompressedDDP(**kwargs)


def test_switch_setters_validate():
    strategy = CompressedDDP()
    with pytest.raises(MisconfigurationException, match="`compressor`"):
        strategy.compressor = "topk"
    with pytest.raises(MisconfigurationException, match="`compression_enabled`"):  # one exception type per layer
        strategy.compression_enabled = "no"


def test_ddp_arguments_pass_through():
    strategy = CompressedDDP(
        TopK(0.01),
        static_graph=True,
        gradient_as_bucket_view=True,
        bucket_cap_mb=5,
        process_group_backend="gloo",
        start_method="spawn",
        find_unused_parameters=False,
    )
    assert strategy._ddp_kwargs == {
        "static_graph": True,
        "gradient_as_bucket_view": True,
        "bucket_cap_mb": 5,
        "find_unused_parameters": False,
    }
    assert strategy.process_group_backend == "gloo"
    assert strategy._start_method == "spawn"
    assert isinstance(strategy.compressor, TopK)


def test_the_monitor_compressed_ddp_adds_gets_its_setup(tmp_path, monkeypatch, in_process_ddp):
    """Lightning calls the callbacks' ``setup`` before the strategy's: the monitor must be added before that."""
    from lightning.pytorch import Trainer

    from lightning_gradcomp.callbacks import CompressionMonitor

    set_up = []
    monkeypatch.setattr(CompressionMonitor, "setup", lambda self, trainer, pl_module, stage: set_up.append(stage))
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        strategy=CompressedDDP(TopK(0.1)),
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
    )
    trainer.fit(TinyNet())
    monitors = [cb for cb in trainer.callbacks if isinstance(cb, CompressionMonitor)]
    assert len(monitors) == 1
    assert set_up == ["fit"]


def _in_process_trainer(tmp_path, strategy, **kwargs):
    from lightning.pytorch import Trainer

    return Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
        **kwargs,
    )


def test_the_setup_line_counts_the_compressed_tensors_of_this_model(tmp_path, in_process_ddp, caplog):
    """The line logged at setup counts what the compressor takes, from ``min_compress_numel`` and the layers' shapes.

    TinyNet's weights: conv 144 and 4608 elements, linear 16384 and 320 (1-D tensors are never compressed). At the
    default threshold (1024) the two large weights are compressed, at 200 the linear head (320) joins them.
    """
    import logging

    total = sum(p.numel() for p in TinyNet().parameters())
    for threshold, tensors, numel in ((1024, 2, 4608 + 16384), (200, 3, 4608 + 16384 + 320)):
        caplog.clear()
        with caplog.at_level(logging.INFO):
            trainer = _in_process_trainer(tmp_path, CompressedDDP(TopK(0.1), min_compress_numel=threshold), max_steps=1)
            trainer.fit(TinyNet())
        lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("CompressedDDP: TopK")]
        assert lines == [
            f"CompressedDDP: TopK(ratio=0.1, transport='auto') compresses {tensors} of 10 parameter tensors"
            f" ({numel:,} of {total:,} elements; the rest are averaged densely); error feedback on; 1 process."
        ]


def test_a_cast_of_16_bit_gradients_is_refused_before_the_first_step(tmp_path, in_process_ddp):
    """``precision="bf16-true"`` with ``FP16()`` is refused at setup, naming `compressor`; switching to a cast after
    setup is refused the same way, and the compressor in force stays."""
    trainer = _in_process_trainer(tmp_path, CompressedDDP(FP16()), max_steps=2, precision="bf16-true")
    with pytest.raises(MisconfigurationException, match=r"`compressor` .*FP16\(\) sends float16.*torch\.bfloat16"):
        trainer.fit(TinyNet())
    assert trainer.global_step == 0

    refused = []

    class SwitchToACast(Callback):
        def on_train_start(self, trainer, pl_module):
            try:
                trainer.strategy.compressor = BF16()
            except MisconfigurationException as error:
                refused.append(str(error))

    strategy = CompressedDDP(TopK(ratio=0.1))
    trainer = _in_process_trainer(tmp_path, strategy, max_steps=2, precision="16-true", callbacks=[SwitchToACast()])
    trainer.fit(TinyNet())
    assert len(refused) == 1
    assert "BF16() sends bfloat16" in refused[0]
    assert "torch.float16" in refused[0]
    assert isinstance(strategy.compressor, TopK)
    assert trainer.global_step == 2


def test_error_feedback_that_can_grow_is_warned_about_when_fitting_starts(tmp_path, in_process_ddp):
    """``error_feedback=True`` with QSGD's defaults (Lemma 3.1 bound 3.2): one warning naming the bound; none at the
    default (error feedback off for QSGD)."""
    import warnings

    with pytest.warns(UserWarning, match=r"QSGD\(.*with error feedback on: .*3\.23 times"):
        _in_process_trainer(tmp_path, CompressedDDP(QSGD(), error_feedback=True), max_steps=1).fit(TinyNet())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _in_process_trainer(tmp_path, CompressedDDP(QSGD()), max_steps=1).fit(TinyNet())
    assert not [w for w in caught if "error feedback on" in str(w.message)]


def test_a_compressor_that_changes_dense_layers_warns_that_sparse_gradients_skip_it(tmp_path, in_process_ddp):
    """signSGD takes a sign step on the layers it averages densely; a sparse embedding's rows are averaged as plain
    DDP averages them instead, and fitting says so, naming the embedding. TopK changes no dense layer: no warning."""
    import warnings

    from lightning_gradcomp.compressors import SignSGD

    with pytest.warns(UserWarning, match=r"SignSGD\(.*sparse gradients of embedding are averaged as plain DDP"):
        _in_process_trainer(tmp_path, CompressedDDP(SignSGD()), max_steps=1).fit(SparseEmbeddingNet())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _in_process_trainer(tmp_path, CompressedDDP(TopK()), max_steps=1).fit(SparseEmbeddingNet())
        _in_process_trainer(tmp_path, CompressedDDP(SignSGD()), max_steps=1).fit(TinyNet())
    assert not [w for w in caught if "sparse gradients" in str(w.message)]


class _NaNOnce(TinyNet):
    """Rank 1's loss times NaN at step 2; non-finite steps are skipped the usual way (gradients zeroed)."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.global_rank == 1 and self.global_step == 2:
            loss = loss * float("nan")
        return loss

    def on_before_optimizer_step(self, optimizer):
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        if not all(bool(torch.isfinite(g).all()) for g in grads):
            for g in grads:
                g.zero_()


@pytest.mark.parametrize(
    "compressor", [TopK(ratio=0.05), pytest.param(PowerSGD(rank=2), marks=pytest.mark.slow)], ids=["topk", "powersgd"]
)
def test_one_nan_costs_one_step_and_is_counted(tmp_path, compressor):
    """One NaN step under Lightning: after it every step is finite again (a residual that kept the NaN once made 5 of 5
    later steps non-finite with TopK and PowerSGD); the monitor counts the step; replicas stay identical."""
    strategy = CompressedDDP(compressor, min_compress_numel=64, **SPAWN)
    model, trainer, ranks = fit(strategy, str(tmp_path), model=_NaNOnce(), max_steps=8)
    assert torch.equal(ranks[0]["params"], ranks[1]["params"])
    assert torch.isfinite(ranks[0]["params"]).all()
    for rank in ranks:
        assert [step["stats"].finite for step in rank["steps"]] == [step != 2 for step in range(8)]
    assert trainer.callback_metrics["gradcomp/nonfinite_steps"].item() == 1
    assert trainer.callback_metrics["gradcomp/state_resets"].item() == 0  # one non-finite step: nothing to reset


class _NaNThrice(_NaNOnce):
    """Rank 1's loss times NaN at steps 2, 3 and 4: three non-finite steps in a row."""

    def training_step(self, batch, batch_idx):
        loss = TinyNet.training_step(self, batch, batch_idx)
        if self.global_rank == 1 and self.global_step in (2, 3, 4):
            loss = loss * float("nan")
        return loss


@pytest.mark.slow
def test_three_non_finite_steps_in_a_row_reset_the_state_on_every_rank(tmp_path):
    """Under Lightning, with DDP's own buckets: after reset_state_after=3 non-finite steps in a row every rank starts
    its state afresh at the same step (a warning says so, the monitor counts it); replicas stay identical."""
    strategy = CompressedDDP(PowerSGD(rank=2), min_compress_numel=64, reset_state_after=3, **SPAWN)
    model, trainer, ranks = fit(strategy, str(tmp_path), model=_NaNThrice(), max_steps=8)
    assert torch.equal(ranks[0]["params"], ranks[1]["params"])
    assert torch.isfinite(ranks[0]["params"]).all()
    for rank in ranks:
        assert [step["stats"].finite for step in rank["steps"]] == [step not in (2, 3, 4) for step in range(8)]
    assert trainer.callback_metrics["gradcomp/nonfinite_steps"].item() == 3
    assert trainer.callback_metrics["gradcomp/state_resets"].item() == 1
