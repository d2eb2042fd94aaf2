"""TracIn: checkpoints during a two-process run, scores sharded over the ranks, parity with Captum's TracInCP."""

import csv
import os
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, SingleDeviceStrategy
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_gradcomp import CompressedDDP
from lightning_gradcomp.callbacks import TracIn
from lightning_gradcomp.compressors import PowerSGD
from lightning_gradcomp.demo.digits import DigitsMLP, digits, fit
from lightning_gradcomp.tracin.report import write_report
from lightning_gradcomp.tracin.scoring import (
    TracInScorer,
    detection_curve,
    load_tracin_checkpoint,
    save_tracin_checkpoint,
)

try:  # only the parity tests need Captum: they skip on their own when it is missing, the others still run
    import captum.influence as captum_influence
except ImportError:  # pragma: no cover - depends on the environment
    captum_influence = None
needs_captum = pytest.mark.skipif(captum_influence is None, reason="Captum (the reference implementation) is missing")

N, EPOCHS, DECAY, LR = 400, 6, 4, 0.05
RTOL = 1e-4  # the agreement asked of Captum parity


def _model(dataset):
    return DigitsMLP(dataset, hidden=(32,), lr=LR, milestones=[DECAY], batch_size=16)


def _relative_error(ours, reference):
    reference = reference.double()
    return ((ours.double() - reference).abs().max() / reference.abs().max()).item()


