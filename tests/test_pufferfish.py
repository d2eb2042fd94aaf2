"""Pufferfish: SVD factorization numerics, the paper's layer choices and counts, and factorization mid-fit."""

import copy
import os

import pytest
import torch
import torchvision
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn

from lightning_gradcomp import CompressedDDP, Pufferfish
from lightning_gradcomp.models import VGG19BN, CifarResNet18
from lightning_gradcomp.runtime.rank_state import checkpoint_file
from lightning_gradcomp.transforms import count_macs, count_parameters, factorize, svd_factors
from lightning_gradcomp.transforms.lowrank import FactorizedConv, FactorizedLinear
from lightning_gradcomp.transforms.pufferfish import apply_factorization, candidates, plan
from tests.distributed import run_distributed
from tests.models import fit


def full(m, n):
    return min(m, n)


def _close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------------------------------------
# Numerics of the factorization
# --------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("layer", "shape"),
    [
        (lambda: nn.Linear(20, 12), (5, 20)),
        (lambda: nn.Linear(12, 30, bias=False), (2, 7, 12)),
        (lambda: nn.Conv2d(6, 10, 3, stride=2, padding=1), (2, 6, 9, 9)),
        (lambda: nn.Conv2d(4, 8, (3, 5), padding="same", dilation=2, padding_mode="reflect"), (2, 4, 11, 11)),
        (lambda: nn.Conv1d(5, 7, 3, bias=False), (3, 5, 16)),
    ],
    ids=["linear", "linear-batched-nobias", "conv2d-strided", "conv2d-same-dilated-reflect", "conv1d"],
)
def test_full_rank_factors_reproduce_the_layer(layer, shape):
    torch.manual_seed(0)
    original = layer()
    x = torch.randn(shape)
    factored = factorize(original, full)
    _close(factored(x), original(x))
    _close(factored.weight, original.weight)


def test_full_rank_lstm_reproduces_the_lstm():
    torch.manual_seed(0)
    lstm = nn.LSTM(8, 12, num_layers=2, bidirectional=True, batch_first=True)
    factored = factorize(lstm, full)
    x = torch.randn(3, 7, 8)
    (out, (h, c)), (ref, (h_ref, c_ref)) = factored(x), lstm(x)
    _close(out, ref)
    _close(h, h_ref)
    _close(c, c_ref)
    names = {n for n, _ in factored.named_parameters()}
    assert "weight_ih_l0" not in names
    assert {"weight_ih_l0_u", "weight_hh_l1_reverse_v", "bias_ih_l0"} <= names
    out.sum().backward()  # gradients reach the factors
    assert factored.weight_hh_l0_u.grad is not None
    assert factored.weight_hh_l0_u.grad.abs().sum() > 0


@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"padding": True},
        {"attn_mask": True},
        {"attn_mask": "bool", "padding": True},
        {"need_weights": False, "attn_mask": True, "padding": True},
        {"average_attn_weights": False},
    ],
    ids=["plain", "padding", "float-mask", "bool-mask-padding", "no-weights", "per-head-weights"],
)
def test_full_rank_attention_reproduces_multihead_attention(batch_first, kwargs):
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(16, 4, batch_first=batch_first)
    factored = factorize(mha, full)
    q, k = torch.randn(5, 3, 16), torch.randn(7, 3, 16)
    if batch_first:
        q, k = q.transpose(0, 1), k.transpose(0, 1)
    call = {key: value for key, value in kwargs.items() if key not in ("padding", "attn_mask")}
    if kwargs.get("padding"):
        call["key_padding_mask"] = torch.zeros(3, 7, dtype=torch.bool)
        call["key_padding_mask"][0, -2:] = True
    if kwargs.get("attn_mask") is True:
        call["attn_mask"] = torch.randn(5, 7)
    elif kwargs.get("attn_mask") == "bool":
        call["attn_mask"] = torch.randn(5, 7) > 1
    (out, weights), (ref, ref_weights) = factored(q, k, k, **call), mha(q, k, k, **call)
    _close(out, ref)
    if ref_weights is None:
        assert weights is None
    else:
        _close(weights, ref_weights)


