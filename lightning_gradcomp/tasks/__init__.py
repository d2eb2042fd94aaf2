"""Ready-made LightningModules and DataModules for the recipes in ``recipes/`` and the quickstart.

They are ordinary Lightning components: the recipes configure them through LightningCLI, and they are the way to
reproduce the papers' setups (CIFAR-10 ResNet-18 and VGG-19-BN, an LSTM language model, a GPT-style transformer) or
to try a compressor offline (scikit-learn's bundled digits).
"""

from lightning_gradcomp.tasks.classification import ImageClassifier
from lightning_gradcomp.tasks.data import CIFAR10DataModule, DigitsDataModule
from lightning_gradcomp.tasks.language import GPTLanguageModel, LSTMLanguageModel, TextDataModule

__all__ = [
    "CIFAR10DataModule",
    "DigitsDataModule",
    "GPTLanguageModel",
    "ImageClassifier",
    "LSTMLanguageModel",
    "TextDataModule",
]