class _ShardedInfluence(pl.Callback):
    """After TracIn scored, every rank computes the proponent/opponent matrix of held-out digits (sharded, gathered)."""

    def __init__(self, tracin, dirpath):
        self.tracin, self.dirpath = tracin, dirpath

    def on_train_end(self, trainer, pl_module):
        matrix = self.tracin.scorer(pl_module, batch_size=64).influence(trainer.train_dataloader.dataset, _test_batch())
        torch.save(matrix, os.path.join(self.dirpath, f"influence{trainer.global_rank}.pt"))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Digits with 10 % flipped labels, trained with PowerSGD on two processes, a TracIn checkpoint every epoch."""
    tmp = tmp_path_factory.mktemp("tracin")
    dataset, flipped = digits(n=N, flip_fraction=0.1)
    tracin = TracIn(str(tmp / "tracin"), every_n_epochs=1, top_n=16, batch_size=128, show_progress=False)
    strategy = CompressedDDP(PowerSGD(rank=2), min_compress_numel=512, start_method="spawn")
    model = _model(dataset)
    probe = _ShardedInfluence(tracin, str(tmp))
    _, ranks = fit(model, strategy, str(tmp / "run"), callbacks=[tracin, probe], max_epochs=EPOCHS)
    influence = [torch.load(tmp / f"influence{r}.pt", weights_only=True) for r in range(2)]
    checkpoints = sorted(
        (os.path.join(tmp, "tracin", f) for f in os.listdir(tmp / "tracin") if f.endswith(".pt")),
        key=lambda p: int(p.rsplit("step=", 1)[1][:-3]),
    )
    return SimpleNamespace(
        model=model.eval(),
        dataset=dataset,
        flipped=flipped,
        ranks=ranks,
        checkpoints=checkpoints,
        report=str(tmp / "tracin" / "report"),
        influence=influence,
    )


def test_checkpoints_hold_the_synchronised_weights_and_the_learning_rate_in_force(run):
    assert len(run.checkpoints) == EPOCHS
    steps_per_epoch = N // 2 // 16 + 1  # 200 examples per rank, batches of 16 (the last one partial)
    for epoch, path in enumerate(run.checkpoints):
        saved = torch.load(path, weights_only=True)
        assert saved["epoch"] == epoch
        assert saved["global_step"] == (epoch + 1) * steps_per_epoch
        assert saved["learning_rate"] == pytest.approx(LR if epoch < DECAY else LR * 0.1), f"epoch {epoch}"
        # the weights after the epoch's last optimizer step: what RecordRun saw after that step, on every rank
        step = (epoch + 1) * steps_per_epoch - 1
        for rank in run.ranks:
            for name, value in saved["state_dict"].items():
                assert torch.equal(value, rank["weights"][step][name]), f"epoch {epoch}, {name}"
    # scoring loaded every checkpoint into the model and restored its own weights afterwards
    last = torch.load(run.checkpoints[-1], weights_only=True)["state_dict"]
    assert all(torch.equal(last[k], run.ranks[0]["final"][k]) for k in last)


def test_sharded_scores_are_gathered_on_every_rank_and_match_one_process(run):
    scores = run.ranks[0]["tracin_scores"]
    assert scores.shape == (N,)
    assert torch.equal(scores, run.ranks[1]["tracin_scores"])
    assert (scores > 0).all()
    single = TracInScorer(run.model, run.checkpoints, batch_size=64).self_influence(run.dataset)
    torch.testing.assert_close(scores, single, rtol=1e-5, atol=0)
    # the influence matrix too: each rank a shard of the training set, gathered in order
    matrix = TracInScorer(run.model, run.checkpoints, batch_size=64).influence(run.dataset, _test_batch())
    assert run.influence[0].shape == (6, N)
    assert torch.equal(run.influence[0], run.influence[1])
    torch.testing.assert_close(run.influence[0], matrix, rtol=1e-5, atol=1e-6 * matrix.abs().max().item())


def _captum(run, layers=None):
    return captum_influence.TracInCP(
        run.model,
        run.dataset,
        run.checkpoints,
        checkpoints_load_func=load_tracin_checkpoint,
        layers=layers,
        loss_fn=nn.CrossEntropyLoss(reduction="sum"),
        batch_size=100,
        sample_wise_grads_per_batch=True,
    )


def _test_batch():
    full, _ = digits()
    return full.tensors[0][N : N + 6], full.tensors[1][N : N + 6]


@needs_captum
def test_self_influence_and_influence_agree_with_captum(run):
    captum = _captum(run)
    reference = captum.self_influence(DataLoader(run.dataset, batch_size=100))
    assert _relative_error(run.ranks[0]["tracin_scores"], reference) < RTOL
    test = _test_batch()
    ours = TracInScorer(run.model, run.checkpoints, batch_size=100)
    assert _relative_error(ours.influence(run.dataset, test), captum.influence(test)) < RTOL
    for proponents in (True, False):
        indices, values = ours.top_influential(run.dataset, test, k=5, proponents=proponents)
        ref_indices, ref_values = captum.influence(test, k=5, proponents=proponents)
        assert torch.equal(indices, ref_indices)
        assert _relative_error(values, ref_values) < RTOL
        assert ((values > 0) if proponents else (values < 0)).all()


@needs_captum
@pytest.mark.parametrize("method", ["full", "last_layer"])
def test_layer_selection_and_last_layer_fast_path_agree_with_captum(run, method):
    reference = _captum(run, layers=["net.2"]).self_influence(DataLoader(run.dataset, batch_size=100))
    ours = TracInScorer(run.model, run.checkpoints, method=method, layers=["net.2"]).self_influence(run.dataset)
    assert _relative_error(ours, reference) < RTOL
    first = _captum(run, layers=["net.0"]).self_influence(DataLoader(run.dataset, batch_size=100))
    assert (
        _relative_error(TracInScorer(run.model, run.checkpoints, layers=["net.0"]).self_influence(run.dataset), first)
        < RTOL
    )


def test_last_layer_fast_path_on_proponents_too(run):
    test = _test_batch()
    fast = TracInScorer(run.model, run.checkpoints, method="last_layer").influence(run.dataset, test)
    full = TracInScorer(run.model, run.checkpoints, layers=["net.2"]).influence(run.dataset, test)
    torch.testing.assert_close(fast, full, rtol=1e-4, atol=1e-6 * full.abs().max().item())


def test_random_projection_preserves_scores_approximately_and_exactly_when_wide(run):
    exact = run.ranks[0]["tracin_scores"]
    d = sum(p.numel() for p in run.model.parameters())
    wide = TracInScorer(run.model, run.checkpoints, projection_dim=d).self_influence(run.dataset)
    assert torch.equal(wide, TracInScorer(run.model, run.checkpoints, batch_size=256).self_influence(run.dataset))
    projected = TracInScorer(run.model, run.checkpoints, projection_dim=512, seed=1).self_influence(run.dataset)
    relative = (projected - exact).abs() / exact
    assert relative.median() < 0.1, "a 512-dimensional JL projection keeps squared norms within ~6 %"
    assert torch.corrcoef(torch.stack([projected, exact]))[0, 1] > 0.98
    again = TracInScorer(run.model, run.checkpoints, projection_dim=512, seed=1).self_influence(run.dataset)
    assert torch.equal(projected, again), "the projection is a function of the seed"
    # last layer: the activation factor (33 wide) projected to 16, the logit gradient (10) kept
    last = TracInScorer(run.model, run.checkpoints, method="last_layer").self_influence(run.dataset)
    both = TracInScorer(run.model, run.checkpoints, method="last_layer", projection_dim=16).self_influence(run.dataset)
    assert torch.corrcoef(torch.stack([both, last]))[0, 1] > 0.8


def test_mislabeled_examples_rank_first(run):
    scores, losses = run.ranks[0]["tracin_scores"], run.ranks[0]["tracin_losses"]
    flagged = set(run.flipped)
    assert len(flagged) == N // 10
    tracin = detection_curve(torch.argsort(scores, descending=True).tolist(), flagged, [0.1, 0.2])
    loss = detection_curve(torch.argsort(losses, descending=True).tolist(), flagged, [0.1, 0.2])
    assert tracin[0] > 0.5, f"top 10 % holds {tracin[0]:.0%} of the flipped labels (random: 10 %)"
    assert tracin[1] > 0.8, f"top 20 % holds {tracin[1]:.0%} of the flipped labels (random: 20 %)"
    assert loss[1] > 0.4  # the baseline works too on this short run; docs/tracin.md compares them


def test_report_lists_every_example_and_draws_the_top_ones(run):
    scores, losses = run.ranks[0]["tracin_scores"], run.ranks[0]["tracin_losses"]
    with open(os.path.join(run.report, "self_influence.csv")) as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == N
    assert [int(r["rank"]) for r in rows] == list(range(N))
    values = [float(r["self_influence"]) for r in rows]
    assert values == sorted(values, reverse=True)
    for r in rows[:20]:
        i = int(r["index"])
        assert float(r["self_influence"]) == pytest.approx(scores[i].item(), rel=1e-8)
        assert int(r["label"]) == run.dataset[i][1].item()
        assert float(r["final_loss"]) == pytest.approx(losses[i].item(), rel=1e-8)
    with open(os.path.join(run.report, "top_self_influence.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    # the losses are the final model's
    x, y = run.dataset.tensors
    with torch.no_grad():
        expected = nn.functional.cross_entropy(run.model(x), y, reduction="none")
    torch.testing.assert_close(losses, expected.double(), rtol=1e-5, atol=1e-7)


# ------------------------------------------------------------------------------------------------------------------
# One process: the step cadence, the learning rate weighting, configuration
# ------------------------------------------------------------------------------------------------------------------
class _StepDecay(DigitsMLP):
    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


@pytest.mark.parametrize(("learning_rate", "expected"), [("mean", [0.1, 0.05, 0.025]), ("last", [0.1, 0.05, 0.025])])
def test_step_cadence_on_a_single_device(tmp_path, learning_rate, expected):
    dataset, _ = digits(n=96)
    tracin = TracIn(str(tmp_path), every_n_steps=2, learning_rate=learning_rate, score_on_train_end=False)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=6,
        callbacks=[tracin],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(_StepDecay(dataset, batch_size=16, shuffle=False))
    assert [os.path.basename(p) for p in tracin.checkpoints] == [
        "tracin-epoch=0-step=2.pt",
        "tracin-epoch=0-step=4.pt",
        "tracin-epoch=0-step=6.pt",
    ]
    # StepLR halves the rate every two steps: each checkpoint's interval ran at one rate
    assert [torch.load(p, weights_only=True)["learning_rate"] for p in tracin.checkpoints] == pytest.approx(expected)
    assert tracin.learning_rates == pytest.approx(expected)


def test_mean_learning_rate_over_an_interval_with_changing_rates(tmp_path):
    dataset, _ = digits(n=96)
    tracin = TracIn(str(tmp_path), every_n_steps=4, score_on_train_end=False)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=4,
        callbacks=[tracin],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(_StepDecay(dataset, batch_size=16, shuffle=False))
    assert tracin.learning_rates == pytest.approx([(0.1 + 0.1 + 0.05 + 0.05) / 4])


@needs_captum
def test_checkpoint_loader_has_captums_signature_and_captums_default_cannot_load_it(tmp_path):
    from captum.influence._utils.common import _load_flexible_state_dict

    model = DigitsMLP(digits(n=8)[0])
    path = str(tmp_path / "ckpt.pt")
    save_tracin_checkpoint(model, path, 0.25)
    other = DigitsMLP(digits(n=8)[0], hidden=(128, 64))
    with torch.no_grad():
        for p in other.parameters():
            p.zero_()
    assert load_tracin_checkpoint(other, path) == 0.25
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), other.state_dict().values()))
    with pytest.raises((RuntimeError, KeyError)):
        _load_flexible_state_dict(other, path)


def test_setup_accepts_whole_model_strategies_and_refuses_sharded_ones(tmp_path):
    tracin = TracIn(str(tmp_path))
    for strategy in (SingleDeviceStrategy("cpu"), DDPStrategy(), CompressedDDP()):
        tracin.setup(SimpleNamespace(strategy=strategy), None, "fit")
    with pytest.raises(MisconfigurationException, match="whole model"):
        tracin.setup(SimpleNamespace(strategy=FSDPStrategy()), None, "fit")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"every_n_epochs": 1, "every_n_steps": 5}, "not both"),
        ({"every_n_epochs": 0}, "`every_n_epochs`"),
        ({"every_n_steps": -1}, "`every_n_steps`"),
        ({"learning_rate": "max"}, "`learning_rate`"),
        ({"method": "fast"}, "`method`"),
        ({"loss": "hinge"}, "`loss`"),
        ({"projection_dim": 0}, "`projection_dim`"),
        ({"batch_size": 0}, "`batch_size`"),
        ({"top_n": -1}, "`top_n`"),
    ],
)
def test_bad_callback_arguments_fail_at_construction(tmp_path, kwargs, match):
    with pytest.raises(MisconfigurationException, match=match):
        TracIn(str(tmp_path), **kwargs)


def test_bad_scorer_arguments_name_the_argument(tmp_path):
    model = DigitsMLP(digits(n=8)[0])
    path = str(tmp_path / "c.pt")
    save_tracin_checkpoint(model, path, 1.0)
    with pytest.raises(ValueError, match="`layers`"):
        TracInScorer(model, [path], layers=["net.9"])
    with pytest.raises(ValueError, match="one `nn.Linear`"):
        TracInScorer(model, [path], method="last_layer", layers=["net"])
    with pytest.raises(ValueError, match="`checkpoints`"):
        TracInScorer(model, [])
    with pytest.raises(ValueError, match="`projection_dim`"):
        TracInScorer(model, [path], projection_dim=0)
    assert TracInScorer(model, str(tmp_path)).checkpoints == [path]  # a directory


def test_report_needs_an_image_shape_for_non_images(tmp_path):
    dataset = TensorDataset(torch.randn(4, 5), torch.arange(4))
    with pytest.raises(ValueError, match="`image_shape`"):
        write_report(str(tmp_path), torch.rand(4), dataset, top_n=2)
    _, png = write_report(str(tmp_path), torch.rand(4), dataset, top_n=2, image_shape=[1, 5])
    assert os.path.getsize(png) > 0
