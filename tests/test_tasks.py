"""The ready-made tasks the recipes use: data is deterministic and offline, and errors say what to do."""

import pytest
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn

from lightning_gradcomp.tasks import (
    CIFAR10DataModule,
    DigitsDataModule,
    GPTLanguageModel,
    ImageClassifier,
    LSTMLanguageModel,
    TextDataModule,
)


def test_digits_split_is_deterministic_and_label_noise_flips_exactly_the_reported_examples():
    clean, noisy = DigitsDataModule(seed=3), DigitsDataModule(seed=3, label_noise=0.1)
    clean.setup()
    noisy.setup()
    x_clean, y_clean = clean.train_set.tensors
    x_noisy, y_noisy = noisy.train_set.tensors
    assert torch.equal(x_clean, x_noisy)
    changed = torch.nonzero(y_clean != y_noisy).squeeze(1)
    assert torch.equal(changed.sort().values, noisy.flipped.sort().values)
    assert len(noisy.flipped) == round(0.1 * len(y_clean))
    assert len(clean.train_set) + len(clean.val_set) == 1797


BAD_DIGITS = [
    ({"batch_size": 0}, "batch_size"),
    ({"val_fraction": 1.0}, "val_fraction"),
    ({"label_noise": 1.0}, "label_noise"),
]


@pytest.mark.parametrize(("kwargs", "match"), BAD_DIGITS)
def test_digits_refuses_bad_arguments(kwargs, match):
    with pytest.raises(MisconfigurationException, match=f"`{match}`"):
        DigitsDataModule(**kwargs)


def test_cifar10_says_clearly_what_to_do_when_it_cannot_download(tmp_path, monkeypatch):
    import torchvision.datasets

    def offline(*args, **kwargs):
        raise OSError("<urlopen error [Errno -3] Temporary failure in name resolution>")

    monkeypatch.setattr(torchvision.datasets.CIFAR10, "__init__", offline)
    with pytest.raises(MisconfigurationException, match="could not be downloaded.*internet access.*quickstart"):
        CIFAR10DataModule(data_dir=str(tmp_path)).prepare_data()
    with pytest.raises(MisconfigurationException, match="`download` is false"):
        CIFAR10DataModule(data_dir=str(tmp_path), download=False).prepare_data()


def test_text_defaults_to_pythons_own_sources_and_predicts_the_next_byte():
    data = TextDataModule(max_bytes=50_000, seq_len=16)
    data.setup()
    x, y = data.train_set.tensors
    assert x.shape[1] == 16
    assert torch.equal(x[0, 1:], y[0, :-1])  # targets are the inputs shifted by one byte
    assert int(x.max()) < 256
    model = LSTMLanguageModel(hidden=32, num_layers=1, dropout=0.0)
    assert model(x[:2]).shape == (2, 16, 256)


def test_word_tokens_and_an_untied_model_give_a_row_sparse_embedding_gradient():
    data = TextDataModule(max_bytes=50_000, seq_len=16, tokens="words", vocab_size=500)
    data.setup()
    x, y = data.train_set.tensors
    assert torch.equal(x[0, 1:], y[0, :-1])
    assert int(x.max()) < 500
    model = LSTMLanguageModel(vocab_size=500, hidden=16, num_layers=1, dropout=0.0, tie_weights=False)
    nn.functional.cross_entropy(model(x[:2]).flatten(0, 1), y[:2].flatten()).backward()
    touched = model.embedding.weight.grad.abs().sum(1) > 0
    assert torch.equal(touched.nonzero().squeeze(1), torch.unique(x[:2]))


def test_classifier_refuses_an_unknown_architecture():
    with pytest.raises(MisconfigurationException, match="`arch`"):
        ImageClassifier(arch="resnet9000")
    assert ImageClassifier(arch="torchvision.resnet18")(torch.randn(2, 3, 32, 32)).shape == (2, 10)


@pytest.mark.parametrize(
    ("name", "cls"),
    [("sgd", torch.optim.SGD), ("novograd", "NovoGrad"), ("fused_sgd", "FusedSGD"), ("fused_adalomo", "FusedAdaLomo")],
)
def test_language_model_optimizer_choice(name, cls):
    kwargs = {"clip_grad_norm": 0.25} if name.startswith("fused_") else {}
    model = LSTMLanguageModel(hidden=8, num_layers=1, dropout=0.0, optimizer=name, lr=0.1, weight_decay=1e-4, **kwargs)
    optimizer = model.configure_optimizers()["optimizer"]
    assert type(optimizer).__name__ == (cls if isinstance(cls, str) else cls.__name__)
    assert optimizer.param_groups[0]["weight_decay"] == 1e-4
    if kwargs:
        assert optimizer.clip_grad_norm == 0.25


def test_language_model_refuses_fused_clipping_for_other_optimizers():
    with pytest.raises(MisconfigurationException, match="`clip_grad_norm`"):
        LSTMLanguageModel(hidden=8, optimizer="sgd", clip_grad_norm=0.25)
    with pytest.raises(MisconfigurationException, match="`optimizer`"):
        LSTMLanguageModel(hidden=8, optimizer="adam")


def test_gpt_has_a_few_million_parameters_and_is_causal():
    model = GPTLanguageModel()
    assert 3_000_000 < sum(p.numel() for p in model.parameters()) < 4_000_000
    assert model.model.head.weight is model.model.wte.weight, "output layer tied to the token embedding"
    x = torch.randint(0, 256, (2, 128), generator=torch.Generator().manual_seed(0))
    changed = x.clone()
    changed[:, 64:] = (changed[:, 64:] + 1) % 256
    model.eval()
    with torch.no_grad():
        before, after = model(x), model(changed)
    assert torch.equal(before[:, :64], after[:, :64]), "no position sees a later one"
    assert not torch.allclose(before[:, 64:], after[:, 64:])


def test_gpt_learns_the_next_byte_of_pythons_sources():
    torch.manual_seed(0)
    data = TextDataModule(max_bytes=20_000, seq_len=32, batch_size=8)
    data.setup()
    x, y = data.train_set.tensors[0][:8], data.train_set.tensors[1][:8]
    model = GPTLanguageModel(block_size=32, n_layer=1, n_head=2, n_embd=32, lr=3e-3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(40):
        loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(torch.log(torch.tensor(256.0)).item(), abs=0.3), "starts at chance"
    assert losses[-1] < 0.6 * losses[0]


def test_gpt_schedule_warms_up_linearly_then_decays_by_cosine_to_its_floor():
    from lightning_gradcomp.tasks.language import _warmup_cosine

    factors = [_warmup_cosine(step, warmup=4, total=20, floor=0.1) for step in range(25)]
    assert factors[:4] == pytest.approx([0.2, 0.4, 0.6, 0.8])
    assert factors[4] == pytest.approx(1.0)
    assert factors[12] == pytest.approx(0.55)  # half-way down the cosine
    assert factors[20:] == pytest.approx([0.1] * 5)
    assert all(a >= b for a, b in zip(factors[4:], factors[5:]))


@pytest.mark.parametrize(
    ("kwargs", "match"), [({"n_head": 3}, "`n_head` to divide `n_embd` \\(256\\)"), ({"lr": 0}, "`lr`")]
)
def test_gpt_refuses_bad_arguments(kwargs, match):
    with pytest.raises(MisconfigurationException, match=match):
        GPTLanguageModel(**kwargs)
