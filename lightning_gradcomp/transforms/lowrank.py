"""Low-rank factorized layers and their initialisation from a truncated SVD (Pufferfish's building blocks).

Wang, Agarwal & Papailiopoulos, "Pufferfish: Communication-efficient Models At No Extra Cost", MLSys 2021
(github.com/hwang595/Pufferfish). A weight viewed as an ``m x n`` matrix ``W`` (``m`` outputs) is replaced by two
factors, ``W ~ A B`` with ``A = U_r sqrt(S_r)`` (``m x r``) and ``B = sqrt(S_r) V_r^T`` (``r x n``): by Eckart-Young
``A B`` is the best rank-``r`` approximation of ``W``, and at full rank it is ``W`` itself. In every layer here ``u``
is the factor applied first (``B``, the input side) and ``v`` the one applied second (``A``, the output side):

* :class:`FactorizedConv`: a ``k x k`` convolution ``c_in -> r`` (same stride, padding, dilation) followed by a
  ``1 x 1`` convolution ``r -> c_out`` that carries the bias;
* :class:`FactorizedLinear`: ``in -> r`` (no bias) then ``r -> out``;
* :class:`FactorizedLSTM`: each of the four gate matrices of every ``weight_ih``/``weight_hh`` is factorized on its
  own (the paper's eight gate matrices per layer); biases stay;
* :class:`FactorizedMultiheadAttention`: the query, key, value and output projections are factorized.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "FactorizedConv",
    "FactorizedLSTM",
    "FactorizedLinear",
    "FactorizedMultiheadAttention",
    "factorize",
    "svd_factors",
]


def svd_factors(matrix: Tensor, rank: int) -> tuple[Tensor, Tensor]:
    """``(A, B)`` with ``A @ B`` the best rank-``rank`` approximation of the 2-D ``matrix``.

    ``A = U_r sqrt(S_r)`` (``m x r``) and ``B = sqrt(S_r) V_r^T`` (``r x n``), as in the paper's ``decompose_weights``.
    Half-precision weights are decomposed in float32. The SVD is deterministic for a given input, so every rank of a
    data-parallel job (whose replicas are equal) computes the same factors.
    """
    if matrix.dim() != 2:
        raise ValueError(f"Expected a 2-D matrix, got shape {tuple(matrix.shape)}.")
    if not 1 <= rank <= min(matrix.shape):
        raise ValueError(f"Expected `rank` in [1, {min(matrix.shape)}] for a {tuple(matrix.shape)} matrix, got {rank}.")
    work = matrix.detach()
    if work.dtype not in (torch.float32, torch.float64):
        work = work.float()
    u, s, vh = torch.linalg.svd(work, full_matrices=False)
    root = s[:rank].sqrt()
    left = u[:, :rank] * root
    right = root.unsqueeze(1) * vh[:rank]
    return left.to(matrix.dtype).contiguous(), right.to(matrix.dtype).contiguous()


class FactorizedLinear(nn.Module):
    """``Linear(in, r, bias=False)`` then ``Linear(r, out)``: a rank-``r`` linear layer.

    Args:
        in_features: inputs.
        out_features: outputs.
        rank: inner dimension ``r``.
        bias: whether the second factor has a bias.
    """

    def __init__(
        self, in_features: int, out_features: int, rank: int, bias: bool = True, device=None, dtype=None
    ) -> None:
        super().__init__()
        self.in_features, self.out_features, self.rank = in_features, out_features, rank
        self.u = nn.Linear(in_features, rank, bias=False, device=device, dtype=dtype)
        self.v = nn.Linear(rank, out_features, bias=bias, device=device, dtype=dtype)

    @classmethod
    def from_linear(cls, linear: nn.Linear, rank: int, svd: bool = True) -> FactorizedLinear:
        """Factors initialised from the truncated SVD of ``linear.weight`` (``svd=False``: left as constructed)."""
        w = linear.weight
        out = cls(linear.in_features, linear.out_features, rank, linear.bias is not None, w.device, w.dtype)
        out.train(linear.training)
        if not svd:
            return out
        left, right = svd_factors(w, rank)
        with torch.no_grad():
            out.u.weight.copy_(right)
            out.v.weight.copy_(left)
            if linear.bias is not None:
                out.v.bias.copy_(linear.bias)
        return out

    def forward(self, x: Tensor) -> Tensor:
        """``v(u(x))``."""
        return self.v(self.u(x))

    @property
    def weight(self) -> Tensor:
        """The composed ``out x in`` weight ``v.weight @ u.weight`` (read-only; for code that inspects ``.weight``)."""
        return self.v.weight @ self.u.weight

    @property
    def bias(self) -> Tensor | None:
        """The bias (the second factor's)."""
        return self.v.bias

    def extra_repr(self) -> str:  # noqa: D102 (nn.Module's)
        return f"in_features={self.in_features}, out_features={self.out_features}, rank={self.rank}"


class FactorizedConv(nn.Module):
    """A ``k x k`` convolution ``c_in -> r`` followed by a ``1 x 1`` convolution ``r -> c_out`` (1-, 2- or 3-D).

    The first factor keeps the original stride, padding, dilation and padding mode, so the output has the original
    shape; the second carries the bias. No normalisation or nonlinearity sits between them (the paper's default).
    """

    def __init__(self, conv: nn.modules.conv._ConvNd, rank: int) -> None:
        super().__init__()
        if isinstance(conv, nn.modules.conv._ConvTransposeNd) or conv.groups != 1:
            raise ValueError("Only ordinary convolutions with groups=1 can be factorized.")
        cls: Callable[..., nn.modules.conv._ConvNd] = type(conv)  # Conv1d, Conv2d or Conv3d: one signature
        w = conv.weight
        self.in_channels, self.out_channels, self.rank = conv.in_channels, conv.out_channels, rank
        self.kernel_size = conv.kernel_size
        self.u = cls(
            conv.in_channels,
            rank,
            conv.kernel_size,
            stride=conv.stride,
            padding=conv.padding,
            dilation=conv.dilation,
            bias=False,
            padding_mode=conv.padding_mode,
            device=w.device,
            dtype=w.dtype,
        )
        self.v = cls(rank, conv.out_channels, 1, bias=conv.bias is not None, device=w.device, dtype=w.dtype)

    @classmethod
    def from_conv(cls, conv: nn.modules.conv._ConvNd, rank: int, svd: bool = True) -> FactorizedConv:
        """Factors initialised from the truncated SVD of ``conv.weight`` viewed as ``c_out x (c_in k k)``."""
        out = cls(conv, rank)
        out.train(conv.training)
        if not svd:
            return out
        left, right = svd_factors(conv.weight.reshape(conv.out_channels, -1), rank)
        with torch.no_grad():
            out.u.weight.copy_(right.view_as(out.u.weight))
            out.v.weight.copy_(left.view_as(out.v.weight))
            if conv.bias is not None and out.v.bias is not None:  # v has a bias exactly when conv has one
                out.v.bias.copy_(conv.bias)
        return out

    def forward(self, x: Tensor) -> Tensor:
        """``v(u(x))``."""
        return self.v(self.u(x))

    @property
    def weight(self) -> Tensor:
        """The composed weight, shaped like the original convolution's (read-only)."""
        composed = self.v.weight.flatten(1) @ self.u.weight.flatten(1)
        return composed.view(self.out_channels, *self.u.weight.shape[1:])

    @property
    def bias(self) -> Tensor | None:
        """The bias (the second factor's)."""
        return self.v.bias

    def extra_repr(self) -> str:  # noqa: D102 (nn.Module's)
        return f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, rank={self.rank}"


class FactorizedLSTM(nn.LSTM):
    """An :class:`~torch.nn.LSTM` whose gate matrices are rank-``r`` products, each gate factorized on its own.

    ``weight_ih_l{k}`` (``4h x in``) and ``weight_hh_l{k}`` (``4h x h``) are replaced by parameters
    ``weight_ih_l{k}_u`` (``4 x r x in``) and ``weight_ih_l{k}_v`` (``4 x h x r``), and likewise for ``hh`` and the
    reverse direction; gate ``g`` is ``v[g] @ u[g]`` (the input, forget, cell and output gates of the paper's LSTM).
    Biases stay full. The forward pass composes the gate matrices (one batched product per weight) and runs torch's
    fused LSTM kernel, so what is communicated and stored follows the factors, while the recurrent arithmetic per
    token is that of the full-rank LSTM (a per-time-step factorized loop in Python would be far slower). On CUDA
    cuDNN warns that the composed weights are not one contiguous chunk; that costs a copy per forward pass.
    Create it with :meth:`from_lstm`.
    """

    _factor_ranks: dict[str, int]

    @classmethod
    def from_lstm(cls, lstm: nn.LSTM, rank: Callable[[int, int], int], svd: bool = True) -> FactorizedLSTM:
        """A factorized copy of ``lstm``; ``rank(rows, cols)`` gives the rank of a ``rows x cols`` gate matrix."""
        if type(lstm) is not nn.LSTM:
            raise ValueError(f"Expected an nn.LSTM, got {type(lstm).__name__}.")
        if lstm.proj_size:
            raise ValueError("LSTMs with projections (proj_size > 0) are not factorized.")
        out = copy.deepcopy(lstm)
        out.__class__ = cls
        assert isinstance(out, cls)
        out._factor_ranks = {}
        h = lstm.hidden_size
        for name in lstm._flat_weights_names:
            if not name.startswith("weight_"):
                continue
            weight = getattr(lstm, name)
            cols = weight.shape[1]
            r = rank(h, cols)
            u = torch.zeros(4, r, cols, dtype=weight.dtype, device=weight.device)
            v = torch.zeros(4, h, r, dtype=weight.dtype, device=weight.device)
            for g in range(4 if svd else 0):
                left, right = svd_factors(weight[g * h : (g + 1) * h], r)
                u[g].copy_(right)
                v[g].copy_(left)
            del out._parameters[name]
            out.register_parameter(f"{name}_u", nn.Parameter(u, requires_grad=weight.requires_grad))
            out.register_parameter(f"{name}_v", nn.Parameter(v, requires_grad=weight.requires_grad))
            out._factor_ranks[name] = r
        out._init_flat_weights()
        return out

    def composed(self, name: str) -> Tensor:
        """The full ``4h x cols`` matrix of the factorized weight ``name`` (e.g. ``"weight_ih_l0"``)."""
        u, v = getattr(self, f"{name}_u"), getattr(self, f"{name}_v")
        return torch.bmm(v, u).reshape(-1, u.shape[-1])

    def forward(self, input, hx=None):  # noqa: D102 (nn.LSTM's)
        self._flat_weights = [
            self.composed(name) if name in self._factor_ranks else getattr(self, name)
            for name in self._flat_weights_names
        ]
        try:
            return super().forward(input, hx)
        finally:  # do not keep this step's graph alive through the module
            self._flat_weights = [
                None if n in self._factor_ranks else w for n, w in zip(self._flat_weights_names, self._flat_weights)
            ]

    def extra_repr(self) -> str:  # noqa: D102 (nn.Module's)
        return super().extra_repr() + f", ranks={sorted(set(self._factor_ranks.values()))}"


class FactorizedMultiheadAttention(nn.Module):
    """Multi-head attention whose query, key, value and output projections are rank-``r`` products.

    Computes what :class:`~torch.nn.MultiheadAttention` computes (same arguments and return values: masks, causal
    hint, ``need_weights``, ``average_attn_weights``, dropout, ``batch_first``, unbatched inputs) with the projections
    applied as two thin matrix products each. ``add_bias_kv`` and ``add_zero_attn`` are not supported (such layers are
    left full-rank). Create it with :meth:`from_attention`.
    """

    # read by TransformerEncoderLayer's inference fast path, which needs a packed, full-rank projection
    in_proj_weight = None
    in_proj_bias = None
    _qkv_same_embed_dim = False

    def __init__(self, attention: nn.MultiheadAttention, ranks: dict[str, int]) -> None:
        super().__init__()
        if attention.bias_k is not None or attention.add_zero_attn:
            raise ValueError("MultiheadAttention with add_bias_kv or add_zero_attn is not factorized.")
        self.embed_dim, self.kdim, self.vdim = attention.embed_dim, attention.kdim, attention.vdim
        self.num_heads, self.head_dim = attention.num_heads, attention.head_dim
        self.dropout, self.batch_first = attention.dropout, attention.batch_first
        ref = attention.out_proj.weight
        bias = attention.in_proj_bias is not None
        kw = {"device": ref.device, "dtype": ref.dtype}
        e = self.embed_dim
        self.q_proj = FactorizedLinear(e, e, ranks["q"], bias=bias, **kw)
        self.k_proj = FactorizedLinear(self.kdim, e, ranks["k"], bias=bias, **kw)
        self.v_proj = FactorizedLinear(self.vdim, e, ranks["v"], bias=bias, **kw)
        self.out_proj = FactorizedLinear(e, e, ranks["out"], bias=attention.out_proj.bias is not None, **kw)

    @classmethod
    def from_attention(
        cls, attention: nn.MultiheadAttention, rank: Callable[[int, int], int], svd: bool = True
    ) -> FactorizedMultiheadAttention:
        """Factors initialised from the truncated SVD of each projection; ``rank(rows, cols)`` gives each rank."""
        e = attention.embed_dim
        if attention._qkv_same_embed_dim:
            weights = dict(zip("qkv", attention.in_proj_weight.chunk(3)))
        else:
            weights = {"q": attention.q_proj_weight, "k": attention.k_proj_weight, "v": attention.v_proj_weight}
        weights["out"] = attention.out_proj.weight
        out = cls(attention, {name: rank(*w.shape) for name, w in weights.items()})
        biases = dict(zip("qkv", attention.in_proj_bias.chunk(3))) if attention.in_proj_bias is not None else {}
        biases["out"] = attention.out_proj.bias
        out.train(attention.training)
        if not svd:
            return out
        with torch.no_grad():
            for name, weight in weights.items():
                proj = getattr(out, f"{name}_proj" if name != "out" else "out_proj")
                left, right = svd_factors(weight, proj.rank)
                proj.u.weight.copy_(right)
                proj.v.weight.copy_(left)
                if biases.get(name) is not None:
                    proj.v.bias.copy_(biases[name])
        assert out.q_proj.out_features == e
        return out

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Tensor | None = None,
        need_weights: bool = True,
        attn_mask: Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """As :meth:`torch.nn.MultiheadAttention.forward`."""
        batched = query.dim() == 3
        if not batched:
            query, key, value = (t.unsqueeze(0 if self.batch_first else 1) for t in (query, key, value))
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        if self.batch_first:  # work in (length, batch, features), like torch's functional implementation
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        tgt_len, bsz, _ = query.shape
        src_len = key.shape[0]
        if is_causal and attn_mask is None:
            raise RuntimeError("Need attn_mask if specifying the is_causal hint (as torch.nn.MultiheadAttention).")
        h, d = self.num_heads, self.head_dim
        q = self.q_proj(query).view(tgt_len, bsz * h, d).transpose(0, 1)
        k = self.k_proj(key).view(src_len, bsz * h, d).transpose(0, 1)
        v = self.v_proj(value).view(src_len, bsz * h, d).transpose(0, 1)
        mask = _merged_mask(attn_mask, key_padding_mask, bsz, h, tgt_len, src_len, q.dtype)
        dropout = self.dropout if self.training else 0.0
        weights = None
        if need_weights:
            scores = torch.bmm(q * math.sqrt(1.0 / d), k.transpose(1, 2))
            if mask is not None:
                scores = scores + mask
            attn = torch.softmax(scores, dim=-1)
            if dropout > 0.0:
                attn = F.dropout(attn, p=dropout)
            out = torch.bmm(attn, v).transpose(0, 1).reshape(tgt_len * bsz, self.embed_dim)
            weights = attn.view(bsz, h, tgt_len, src_len)
            if average_attn_weights:
                weights = weights.mean(dim=1)
        else:
            if mask is not None:
                mask = mask.view(bsz, h, -1, src_len) if mask.shape[0] != 1 else mask.unsqueeze(0)
            out = F.scaled_dot_product_attention(
                q.view(bsz, h, tgt_len, d),
                k.view(bsz, h, src_len, d),
                v.view(bsz, h, src_len, d),
                attn_mask=mask,
                dropout_p=dropout,
            )
            out = out.permute(2, 0, 1, 3).reshape(tgt_len * bsz, self.embed_dim)
        out = self.out_proj(out).view(tgt_len, bsz, self.embed_dim)
        if self.batch_first:
            out = out.transpose(0, 1)
        if not batched:
            out = out.squeeze(0 if self.batch_first else 1)
            if weights is not None:
                weights = weights.squeeze(0)
        return out, weights

    def extra_repr(self) -> str:  # noqa: D102 (nn.Module's)
        return f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, batch_first={self.batch_first}"


def _as_additive(mask: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """Boolean masks (``True`` = not allowed) become ``-inf``/0 float masks; float masks are added as they are."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(mask, float("-inf"))
    return mask.to(dtype)


def _merged_mask(
    attn_mask: Tensor | None, key_padding_mask: Tensor | None, bsz: int, heads: int, tgt: int, src: int, dtype
) -> Tensor | None:
    """One additive mask of shape ``(bsz * heads | 1, tgt, src)``, as torch's functional attention merges them."""
    mask = _as_additive(attn_mask, dtype)
    if mask is not None:
        expected = (tgt, src) if mask.dim() == 2 else (bsz * heads, tgt, src)
        if tuple(mask.shape) != expected:
            raise RuntimeError(f"The shape of the attn_mask is {tuple(mask.shape)}, but should be {expected}.")
        if mask.dim() == 2:
            mask = mask.unsqueeze(0)
    padding = _as_additive(key_padding_mask, dtype)
    if padding is not None:
        padding = padding.view(bsz, 1, 1, src).expand(-1, heads, -1, -1).reshape(bsz * heads, 1, src)
        mask = padding if mask is None else mask + padding
    return mask


def factorize(module: nn.Module, rank: Callable[[int, int], int], svd: bool = True) -> nn.Module:
    """A factorized copy of one layer (Linear, Conv1d/2d/3d, LSTM or MultiheadAttention), SVD-initialised.

    ``rank(rows, cols)`` gives the rank for a weight viewed as a ``rows x cols`` matrix (Pufferfish:
    ``ratio * min(rows, cols)``). ``svd=False`` builds the structure only (its weights are about to be loaded).

    Raises:
        ValueError: If the layer cannot be factorized.
    """
    if isinstance(module, nn.Linear):
        return FactorizedLinear.from_linear(module, rank(*module.weight.shape), svd)
    if isinstance(module, nn.modules.conv._ConvNd):
        w = module.weight
        return FactorizedConv.from_conv(module, rank(w.shape[0], math.prod(w.shape[1:])), svd)
    if type(module) is nn.LSTM:
        return FactorizedLSTM.from_lstm(module, rank, svd)
    if isinstance(module, nn.MultiheadAttention):
        return FactorizedMultiheadAttention.from_attention(module, rank, svd)
    raise ValueError(f"Cannot factorize a {type(module).__name__}.")