def test_full_rank_transformer_encoder_in_training_and_inference():
    torch.manual_seed(0)
    encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True), 2)
    factored = copy.deepcopy(encoder)
    layers = [name for name, _ in candidates(factored)]
    assert layers == [f"layers.{i}.{m}" for i in range(2) for m in ("self_attn", "linear1", "linear2")]
    apply_factorization(factored, layers, rank_ratio=1.0)
    x = torch.randn(3, 6, 16)
    padding = torch.zeros(3, 6, dtype=torch.bool)
    padding[1, -3:] = True
    _close(factored(x, src_key_padding_mask=padding), encoder(x, src_key_padding_mask=padding))
    encoder.eval(), factored.eval()
    with torch.no_grad():  # the inference fast path (nested tensors) of the reference; padded positions differ
        _close(factored(x, src_key_padding_mask=padding)[~padding], encoder(x, src_key_padding_mask=padding)[~padding])


def test_lower_rank_factors_are_the_best_rank_r_approximation():
    """Eckart-Young: the factors' product is the truncated SVD, whose error is the discarded singular values."""
    torch.manual_seed(0)
    w = torch.randn(40, 30, dtype=torch.float64)
    u, s, vh = torch.linalg.svd(w, full_matrices=False)
    for r in (1, 5, 17):
        left, right = svd_factors(w, r)
        best = u[:, :r] @ torch.diag(s[:r]) @ vh[:r]
        torch.testing.assert_close(left @ right, best, rtol=1e-10, atol=1e-10)
        assert torch.linalg.matrix_rank(left @ right) == r
        torch.testing.assert_close(torch.linalg.norm(w - left @ right) ** 2, (s[r:] ** 2).sum())
        # and it is better than another rank-r product, e.g. the truncation perturbed
        assert torch.linalg.norm(w - (left + 1e-3) @ right) > torch.linalg.norm(w - left @ right)
    conv = nn.Conv2d(8, 16, 3).double()
    factored = factorize(conv, lambda m, n: 4)
    matrix = conv.weight.reshape(16, -1)
    u, s, vh = torch.linalg.svd(matrix, full_matrices=False)
    torch.testing.assert_close(factored.weight.reshape(16, -1), u[:, :4] @ torch.diag(s[:4]) @ vh[:4])
    lstm = nn.LSTM(6, 10).double()
    factored = factorize(lstm, lambda m, n: 3)
    for g in range(4):  # every gate matrix on its own
        gate = lstm.weight_hh_l0[g * 10 : (g + 1) * 10]
        u, s, vh = torch.linalg.svd(gate, full_matrices=False)
        torch.testing.assert_close(
            factored.composed("weight_hh_l0")[g * 10 : (g + 1) * 10], u[:, :3] @ torch.diag(s[:3]) @ vh[:3]
        )


def test_rank_is_ratio_of_min_dimension_and_factor_shapes_follow_the_paper():
    seq = nn.Sequential(nn.Conv2d(64, 128, 3, padding=1, bias=False))
    apply_factorization(seq, ["0"], rank_ratio=0.25)
    factored = seq[0]
    assert isinstance(factored, FactorizedConv)
    # k x k conv c_in -> r, then 1 x 1 conv r -> c_out; r = min(128, 64 * 9) / 4
    assert factored.u.weight.shape == (32, 64, 3, 3)
    assert factored.v.weight.shape == (128, 32, 1, 1)
    linear = nn.Sequential(nn.Linear(512, 512))
    apply_factorization(linear, ["0"], rank_ratio=0.25)
    assert isinstance(linear[0], FactorizedLinear)
    assert linear[0].u.weight.shape == (128, 512)
    assert linear[0].u.bias is None
    assert linear[0].v.bias is not None


