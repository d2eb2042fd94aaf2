"""PacTrain-style pruning: schedule, masks, the mask-compacting compressor, and training on two processes."""

import copy
import os
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn

from lightning_gradcomp import CompressedDDP, PacTrain
from lightning_gradcomp.compressors import Identity, MaskedCompressor, Masks, TopK
from lightning_gradcomp.compressors.base import Layer, layers_from_shapes
from lightning_gradcomp.engine.telemetry import Telemetry
from lightning_gradcomp.runtime.rank_state import checkpoint_file
from lightning_gradcomp.testing import simulate_reduce
from lightning_gradcomp.transforms.pactrain import magnitude_masks, prunable_parameters, sparsity_at
from tests.distributed import run_distributed
from tests.models import fit

# --------------------------------------------------------------------------------------------------------------------
# Schedule and masks
# --------------------------------------------------------------------------------------------------------------------


def test_cubic_and_linear_schedules():
    assert sparsity_at(9, 0.9, start=10, end=110) == 0.0
    assert sparsity_at(10, 0.9, start=10, end=110, initial=0.1) == pytest.approx(0.1)
    assert sparsity_at(60, 0.9, start=10, end=110) == pytest.approx(0.9 - 0.9 * 0.5**3)
    assert sparsity_at(60, 0.9, start=10, end=110, schedule="linear") == pytest.approx(0.45)
    assert sparsity_at(110, 0.9, start=10, end=110) == sparsity_at(10**6, 0.9, start=10, end=110) == 0.9
    assert sparsity_at(5, 0.9, start=5, end=5) == 0.9  # one-shot
    steps = [t for t in range(200) if PacTrain(start_step=10, end_step=105, frequency=20).is_update_step(t)]
    assert steps == [10, 30, 50, 70, 90, 105]


def test_element_masks_keep_the_largest_magnitudes_per_layer_and_never_revive():
    torch.manual_seed(0)
    w = {"a": torch.randn(20, 30), "b": torch.randn(7, 3, 3, 3)}
    masks = magnitude_masks(w, 0.75)
    for name, weight in w.items():
        n = weight.numel()
        assert int(masks[name].sum()) == n - int(0.75 * n)
        assert weight.abs()[masks[name]].min() >= weight.abs()[~masks[name]].max()
    # a pruned weight stays pruned even if it became large
    grown = {name: weight.clone() for name, weight in w.items()}
    grown["a"][~masks["a"]] = 100.0
    later = magnitude_masks(grown, 0.8, previous=masks)
    assert not (later["a"] & ~masks["a"]).any()
    assert int(later["a"].sum()) == 600 - int(0.8 * 600)


def test_channel_and_global_masks():
    torch.manual_seed(0)
    w = {"a": torch.randn(16, 8), "b": torch.randn(4, 2, 3, 3) * 10}
    masks = magnitude_masks(w, 0.5, granularity="channel")
    for name, weight in w.items():
        rows = masks[name].reshape(weight.shape[0], -1)
        assert (rows.all(1) | ~rows.any(1)).all()  # whole rows
        kept = rows.all(1)
        assert int(kept.sum()) == weight.shape[0] // 2
        norms = weight.reshape(weight.shape[0], -1).norm(dim=1)
        assert norms[kept].min() >= norms[~kept].max()
    glob = magnitude_masks(w, 0.5, scope="global")
    assert int(glob["a"].sum() + glob["b"].sum()) == 200 - 100
    assert glob["b"].float().mean() > glob["a"].float().mean()  # the large layer keeps more
    assert int(magnitude_masks({"a": torch.randn(3, 3)}, 0.99)["a"].sum()) == 1  # never an empty layer


def test_biases_normalisation_and_excluded_layers_are_not_pruned():
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.Flatten(), nn.LayerNorm(8), nn.Linear(8, 4), nn.Linear(4, 2)
    )
    assert list(prunable_parameters(model)) == ["0.weight", "4.weight", "5.weight"]
    assert list(prunable_parameters(model, exclude=["5.*"])) == ["0.weight", "4.weight"]


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"sparsity": 1.0}, "sparsity"),
        ({"sparsity": -0.1}, "sparsity"),
        ({"start_step": -1}, "start_step"),
        ({"frequency": 0}, "frequency"),
        ({"start_step": 5, "end_step": 4}, "end_step"),
        ({"initial_sparsity": 0.95}, "initial_sparsity"),
        ({"schedule": "exp"}, "schedule"),
        ({"granularity": "block"}, "granularity"),
        ({"scope": "global", "granularity": "channel"}, "scope"),
        ({"exclude": "fc.*"}, "exclude"),
        ({"dense_threshold": 2}, "dense_threshold"),
    ],
)
def test_bad_arguments_are_refused(kwargs, name):
    with pytest.raises(MisconfigurationException, match=f"`{name}`"):
        PacTrain(**kwargs)


