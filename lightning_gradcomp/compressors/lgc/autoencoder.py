"""LGC's autoencoder: a 1-D convolutional encoder, one or several decoders, and a functional optimizer for it.

The architecture follows the third-party LGC implementation (``LGCAutoEncoder``, read line by line in the project's
research notes): every convolution is 1-D, kernel 3, stride 2, no padding, LeakyReLU after each; the encoder ends in a
kernel-1 convolution to ``latent_channels`` channels; a decoder is a stack of transposed convolutions (kernel 3,
stride 2), interpolated to the input's length, optionally concatenated with the "innovation" as one more channel,
and mapped to one channel by a kernel-1 convolution. The network is fully convolutional, so one autoencoder serves
inputs of any length (every DDP bucket). Inputs shorter than the encoder's receptive field are zero-padded.

The optimizer is written out (SGD with momentum, or Adam) instead of using ``torch.optim`` so that its state is a
plain dictionary of tensors, known before the first step: the compressor stages every tensor of it, with the
weights, for the non-finite guard to commit or drop (:class:`~lightning_gradcomp.engine.requests.StepUpdates`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn
from torch.nn import functional as F  # noqa: N812 (the usual alias)

__all__ = ["LGCAutoencoder", "latent_numel", "min_length", "optimizer_state", "optimizer_step"]


class LGCAutoencoder(nn.Module):
    """Encoder shared by every rank, plus ``decoders`` decoders (one per rank for LGC-PS, one for LGC-allreduce).

    Args:
        decoders: how many decoders.
        channels: output channels of the encoder's stride-2 convolutions (each halves the length).
        decoder_channels: output channels of each decoder's stride-2 transposed convolutions (each doubles it).
        latent_channels: channels of the code (the encoder's last, kernel-1 convolution).
        innovation: the decoders take the innovation as one more input channel (LGC-PS).
        linear_encoder: no activation in the encoder, so it is affine: the mean of the codes is the code of the mean.
    """

    def __init__(
        self,
        decoders: int,
        channels: Sequence[int],
        decoder_channels: Sequence[int],
        latent_channels: int,
        innovation: bool,
        linear_encoder: bool = False,
    ) -> None:
        super().__init__()
        self.strides = len(channels)
        self.latent_channels = latent_channels
        self.innovation = innovation
        layers: list[nn.Module] = []
        width = 1
        for c in channels:
            layers.append(nn.Conv1d(width, c, 3, stride=2))
            if not linear_encoder:
                layers.append(nn.LeakyReLU())
            width = c
        layers.append(nn.Conv1d(width, latent_channels, 1))
        if not linear_encoder:
            layers.append(nn.LeakyReLU())
        self.encoder = nn.Sequential(*layers)
        self.decoders = nn.ModuleList()
        self.heads = nn.ModuleList()
        for _ in range(decoders):
            stack: list[nn.Module] = []
            width = latent_channels
            for c in decoder_channels:
                stack += [nn.ConvTranspose1d(width, c, 3, stride=2), nn.LeakyReLU()]
                width = c
            self.decoders.append(nn.Sequential(*stack))
            self.heads.append(nn.Conv1d(width + int(innovation), 1, 1))
        self.min_length = min_length(self.strides)

    def padded_length(self, k: int) -> int:
        """The length an input of ``k`` values is zero-padded to."""
        return max(k, self.min_length)

    def latent_numel(self, k: int) -> int:
        """Numbers in the code of ``k`` values (:func:`latent_numel`)."""
        return latent_numel(k, self.strides, self.latent_channels)

    def encode(self, x: Tensor) -> Tensor:
        """Codes of the rows of ``x`` (``[B, k]``), flattened to ``[B, latent_numel(k)]``."""
        k = x.shape[1]
        x = F.pad(x, (0, self.padded_length(k) - k))
        return self.encoder(x.unsqueeze(1)).flatten(1)

    def decode(self, j: int, z: Tensor, k: int, innovation: Tensor | None = None) -> Tensor:
        """Decoder ``j`` applied to codes ``z`` (``[B, latent_numel(k)]``), returning ``[B, k]``."""
        h = self.decoders[j](z.view(z.shape[0], self.latent_channels, -1))
        length = self.padded_length(k)
        h = F.interpolate(h, size=length)  # nearest, as the third-party code
        if self.innovation:
            assert innovation is not None
            h = torch.cat([h, F.pad(innovation, (0, length - k)).unsqueeze(1)], dim=1)
        return self.heads[j](h)[:, 0, :k]


def min_length(strides: int) -> int:
    """The shortest input that ``strides`` kernel-3 stride-2 convolutions map to at least one element."""
    shortest = 1
    for _ in range(strides):
        shortest = 2 * (shortest - 1) + 3  # L -> (L - 3) // 2 + 1, backwards
    return shortest


def latent_numel(k: int, strides: int, latent_channels: int) -> int:
    """Numbers in the code of ``k`` values: ``latent_channels`` times the length after the strided convolutions.

    Inputs shorter than :func:`min_length` are zero-padded to it first.
    """
    length = max(k, min_length(strides))
    for _ in range(strides):
        length = (length - 3) // 2 + 1
    return latent_channels * length


def optimizer_state(params: dict[str, Tensor], kind: str) -> dict[str, Tensor]:
    """Zero optimizer state for ``params`` (SGD: a momentum buffer each; Adam: two moments each, and a step count)."""
    state: dict[str, Tensor] = {}
    for name, p in params.items():
        state[f"m.{name}"] = torch.zeros_like(p)
        if kind == "adam":
            state[f"v.{name}"] = torch.zeros_like(p)
    if kind == "adam":
        state["step"] = torch.zeros((), dtype=torch.float32, device=next(iter(params.values())).device)
    return state


def optimizer_step(
    params: dict[str, Tensor],
    grads: dict[str, Tensor],
    state: dict[str, Tensor],
    *,
    kind: str,
    lr: float,
    momentum: float,
    apply: Tensor | None = None,
) -> dict[str, Tensor]:
    """One SGD (with ``momentum``) or Adam (betas 0.9, 0.999, eps 1e-8, as ``torch.optim.Adam``) step.

    Returns new tensors for every parameter and state entry (nothing is changed in place). Where ``apply`` (a 0-dim
    bool tensor) is false, the new tensors equal the old ones: the step is skipped without reading the flag on the
    host.
    """
    new: dict[str, Tensor] = {}
    if kind == "adam":
        step = state["step"] + 1
        new["step"] = step
        c1 = 1 - 0.9**step
        c2 = 1 - 0.999**step
    for name, p in params.items():
        g = grads[name]
        if kind == "adam":
            m = state[f"m.{name}"] * 0.9 + g * 0.1
            v = state[f"v.{name}"] * 0.999 + g * g * 0.001
            new[f"m.{name}"], new[f"v.{name}"] = m, v
            new[name] = p - lr * (m / c1) / ((v / c2).sqrt() + 1e-8)
        else:
            m = state[f"m.{name}"] * momentum + g
            new[f"m.{name}"] = m
            new[name] = p - lr * m
    if apply is not None:
        old = {**params, **state}
        new = {key: torch.where(apply, value, old[key]) for key, value in new.items()}
    return new