# --------------------------------------------------------------------------------------------------------------------
# Which layers, and the paper's models
# --------------------------------------------------------------------------------------------------------------------
PAPER_MODELS = {
    # (model, parameters, factorized parameters, factorized layers, input size); the counts are [calc] from these
    # definitions, which follow the paper's code (docs/pufferfish.md)
    "resnet18": (CifarResNet18, 11_173_834, 3_336_138, 14, 32),
    "vgg19": (VGG19BN, 20_560_330, 8_370_634, 9, 32),
    "resnet50": (lambda: torchvision.models.resnet50(), 25_557_032, 15_202_344, 10, 224),
}


@pytest.mark.parametrize("name", list(PAPER_MODELS))
def test_parameter_counts_of_the_papers_models(name):
    factory, params, factorized_params, factorized_layers, size = PAPER_MODELS[name]
    torch.manual_seed(0)
    model = factory()
    assert count_parameters(model) == params
    decisions = plan(model, 0.25)
    chosen = [d.name for d in decisions if d.factorize]
    assert len(chosen) == factorized_layers
    apply_factorization(model, chosen, 0.25, svd=False)  # the structure is what counts (and SVDs take seconds)
    assert count_parameters(model) == factorized_params
    full_macs, macs = count_macs(model, torch.randn(1, 3, size, size))
    assert macs < full_macs
    if name == "resnet18":  # conv1, layer1.0, shortcuts, linear stay; layers 1.1 to 4.1 are factorized
        assert not any(n.startswith(("layer1.0.", "linear", "conv1")) or "shortcut" in n for n in chosen)
        assert sorted({n.rsplit(".", 1)[0] for n in chosen}) == [
            "layer1.1",
            "layer2.0",
            "layer2.1",
            "layer3.0",
            "layer3.1",
            "layer4.0",
            "layer4.1",
        ]
    if name == "vgg19":
        assert chosen == [f"conv{i}" for i in range(10, 17)] + ["classifier.1", "classifier.4"]
    if name == "resnet50":
        assert all(n.startswith("layer4.") for n in chosen)
        assert "layer4.0.downsample.0" in chosen


def test_full_rank_patterns_positions_and_savings():
    model = nn.Sequential(nn.Conv2d(3, 16, 3), nn.Conv2d(16, 32, 3), nn.Linear(32, 32), nn.Linear(32, 4))
    names = lambda decisions: [d.name for d in decisions if d.factorize]  # noqa: E731
    assert names(plan(model, 0.25)) == ["1", "2"]  # first and last stay by default
    assert names(plan(model, 0.25, full_rank=[])) == ["0", "1", "2", "3"]
    assert names(plan(model, 0.25, full_rank=["1", -2])) == ["0", "3"]
    # at rank ratio 1/2 a square layer saves nothing: it stays full-rank, with the reason
    decisions = plan(model, 0.5, full_rank=[])
    assert {d.name: d.reason for d in decisions}["2"] == "no parameters saved at this rank"
    from lightning_gradcomp.transforms.pufferfish import unused_rules

    assert unused_rules(model, ["1", "conv*", 3, 4, -5]) == ["conv*", 4, -5]  # reported as likely typos
    tied = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 10))
    tied[1].weight = tied[0].weight
    assert candidates(tied) == []  # a shared weight cannot be factorized in one place only


def test_macs_count_conv_and_linear_exactly():
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.Flatten(), nn.Linear(8 * 6 * 6, 5))
    full_macs, macs = count_macs(model, torch.randn(2, 3, 6, 6))
    expected = 2 * (8 * 36 * 3 * 9 + 5 * 288)
    assert full_macs == macs == expected
    apply_factorization(model, ["0", "2"], rank_ratio=0.25)  # r = 6 for the conv (min(8, 27) = 8 -> 2), 1 for fc
    full_after, after = count_macs(model, torch.randn(2, 3, 6, 6))
    assert full_after == expected
    assert after == 2 * (36 * (2 * 27 + 8 * 2) + 1 * (288 + 5))


