"""Accordion on real two-process training runs (digits, step LR decay) and its parts on their own."""

import copy
import functools
import io
import math
import os
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.callbacks import GradientAccumulationScheduler, ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from lightning_gradcomp import CompressedDDP
from lightning_gradcomp.callbacks import Accordion
from lightning_gradcomp.callbacks.accordion import LocalGradientSum, relative_changes
from lightning_gradcomp.compressors import BF16, Identity, Planned, PowerSGD, RandomK, TopK
from lightning_gradcomp.compressors.base import keep_count
from lightning_gradcomp.demo.digits import DigitsMLP, digits, fit
from tests.distributed import run_distributed

SPAWN = {"start_method": "spawn"}
MIN_NUMEL = 512  # the three weight matrices of the MLP are compressed, the biases go dense
EPOCHS, DECAY, INTERVAL, LOW, HIGH = 12, 7, 2, 4, 1


@functools.cache
def _shapes() -> tuple[tuple[str, torch.Size], ...]:
    return tuple((name, p.shape) for name, p in DigitsMLP(digits(n=8)[0]).named_parameters())


def _powersgd_bytes(levels: dict[str, int]) -> int:
    """Payload bytes of one step of the digits MLP under PowerSGD with these per-layer ranks (one bucket)."""
    total = 0
    for name, shape in _shapes():
        numel = shape.numel()
        if name in levels:
            n, m = shape[0], numel // shape[0]
            r = min(n, m, levels[name])
            assert (n + m) * r * 2.0 < n * m, "every tracked layer is compressed at both levels"
            total += 4 * (n + m) * r
        else:
            total += 4 * numel
    return total + 4  # the non-finite flag rides with P (fp32)


def _topk_bytes(levels: dict[str, float]) -> int:
    dense = k = 0
    for name, shape in _shapes():
        if name in levels:
            k += keep_count(shape.numel(), levels[name])
        else:
            dense += shape.numel()
    # values and int32 indices, each 8-byte aligned, and the non-finite flag (one more aligned word)
    return 4 * dense + 2 * math.ceil(4 * k / 8) * 8 + 8


def _accordion():
    return Accordion(interval=INTERVAL, low_compression_level=LOW, high_compression_level=HIGH)


@pytest.fixture(scope="module")
def powersgd_run(tmp_path_factory):
    """PowerSGD rank 4 / rank 1 under Accordion, lr x0.1 at epoch 7; then a resume from the end of epoch 3."""
    tmp = tmp_path_factory.mktemp("accordion")
    ckpt_dir = str(tmp / "ckpt")

    def model():
        return DigitsMLP(digits(n=512)[0], milestones=[DECAY], batch_size=16)

    def strategy():
        return CompressedDDP(PowerSGD(rank=HIGH), min_compress_numel=MIN_NUMEL, **SPAWN)

    checkpoints = ModelCheckpoint(dirpath=ckpt_dir, filename="{epoch}", save_top_k=-1, every_n_epochs=1)
    trainer, ranks = fit(
        model(),
        strategy(),
        str(tmp / "run"),
        callbacks=[_accordion(), checkpoints],
        max_epochs=EPOCHS,
        enable_checkpointing=True,
    )
    _, resumed = fit(
        model(),
        strategy(),
        str(tmp / "resumed"),
        callbacks=[_accordion()],
        max_epochs=EPOCHS,
        ckpt_path=os.path.join(ckpt_dir, "epoch=3.ckpt"),
    )
    return trainer, ranks, resumed


def test_decisions_follow_the_rule_and_every_rank_makes_the_same(powersgd_run):
    _, ranks, _ = powersgd_run
    history = ranks[0]["callbacks"]["Accordion"]["history"]
    assert history == ranks[1]["callbacks"]["Accordion"]["history"], "ranks must agree on every decision"
    assert [h["epoch"] for h in history] == list(range(EPOCHS))
    layers = list(history[0]["levels"])
    assert layers == ["net.0.weight", "net.2.weight", "net.4.weight"]
    norms = {h["epoch"]: h["norms"] for h in history}
    critical = dict.fromkeys(layers, True)  # start: low compression
    for h in history:
        e = h["epoch"]
        if h["lr_decay"]:
            critical = dict.fromkeys(layers, True)
        assert h["lr_decay"] == (e == DECAY), "the decay is detected at the epoch it takes effect"
        assert h["critical"] == critical, f"epoch {e}"
        assert h["levels"] == {name: LOW if critical[name] else HIGH for name in layers}, f"epoch {e}"
        assert all(v > 0 for v in h["norms"].values())
        if e % INTERVAL == 0:  # recompute the decision from the recorded norms
            previous = norms.get(e - INTERVAL)
            for name in layers:
                change = math.inf if previous is None else abs(previous[name] - norms[e][name]) / previous[name]
                assert h["changes"][name] == pytest.approx(change)
                critical[name] = change >= 0.5
        else:
            assert h["changes"] is None
        if h["lr_decay"]:  # the decay rule runs after the check and wins (the reference's order)
            critical = dict.fromkeys(layers, True)
        assert h["next_critical"] == critical


