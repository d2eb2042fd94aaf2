"""Pufferfish: train full-rank for a warm-up, then factorize the model into low-rank layers and go on training.

Wang, Agarwal & Papailiopoulos, "Pufferfish: Communication-efficient Models At No Extra Cost", MLSys 2021
(arXiv:2103.03936, github.com/hwang595/Pufferfish). The gradient of a factorized layer is the gradient of its factors,
so plain DDP averaging moves fewer numbers and the forward and backward passes do less arithmetic; no compression
kernel and no error feedback are involved. The paper's procedure ("vanilla warm-up" with SVD initialisation):

1. train the full-rank model for ``E_wu`` epochs;
2. replace every chosen layer by two factors initialised from its truncated SVD, rank ``ratio * min(m, n)``;
3. re-create the optimizer (and go on with the same learning-rate schedule), and train the factorized model.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from typing_extensions import override

from lightning_gradcomp.ddp.strategy import CompressedDDP
from lightning_gradcomp.runtime.model_transform import ModelTransform
from lightning_gradcomp.transforms.complexity import MacCounter, count_parameters
from lightning_gradcomp.transforms.lowrank import (
    FactorizedConv,
    FactorizedLinear,
    FactorizedLSTM,
    FactorizedMultiheadAttention,
    factorize,
)
from lightning_gradcomp.validation import check_bool, check_int, check_ratio

_FACTORIZED = (FactorizedLinear, FactorizedConv, FactorizedLSTM, FactorizedMultiheadAttention)
#: the paper's ImageNet "hybrid" ResNet-50 / Wide-ResNet-50-2: layer1 to layer3 (and stem and classifier) full-rank
_TORCHVISION_RESNET = ("conv1", "layer1.*", "layer2.*", "layer3.*", "fc")


def rank_rule(ratio: float) -> Callable[[int, int], int]:
    """Pufferfish's rank for an ``m x n`` weight: ``max(1, int(ratio * min(m, n)))`` (``int(rank / 4)`` in the code)."""
    return lambda m, n: max(1, int(ratio * min(m, n)))


def _kind(module: nn.Module) -> str | None:
    """What kind of factorizable layer ``module`` is, or ``None``."""
    if isinstance(module, _FACTORIZED):
        return None
    if isinstance(module, nn.Linear):
        return "linear"
    if isinstance(module, nn.modules.conv._ConvNd):
        transposed = isinstance(module, nn.modules.conv._ConvTransposeNd)
        return "conv" if not transposed and module.groups == 1 else None
    if type(module) is nn.LSTM:
        return "lstm" if not module.proj_size else None
    if isinstance(module, nn.MultiheadAttention):
        return "attention" if module.bias_k is None and not module.add_zero_attn else None
    return None


def _matrices(module: nn.Module) -> Iterator[tuple[int, int]]:
    """The ``m x n`` shapes a layer's factorization replaces (one per gate or projection)."""
    if isinstance(module, (nn.Linear, nn.modules.conv._ConvNd)):
        yield module.weight.shape[0], module.weight[0].numel()
    elif isinstance(module, nn.LSTM):
        for name in module._flat_weights_names:
            if name.startswith("weight_"):
                yield module.hidden_size, getattr(module, name).shape[1]
    elif isinstance(module, nn.MultiheadAttention):
        e = module.embed_dim
        yield from ((e, e), (e, module.kdim), (e, module.vdim), (e, e))


