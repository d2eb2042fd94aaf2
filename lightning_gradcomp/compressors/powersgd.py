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
from lightning_gradcomp.compressors.ops.powersgd_plan import Workspace, orthogonalize, plan_runs
from lightning_gradcomp.engine.requests import AllReduce, Exchange, SentValue

__all__ = ["PowerSGD", "orthogonalize"]
from lightning_gradcomp.validation import check_bool, check_choice, check_number, check_positive_int


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

    Matrices of the same shape that lie at equal distances in the bucket (a *run*) are multiplied, orthogonalised and
    rebuilt as one batch, so a bucket costs a few operators per run, not per layer
    (:mod:`~lightning_gradcomp.compressors.ops.powersgd_plan`). Every matrix's factors sit at 64-byte aligned offsets,
    where BLAS rounds a matrix's product the same whether it is alone or in a batch: results do not depend on DDP's
    bucket layout, which changes after the first step and after a resume, and a resumed run is bitwise an uninterrupted
    one.

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
        batch_same_shape: batch same-shaped matrices of a bucket (``None``, the default, and ``True``: on every
            device); ``False``: one product per layer, the same results with more operators. With ``init="torch"``,
            ``True`` also draws a shape group's queries at once, as torch's ``batch_tensors_with_same_shape``.
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
        self._memory: dict[str, Tensor] = {}  # every layer's warm-start Q^T (r x m), a view of a workspace's memory
        self._workspaces: dict[tuple, Workspace] = {}
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

    def _random_host_queries(self, ctx: BucketContext) -> dict[str, Tensor]:
        """Fresh N(0, 1) queries ``Q`` (``m x r``) for every layer of ``ctx``, identical on every rank (on the CPU)."""
        shape = {layer.name: (layer.numel // layer.shape[0], self._rank_for(layer)) for layer in ctx.layers}
        if self.init == "layer":
            return {
                layer.name: torch.randn(shape[layer.name], generator=ctx.generator(layer), dtype=ctx.dtype)
                for layer in ctx.layers
            }
        # torch's protocol: one numpy draw per bucket seeds the CPU generator; queries are filled in shape-group
        # order, one tensor (or one same-shape batch with batch_tensors_with_same_shape, here batch_same_shape=True)
        # at a time
        if self._torch_rng is None:
            import numpy as np

            self._torch_rng = np.random.RandomState(ctx.seed)
        generator = torch.Generator().manual_seed(int(self._torch_rng.randint(1_000_000_000)))
        queries = {}
        for group in self._shape_groups(ctx.layers):
            cols, r = shape[group[0].name]
            if self.batch_same_shape:
                drawn = torch.randn((len(group), cols, r), generator=generator, dtype=ctx.dtype)
                queries.update({layer.name: drawn[i] for i, layer in enumerate(group)})
            else:
                queries.update(
                    {layer.name: torch.randn((1, cols, r), generator=generator, dtype=ctx.dtype)[0] for layer in group}
                )
        return queries

    def _workspace(self, ctx: BucketContext) -> Workspace:
        """The bucket layout's runs and factor workspaces, made once per layout (and device and dtype)."""
        ranks = tuple(self._rank_for(layer) for layer in ctx.layers)
        key = (
            tuple((layer.name, layer.offset, tuple(layer.shape)) for layer in ctx.layers),
            ranks,
            ctx.dtype,
            str(ctx.device),
        )
        found = self._workspaces.get(key)
        if found is None:
            # a layer is in one layout at a time (DDP's buckets after their rebuild, a new rank): the others go, and
            # their memory stays in ``_memory`` (views that keep it alive) for this one to adopt
            names = {layer.name for layer in ctx.layers}
            self._workspaces = {k: w for k, w in self._workspaces.items() if not names & w.names}
            runs = plan_runs(ctx.layers, ranks, self.batch_same_shape is not False, ctx.dtype.itemsize)
            found = self._workspaces[key] = Workspace.build(runs, ctx.dtype, ctx.device, memory=self.warm_start)
        return found

    def _load_queries(self, workspace: Workspace, ctx: BucketContext) -> None:
        """This step's queries into ``workspace.q_work``: the warm-start memory (one copy), else fresh draws."""
        memory = workspace.q_memory
        if memory is not None and workspace.memory_ready:
            workspace.q_work.copy_(memory)
            return
        if memory is not None:
            fresh = self._adopt_memory(workspace, ctx)
            if not fresh:
                workspace.q_work.copy_(memory)
                return
        else:
            fresh = self._random_host_queries(ctx)
        for name, view in workspace.query_views(workspace.q_work).items():
            view.copy_(_to_device(fresh[name], ctx.device).t())

    def _adopt_memory(self, workspace: Workspace, ctx: BucketContext) -> dict[str, Tensor]:
        """Move every layer's warm-start query into ``workspace.q_memory`` (fresh ones where missing); the draws.

        A layer seen for the first time starts from a fresh draw, which stays its memory if this step is not finite.
        With ``init="torch"``, a bucket with a new layer takes fresh queries for all its layers this step (torch's
        hook starts a bucket afresh), while the memory of the others stays as it was until the step commits.
        """
        assert workspace.q_memory is not None
        names = {layer.name for layer in ctx.layers}
        views = workspace.query_views(workspace.q_memory)
        known = {
            name: q
            for name, view in views.items()
            if (q := self._memory.get(name)) is not None and q.shape == view.shape
        }
        fresh = self._random_host_queries(ctx) if len(known) < len(names) else {}
        for name, view in views.items():
            view.copy_(_to_device(known[name] if name in known else fresh[name].t(), ctx.device))
            self._memory[name] = view
        workspace.memory_ready = True
        return fresh if self.init == "torch" else {}

    # ------------------------------------------------------------------------------------------------------------
    # The factors: P and Q are kept transposed (r x n and r x m, row-major), which turns every product into a
    # short-output GEMM; BLAS runs M^T P as (P^T M)^T about ten times faster than with a 2-column output.
    # ------------------------------------------------------------------------------------------------------------
    def compress(self, tensor: Tensor, ctx: BucketContext) -> Payload:
        """One worker's PowerSGD step: ``P = orth(M Q)``, ``Q = M^T P``; the payload is ``(P^T, Q^T)`` flattened."""
        workspace = self._workspace(ctx)
        self._load_queries(workspace, ctx)
        workspace.orthogonalize_queries(self.orthogonalization_epsilon)
        workspace.project(tensor)
        workspace.orthogonalize_projections(self.orthogonalization_epsilon)
        workspace.back_project()
        return workspace.gather(p=True), workspace.gather(p=False)

    def decompress(self, payload: Payload, ctx: BucketContext, out: Tensor | None = None) -> Tensor:
        """``P Q^T`` for every layer."""
        out = ctx.output(out)
        self._workspace(ctx).reconstruct_from(payload[0], payload[1], out)
        return out

    # ------------------------------------------------------------------------------------------------------------
    # The distributed reduction: two ordered rounds
    # ------------------------------------------------------------------------------------------------------------
    @property
    def keeps_input(self) -> bool:
        """Yes: ``M`` is only read, and ``P Q^T`` is reconstructed into ``out``."""
        return True

    def exchange(self, tensor: Tensor, ctx: BucketContext, out: Tensor) -> Exchange:
        """Round 0: all-reduce the ``P`` of all layers. Round 1: all-reduce their ``Q``. Then ``P Q^T``.

        A few operators per run of same-shaped matrices (:mod:`~lightning_gradcomp.compressors.ops.powersgd_plan`);
        the payloads are gathered from the workspaces and scattered back with one operator each.
        """
        workspace = self._workspace(ctx)
        self._load_queries(workspace, ctx)
        workspace.orthogonalize_queries(self.orthogonalization_epsilon)
        workspace.project(tensor)  # P^T = Q^T M^T
        # its scale does not matter: it is orthonormalised
        (p_summed,) = yield AllReduce((workspace.gather(p=True),))
        workspace.p_work.index_copy_(0, workspace.p_index, p_summed.view(-1))
        workspace.orthogonalize_projections(self.orthogonalization_epsilon)
        workspace.back_project()  # Q^T = P^T M
        (q_summed,) = yield AllReduce((workspace.gather(p=False),))
        workspace.q_work.index_copy_(0, workspace.q_index, q_summed.view(-1)).div_(ctx.world_size)
        # ``out`` is spent (it holds g, or M without error feedback): reconstruct into it instead of allocating
        workspace.reconstruct(out)
        if self.warm_start:
            assert workspace.q_memory is not None
            ctx.stage(workspace.q_memory, workspace.q_work)  # once the step is finite on every rank
        yield SentValue(out)  # error feedback keeps M - P Q^T
        return out

    # ------------------------------------------------------------------------------------------------------------
    # State
    # ------------------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Warm-start queries ``Q`` (``m x r``) per layer and, for ``init="torch"``, the numpy generator's state."""
        queries = {name: q.t().clone(memory_format=torch.contiguous_format) for name, q in self._memory.items()}
        state: dict[str, Any] = {**super().state_dict(), "queries": queries}
        if self._torch_rng is not None:
            # plain tensors and numbers, so checkpoints load with torch.load(weights_only=True)
            _, keys, pos, has_gauss, cached = self._torch_rng.get_state()
            state["torch_rng"] = {
                "keys": torch.from_numpy(keys.astype("int64")),
                "pos": int(pos),
                "has_gauss": int(has_gauss),
                "cached_gaussian": float(cached),
            }
        return state

    def reset_state(self) -> None:
        """Also forget the warm-start queries and, for ``init="torch"``, restart its generator from the seed."""
        super().reset_state()
        self._memory.clear()
        self._workspaces.clear()
        self._torch_rng = None

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`.

        Raises:
            ValueError: If a saved query is not a matrix (``m x r``).
        """
        super().load_state_dict(state_dict)
        queries = state_dict.get("queries", {})
        bad = [name for name, q in queries.items() if not isinstance(q, Tensor) or q.dim() != 2]
        if bad:
            raise ValueError(f"PowerSGD state: the saved queries must be m x r matrices; {bad[0]!r} is not.")
        self._memory = {name: q.t().clone() for name, q in queries.items()}
        self._workspaces.clear()
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