def test_low_compression_first_and_after_the_decay_high_in_between(powersgd_run):
    _, ranks, _ = powersgd_run
    levels = [h["levels"] for h in ranks[0]["callbacks"]["Accordion"]["history"]]
    low = [all(v == LOW for v in lv.values()) for lv in levels]
    high = [all(v == HIGH for v in lv.values()) for lv in levels]
    assert low[0], "the first epoch is critical"
    assert low[1], "the first check counts as critical"
    assert any(high[2:DECAY]), f"some epochs between warm-up and the decay compress every layer hard: {levels}"
    assert low[DECAY], "the learning-rate decay forces low compression"
    assert any(high[DECAY + 1 :]), "compression goes up again after the decay's critical regime"


def test_levels_are_applied_and_bytes_saved_against_static_low(powersgd_run):
    trainer, ranks, _ = powersgd_run
    history = ranks[0]["callbacks"]["Accordion"]["history"]
    for rank in ranks:
        for step in rank["steps"]:
            assert step["bytes_sent"] == _powersgd_bytes(history[step["epoch"]]["levels"]), f"step {step}"
    total = ranks[0]["total_bytes_sent"]
    static_low = len(ranks[0]["steps"]) * _powersgd_bytes(dict.fromkeys(history[0]["levels"], LOW))
    assert total == sum(s["bytes_sent"] for s in ranks[0]["steps"])
    assert total < 0.8 * static_low, f"Accordion sent {total} bytes, static low compression {static_low}"
    # the replicas stayed identical under switching levels
    assert all(torch.equal(ranks[0]["final"][k], ranks[1]["final"][k]) for k in ranks[0]["final"])
    # logged per layer (callback_metrics come back from the spawned rank 0)
    metrics = trainer.callback_metrics
    last = history[-1]
    for name in last["levels"]:
        assert metrics[f"accordion/level/{name}"].item() == last["levels"][name]
        assert metrics[f"accordion/critical/{name}"].item() == float(last["critical"][name])


def test_resume_restores_norms_and_decisions_exactly(powersgd_run):
    _, ranks, resumed = powersgd_run
    for rank in range(2):
        assert resumed[rank]["callbacks"]["Accordion"]["history"] == ranks[rank]["callbacks"]["Accordion"]["history"]
        for name, value in ranks[rank]["final"].items():
            assert torch.equal(value, resumed[rank]["final"][name]), f"rank {rank}: {name} differs after resume"


@pytest.fixture(scope="module")
def batch_size_run(tmp_path_factory):
    """TopK keep 99 % / 10 % and batch-size switching (x2 outside critical regimes), checked every epoch."""
    tmp = tmp_path_factory.mktemp("accordion-batch")
    model = DigitsMLP(digits(n=256)[0], milestones=[4], batch_size=16)
    strategy = CompressedDDP(TopK(ratio=0.1), min_compress_numel=MIN_NUMEL, **SPAWN)
    accordion = Accordion(interval=1, mode="both", batch_size_factor=2)
    _, ranks = fit(model, strategy, str(tmp), callbacks=[accordion], max_epochs=6)
    return ranks


def test_topk_ratios_and_batch_size_switch_with_the_regime(batch_size_run):
    ranks = batch_size_run
    history = ranks[0]["callbacks"]["Accordion"]["history"]
    assert history == ranks[1]["callbacks"]["Accordion"]["history"]
    micro_batches = 256 // 2 // 16
    seen = {"critical": False, "relaxed": False}
    done = 0  # optimizer steps before the epoch
    for h in history:
        any_critical = any(h["critical"].values())
        seen["critical" if any_critical else "relaxed"] = True
        assert h["accumulate_grad_batches"] == (1 if any_critical else 2)
        assert h["levels"] == {name: 0.99 if c else 0.1 for name, c in h["critical"].items()}
        steps = [s for s in ranks[0]["steps"] if s["epoch"] == h["epoch"]]
        optimizer_steps = steps[-1]["global_step"] - done
        done = steps[-1]["global_step"]
        assert len(steps) == micro_batches
        assert optimizer_steps == micro_batches // h["accumulate_grad_batches"], f"epoch {h['epoch']}"
        # one reduction per optimizer step, at the epoch's levels (micro-steps communicate nothing)
        reductions = [s["bytes_sent"] for i, s in enumerate(steps) if (i + 1) % h["accumulate_grad_batches"] == 0]
        assert reductions == [_topk_bytes(h["levels"])] * optimizer_steps
    assert seen == {"critical": True, "relaxed": True}, "the run must visit both regimes"
    assert history[4]["lr_decay"]
    assert all(history[4]["critical"].values())


