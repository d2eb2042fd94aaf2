"""The CIFAR-10 ResNet-18 of the Pufferfish paper's code (``resnet_cifar10.py``: ``ResNet(BasicBlock, [2, 2, 2, 2])``).

Wang, Agarwal & Papailiopoulos, "Pufferfish: Communication-efficient Models At No Extra Cost", MLSys 2021
(github.com/hwang595/Pufferfish). It is the widely used CIFAR variant of He et al.'s ResNet-18 (a 3x3 stem without
max-pooling, 4x4 average pooling before the classifier) with one difference that the paper's code makes: the stem
convolution has no batch normalisation (``F.relu(self.conv1(x))``; its ``bn1`` is commented out). Module names follow
that code, so the paper's full-rank choice reads as names: ``conv1``, ``layer1.0``, the shortcuts and ``linear``.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with batch norm and a (1x1 convolution when the shape changes) shortcut."""

    expansion = 1

    def __init__(self, in_planes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, kernel_size=3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, kernel_size=3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.shortcut = nn.Sequential()
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_planes, planes, kernel_size=1, stride=stride, bias=False), nn.BatchNorm2d(planes)
            )

    def forward(self, x: Tensor) -> Tensor:
        """The block's output for ``x``."""
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class CifarResNet18(nn.Module):
    """ResNet-18 for 32x32 inputs, as in the Pufferfish paper's code (11,173,834 parameters with 10 classes).

    Args:
        num_classes: outputs of the classifier.

    Example::

        >>> model = CifarResNet18()
        >>> model(torch.randn(2, 3, 32, 32)).shape
        torch.Size([2, 10])
    """

    #: the layers the paper keeps full-rank (``Pufferfish(full_rank=None)`` uses these names)
    pufferfish_full_rank: ClassVar[tuple[str, ...]] = ("conv1", "layer1.0.*", "*.shortcut.*", "linear")

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.in_planes = 64
        self.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
        self.layer1 = self._make_layer(64, 2, stride=1)
        self.layer2 = self._make_layer(128, 2, stride=2)
        self.layer3 = self._make_layer(256, 2, stride=2)
        self.layer4 = self._make_layer(512, 2, stride=2)
        self.linear = nn.Linear(512, num_classes)

    def _make_layer(self, planes: int, blocks: int, stride: int) -> nn.Sequential:
        layers = []
        for s in [stride] + [1] * (blocks - 1):
            layers.append(BasicBlock(self.in_planes, planes, s))
            self.in_planes = planes
        return nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        """Logits for a batch of 32x32 images."""
        out = F.relu(self.conv1(x))
        out = self.layer4(self.layer3(self.layer2(self.layer1(out))))
        out = F.avg_pool2d(out, 4)
        return self.linear(torch.flatten(out, 1))
