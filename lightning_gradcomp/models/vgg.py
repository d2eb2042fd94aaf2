"""The CIFAR-10 VGG-19-BN of the Pufferfish paper's code (``lowrank_vgg.py``: ``FullRankVGG19``).

Wang, Agarwal & Papailiopoulos, "Pufferfish: Communication-efficient Models At No Extra Cost", MLSys 2021
(github.com/hwang595/Pufferfish). Sixteen 3x3 convolutions without bias, each followed by batch norm and ReLU, max
pooling after convolutions 2, 4, 8, 12 and 16, and a classifier of dropout, 512-512, ReLU, dropout, 512-512, ReLU,
512-classes. Convolutions are initialised from N(0, 2 / (k * k * c_out)) as in that code. Module names follow the
code (``conv1`` ... ``conv16``, ``batch_norm1`` ..., ``classifier``), so the paper's full-rank choice reads as names.
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

_CHANNELS = (64, 64, 128, 128, 256, 256, 256, 256, 512, 512, 512, 512, 512, 512, 512, 512)
_POOL_AFTER = frozenset({2, 4, 8, 12, 16})


class VGG19BN(nn.Module):
    """VGG-19 with batch norm for 32x32 inputs, as in the Pufferfish paper's code (20,560,330 parameters).

    Args:
        num_classes: outputs of the classifier.

    Example::

        >>> model = VGG19BN()
        >>> model(torch.randn(2, 3, 32, 32)).shape
        torch.Size([2, 10])
    """

    #: the layers the paper keeps full-rank: conv1 to conv9 and the last classifier layer
    pufferfish_full_rank: ClassVar[tuple[str, ...]] = tuple(f"conv{i}" for i in range(1, 10)) + ("classifier.6",)

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        in_channels = 3
        for i, out_channels in enumerate(_CHANNELS, start=1):
            self.add_module(f"conv{i}", nn.Conv2d(in_channels, out_channels, 3, 1, padding=1, bias=False))
            self.add_module(f"batch_norm{i}", nn.BatchNorm2d(out_channels))
            in_channels = out_channels
        self.classifier = nn.Sequential(
            nn.Dropout(),
            nn.Linear(512, 512),
            nn.ReLU(True),
            nn.Dropout(),
            nn.Linear(512, 512),
            nn.ReLU(True),
            nn.Linear(512, num_classes),
        )
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                m.weight.data.normal_(0, math.sqrt(2.0 / (m.kernel_size[0] * m.kernel_size[1] * m.out_channels)))

    def forward(self, x: Tensor) -> Tensor:
        """Logits for a batch of 32x32 images."""
        for i in range(1, len(_CHANNELS) + 1):
            x = F.relu(getattr(self, f"batch_norm{i}")(getattr(self, f"conv{i}")(x)))
            if i in _POOL_AFTER:
                x = F.max_pool2d(x, 2, 2)
        return self.classifier(torch.flatten(x, 1))