# ------------------------------------------------------------------------------------------------------------------
# The local-gradient tap, on raw DDP (two processes): local, before the average, whole under accumulation
# ------------------------------------------------------------------------------------------------------------------
def _tap_under_ddp(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    reference = copy.deepcopy(model)
    ddp = DDP(model)
    sums = LocalGradientSum({n: p for n, p in model.named_parameters() if p.dim() > 1})
    sums.scale = 2.0  # two micro-batches; the loss is divided by 2 as Lightning does
    expected = {n: torch.zeros_like(p) for n, p in reference.named_parameters() if p.dim() > 1}
    g = torch.Generator().manual_seed(rank)
    for step in range(2):
        for micro in range(2):
            x, y = torch.randn(5, 8, generator=g), torch.randint(0, 4, (5,), generator=g)
            reference.zero_grad()
            nn.functional.cross_entropy(reference(x), y).backward()
            for n, p in reference.named_parameters():
                if n in expected:
                    expected[n] += p.grad
            if micro == 0:
                with ddp.no_sync():
                    (nn.functional.cross_entropy(ddp(x), y) / 2).backward()
            else:
                (nn.functional.cross_entropy(ddp(x), y) / 2).backward()
        averaged = {n: p.grad.clone() for n, p in model.named_parameters() if n in expected}
        model.zero_grad()
    sums.remove()
    return {
        "sums": {n: t.clone() for n, t in sums.sums.items()},
        "expected": expected,
        "norms": sums.norms(),
        "averaged": averaged,
    }


def test_tap_sums_the_local_gradient_before_ddp_averages_it():
    ranks = run_distributed(_tap_under_ddp)
    for r in ranks:
        for name, total in r["sums"].items():
            torch.testing.assert_close(total, r["expected"][name], rtol=1e-5, atol=1e-6)
            assert r["norms"][name] == pytest.approx(torch.linalg.vector_norm(r["expected"][name]).item(), rel=1e-5)
    # each rank's sum is its own (different data), unlike the averaged .grad DDP leaves
    for name in ranks[0]["sums"]:
        assert not torch.allclose(ranks[0]["sums"][name], ranks[1]["sums"][name])
        assert torch.equal(ranks[0]["averaged"][name], ranks[1]["averaged"][name])


# ------------------------------------------------------------------------------------------------------------------
# Configuration and state (no processes)
# ------------------------------------------------------------------------------------------------------------------
def test_relative_changes():
    assert relative_changes({"a": 3.0, "b": 1.0}, None) == {"a": math.inf, "b": math.inf}
    changes = relative_changes({"a": 3.0, "b": 1.0, "c": 2.0}, {"a": 2.0, "b": 0.0})
    assert changes == {"a": 0.5, "b": math.inf, "c": math.inf}


def _stub(strategy, module, callbacks=()):
    return SimpleNamespace(strategy=strategy, callbacks=list(callbacks), accumulate_grad_batches=1, is_global_zero=True)


@pytest.mark.parametrize(
    ("compressor", "levels"),
    [(PowerSGD(rank=1), (2, 1)), (TopK(ratio=0.1), (0.99, 0.1)), (RandomK(ratio=0.1), (0.99, 0.1))],
    ids=["powersgd", "topk", "randomk"],
)
def test_reference_default_levels_are_applied_per_layer(compressor, levels):
    module = DigitsMLP(digits(n=8)[0])
    strategy = CompressedDDP(compressor, min_compress_numel=MIN_NUMEL)
    accordion = Accordion()
    accordion.setup(_stub(strategy, module), module, "fit")
    assert accordion._layers == ["net.0.weight", "net.2.weight", "net.4.weight"]
    accordion.critical = {"net.0.weight": True, "net.2.weight": False, "net.4.weight": True}
    accordion._apply(_stub(strategy, module))
    low, high = levels
    assert strategy.compressor.layer_levels == {"net.0.weight": low, "net.2.weight": high, "net.4.weight": low}


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"interval": 0}, "`interval`"),
        ({"eta": 0}, "`eta`"),
        ({"mode": "rank"}, "`mode`"),
        ({"mode": "batch_size", "low_compression_level": 2}, "does not switch compression levels"),
        ({"batch_size_factor": 4}, "does not switch the batch size"),
        ({"mode": "both", "batch_size_factor": 1}, "`batch_size_factor`"),
        ({"lr_drop": 1.5}, "`lr_drop`"),
        ({"low_compression_level": [2]}, "`low_compression_level`"),
        ({"high_compression_level": float("nan")}, "`high_compression_level`"),
    ],
)
def test_bad_arguments_fail_at_construction(kwargs, match):
    with pytest.raises(MisconfigurationException, match=match):
        Accordion(**kwargs)