def test_bad_arguments_are_refused():
    for kwargs, name in [
        ({"warmup_epochs": -1}, "warmup_epochs"),
        ({"warmup_epochs": 1.5}, "warmup_epochs"),
        ({"warmup_epochs": 1, "rank_ratio": 0}, "rank_ratio"),
        ({"warmup_epochs": 1, "rank_ratio": 1.5}, "rank_ratio"),
        ({"warmup_epochs": 1, "full_rank": "conv1"}, "full_rank"),
        ({"warmup_epochs": 1, "keep_lr_schedule": 1}, "keep_lr_schedule"),
    ]:
        with pytest.raises(MisconfigurationException, match=f"`{name}`"):
            Pufferfish(**kwargs)


def test_structure_restores_outside_a_trainer():
    """A factorized checkpoint loads for inference: rebuild the structure from its record, then load the weights."""
    torch.manual_seed(0)
    model = CifarResNet18()
    callback = Pufferfish(warmup_epochs=0)
    callback.restore_structure(model, {"format": 1, "layers": ["layer4.1.conv2", "layer3.0.conv1"], "rank_ratio": 0.25})
    state = copy.deepcopy(model.state_dict())
    fresh = CifarResNet18()
    callback.restore_structure(fresh, callback.structure_state())
    fresh.load_state_dict(state)  # strict: the structures match
    x = torch.randn(2, 3, 32, 32)
    model.eval(), fresh.eval()
    torch.testing.assert_close(fresh(x), model(x), rtol=0, atol=0)


# --------------------------------------------------------------------------------------------------------------------
# Mid-training factorization under CompressedDDP, two processes
# --------------------------------------------------------------------------------------------------------------------
class _Record(Callback):
    """What each rank saw: learning rates, the optimizer's parameters, the structure, Pufferfish's own report."""

    def __init__(self, dirpath):
        self.dirpath = dirpath
        self.lrs = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])

    def on_train_end(self, trainer, pl_module):
        pufferfish = next(cb for cb in trainer.callbacks if isinstance(cb, Pufferfish))
        optimized = {id(p) for group in trainer.optimizers[0].param_groups for p in group["params"]}
        torch.save(
            {
                "lrs": self.lrs,
                "optimizer_has_every_parameter": optimized == {id(p) for p in pl_module.parameters()},
                "ddp_wraps_module": trainer.strategy.model.module is pl_module,
                "lightning_optimizer_wraps_it": trainer.strategy._lightning_optimizers[0].optimizer
                is trainer.optimizers[0],
                "factorized": [
                    n for n, m in pl_module.named_modules() if isinstance(m, (FactorizedConv, FactorizedLinear))
                ],
                "replicas_identical": pufferfish.replicas_identical,
                "report": dict(pufferfish.report),
                "metrics": {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("pufferfish/")},
            },
            os.path.join(self.dirpath, f"extra{trainer.global_rank}.pt"),
        )


def _digits_model(epochs):
    from lightning_gradcomp.demo.digits import DigitsNet

    return DigitsNet(epochs=epochs, lr=0.05)


def _fit(tmp_path, name, epochs, callbacks=(), **kwargs):
    dirpath = str(tmp_path / name)
    record = _Record(dirpath)
    model, trainer, ranks = fit(
        CompressedDDP(start_method="spawn"),
        dirpath,
        model=_digits_model(4),
        max_steps=-1,
        max_epochs=epochs,
        callbacks=[*callbacks, record],
        **kwargs,
    )
    extra = [torch.load(os.path.join(dirpath, f"extra{r}.pt"), weights_only=False) for r in range(2)]
    return model, ranks, extra


def _epoch_losses(record, steps_per_epoch):
    losses = [s["loss"] for s in record["steps"]]
    return [sum(losses[i : i + steps_per_epoch]) / steps_per_epoch for i in range(0, len(losses), steps_per_epoch)]