def candidates(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The layers that can be factorized, in registration order (the order positions in ``full_rank`` refer to).

    Linear layers, convolutions with ``groups=1``, LSTMs without projections and multi-head attention without
    ``add_bias_kv``/``add_zero_attn``. Layers holding a parameter shared with another layer (tied embeddings and
    decoders) are not candidates: a shared weight cannot be replaced by factors in one place only.
    """
    counts: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        counts[id(p)] = counts.get(id(p), 0) + 1

    def walk(module: nn.Module, prefix: str) -> Iterator[tuple[str, nn.Module]]:
        for name, child in module.named_children():
            full = prefix + name
            if _kind(child) is not None:
                if all(counts[id(p)] == 1 for p in child.parameters()):
                    yield full, child
            elif not isinstance(child, (*_FACTORIZED, nn.MultiheadAttention, nn.RNNBase)):
                yield from walk(child, full + ".")

    return list(walk(model, ""))


def default_full_rank(model: nn.Module) -> list[str | int]:
    """The layers the paper keeps full-rank, for the models it trains; else the first and the last layer.

    Recognised (also as submodules, e.g. ``self.net = CifarResNet18()``): models that declare
    ``pufferfish_full_rank`` (:class:`~lightning_gradcomp.models.CifarResNet18`: ``conv1``, ``layer1.0``, the
    shortcuts and ``linear``; :class:`~lightning_gradcomp.models.VGG19BN`: ``conv1`` to ``conv9`` and
    ``classifier.6``) and torchvision's ResNets (the paper's ResNet-50 "hybrid": ``conv1``, ``layer1`` to ``layer3``
    and ``fc``). Otherwise the first candidate when it is a convolution or linear layer (the input layer) and the last
    when it is a linear layer (the classifier), as the paper does for every model; its LSTM and Transformer
    experiments also keep embeddings (not candidates) and, for the Transformer, the first encoder and decoder layer
    (pass ``full_rank=["*layers.0.*"]``).
    """
    patterns: list[str | int] = []
    for name, module in model.named_modules():
        preset = getattr(type(module), "pufferfish_full_rank", None)
        if preset is None and _is_torchvision_resnet(module):
            preset = _TORCHVISION_RESNET
        if preset:
            prefix = f"{name}." if name else ""
            patterns.extend(prefix + pattern for pattern in preset)
    if patterns:
        return patterns
    layers = candidates(model)
    positions: list[str | int] = []
    if layers and _kind(layers[0][1]) in ("conv", "linear"):
        positions.append(0)
    if layers and _kind(layers[-1][1]) == "linear":
        positions.append(-1)
    return positions


def _is_torchvision_resnet(module: nn.Module) -> bool:
    try:
        from torchvision.models import ResNet
    except ImportError:  # pragma: no cover (torchvision is a dependency)
        return False
    return isinstance(module, ResNet)


@dataclass(frozen=True)
class Decision:
    """What happens to one candidate layer."""

    name: str
    kind: str
    factorize: bool
    reason: str


def plan(model: nn.Module, rank_ratio: float, full_rank: Sequence[str | int] | None = None) -> list[Decision]:
    """Decide, for every candidate layer, whether it is factorized (and why not, if it is not).

    A layer stays full-rank if its name matches a pattern of ``full_rank``, if its position among the candidates is
    in ``full_rank`` (negative positions count from the end), or if factorizing it at this rank would not save
    parameters (``r (m + n) >= m n`` for one of its matrices).
    """
    layers = candidates(model)
    rules = default_full_rank(model) if full_rank is None else list(full_rank)
    n = len(layers)
    positions = {p % n for p in rules if isinstance(p, int) and -n <= p < n}
    patterns = [p for p in rules if isinstance(p, str)]
    rank = rank_rule(rank_ratio)
    decisions = []
    for i, (name, module) in enumerate(layers):
        kind = _kind(module)
        if kind is None:  # candidates() lists only layers of a factorizable kind
            continue
        matched = next((p for p in patterns if fnmatch.fnmatchcase(name, p)), None)
        if matched is not None:
            decisions.append(Decision(name, kind, False, f"full-rank by pattern {matched!r}"))
        elif i in positions:
            decisions.append(Decision(name, kind, False, f"full-rank by position {i}"))
        elif any(rank(m, k) * (m + k) >= m * k for m, k in _matrices(module)):
            decisions.append(Decision(name, kind, False, "no parameters saved at this rank"))
        else:
            decisions.append(Decision(name, kind, True, "factorized"))
    return decisions


def unused_rules(model: nn.Module, full_rank: Sequence[str | int]) -> list[str | int]:
    """The patterns of ``full_rank`` that match no candidate layer and the positions out of range (likely typos)."""
    names = [name for name, _ in candidates(model)]
    n = len(names)
    return [
        rule
        for rule in full_rank
        if (isinstance(rule, str) and not any(fnmatch.fnmatchcase(name, rule) for name in names))
        or (isinstance(rule, int) and not -n <= rule < n)
    ]


def apply_factorization(model: nn.Module, layers: Sequence[str], rank_ratio: float, svd: bool = True) -> None:
    """Replace each named layer of ``model`` by its SVD-initialised factorization (in place).

    ``svd=False`` builds the factorized structure only, for weights that are about to be loaded into it.
    """
    rank = rank_rule(rank_ratio)
    for name in layers:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        old = getattr(parent, child)
        if isinstance(old, _FACTORIZED):
            continue
        setattr(parent, child, factorize(old, rank, svd))
    # a transformer encoder's nested-tensor inference path bypasses the attention module's own forward
    for module in model.modules():
        if isinstance(module, nn.TransformerEncoder) and any(isinstance(m, _FACTORIZED) for m in module.modules()):
            module.use_nested_tensor = False


class Pufferfish(ModelTransform):
    """Factorize the model into low-rank layers after a full-rank warm-up, within one ``trainer.fit``.

    At the start of epoch ``warmup_epochs`` (epoch 0: from the first step) every chosen layer is replaced by two
    factors initialised from its truncated SVD (``nn.Conv*``: a ``k x k`` convolution to ``r`` channels then a
    ``1 x 1`` one; ``nn.Linear``: ``in -> r -> out``; ``nn.LSTM``: each gate matrix; ``nn.MultiheadAttention``,
    also inside ``nn.TransformerEncoderLayer``: the query, key, value and output projections), with
    ``r = int(rank_ratio * min(m, n))`` for a weight viewed as ``m x n``. Then
    :meth:`CompressedDDP.rewrap_model <lightning_gradcomp.CompressedDDP.rewrap_model>` wraps the new model in DDP,
    registers the communication hook again and rebuilds the optimizers and schedulers (continuing the schedule).
    The factorization runs on every rank from equal replicas; that the factors came out bitwise equal on all ranks is
    checked (:attr:`replicas_identical`) before DDP broadcasts rank 0's copy. Parameter counts are printed then;
    multiply-accumulates of the next training batch (factorized and full-rank) are printed after it and logged as
    ``pufferfish/*``. Checkpoints written after the factorization resume into the factorized model.

    Args:
        warmup_epochs: full-rank epochs before factorizing (the paper's ``E_wu``: 80 of 300 for ResNet-18 on
            CIFAR-10, 30 for VGG-19-BN, 15 for ResNet-50 on ImageNet, 5 for the LSTM, 50 for the Transformer).
        rank_ratio: rank as a fraction of ``min(m, n)``, in (0, 1] (the paper: 1/4).
        full_rank: layers kept full-rank: module-name patterns (``fnmatch``, e.g. ``"layer1.*"``) and positions among
            the factorizable layers (:func:`candidates`; ``-1`` is the last). ``None``: the paper's choice for its
            models (:func:`default_full_rank`), else the first and the last layer.
        keep_lr_schedule: go on with the LR schedule where it was (the paper); ``False`` restarts it with the
            rebuilt optimizers.
        verbose: print the per-layer decisions at factorization.

    Raises:
        MisconfigurationException: If an argument is out of range, or (in ``setup``) the strategy is not
            ``CompressedDDP``.

    Example::

        >>> from lightning.pytorch import Trainer
        >>> from lightning_gradcomp import CompressedDDP, Pufferfish
        >>> trainer = Trainer(accelerator="cpu", devices=2, strategy=CompressedDDP(),
        ...                   callbacks=[Pufferfish(warmup_epochs=80)], max_epochs=300)
    """

    def __init__(
        self,
        warmup_epochs: int,
        rank_ratio: float = 0.25,
        full_rank: Sequence[str | int] | None = None,
        keep_lr_schedule: bool = True,
        verbose: bool = False,
    ) -> None:
        check_int(warmup_epochs, "warmup_epochs", low=0, error=MisconfigurationException)
        check_ratio(rank_ratio, "rank_ratio", error=MisconfigurationException)
        if full_rank is not None:
            if isinstance(full_rank, (str, int)) or not all(
                isinstance(x, str) or (isinstance(x, int) and not isinstance(x, bool)) for x in full_rank
            ):
                raise MisconfigurationException(
                    "Expected `full_rank` to be None or a list of module-name patterns (str) and positions (int),"
                    f" got {full_rank!r}."
                )
            full_rank = list(full_rank)
        check_bool(keep_lr_schedule, "keep_lr_schedule", error=MisconfigurationException)
        check_bool(verbose, "verbose", error=MisconfigurationException)
        self.warmup_epochs = warmup_epochs
        self.rank_ratio = float(rank_ratio)
        self.full_rank = full_rank
        self.keep_lr_schedule = keep_lr_schedule
        self.verbose = verbose
        self.layers: list[str] | None = None  # the factorized layers, once factorized
        self.factorized_ratio: float | None = None
        self.replicas_identical: bool | None = None
        self.report: dict[str, int] = {}
        self._counter: MacCounter | None = None
        self._counting: Any = None

    # ------------------------------------------------------------------------------------------------------------
    # Lightning hooks
    # ------------------------------------------------------------------------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            CompressedDDP.require(trainer, self)

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.layers is None and trainer.current_epoch >= self.warmup_epochs:
            self.factorize(trainer, pl_module)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._counter is not None and self._counting is None:
            self._counting = self._counter.attached()
            self._counting.__enter__()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        counter = self._counter
        if self._counting is None or counter is None:
            return
        self._counting.__exit__(None, None, None)
        self._counter, self._counting = None, None
        self.report.update(macs_full_rank=counter.full_rank, macs=counter.total)
        rank_zero_info(
            f"Pufferfish: multiply-accumulates of one training batch (rank 0): {counter.full_rank:,} full-rank ->"
            f" {counter.total:,} factorized ({counter.full_rank / max(1, counter.total):.2f}x fewer)."
        )
        for key, value in self.report.items():
            pl_module.log(f"pufferfish/{key}", float(value), on_step=True, on_epoch=False, batch_size=1)

    # ------------------------------------------------------------------------------------------------------------
    # The factorization
    # ------------------------------------------------------------------------------------------------------------
    def factorize(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Factorize ``pl_module`` now and re-wrap it (call on every rank, between steps)."""
        strategy = CompressedDDP.require(trainer, self)
        if self.full_rank is not None and (unused := unused_rules(pl_module, self.full_rank)):
            rank_zero_warn(f"Pufferfish: `full_rank` entries {unused} match no factorizable layer (see `candidates`).")
        decisions = plan(pl_module, self.rank_ratio, self.full_rank)
        chosen = [d.name for d in decisions if d.factorize]
        before = count_parameters(pl_module)
        apply_factorization(pl_module, chosen, self.rank_ratio)
        after = count_parameters(pl_module)
        self.layers, self.factorized_ratio = chosen, self.rank_ratio
        new_params = [p for name in chosen for p in pl_module.get_submodule(name).parameters()]
        self.replicas_identical = strategy.identical_on_all_ranks(new_params)
        if not self.replicas_identical:
            rank_zero_warn(
                "Pufferfish: the SVD factors differ between ranks (a nondeterministic SVD?); DDP now broadcasts"
                " rank 0's copy, so training goes on with identical replicas."
            )
        strategy.rewrap_model(keep_lr_schedule=self.keep_lr_schedule)
        self.report = {"params_full_rank": before, "params": after}
        self._counter = MacCounter(pl_module)
        if self.verbose:
            for d in decisions:
                rank_zero_info(f"Pufferfish: {d.name} ({d.kind}): {d.reason}")
        rank_zero_info(
            f"Pufferfish: factorized {len(chosen)} of {len(decisions)} layers at epoch {trainer.current_epoch} (rank"
            f" ratio {self.rank_ratio:g}): {before:,} -> {after:,} parameters ({before / max(1, after):.2f}x fewer)."
        )

    # ------------------------------------------------------------------------------------------------------------
    # Checkpoints
    # ------------------------------------------------------------------------------------------------------------
    @override
    def structure_state(self) -> dict[str, Any] | None:
        if self.layers is None:
            return None
        return {"format": 1, "layers": list(self.layers), "rank_ratio": self.factorized_ratio}

    @override
    def restore_structure(self, module: nn.Module, state: dict[str, Any] | None) -> None:
        """Factorize the layers a checkpoint's model had factorized (``state``: its :meth:`structure_state`).

        Also usable outside a Trainer, to load a factorized checkpoint for inference::

            checkpoint = torch.load(path, weights_only=True)
            Pufferfish(warmup_epochs=0).restore_structure(model, checkpoint["gradcomp_transforms"]["Pufferfish"])
            model.load_state_dict(checkpoint["state_dict"])
        """
        if state is None:
            return
        if state["rank_ratio"] != self.rank_ratio:
            rank_zero_warn(
                f"Pufferfish: the checkpoint's model was factorized at rank ratio {state['rank_ratio']:g}, not"
                f" {self.rank_ratio:g}; it is restored as it was."
            )
        # the structure only: the weights of the checkpoint are loaded into it next
        apply_factorization(module, state["layers"], state["rank_ratio"], svd=False)
        self.layers, self.factorized_ratio = list(state["layers"]), state["rank_ratio"]

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"structure": self.structure_state()}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        structure = state_dict.get("structure")
        if structure is not None:  # the structure itself was rebuilt before the weights were loaded
            self.layers, self.factorized_ratio = list(structure["layers"]), structure["rank_ratio"]
