"""Uniform draws for a whole bucket at once, keyed by layer, position, step and rank: a counter-based hash.

The stochastic quantisers (QSGD, TernGrad) need one uniform draw per element, different on every rank and keyed by
the layer (not by the bucket: DDP rebuilds its buckets after the first step and after a resume, and a resumed run
must draw what an uninterrupted one would). A generator per layer gives that, at the price of a few operators per
layer: on a GPU, kernel launches that grow with the number of layers. Here the draw of element ``p`` of layer ``l``
is a hash of ``p`` and of a key of ``(seed, step, rank, l, salt)``, in the manner of counter-based generators (Salmon
et al., "Parallel Random Numbers: As Easy as 1, 2, 3", SC 2011): every element of the bucket in one pass of integer
operations, a fixed number of operators whatever the number of layers, and a layer's draws the same in any bucket.

The hash is ``x = p * a_l + b_l`` (32-bit, wrapping; ``a_l`` odd, so ``p -> x`` is a bijection per layer) finished by
Wellons' "lowbias32" integer mixer (two multiply-xorshift rounds; its bias is close to the best of its family,
https://github.com/skeeto/hash-prospector). Layer keys ``a_l, b_l`` are the same mixer applied to the layer index and
a 32-bit seed of ``(seed, step, rank, salt)``. On the CPU the per-element hash runs in NumPy's ``uint32`` (its shifts
are logical and it wraps, one pass per operation, about the cost of torch's uniform ``rand``); elsewhere in torch's
``int32`` with the same values, so the draws are the same on every device.

A draw carries 24 random bits in fp32 (and in the fp32 that half precision computes in) and 32 in fp64:
``u = (h >> 8) 2^-24`` or ``h 2^-32``, in [0, 1). With ``bits=16``, ``u = (h >> 16) + 1/2) 2^-16``, in (0, 1).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from lightning_gradcomp.compressors.ops.segments import Segments, segments_of
from lightning_gradcomp.engine.context import BucketContext, Layer, derive_seed

__all__ = ["layer_keys", "lowbias32_", "uniform_draws"]

_MULTIPLIERS = (0x7FEB352D, 0x846CA68B)  # lowbias32's
_SHIFTS = (16, 15, 16)
_GOLDEN = 0x9E3779B9  # spreads consecutive layer indices before mixing
_STREAM = 0x68E31DA4  # separates b_l's mixing from a_l's
_RANK_SALT = 0x5EED


def _signed(value: int) -> int:
    """A 32-bit pattern as the int32 that holds it (torch's int32 operators take signed scalars)."""
    return value - (1 << 32) if value >= 1 << 31 else value


def _mix_numpy(x: np.ndarray, scratch: np.ndarray) -> np.ndarray:
    """lowbias32 of every ``uint32`` of ``x``, in place (``scratch``: a buffer like ``x``, reused for the shifts)."""
    for i, shift in enumerate(_SHIFTS):
        x ^= np.right_shift(x, np.uint32(shift), out=scratch)
        if i < len(_MULTIPLIERS):
            x *= np.uint32(_MULTIPLIERS[i])
    return x


def lowbias32_(x: Tensor) -> Tensor:
    """lowbias32 of every ``int32`` of ``x`` (read as ``uint32``), in place; arithmetic shifts masked to logical."""
    for i, shift in enumerate(_SHIFTS):
        x.bitwise_xor_((x >> shift).bitwise_and_((1 << (32 - shift)) - 1))
        if i < len(_MULTIPLIERS):
            x.mul_(_signed(_MULTIPLIERS[i]))
    return x


def _step_seed(ctx: BucketContext, salt: int) -> int:
    """A 32-bit seed of the step, the rank and ``salt`` (the same on every device)."""
    return derive_seed(ctx.seed, ctx.step, _RANK_SALT, ctx.rank, salt) & 0xFFFFFFFF


def layer_keys(indices: Tensor, seed: int) -> tuple[Tensor, Tensor]:
    """Every layer's ``(a_l, b_l)`` (int32 bit patterns; ``a_l`` odd) from its index and a 32-bit ``seed``.

    ``indices`` is int64 on any device; the keys are computed there, in a few operators over the layers.
    """
    k = lowbias32_(((indices * _GOLDEN + seed) & 0xFFFFFFFF).to(torch.int32))  # the low 32 bits, as int32
    a = lowbias32_(k.clone()).bitwise_or_(1)
    b = lowbias32_(k.bitwise_xor_(_signed(_STREAM)))
    return a, b


def _layer_indices(layers: Sequence[Layer], device: torch.device) -> Tensor:
    segments = segments_of(layers, device)
    found = segments.__dict__.get("_layer_indices")
    if found is None:  # cached with the layout (the indices belong to it)
        found = segments.__dict__["_layer_indices"] = torch.tensor(
            [layer.index for layer in layers], dtype=torch.int64, device=device
        )
    return found


def uniform_draws(
    ctx: BucketContext, dtype: torch.dtype, bits: int | None = None, salt: int = 0, *, out: Tensor | None = None
) -> Tensor:
    """One uniform draw per element of ``ctx``'s bucket, different on every rank, keyed by layer and position.

    Args:
        ctx: the bucket (its layers, step, rank, seed and device).
        dtype: the draws' floating dtype (fp32 or fp64).
        bits: ``None``: 24 random bits in fp32, 32 in fp64, ``u`` in [0, 1); ``16``: ``(r + 1/2) 2^-16`` for a
            16-bit ``r``, ``u`` in (0, 1).
        salt: separates draws that must be independent (another use of the same layers at the same step).
        out: ``numel`` elements of ``dtype`` on ``ctx.device`` to write the draws into.

    Returns:
        The draws (``out`` if given).
    """
    numel = ctx.numel
    out = torch.empty(numel, dtype=dtype, device=ctx.device) if out is None else out
    if not numel:
        return out
    segments = segments_of(ctx.layers, ctx.device)
    a, b = layer_keys(_layer_indices(ctx.layers, ctx.device), _step_seed(ctx, salt))
    # x = p a_l + b_l for the position p within the layer: (position in the bucket) a_l + (b_l - start_l a_l)
    c = b - segments.starts.to(torch.int32) * a
    if ctx.device.type == "cpu":
        return _draws_numpy(a, c, segments.lengths, bits, out)
    return _draws_torch(a, c, segments, bits, out)


def _draws_numpy(a: Tensor, c: Tensor, lengths: Tensor, bits: int | None, out: Tensor) -> Tensor:
    """The draws on the CPU, in NumPy's ``uint32``: the same values as :func:`_draws_torch`."""
    counts = lengths.numpy()
    x = np.arange(out.numel(), dtype=np.uint32)
    scratch = np.repeat(a.numpy().view(np.uint32), counts)
    x *= scratch
    x += np.repeat(c.numpy().view(np.uint32), counts)
    h = _mix_numpy(x, scratch)
    target = out.numpy()
    if bits == 16:
        np.right_shift(h, np.uint32(16), out=h)
        target[...] = h
        target += 0.5
        target *= 2.0**-16
    elif out.dtype == torch.float64:
        target[...] = h
        target *= 2.0**-32
    else:
        np.right_shift(h, np.uint32(8), out=h)
        target[...] = h
        target *= 2.0**-24
    return out


def _draws_torch(a: Tensor, c: Tensor, segments: Segments, bits: int | None, out: Tensor) -> Tensor:
    """The draws in torch's ``int32`` on any device (a fixed number of operators)."""
    x = torch.arange(out.numel(), dtype=torch.int32, device=out.device)
    h = lowbias32_(x.mul_(segments.expand(a)).add_(segments.expand(c)))
    if bits == 16:
        return torch.add((h >> 16).bitwise_and_(0xFFFF), 0.5, out=out).mul_(2.0**-16)
    if out.dtype == torch.float64:  # the int32's bit pattern read as unsigned
        return out.copy_(h).add_(torch.where(h < 0, 2.0**32, 0.0)).mul_(2.0**-32)
    return out.copy_((h >> 8).bitwise_and_(0xFFFFFF)).mul_(2.0**-24)