def test_setup_checks_the_strategy_and_the_levels():
    module = DigitsMLP(digits(n=8)[0])
    with pytest.raises(MisconfigurationException, match="requires `Trainer\\(strategy=CompressedDDP"):
        Accordion().setup(_stub(DDPStrategy(), module), module, "fit")
    with pytest.raises(MisconfigurationException, match="has no level to switch"):
        Accordion().setup(_stub(CompressedDDP(Identity()), module), module, "fit")
    Accordion(mode="batch_size").setup(_stub(CompressedDDP(Identity()), module), module, "fit")  # plain DDP + batch
    with pytest.raises(MisconfigurationException, match="must compress less"):
        Accordion(low_compression_level=1, high_compression_level=2).setup(
            _stub(CompressedDDP(PowerSGD(rank=1)), module), module, "fit"
        )
    with pytest.raises(MisconfigurationException, match="invalid"):
        Accordion(low_compression_level=1.5, high_compression_level=0.1).setup(
            _stub(CompressedDDP(TopK(0.1)), module), module, "fit"
        )
    with pytest.raises(MisconfigurationException, match="invalid"):  # a candidate's name, but no candidates
        Accordion(low_compression_level="high").setup(_stub(CompressedDDP(PowerSGD(rank=1)), module), module, "fit")
    planned = Planned({"dense": Identity(), "bf16": BF16(), "topk": TopK(0.1)})
    with pytest.raises(MisconfigurationException, match="name one of \\['dense', 'bf16', 'topk'\\]"):
        Accordion(low_compression_level="fp8").setup(_stub(CompressedDDP(planned), module), module, "fit")
    with pytest.raises(MisconfigurationException, match="less lossy candidate"):
        Accordion(low_compression_level="topk", high_compression_level="bf16").setup(
            _stub(CompressedDDP(planned), module), module, "fit"
        )
    stub = _stub(CompressedDDP(TopK(0.1)), module, [GradientAccumulationScheduler({0: 2})])
    with pytest.raises(MisconfigurationException, match="GradientAccumulationScheduler"):
        Accordion(mode="both").setup(stub, module, "fit")


def test_state_round_trips_through_a_weights_only_checkpoint():
    accordion = Accordion()
    accordion.norms = {0: {"w": 1.5}, 2: {"w": 0.5}}
    accordion.critical = {"w": False}
    accordion.history = [{"epoch": 0, "changes": {"w": math.inf}, "critical": {"w": True}}]
    accordion._epoch_lrs = [0.1]
    accordion._sums = SimpleNamespace(backward_passes=3, sums={"w": torch.ones(2, 2)})
    buffer = io.BytesIO()
    torch.save(accordion.state_dict(), buffer)
    buffer.seek(0)
    restored = Accordion()
    restored.load_state_dict(torch.load(buffer, weights_only=True))
    assert restored.norms == accordion.norms
    assert restored.critical == {"w": False}
    assert restored.history == accordion.history
    assert restored._epoch_lrs == [0.1]
    assert torch.equal(restored._pending_sums["w"], torch.ones(2, 2)), "a mid-epoch checkpoint keeps rank 0's sums"


class _Norms:
    """Stands in for rank 0's gradient sums: the norms each epoch ends with are set by the test."""

    def __init__(self):
        self.next, self.scale, self.backward_passes = {}, 1.0, 0

    def norms(self):
        return dict(self.next)

    def reset(self):
        pass

    def remove(self):
        pass


