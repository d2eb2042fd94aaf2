"""PowerSGD: low-rank gradient compression by one step of power iteration, with warm start and error feedback."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import torch
from torch import Tensor

from lightning_gradcomp.compressors.base import (
    BucketContext,
    Collective,
    Compressor,
    Layer,
    Payload,
)
from lightning_gradcomp.compressors.exchange import AllReduce, Exchange, SentValue
from lightning_gradcomp.validation import check_bool, check_choice, check_number, check_positive_int


def orthogonalize(matrices: Tensor, epsilon: float = 1e-8) -> None:
    """Orthonormalise the columns of every matrix of the batch ``matrices`` ``(b, n, r)`` in place (views work).

    Gram-Schmidt for rank <= 2 and half precision, QR otherwise (the rule of torch's ``powerSGD_hook``, which the
    paper's code follows). ``epsilon`` is added to every column norm, so an all-zero column (a layer whose gradient is
    exactly zero, as every residual branch of a ResNet with ``zero_init_residual=True`` at its first step) stays zero
    instead of becoming 0 / 0.
    """
    rank = matrices.shape[2]
    if rank <= 2 or matrices.dtype in (torch.float16, torch.bfloat16):
        for i in range(rank):
            col = matrices[:, :, i : i + 1]
            col /= torch.linalg.vector_norm(col, dim=1, keepdim=True) + epsilon
            if i + 1 < rank:
                rest = matrices[:, :, i + 1 :]
                rest -= torch.sum(col * rest, dim=1, keepdim=True) * col
    else:
        # on a fresh copy: LAPACK's blocked QR rounds differently depending on where its input lives, and these
        # factors sit at offsets that depend on DDP's bucket layout
        matrices.copy_(torch.linalg.qr(matrices.contiguous()).Q)


def _to_device(tensor: Tensor, device: torch.device) -> Tensor:
    """``tensor`` (drawn or loaded on the CPU) on ``device``, without a host synchronisation on CUDA.

    A plain ``.to("cuda")`` of pageable memory waits for the copy; from pinned memory a non-blocking copy is ordered
    on the current stream like any kernel, and the caching host allocator keeps the pinned block alive until then.
    """
    if tensor.device == device:
        return tensor
    if device.type == "cuda" and tensor.device.type == "cpu":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def _into(buffer: Tensor, received: Tensor) -> Tensor:
    """``buffer`` holding ``received`` (a collective reduces in place unless it packed the payload with others)."""
    if received.data_ptr() != buffer.data_ptr():
        buffer.copy_(received.view_as(buffer))
    return buffer


def _outer_products_into(pt: Tensor, qt: Tensor, out: Tensor) -> None:
    """``out = P Q^T`` for one ``r x n`` ``P^T`` and ``r x m`` ``Q^T`` at rank 1 or 2, as elementwise products.

    ``p_0 q_0^T``, then ``out += p_1 q_1^T`` with torch's ``addcmul_`` (a fused multiply-add where the CPU has
    one). MKL's GEMM with an inner dimension of 2 runs at about a fifth of memory speed once the output leaves the
    cache (ResNet-18's 512 x 4608 layers: 1.0 ms, against 0.2 ms for these two passes; ``benchmarks/codec.py``).
    Every output row is computed alike whatever its address, so results do not depend on DDP's bucket layout.
    """
    torch.mul(pt[0].unsqueeze(1), qt[0].unsqueeze(0), out=out)
    if pt.shape[0] == 2:
        out.addcmul_(pt[1].unsqueeze(1), qt[1].unsqueeze(0))


def _reconstruct_into(group: list[Layer], pt: Tensor, qt: Tensor, out: Tensor) -> None:
    """Write ``P Q^T`` of every layer of ``group`` into its place in the flat ``out``.

    On the CPU, in fp32, at rank 1 or 2: as :func:`_outer_products_into`, layer by layer; otherwise one batched
    product.
    """
    if out.device.type == "cpu" and out.dtype == torch.float32 and pt.shape[1] <= 2:
        for i, layer in enumerate(group):
            _outer_products_into(pt[i], qt[i], layer.matrix(out))
        return
    if len(group) == 1:
        torch.bmm(pt.transpose(1, 2), qt, out=group[0].matrix(out).unsqueeze(0))
        return
    approx = torch.bmm(pt.transpose(1, 2), qt)
    for i, layer in enumerate(group):
        layer.matrix(out).copy_(approx[i])


def _bmm_into(factor: Tensor, matrix: Tensor, out: Tensor) -> None:
    """``out = factor @ matrix`` (batched), with a result that does not depend on where the operands live in memory.

    With a short output (``r`` rows) BLAS picks kernels whose vectorised rounding depends on the 64-byte alignment
    of the factor and of the output, and, at rank 1 (GEMV), of the matrix too. DDP's bucket layout decides those
    offsets and changes after the first step and after a resume, so the products run on aligned operands into a
    fresh output, then are copied into place: results do not depend on the layout and resumes are bitwise exact.
    Only the small factors are copied, and the gradient matrix only at rank 1 when it is misaligned.
    """
    # clone() keeps a transposed view's strides, in fresh (64-byte aligned) memory
    if factor.data_ptr() % 64:
        factor = factor.clone()
    if factor.shape[1] == 1 and matrix.data_ptr() % 64:
        matrix = matrix.clone()
    out.copy_(torch.bmm(factor, matrix))


class PowerSGD(Compressor):
    """Rank-``r`` approximation of every gradient matrix by one power-iteration step; two all-reduces per bucket.

    Vogels, Karimireddy & Jaggi, "PowerSGD: Practical Low-Rank Gradient Compression for Distributed Optimization",
    NeurIPS 2019 (arXiv:1905.13727). For every compressed layer viewed as ``M`` (``shape[0] x rest``), with error
    feedback ``M = g + e``:

    1. ``Q`` (``m x r``): the previous step's ``Q`` (warm start), else i.i.d. N(0, 1) from the seed shared by all
       ranks; its columns are orthonormalised (as torch's hook does; it spans the same space, better conditioned);
    2. ``P = M Q``; all-reduce the ``P`` of every layer of the bucket in one buffer; orthonormalise ``P``;
    3. ``Q = M^T P``; all-reduce all ``Q`` in one buffer; ``Q /= n``;
    4. the average is ``P Q^T``; the residual is ``e = M - P Q^T`` (local ``M``, global reconstruction, as in the
       paper's code and torch's hook).

    Matrices of the same shape are multiplied in one batched product when ``batch_same_shape`` is on (the default on
    CUDA). On the CPU the default is off: MKL's batched GEMM rounds differently from its single GEMM, so batching by
    bucket would make results depend on DDP's bucket layout, which changes after the first step and after a resume.
    Per-layer products keep a resumed run bitwise equal to an uninterrupted one.

    The second round is issued through ``ctx.comm.after`` on its own process group, so every rank issues the
    collectives of every bucket in the same order; torch's ``powerSGD_hook`` issues it from a future callback on the
    same group and aborts under gloo when a model spans several buckets.

    Args:
        rank: the approximation rank ``r`` (the paper uses 2 for ResNet-18 on CIFAR-10).
        warm_start: reuse ``Q`` from the previous step (the paper's ``reuse_query``).
        min_compression_rate: compress a layer only if ``(n + m) r * min_compression_rate < n m`` (torch's rule);
            the others are averaged densely.
        orthogonalization_epsilon: added to column norms in Gram-Schmidt: 1e-8 as in the paper's code (torch's hook
            uses 0, which turns an all-zero gradient into NaN).
        batch_same_shape: batch same-shaped matrices of a bucket into one product; ``None`` means "on CUDA only".
        init: how the shared random ``Q`` is drawn. ``"layer"``: from a seed derived from the shared seed, the step
            and the layer, independent of DDP's buckets (exact resume, results independent of ``bucket_cap_mb``).
            ``"torch"``: exactly torch's ``PowerSGDState(random_seed=seed)`` draws, one per bucket, for
            like-for-like comparisons with ``powerSGD_hook``; those depend on the bucket layout.

    Raises:
        ValueError: If ``rank`` is not an integer >= 1 or another argument is out of range.

    Example::

        >>> from lightning_gradcomp.compressors import PowerSGD
        >>> PowerSGD(rank=2)
        PowerSGD(rank=2, warm_start=True, min_compression_rate=2.0, orthogonalization_epsilon=1e-08, \
batch_same_shape=None, init='layer')
    """

    collective: ClassVar[Collective] = "allreduce"
    unbiased: ClassVar[bool] = False
    rounds: ClassVar[int] = 2
    level_attribute: ClassVar[str] = "rank"

    def __init__(
        self,
        rank: int = 2,
        warm_start: bool = True,
        min_compression_rate: float = 2.0,
        orthogonalization_epsilon: float = 1e-8,
        batch_same_shape: bool | None = None,
        init: Literal["layer", "torch"] = "layer",
    ) -> None:
        super().__init__()
        self.rank = check_positive_int(rank, "rank")
        self.warm_start = check_bool(warm_start, "warm_start")
        self.min_compression_rate = check_number(min_compression_rate, "min_compression_rate", low=0.0)
        self.orthogonalization_epsilon = check_number(orthogonalization_epsilon, "orthogonalization_epsilon", low=0.0)
        self.batch_same_shape = check_bool(batch_same_shape, "batch_same_shape", allow_none=True)
        self.init = check_choice(init, "init", ("layer", "torch"))
        self._memory: dict[str, Tensor] = {}
        self._torch_rng: Any = None  # numpy RandomState, for init="torch"

    # ------------------------------------------------------------------------------------------------------------
    # Which layers, which rank
    # ------------------------------------------------------------------------------------------------------------
    def check_level(self, value: Any) -> int:
        """A rank: an integer >= 1."""
        return check_positive_int(value, "rank")

    def _rank_for(self, layer: Layer) -> int:
        rows = layer.shape[0]
        return min(rows, layer.numel // rows, self.level(layer))

    def compresses(self, layer: Layer, min_numel: int) -> bool:
        """Matrices (>= 2-D, >= ``min_numel`` elements) that rank ``r`` makes ``min_compression_rate`` smaller."""
        if not super().compresses(layer, min_numel):
            return False
        rows, cols = layer.shape[0], layer.numel // layer.shape[0]
        return (rows + cols) * self._rank_for(layer) * self.min_compression_rate < rows * cols

    # ------------------------------------------------------------------------------------------------------------
    # Query vectors
    # ------------------------------------------------------------------------------------------------------------
    def _shape_groups(self, layers: tuple[Layer, ...]) -> list[list[Layer]]:
        groups: dict[tuple[int, int], list[Layer]] = {}
        for layer in layers:
            groups.setdefault((layer.shape[0], layer.numel // layer.shape[0]), []).append(layer)
        return list(groups.values())

    def _batched(self, ctx: BucketContext) -> bool:
        return self.batch_same_shape if self.batch_same_shape is not None else ctx.device.type == "cuda"

    def _random_queries(self, ctx: BucketContext) -> dict[str, Tensor]:
        """Fresh N(0, 1) queries for every layer of ``ctx``, identical on every rank (drawn on the CPU)."""
        return {name: _to_device(q, ctx.device) for name, q in self._random_host_queries(ctx).items()}

    def _random_host_queries(self, ctx: BucketContext) -> dict[str, Tensor]:
        shape = {layer.name: (layer.numel // layer.shape[0], self._rank_for(layer)) for layer in ctx.layers}
        if self.init == "layer":
            return {
                layer.name: torch.randn(shape[layer.name], generator=ctx.generator(layer), dtype=ctx.dtype)
                for layer in ctx.layers
            }
        # torch's protocol: one numpy draw per bucket seeds the CPU generator; queries are filled in shape-group
        # order, one tensor (or one same-shape batch when batching) at a time
        if self._torch_rng is None:
            import numpy as np

            self._torch_rng = np.random.RandomState(ctx.seed)
        generator = torch.Generator().manual_seed(int(self._torch_rng.randint(1_000_000_000)))
        queries = {}
        for group in self._shape_groups(ctx.layers):
            cols, r = shape[group[0].name]
            if self._batched(ctx):
                drawn = torch.randn((len(group), cols, r), generator=generator, dtype=ctx.dtype)
                queries.update({layer.name: drawn[i] for i, layer in enumerate(group)})
            else:
                queries.update(
                    {layer.name: torch.randn((1, cols, r), generator=generator, dtype=ctx.dtype)[0] for layer in group}
                )
        return queries

    def _queries(self, ctx: BucketContext) -> dict[str, Tensor]:
        """Warm-start queries where available and of the right shape, fresh ones otherwise (all rank-consistent)."""
        expected = {layer.name: (layer.numel // layer.shape[0], self._rank_for(layer)) for layer in ctx.layers}
        if self.warm_start:
            known = {name: self._memory.get(name) for name in expected}
            for name, q in known.items():
                if q is not None and q.device != ctx.device:  # loaded from a checkpoint: moved once, kept
                    known[name] = self._memory[name] = _to_device(q, ctx.device)
            if all(q is not None and tuple(q.shape) == expected[name] for name, q in known.items()):
                return known  # type: ignore[return-value]
            if self.init == "layer":
                fresh = self._random_queries(ctx)
                return {
                    name: q if q is not None and tuple(q.shape) == expected[name] else fresh[name]
                    for name, q in known.items()
                }
        return self._random_queries(ctx)

    # ------------------------------------------------------------------------------------------------------------
    # The factors: P and Q are kept transposed (r x n and r x m, row-major), which turns every product into a
    # short-output GEMM; BLAS runs M^T P as (P^T M)^T about ten times faster than with a 2-column output.
    # ------------------------------------------------------------------------------------------------------------
    def _layout(self, ctx: BucketContext) -> list[tuple[list[Layer], int, int, int, int]]:
        """Groups of layers multiplied together, with (batch, rows, cols, rank); the payload follows this order."""
        groups = self._shape_groups(ctx.layers) if self._batched(ctx) else [[layer] for layer in ctx.layers]
        return [(g, len(g), g[0].shape[0], g[0].numel // g[0].shape[0], self._rank_for(g[0])) for g in groups]

    def _blocks(self, tensor: Tensor, ctx: BucketContext, queries: dict[str, Tensor]) -> tuple[
            list[tuple[list[Layer], Tensor, Tensor, Tensor]], Tensor, Tensor]:  # fmt: skip
        """Batched matrices with views of ``P^T`` and ``Q^T`` in two flat buffers; ``Q`` filled and orthonormalised."""
        layout = self._layout(ctx)
        p_buffer = torch.empty(sum(b * n * r for _, b, n, _, r in layout), dtype=tensor.dtype, device=tensor.device)
        q_buffer = torch.empty(sum(b * m * r for _, b, _, m, r in layout), dtype=tensor.dtype, device=tensor.device)
        blocks, p_at, q_at = [], 0, 0
        for group, b, n, m, r in layout:
            matrices = [layer.matrix(tensor) for layer in group]
            batch = matrices[0].unsqueeze(0) if b == 1 else torch.stack(matrices)
            pt = p_buffer[p_at : p_at + b * r * n].view(b, r, n)
            qt = q_buffer[q_at : q_at + b * r * m].view(b, r, m)
            for i, layer in enumerate(group):
                qt[i].copy_(queries[layer.name].t())
            orthogonalize(qt.transpose(1, 2), self.orthogonalization_epsilon)
            blocks.append((group, batch, pt, qt))
            p_at += b * r * n
            q_at += b * r * m
        return blocks, p_buffer, q_buffer

    def compress(self, tensor: Tensor, ctx: BucketContext) -> Payload:
        """One worker's PowerSGD step: ``P = orth(M Q)``, ``Q = M^T P``; the payload is ``(P^T, Q^T)`` flattened."""
        blocks, p_buffer, q_buffer = self._blocks(tensor, ctx, self._queries(ctx))
        for _, batch, pt, qt in blocks:
            _bmm_into(qt, batch.transpose(1, 2), pt)  # P^T = Q^T M^T
            orthogonalize(pt.transpose(1, 2), self.orthogonalization_epsilon)
            _bmm_into(pt, batch, qt)  # Q^T = P^T M
        return p_buffer, q_buffer

    def decompress(self, payload: Payload, ctx: BucketContext, out: Tensor | None = None) -> Tensor:
        """``P Q^T`` for every layer."""
        p_buffer, q_buffer = payload
        out = ctx.output(out)
        p_at = q_at = 0
        for group, b, n, m, r in self._layout(ctx):
            pt = p_buffer[p_at : p_at + b * r * n].view(b, r, n)
            qt = q_buffer[q_at : q_at + b * r * m].view(b, r, m)
            _reconstruct_into(group, pt, qt, out)
            p_at += b * r * n
            q_at += b * r * m
        return out

    # ------------------------------------------------------------------------------------------------------------
    # The distributed reduction: two ordered rounds
    # ------------------------------------------------------------------------------------------------------------
    @property
    def keeps_input(self) -> bool:
        """Yes: ``M`` is only read, and ``P Q^T`` is reconstructed into ``out``."""
        return True

    def exchange(self, tensor: Tensor, ctx: BucketContext, out: Tensor) -> Exchange:
        """Round 0: all-reduce the ``P`` of all layers. Round 1: all-reduce their ``Q``. Then ``P Q^T``."""
        queries = self._queries(ctx)
        blocks, p_buffer, q_buffer = self._blocks(tensor, ctx, queries)
        for _, batch, pt, qt in blocks:
            _bmm_into(qt, batch.transpose(1, 2), pt)  # P^T = Q^T M^T
        (p_summed,) = yield AllReduce((p_buffer,))  # its scale does not matter: it is orthonormalised
        _into(p_buffer, p_summed)
        for _, batch, pt, qt in blocks:
            orthogonalize(pt.transpose(1, 2), self.orthogonalization_epsilon)
            _bmm_into(pt, batch, qt)  # Q^T = P^T M
        (q_summed,) = yield AllReduce((q_buffer,))
        _into(q_buffer, q_summed).div_(ctx.world_size)
        # ``out`` is spent (it holds g, or M without error feedback): reconstruct into it instead of allocating
        for group, _, pt, qt in blocks:
            _reconstruct_into(group, pt, qt, out)
            if self.warm_start:
                for i, layer in enumerate(group):
                    self._stage_query(layer, qt[i].t(), queries[layer.name], ctx)
        yield SentValue(out)  # error feedback keeps M - P Q^T
        return out

    def _stage_query(self, layer: Layer, query: Tensor, used: Tensor, ctx: BucketContext) -> None:
        """Keep ``query`` (a view of this step's buffer) as ``layer``'s warm start, once the step is finite.

        A layer seen for the first time starts from the query this step used (a finite one, which a non-finite step
        then leaves in place).
        """
        memory = self._memory.get(layer.name)
        if memory is None or memory.shape != query.shape:
            memory = self._memory[layer.name] = used.clone()
        ctx.stage(memory, query)

    # ------------------------------------------------------------------------------------------------------------
    # State
    # ------------------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Warm-start queries per layer and, for ``init="torch"``, the numpy generator's state."""
        state: dict[str, Any] = {**super().state_dict(), "queries": dict(self._memory)}
        if self._torch_rng is not None:
            # plain tensors and numbers, so checkpoints load with torch.load(weights_only=True)
            _, keys, pos, has_gauss, cached = self._torch_rng.get_state()
            state["torch_rng"] = {"keys": torch.from_numpy(keys.astype("int64")), "pos": int(pos),
                                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}  # fmt: skip
        return state

    def reset_state(self) -> None:
        """Also forget the warm-start queries and, for ``init="torch"``, restart its generator from the seed."""
        super().reset_state()
        self._memory.clear()
        self._torch_rng = None

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        super().load_state_dict(state_dict)
        self._memory = {name: q.clone() for name, q in state_dict.get("queries", {}).items()}
        if "torch_rng" in state_dict:
            import numpy as np

            rng = state_dict["torch_rng"]
            self._torch_rng = np.random.RandomState()
            self._torch_rng.set_state(
                ("MT19937", rng["keys"].numpy().astype("uint32"), rng["pos"], rng["has_gauss"], rng["cached_gaussian"])
            )

    def __getstate__(self) -> dict[str, Any]:
        return {**self.hparams(), "_state": self.state_dict()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        saved = state.pop("_state")
        self.__init__(**state)  # type: ignore[misc]
        self.load_state_dict(saved)