@pytest.mark.slow
def test_factorization_mid_training_with_two_processes_then_resume(tmp_path):
    """Full-rank epoch 0, factorized from epoch 1; replicas identical; loss keeps falling; the LR schedule goes on;
    a checkpoint written after the factorization resumes into the factorized model, bitwise like the straight run."""
    ckpt_dir = str(tmp_path / "ckpt")
    checkpoints = ModelCheckpoint(dirpath=ckpt_dir, filename="{epoch}", save_top_k=-1)
    model, straight, extra = _fit(
        tmp_path, "straight", 4, [Pufferfish(warmup_epochs=1), checkpoints], enable_checkpointing=True
    )
    for r in range(2):
        assert extra[r]["replicas_identical"] is True, "the SVD factors came out bitwise equal on both ranks"
        assert extra[r]["optimizer_has_every_parameter"]
        assert extra[r]["ddp_wraps_module"]
        assert extra[r]["factorized"] == ["conv2", "fc1"]  # conv1 (first) and fc2 (last) stay full-rank
    assert straight[0]["comm_hook"] == straight[1]["comm_hook"]
    assert "compression_hook" in straight[0]["comm_hook"]
    assert torch.equal(straight[0]["params"], straight[1]["params"])
    steps_per_epoch = len(straight[0]["steps"]) // 4
    losses = _epoch_losses(straight[0], steps_per_epoch)
    assert losses[3] < losses[2] < losses[1] < losses[0], losses
    # the cosine schedule over all 4 epochs went on through the rebuild instead of restarting
    lrs = extra[0]["lrs"]
    expected = [0.05 * (1 + torch.cos(torch.tensor(torch.pi * t / len(lrs))).item()) / 2 for t in range(len(lrs))]
    torch.testing.assert_close(torch.tensor(lrs), torch.tensor(expected), rtol=1e-6, atol=1e-9)
    # spawn: the main process's model was rebuilt factorized before rank 0's weights were copied into it
    assert torch.equal(torch.cat([p.detach().flatten() for p in model.parameters()]), straight[0]["params"])
    report = extra[0]["report"]
    assert report["params"] < report["params_full_rank"]
    assert report["macs"] < report["macs_full_rank"]
    assert extra[0]["metrics"]["pufferfish/params"] == report["params"]

    path = os.path.join(ckpt_dir, "epoch=1.ckpt")
    saved = torch.load(checkpoint_file(path), weights_only=True)
    assert saved["gradcomp_transforms"]["Pufferfish"]["layers"] == ["conv2", "fc1"]
    assert "conv2.u.weight" in saved["state_dict"]
    _, resumed, resumed_extra = _fit(tmp_path, "resumed", 4, [Pufferfish(warmup_epochs=1)], ckpt_path=path)
    for r in range(2):
        assert resumed_extra[r]["factorized"] == ["conv2", "fc1"]
        assert torch.equal(resumed[r]["params"], straight[r]["params"]), f"rank {r} differs after the resume"
    torch.testing.assert_close(
        torch.tensor(resumed_extra[0]["lrs"]), torch.tensor(lrs[2 * steps_per_epoch :]), rtol=0, atol=0
    )


class _UnlaunchedDDP(CompressedDDP):
    """CompressedDDP over a process group started outside Lightning: its collectives, the group's world size."""

    world_size = property(lambda self: torch.distributed.get_world_size())
    root_device = property(lambda self: torch.device("cpu"))


def _replica_check(rank, world_size):
    strategy = _UnlaunchedDDP()
    same = torch.arange(6.0)
    return strategy.identical_on_all_ranks([same]), strategy.identical_on_all_ranks([same, same + rank * 1e-7])


@pytest.mark.slow
def test_the_replica_check_sees_a_tiny_difference():
    for same, different in run_distributed(_replica_check):
        assert same is True
        assert different is False


@pytest.mark.slow
def test_factorized_from_the_first_step(tmp_path):
    model, ranks, extra = _fit(tmp_path, "step0", 1, [Pufferfish(warmup_epochs=0, full_rank=["conv1"])])
    assert extra[0]["factorized"] == ["conv2", "fc1", "fc2"]
    assert torch.equal(ranks[0]["params"], ranks[1]["params"])
    assert ranks[0]["params"].numel() == count_parameters(model) == extra[0]["report"]["params"]
    # every step after the factorization sent the factorized model's gradients: fewer bytes than full-rank
    assert all(s["stats"].bytes_sent == 4 * count_parameters(model) for s in ranks[0]["steps"])
