"""TracIn influence scores from saved checkpoints: self-influence, proponents and opponents.

Pruthi, Liu, Kale & Sundararajan, "Estimating Training Data Influence by Tracing Gradient Descent", NeurIPS 2020
(arXiv:2002.08484). The checkpoint version of TracIn scores a training example ``z`` against an example ``z'`` as

    TracInCP(z, z') = sum_i lr_i * grad l(w_i, z) . grad l(w_i, z')

over saved weights ``w_i`` with ``lr_i`` the learning rate of the interval checkpoint ``i`` stands for; the
self-influence of ``z`` is ``sum_i lr_i * ||grad l(w_i, z)||^2``. Captum's ``TracInCP`` is the reference
implementation; the scores here agree with it on the same checkpoints and layers (``tests/test_tracin.py``).

Three ways to get the gradients:

* ``method="full"``: per-example gradients of the chosen layers' parameters with ``torch.func`` (``vmap(grad)``
  over the batch);
* ``method="last_layer"``: for a final ``nn.Linear`` with input ``a`` and output gradient ``delta = dl/dz``, the
  weight gradient is ``delta a^T`` and the bias gradient ``delta``, so ``grad . grad' = (a.a' + 1)(delta.delta')``:
  nothing per-example is materialised beyond ``a`` and ``delta`` (the paper's last-layer approximation, Captum's
  ``TracInCPFast``, which leaves the bias out);
* ``projection_dim``: a Gaussian random projection to that many dimensions (Johnson-Lindenstrauss; dot products are
  preserved in expectation), of the gradient or, for the last layer, of ``a`` and ``delta`` separately (Captum's
  ``TracInCPFastRandProj``). The matrices come from ``seed``: the same on every rank and run.

Nothing here needs a strategy or a Trainer. When ``torch.distributed`` is initialised, :class:`TracInScorer`
scores a dataset in parallel: every rank takes a contiguous shard and the scores are all-gathered, so every rank
(all must call) returns the whole result.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset, Subset

from lightning_gradcomp.validation import check_bool, check_choice, check_int, check_positive_int

LossFn = Callable[[Tensor, Tensor], Tensor]
CheckpointLoader = Callable[[nn.Module, str], float]
Method = Literal["full", "last_layer"]


# ----------------------------------------------------------------------------------------------------------------
# Checkpoints
# ----------------------------------------------------------------------------------------------------------------
def save_tracin_checkpoint(model: nn.Module, path: str, learning_rate: float, **extra: Any) -> None:
    """Save ``model``'s weights with the learning rate of the interval they end, as :class:`TracIn` does."""
    state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    torch.save({"state_dict": state, "learning_rate": float(learning_rate), **extra}, path)


def load_tracin_checkpoint(model: nn.Module, path: str) -> float:
    """Load a TracIn checkpoint into ``model`` and return its learning rate.

    Has the signature of Captum's ``checkpoints_load_func``: pass it to ``captum.influence.TracInCP`` (Captum's
    default loader would hand the ``learning_rate`` entry to ``load_state_dict``, which a strict load refuses).
    """
    checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    model.load_state_dict(checkpoint["state_dict"])
    return float(checkpoint["learning_rate"])


def per_example_cross_entropy(outputs: Tensor, targets: Tensor) -> Tensor:
    """Cross-entropy of every example (``reduction="none"``): the default loss."""
    return nn.functional.cross_entropy(outputs, targets, reduction="none")


def per_example_mse(outputs: Tensor, targets: Tensor) -> Tensor:
    """Squared error of every example, summed over its outputs."""
    return ((outputs - targets) ** 2).flatten(1).sum(1)


LOSSES: dict[str, LossFn] = {"cross_entropy": per_example_cross_entropy, "mse": per_example_mse}


