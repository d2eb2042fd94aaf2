"""Parameter counts and multiply-accumulates of the Pufferfish paper's models, full-rank and factorized.

Counts are exact and deterministic (they follow from the layer shapes): the paper's CIFAR-10 ResNet-18 and VGG-19-BN
(``lightning_gradcomp.models``, defined as in its code) and torchvision's ResNet-50 and Wide-ResNet-50-2 (the paper's
ImageNet "hybrid" models), each factorized with ``Pufferfish``'s defaults (rank ratio 1/4, the paper's full-rank
layers). Multiply-accumulates are per image (32x32 for CIFAR, 224x224 for ImageNet), for the convolution and linear
layers.

    python benchmarks/pufferfish_params.py
"""

from __future__ import annotations

import argparse

import torch
import torchvision

from lightning_gradcomp.models import VGG19BN, CifarResNet18
from lightning_gradcomp.transforms import count_macs, count_parameters
from lightning_gradcomp.transforms.pufferfish import apply_factorization, plan

MODELS = {
    "ResNet-18 (CIFAR-10)": (CifarResNet18, 32),
    "VGG-19-BN (CIFAR-10)": (VGG19BN, 32),
    "ResNet-50 (ImageNet, hybrid)": (torchvision.models.resnet50, 224),
    "Wide-ResNet-50-2 (ImageNet, hybrid)": (torchvision.models.wide_resnet50_2, 224),
}


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()  # no options; --help describes it
    print("| model | parameters | factorized | fewer | factorized layers | MACs per image | factorized | fewer |")
    print("|---|---|---|---|---|---|---|---|")
    for name, (factory, size) in MODELS.items():
        torch.manual_seed(0)
        model = factory()
        before = count_parameters(model)
        decisions = plan(model, 0.25)
        chosen = [d.name for d in decisions if d.factorize]
        apply_factorization(model, chosen, 0.25, svd=False)  # the structure decides the counts
        after = count_parameters(model)
        full_macs, macs = count_macs(model, torch.zeros(1, 3, size, size))
        print(
            f"| {name} | {before:,} | {after:,} | {before / after:.2f}x | {len(chosen)} of {len(decisions)} |"
            f" {full_macs:,} | {macs:,} | {full_macs / macs:.2f}x |"
        )


if __name__ == "__main__":
    main()