def _started_accordion(module, stub_module):
    """Accordion set up and started on a stub trainer, its gradient norms under the test's control."""
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    strategy = CompressedDDP(PowerSGD(rank=1), min_compress_numel=MIN_NUMEL)
    trainer = SimpleNamespace(
        strategy=strategy,
        callbacks=[],
        accumulate_grad_batches=1,
        is_global_zero=True,
        current_epoch=0,
        optimizers=[optimizer],
    )
    accordion = Accordion(interval=2, low_compression_level=LOW, high_compression_level=HIGH)
    accordion.setup(trainer, stub_module, "fit")
    accordion.on_train_start(trainer, stub_module)
    accordion._sums.remove()
    accordion._sums = fake = _Norms()
    return optimizer, strategy, trainer, accordion, fake


def test_rule_on_controlled_norms_boundaries_lr_decay_and_logging():
    """eta is inclusive, a zero old norm is critical, checks compare with `interval` epochs back, decays force low."""
    module = DigitsMLP(digits(n=8)[0])
    logged = {}
    stub_module = SimpleNamespace(
        named_parameters=module.named_parameters,
        automatic_optimization=True,
        log=lambda name, value, **kw: logged.__setitem__(name, value),
    )
    optimizer, strategy, trainer, accordion, fake = _started_accordion(module, stub_module)
    a, b, c = "net.0.weight", "net.2.weight", "net.4.weight"
    assert strategy.compressor.layer_levels == {a: LOW, b: LOW, c: LOW}
    epochs = {
        0: {a: 1.0, b: 1.0, c: 0.0},  # first check: critical
        1: {a: 9.0, b: 9.0, c: 9.0},  # not a check epoch
        2: {a: 1.5, b: 1.2, c: 1.0},  # vs epoch 0: 0.5 (critical: >= eta), 0.2 (high), old norm 0 (critical)
        3: {a: 1.0, b: 1.0, c: 1.0},  # starts with a learning-rate decay: all low for this epoch
        4: {a: 1.5, b: 2.4, c: 1.2},  # vs epoch 2: 0 (high), 1.0 (critical), 0.2 (high)
    }
    expected_after = {
        0: (LOW, LOW, LOW),
        1: (LOW, LOW, LOW),
        2: (LOW, HIGH, LOW),
        3: (LOW, LOW, LOW),
        4: (HIGH, LOW, HIGH),
    }
    for epoch, norms in epochs.items():
        trainer.current_epoch = epoch
        if epoch == 3:
            optimizer.param_groups[0]["lr"] = 0.01
        accordion.on_train_epoch_start(trainer, stub_module)
        if epoch == 3:
            assert strategy.compressor.layer_levels == {a: LOW, b: LOW, c: LOW}, "the decay acts at once"
        fake.next = norms
        accordion.on_train_epoch_end(trainer, stub_module)
        levels = strategy.compressor.layer_levels
        assert (levels[a], levels[b], levels[c]) == expected_after[epoch], f"after epoch {epoch}"
    assert [h["lr_decay"] for h in accordion.history] == [False, False, False, True, False]
    assert accordion.history[2]["changes"] == {a: 0.5, b: pytest.approx(0.2), c: math.inf}
    assert logged[f"accordion/level/{b}"] == LOW  # what epoch 4 ran at
    assert logged[f"accordion/norm_change/{b}"] == 1.0
    assert f"accordion/norm_change/{c}" in logged


def test_a_decay_at_a_check_epoch_is_not_undone_by_that_epochs_check():
    """The reference runs the decay rule after the regime check: low compression until the next check, not 1 epoch."""
    module = DigitsMLP(digits(n=8)[0])
    stub_module = SimpleNamespace(
        named_parameters=module.named_parameters, automatic_optimization=True, log=lambda *args, **kwargs: None
    )
    optimizer, strategy, trainer, accordion, fake = _started_accordion(module, stub_module)
    layers = list(strategy.compressor.layer_levels)
    steady = dict.fromkeys(layers, 1.0)  # norms that do not change: every check says "not critical"
    after = {}
    for epoch in range(6):
        trainer.current_epoch = epoch
        if epoch == 2:  # the decay takes effect at a check epoch
            optimizer.param_groups[0]["lr"] = 0.01
        accordion.on_train_epoch_start(trainer, stub_module)
        fake.next = steady
        accordion.on_train_epoch_end(trainer, stub_module)
        after[epoch] = set(strategy.compressor.layer_levels.values())
    assert after[0] == after[1] == {LOW}, "the first check (no earlier norm) is critical"
    assert after[2] == {LOW}, "the decay's own check must not switch back to high compression"
    assert after[3] == {LOW}, "low compression lasts until the next check"
    assert after[4] == after[5] == {HIGH}, "the next check raises compression again"