# ----------------------------------------------------------------------------------------------------------------
# Distribution
# ----------------------------------------------------------------------------------------------------------------
def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def shard(n: int, rank: int, world_size: int) -> range:
    """The contiguous block of ``range(n)`` that ``rank`` scores (sizes differ by at most one)."""
    start = n * rank // world_size
    return range(start, n * (rank + 1) // world_size)


def _gather_last_dim(local: Tensor, n: int, world_size: int) -> Tensor:
    """All-gather every rank's ``(..., shard)`` scores into ``(..., n)`` in rank order (padded to equal sizes)."""
    if world_size == 1:
        return local
    width = math.ceil(n / world_size)
    padded = torch.zeros((*local.shape[:-1], width), dtype=local.dtype, device=local.device)
    padded[..., : local.shape[-1]] = local
    parts = [torch.empty_like(padded) for _ in range(world_size)]
    dist.all_gather(parts, padded.contiguous())
    return torch.cat([part[..., : len(shard(n, r, world_size))] for r, part in enumerate(parts)], dim=-1)


# ----------------------------------------------------------------------------------------------------------------
# The scorer
# ----------------------------------------------------------------------------------------------------------------
class TracInScorer:
    """TracInCP scores of a model's training examples from saved checkpoints.

    Args:
        model: the model the checkpoints belong to (called as ``model(*batch[:-1])``; the last element of every
            batch is the target, Captum's convention). Its weights and train/eval mode are restored after each
            computation; scoring runs in eval mode.
        checkpoints: checkpoint paths, or a directory (every ``*.pt`` file in it, sorted by name).
        loss_fn: per-example loss ``loss_fn(outputs, targets) -> (batch,)`` (``reduction="none"``); default
            cross-entropy.
        method: ``"full"`` (per-example gradients via ``torch.func``) or ``"last_layer"`` (the outer-product
            identity on a final ``nn.Linear``).
        layers: names of the modules (as in ``model.named_modules()``) whose parameters the gradients are taken
            over. ``"full"``: ``None`` means every trainable parameter. ``"last_layer"``: one ``nn.Linear``;
            ``None`` means the last ``nn.Linear`` of the model.
        projection_dim: project gradients (or, for the last layer, each factor) to this many dimensions with a
            Gaussian random matrix; ``None`` (default) keeps them exact. Dimensions already at most this are not
            projected. Costs a ``d x projection_dim`` matrix per projected factor.
        seed: seed of the projection matrices.
        batch_size: examples per batch (per-example gradients cost ``batch_size x d`` memory).
        checkpoints_load_func: loads a checkpoint into the model and returns its learning rate (Captum's
            signature); default :func:`load_tracin_checkpoint`.
        distributed: shard the examples over the ``torch.distributed`` ranks and gather the scores (every rank
            must call); ``None``: whenever ``torch.distributed`` is initialised with more than one rank.
        show_progress: show a progress bar (on rank 0) over checkpoints and batches.

    Raises:
        ValueError: If an argument is out of range, a layer does not exist, or ``"last_layer"`` does not name an
            ``nn.Linear``.
    """

    def __init__(
        self,
        model: nn.Module,
        checkpoints: Sequence[str] | str,
        loss_fn: LossFn | None = None,
        method: Method = "full",
        layers: Sequence[str] | None = None,
        projection_dim: int | None = None,
        seed: int = 0,
        batch_size: int = 64,
        checkpoints_load_func: CheckpointLoader = load_tracin_checkpoint,
        distributed: bool | None = None,
        show_progress: bool = False,
    ) -> None:
        if isinstance(checkpoints, (str, os.PathLike)):
            directory = os.fspath(checkpoints)
            if not os.path.isdir(directory):
                raise ValueError(f"Expected `checkpoints` to be a list of paths or a directory, got {checkpoints!r}.")
            checkpoints = sorted(os.path.join(directory, f) for f in os.listdir(directory) if f.endswith(".pt"))
        self.checkpoints = list(checkpoints)
        if not self.checkpoints:
            raise ValueError("Expected `checkpoints` to hold at least one checkpoint, got none.")
        # plain ValueError: the scorer is usable without Lightning
        check_choice(method, "method", ("full", "last_layer"))
        check_int(projection_dim, "projection_dim", low=1, allow_none=True)
        check_int(seed, "seed")
        check_positive_int(batch_size, "batch_size")
        check_bool(distributed, "distributed", allow_none=True)
        check_bool(show_progress, "show_progress")
        self.model = model
        self.loss_fn = loss_fn or per_example_cross_entropy
        self.method = method
        self.projection_dim = projection_dim
        self.seed = seed
        self.batch_size = batch_size
        self.checkpoints_load_func = checkpoints_load_func
        self.distributed = distributed
        self.show_progress = show_progress
        modules = dict(model.named_modules())
        if layers is not None:
            if isinstance(layers, str):
                layers = [layers]
            missing = [name for name in layers if name not in modules]
            if missing:
                raise ValueError(f"Expected `layers` to name modules of the model, got unknown {missing}.")
        if method == "last_layer":
            if layers is None:
                linears = [name for name, m in modules.items() if isinstance(m, nn.Linear)]
                if not linears:
                    raise ValueError("`method='last_layer'` needs an `nn.Linear` in the model; there is none.")
                layers = [linears[-1]]
            if len(layers) != 1 or not isinstance(modules[layers[0]], nn.Linear):
                raise ValueError(f"Expected `layers` to name one `nn.Linear` for method='last_layer', got {layers}.")
        self.layers = list(layers) if layers is not None else None
        self._param_names = self._selected_parameters()
        self._projections: dict[tuple[int, int], Tensor] = {}

    def _selected_parameters(self) -> list[str]:
        if self.layers is None:
            return [name for name, p in self.model.named_parameters() if p.requires_grad]
        names: list[str] = []
        for layer in self.layers:
            prefix = f"{layer}." if layer else ""
            for name, p in self.model.named_parameters():
                if name.startswith(prefix) and p.requires_grad and name not in names:
                    names.append(name)
        if not names:
            raise ValueError(f"`layers` {self.layers} hold no trainable parameters.")
        return names

    # ------------------------------------------------------------------------------------------------------------
    # Public API
    # ------------------------------------------------------------------------------------------------------------
    def self_influence(self, dataset: Dataset) -> Tensor:
        """``sum_i lr_i ||grad l(w_i, z)||^2`` for every example ``z`` of ``dataset`` (a 1-D tensor, on the CPU)."""
        n = len(dataset)  # type: ignore[arg-type]
        rank, world_size = self._distribution()
        part = Subset(dataset, shard(n, rank, world_size))
        local = torch.zeros(len(part), dtype=torch.float64)
        with self._scoring():
            for lr, at, terms in self._walk(part, "self-influence"):
                norms = _dots(terms)
                local[at : at + norms.numel()] += lr * norms.cpu()
        return self._gather(local, n, world_size)

    def influence(self, train_dataset: Dataset, test_batch: Sequence[Tensor]) -> Tensor:
        """TracInCP scores of every training example for every test example: ``(n_test, n_train)`` (on the CPU).

        ``test_batch`` is one batch in the training batches' format (inputs, then targets). A positive score
        marks a proponent (training on it lowered the test example's loss), a negative one an opponent.
        """
        n = len(train_dataset)  # type: ignore[arg-type]
        rank, world_size = self._distribution()
        part = Subset(train_dataset, shard(n, rank, world_size))
        m = len(test_batch[-1])
        local = torch.zeros(m, len(part), dtype=torch.float64)
        test_terms: list[list[Tensor]] = []

        def on_checkpoint(index: int) -> None:
            test_terms[:] = self._features(self._to_device(test_batch))

        with self._scoring():
            for lr, at, terms in self._walk(part, "influence", on_checkpoint):
                scores = _dots(test_terms, terms)
                local[:, at : at + scores.shape[1]] += lr * scores.cpu()
        return self._gather(local, n, world_size)

    def top_influential(
        self, train_dataset: Dataset, test_batch: Sequence[Tensor], k: int, proponents: bool = True
    ) -> tuple[Tensor, Tensor]:
        """The ``k`` strongest proponents (or opponents) of every test example, strongest first.

        Returns ``(indices, scores)``, each ``(n_test, k)``, as Captum's ``influence(inputs, k=k, proponents=...)``.
        """
        scores = self.influence(train_dataset, test_batch)
        values, indices = torch.topk(scores if proponents else -scores, k, dim=1)
        return indices, values if proponents else -values

    def losses(self, dataset: Dataset) -> Tensor:
        """The per-example loss at the model's current weights (for a loss-ranking baseline), sharded like the rest."""
        n = len(dataset)  # type: ignore[arg-type]
        rank, world_size = self._distribution()
        part = Subset(dataset, shard(n, rank, world_size))
        local = torch.zeros(len(part), dtype=torch.float64)
        with self._eval_mode(), torch.no_grad():
            at = 0
            for batch in DataLoader(part, batch_size=self.batch_size, shuffle=False):
                batch = self._to_device(batch)
                values = self.loss_fn(self.model(*batch[:-1]), batch[-1]).double().cpu()
                local[at : at + values.numel()] = values
                at += values.numel()
        return self._gather(local, n, world_size)

    # ------------------------------------------------------------------------------------------------------------
    # Iteration over checkpoints and batches
    # ------------------------------------------------------------------------------------------------------------
    def _walk(
        self, part: Dataset, what: str, on_checkpoint: Callable[[int], None] | None = None
    ) -> Iterator[tuple[float, int, list[list[Tensor]]]]:
        """Load every checkpoint in turn and yield ``(learning rate, offset, features)`` for every batch of ``part``."""
        loader = DataLoader(part, batch_size=self.batch_size, shuffle=False)
        progress = self._progress(len(self.checkpoints) * len(loader), what)
        try:
            for i, path in enumerate(self.checkpoints):
                lr = float(self.checkpoints_load_func(self.model, path))
                if on_checkpoint is not None:
                    on_checkpoint(i)
                at = 0
                for batch in loader:
                    terms = self._features(self._to_device(batch))
                    yield lr, at, terms
                    at += terms[0][0].shape[0]
                    if progress is not None:
                        progress.update(1)
        finally:
            if progress is not None:
                progress.close()

    def _progress(self, total: int, what: str) -> Any:
        if not self.show_progress or _world()[0] != 0:
            return None
        from tqdm.auto import tqdm  # a dependency of Lightning

        return tqdm(total=total, desc=f"TracIn {what} ({len(self.checkpoints)} checkpoints)", unit="batch")

    def _distribution(self) -> tuple[int, int]:
        rank, world_size = _world()
        use = self.distributed if self.distributed is not None else world_size > 1
        if use and world_size == 1 and self.distributed:
            raise RuntimeError("`distributed=True` needs torch.distributed to be initialised.")
        return (rank, world_size) if use else (0, 1)

    def _gather(self, local: Tensor, n: int, world_size: int) -> Tensor:
        if world_size == 1:
            return local
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
        return _gather_last_dim(local.to(device), n, world_size).cpu()

    def _to_device(self, batch: Sequence[Any]) -> list[Any]:
        device = next(self.model.parameters()).device
        return [t.to(device) if isinstance(t, Tensor) else t for t in batch]

    @contextmanager
    def _eval_mode(self) -> Iterator[None]:
        training = self.model.training
        self.model.eval()  # dropout off, batch norm on running statistics: examples do not interact
        try:
            yield
        finally:
            self.model.train(training)

    @contextmanager
    def _scoring(self) -> Iterator[None]:
        """Eval mode, and the model's own weights back afterwards (checkpoints are loaded into it)."""
        saved = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        try:
            with self._eval_mode():
                yield
        finally:
            self.model.load_state_dict(saved)

    # ------------------------------------------------------------------------------------------------------------
    # Gradient features. An example is a list of terms, each a list of factors (rows of ``(batch, *)`` matrices);
    # the score of two examples is the sum over terms of the product over factors of their dot products. Full
    # gradients: one term per parameter, one factor each (no concatenation into one huge matrix); last layer: one
    # term with the factors ``a`` and ``delta``; a projection folds the full gradient's terms into one.
    # ------------------------------------------------------------------------------------------------------------
    def _features(self, batch: Sequence[Any]) -> list[list[Tensor]]:
        if self.method == "last_layer":
            return [[self._project(factor, i) for i, factor in enumerate(self._last_layer_factors(batch))]]
        grads = self._full_gradients(batch)
        if self.projection_dim is None or sum(g.shape[1] for g in grads) <= self.projection_dim:
            return [[g] for g in grads]
        # one Gaussian block per parameter: together they are one (d x k) Gaussian matrix, never materialised whole
        projected = sum(self._project(g, 16 + i, force=True) for i, g in enumerate(grads))
        return [[projected]]  # type: ignore[list-item]

    def _full_gradients(self, batch: Sequence[Any]) -> list[Tensor]:
        """Per-example gradients of the selected parameters, each flattened to ``(batch, numel)``."""
        from torch.func import functional_call, grad, vmap

        model = self.model
        selected = set(self._param_names)
        params = {name: p.detach() for name, p in model.named_parameters() if name in selected}
        frozen = {name: p.detach() for name, p in model.named_parameters() if name not in selected}
        frozen.update(dict(model.named_buffers()))
        loss_fn = self.loss_fn

        def example_loss(p: dict[str, Tensor], *example: Any) -> Tensor:
            batched = [t.unsqueeze(0) if isinstance(t, Tensor) else t for t in example]
            outputs = functional_call(model, (p, frozen), tuple(batched[:-1]))
            return loss_fn(outputs, batched[-1]).sum()

        in_dims = (None, *(0 if isinstance(t, Tensor) else None for t in batch))
        grads = vmap(grad(example_loss), in_dims=in_dims)(params, *batch)
        return [grads[name].flatten(1) for name in self._param_names]

    def _last_layer_factors(self, batch: Sequence[Any]) -> list[Tensor]:
        """``[a, delta]`` per example for the final linear layer (``a`` extended by a 1 for the bias)."""
        layer = dict(self.model.named_modules())[self.layers[0]]  # type: ignore[index]
        captured: dict[str, Tensor] = {}

        def capture(module: nn.Module, inputs: tuple[Tensor, ...], output: Tensor) -> None:
            captured["a"], captured["z"] = inputs[0], output

        handle = layer.register_forward_hook(capture)
        try:
            with torch.enable_grad():
                outputs = self.model(*batch[:-1])
                a, z = captured["a"], captured["z"]
                if a.dim() != 2:
                    raise ValueError(
                        f"method='last_layer' needs the layer's input to be (batch, features), got {tuple(a.shape)}."
                    )
                delta = torch.autograd.grad(self.loss_fn(outputs, batch[-1]).sum(), z)[0]
        finally:
            handle.remove()
        a = a.detach()
        if layer.bias is not None and layer.bias.requires_grad:
            a = torch.cat([a, torch.ones_like(a[:, :1])], dim=1)
        if not layer.weight.requires_grad:
            raise ValueError("method='last_layer' scores the last layer's weights, which do not require grad.")
        return [a, delta.detach()]

    def _project(self, factor: Tensor, index: int, force: bool = False) -> Tensor:
        k = self.projection_dim
        d = factor.shape[1]
        if k is None or (d <= k and not force):
            return factor
        key = (index, d)
        matrix = self._projections.get(key)
        if matrix is None:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
            # entries N(0, 1/k): E[(x P).(y P)] = x.y
            matrix = torch.randn(d, k, generator=generator, dtype=factor.dtype) / math.sqrt(k)
            self._projections[key] = matrix = matrix.to(factor.device)
        return factor @ matrix


def _dots(left: list[list[Tensor]], right: list[list[Tensor]] | None = None) -> Tensor:
    """Scores from features: ``sum over terms of prod over factors of left . right`` (float64).

    With ``right`` omitted, every example with itself (a vector of squared norms); otherwise every example of
    ``left`` with every example of ``right`` (a matrix).
    """
    total: Tensor | None = None
    for i, term in enumerate(left):
        product: Tensor | None = None
        for j, factor in enumerate(term):
            value = factor.pow(2).sum(1) if right is None else factor @ right[i][j].T
            product = value.double() if product is None else product * value.double()
        assert product is not None
        total = product if total is None else total + product
    assert total is not None
    return total


# ----------------------------------------------------------------------------------------------------------------
# Evaluation
# ----------------------------------------------------------------------------------------------------------------
def detection_curve(order: Iterable[int], flagged: set[int], fractions: Sequence[float]) -> list[float]:
    """Fraction of ``flagged`` examples among the first ``fraction`` of ``order``, for every fraction.

    The mislabeled-data protocol of the TracIn paper: inspect the training data in the order of a score and count
    how many of the corrupted examples have been found.
    """
    order = list(order)
    found = []
    for fraction in fractions:
        inspected = order[: int(round(fraction * len(order)))]
        found.append(sum(1 for i in inspected if i in flagged) / max(1, len(flagged)))
    return found
