"""The ready-made tasks the recipes use: data is deterministic and offline, and errors say what to do."""

import pytest
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn

from lightning_gradcomp.tasks import (
    CIFAR10DataModule,
    DigitsDataModule,
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
    ("name", "cls"), [("sgd", torch.optim.SGD), ("novograd", "NovoGrad"), ("fused_sgd", "FusedSGD"),
                      ("fused_adalomo", "FusedAdaLomo")],
)  # fmt: skip
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
