"""Reference models of the papers, defined as in their code so that parameter counts can be checked."""

from lightning_gradcomp.models.cifar_resnet import CifarResNet18
from lightning_gradcomp.models.gpt import GPT
from lightning_gradcomp.models.vgg import VGG19BN

__all__ = ["GPT", "CifarResNet18", "VGG19BN"]