# --------------------------------------------------------------------------------------------------------------------
# The mask-compacting compressor (simulated ranks: the hook's code path in one process)
# --------------------------------------------------------------------------------------------------------------------
SHAPES = [(16, 4, 3, 3), (48, 64), (96, 24), (30,), (24, 96)]


def _masks(dense_fraction=0.95):
    g = torch.Generator().manual_seed(1)
    rows = torch.rand(96, 1, generator=g) < 0.3
    return {
        "param0": torch.rand(SHAPES[0], generator=g) < 0.5,  # compacted elements
        "param1": torch.rand(SHAPES[1], generator=g) < 0.1,  # compacted elements
        "param2": rows.expand(SHAPES[2]).clone(),  # compacted rows
        "param4": torch.rand(SHAPES[4], generator=g) < dense_fraction,  # above the threshold: masked in place
    }  # param3 (a bias) has no mask: sent whole


def _telemetry(numel):
    """One Telemetry per rank, told the dense size of the step (as the hook does per bucket)."""
    out = [Telemetry(), Telemetry()]
    for t in out:
        t.add_bucket(4 * numel)
    return out


def _grads(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    numel = sum(layer.numel for layer in layers_from_shapes(SHAPES))
    return [torch.randn(numel, generator=g) for _ in range(n)]


def _masked_flat(masks, layers, tensor):
    out = tensor.clone()
    for layer in layers:
        if layer.name in masks:
            layer.view(out).mul_(masks[layer.name])
    return out


def test_compaction_averages_exactly_the_kept_entries_and_sends_only_them():
    masks = _masks()
    layers = layers_from_shapes(SHAPES)
    grads = _grads(2)
    telemetry = _telemetry(grads[0].numel())
    outs = simulate_reduce([MaskedCompressor(Identity(), masks) for _ in range(2)], grads, layers, telemetry=telemetry)
    expected = (_masked_flat(masks, layers, grads[0]) + _masked_flat(masks, layers, grads[1])) / 2
    for out in outs:
        torch.testing.assert_close(out, expected, rtol=0, atol=1e-7)  # the dense average of the masked gradients
    for layer in layers:  # pruned entries come back exactly zero
        if layer.name in masks:
            assert (layer.view(outs[0])[~masks[layer.name]] == 0).all()
    kept = sum(int(m.sum()) for n, m in masks.items() if n != "param4") + SHAPES[3][0] + 24 * 96
    assert telemetry[0].pop_step().bytes_sent == 4 * kept  # no indices; param4 goes whole (masked)


def test_compaction_does_not_depend_on_the_bucket_layout():
    masks = _masks()
    layers = layers_from_shapes(SHAPES)
    grads = _grads(2, seed=3)
    whole = simulate_reduce([MaskedCompressor(TopK(ratio=0.3), masks) for _ in range(2)], grads, layers)[0]
    # the same layers in two buckets, in another order
    first, second = [layers[3], layers[1]], [layers[0], layers[4], layers[2]]
    pieces = []
    for group in (first, second):
        relaid, offset = [], 0
        for layer in group:
            relaid.append(Layer(layer.name, layer.index, layer.shape, offset))
            offset += layer.numel
        inputs = [torch.cat([layer.flat(g) for layer in group]) for g in grads]
        out = simulate_reduce([MaskedCompressor(TopK(ratio=0.3), masks) for _ in range(2)], inputs, tuple(relaid))[0]
        pieces.extend((layer, relaid_layer.flat(out)) for layer, relaid_layer in zip(group, relaid))
    for layer, piece in pieces:
        torch.testing.assert_close(piece, layer.flat(whole), rtol=0, atol=0)


def test_inner_compressor_runs_on_the_compact_buffer():
    """Stacked top-k equals top-k applied to the compacted gradient, scattered back."""
    masks = _masks(dense_fraction=0.5)
    layers = layers_from_shapes(SHAPES)
    grads = _grads(2, seed=5)
    masked = MaskedCompressor(TopK(ratio=0.2), masks)
    outs = simulate_reduce([copy.deepcopy(masked) for _ in range(2)], grads, layers)
    from lightning_gradcomp.compressors.base import BucketContext

    layout = masked._layout(BucketContext(index=0, step=0, rank=0, world_size=2, layers=layers))
    compact = [masked._gather(g, layout) for g in grads]
    reference = simulate_reduce([TopK(ratio=0.2) for _ in range(2)], compact, layout.layers)[0]
    expected = masked._scatter(reference, layout, torch.empty_like(grads[0]))
    torch.testing.assert_close(outs[0], expected, rtol=0, atol=0)
    assert {entry.mode for entry in layout.entries} == {"elements", "rows", "whole"}


def test_dense_threshold_and_mask_updates():
    layers = layers_from_shapes([(10, 10)])
    masks = Masks({"param0": torch.arange(100).reshape(10, 10) % 10 != 0})  # 90% kept
    grads = _grads_for(layers, 2)
    for threshold, nbytes in ((0.95, 4 * 90), (0.85, 4 * 100)):
        telemetry = _telemetry(100)
        out = simulate_reduce(
            [MaskedCompressor(Identity(), masks, dense_threshold=threshold) for _ in range(2)],
            grads,
            layers,
            telemetry=telemetry,
        )[0]
        assert telemetry[0].pop_step().bytes_sent == nbytes
        assert (out.view(10, 10)[:, 0] == 0).all()  # masked in place or compacted: pruned entries are zero
    compressor = MaskedCompressor(Identity(), masks)
    key = compressor.plan_key()
    masks.update({"param0": torch.arange(100).reshape(10, 10) % 2 == 0})
    assert compressor.plan_key() != key  # the hook re-plans its buckets
    telemetry = _telemetry(100)
    simulate_reduce([compressor, copy.deepcopy(compressor)], grads, layers, telemetry=telemetry)
    assert telemetry[0].pop_step().bytes_sent == 4 * 50


def _grads_for(layers, n):
    g = torch.Generator().manual_seed(7)
    return [torch.randn(sum(layer.numel for layer in layers), generator=g) for _ in range(n)]


# --------------------------------------------------------------------------------------------------------------------
# Training on two processes
# --------------------------------------------------------------------------------------------------------------------
class _UnlaunchedDDP(CompressedDDP):
    """CompressedDDP over a process group started outside Lightning: its collectives, the group's world size."""

    world_size = property(lambda self: torch.distributed.get_world_size())
    root_device = property(lambda self: torch.device("cpu"))


def _check_masks(rank, world_size):
    trainer = SimpleNamespace(strategy=_UnlaunchedDDP())
    results = []
    for differ in (False, True):
        callback = PacTrain()
        callback.masks.update({"w": torch.arange(12).view(3, 4) % (2 + (rank if differ else 0)) == 0})
        try:
            callback._verify(trainer)
            results.append("same")
        except RuntimeError as error:
            results.append(str(error))
    return results


@pytest.mark.slow
def test_masks_that_differ_between_ranks_are_caught():
    for same, different in run_distributed(_check_masks):
        assert same == "same"
        assert "masks differ between ranks" in different


class _Watch(Callback):
    """After every step (and PacTrain's re-masking): are the pruned weights zero; the masks' density and checksum."""

    def __init__(self, dirpath):
        self.dirpath = dirpath
        self.steps = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        pactrain = next(cb for cb in trainer.callbacks if isinstance(cb, PacTrain))
        params = dict(pl_module.named_parameters())
        masks = pactrain.masks
        self.steps.append(
            {
                "step": trainer.global_step,
                "pruned_are_zero": all(bool((params[n][~masks[n]] == 0).all()) for n in masks),
                "kept": sum(masks.kept(n) for n in masks),
                "pruned": sum(masks[n].numel() - masks.kept(n) for n in masks),
                "masks": [masks[n].cpu().clone() for n in sorted(masks)],
            }
        )

    def on_train_end(self, trainer, pl_module):
        torch.save(self.steps, os.path.join(self.dirpath, f"watch{trainer.global_rank}.pt"))


def _digits_model():
    from lightning_gradcomp.demo.digits import DigitsNet

    return DigitsNet(lr=0.05)


CASES = {
    "identity-element": (None, {}),
    "topk-channel": (TopK(ratio=0.3), {"granularity": "channel"}),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_pruned_training_on_two_processes_then_resume(tmp_path, case):
    """Gradual pruning to 90% within the run: bytes per step follow the masks' density exactly, pruned weights stay
    zero after every step, masks and replicas are identical on both ranks; a resume mid-schedule is bitwise exact."""
    compressor, options = CASES[case]
    schedule = {"sparsity": 0.9, "start_step": 5, "end_step": 35, "frequency": 10, **options}

    def run(name, epochs, ckpt_path=None, checkpoints=()):
        dirpath = str(tmp_path / name)
        watch = _Watch(dirpath)
        _, _, ranks = fit(
            CompressedDDP(compressor, start_method="spawn"),
            dirpath,
            model=_digits_model(),
            max_steps=-1,
            max_epochs=epochs,
            callbacks=[PacTrain(**schedule), watch, *checkpoints],
            ckpt_path=ckpt_path,
            enable_checkpointing=bool(checkpoints),
        )
        return ranks, [torch.load(os.path.join(dirpath, f"watch{r}.pt"), weights_only=False) for r in range(2)]

    ckpt_dir = str(tmp_path / "ckpt")
    straight, watch = run(
        "straight", 3, checkpoints=[ModelCheckpoint(dirpath=ckpt_dir, filename="{epoch}", save_top_k=-1)]
    )
    assert torch.equal(straight[0]["params"], straight[1]["params"])
    for mine, other in zip(watch[0], watch[1]):
        assert all(torch.equal(a, b) for a, b in zip(mine["masks"], other["masks"]))
    assert all(s["pruned_are_zero"] for s in watch[0])
    final = watch[0][-1]
    assert final["pruned"] / (final["kept"] + final["pruned"]) == pytest.approx(0.9, abs=0.01)
    for record, seen in zip(straight[0]["steps"], watch[0]):
        stats = record["stats"]
        unpruned = stats.bytes_dense // 4 - seen["kept"] - seen["pruned"]  # biases, batch norm
        density = (seen["kept"] + unpruned) / (stats.bytes_dense // 4)
        if compressor is None:  # the gradients of pruned weights are never sent: bytes = density x dense
            assert stats.bytes_sent == pytest.approx(density * stats.bytes_dense, rel=0.01)
            assert stats.bytes_sent == 4 * (seen["kept"] + unpruned)
        else:  # top-k of the compact buffer: values and indices of 30% of the kept entries (+ dense biases)
            assert stats.bytes_sent < 0.75 * density * stats.bytes_dense + 4 * unpruned + 64
    if compressor is None:
        assert straight[0]["steps"][-1]["stats"].bytes_sent < 0.12 * straight[0]["steps"][-1]["stats"].bytes_dense

    path = os.path.join(ckpt_dir, "epoch=0.ckpt")  # 23 steps: in the middle of the pruning schedule
    saved = torch.load(checkpoint_file(path), weights_only=True)
    state = next(v for k, v in saved["callbacks"].items() if k.startswith("PacTrain"))
    assert state["last_update"] == 15
    assert state["masks"]["masks"]
    resumed, _ = run("resumed", 3, ckpt_path=path)
    for r in range(2):
        assert torch.equal(resumed[r]["params"], straight[r]["params"]), f"rank {r} differs after the resume"


@pytest.mark.slow
def test_accuracy_at_90_percent_sparsity_is_within_1_5_points_of_dense(tmp_path):
    """The short version of benchmarks/pactrain_accuracy.py (digits, 2 processes, 10 epochs instead of 30; the full
    table, where per-layer 90% is within 1.5 points too, is in docs/pactrain.md). Global magnitude pruning: at this
    short budget per-layer pruning leaves the 288-weight first layer 29 weights and is 1.1 points behind."""
    from benchmarks.pactrain_accuracy import run

    dense = run("dense", epochs=10, workdir=str(tmp_path))
    pruned = run("global-90", epochs=10, workdir=str(tmp_path))
    assert pruned["sparsity"] == pytest.approx(0.9, abs=0.001)
    assert pruned["bytes_sent"] < 0.11 * pruned["bytes_dense"]
    assert dense["accuracy"] > 95.0
    assert pruned["accuracy"] >= dense["accuracy"] - 1.5, (dense, pruned)
