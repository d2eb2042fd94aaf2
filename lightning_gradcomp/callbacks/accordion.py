"""``Accordion``: compress each layer gently in critical learning regimes and hard otherwise.

Agarwal, Wang, Lee, Venkataraman & Papailiopoulos, "Accordion: Adaptive Gradient Communication via Critical Learning
Regime Identification", MLSys 2021 (arXiv:2010.16248); reference code: github.com/uw-mad-dash/Accordion
(``auto_scale.py``, ``main.py``).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, GradientAccumulationScheduler
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor
from typing_extensions import override

from lightning_gradcomp.compressors.base import Compressor, Layer
from lightning_gradcomp.compressors.planned import Planned
from lightning_gradcomp.ddp.strategy import CompressedDDP
from lightning_gradcomp.validation import check_choice, check_int, check_number, check_positive_int

_MiscError = MisconfigurationException

#: The reference code's level pairs (low compression, high compression) per level attribute: PowerSGD rank 2 vs 1
#: (``auto_scale.py``), top-k keep 99 % vs 10 % (``auto_scale_topk.py``, CIFAR-10).
DEFAULT_LEVELS: dict[str, tuple[float, float]] = {"rank": (2, 1), "ratio": (0.99, 0.1)}
#: Level attributes for which a larger value compresses less: PowerSGD's rank, a keep-ratio, QSGD's number of levels.
GENTLER_WHEN_LARGER = frozenset({"rank", "ratio", "levels"})
#: Batch-size mode: the reference logs switch between batches of 512 and 4096.
DEFAULT_BATCH_SIZE_FACTOR = 8

Mode = Literal["levels", "batch_size", "both"]


def relative_changes(current: Mapping[str, float], previous: Mapping[str, float] | None) -> dict[str, float]:
    """``|N_prev - N| / N_prev`` per layer; infinite where there is no previous norm or it is zero (critical)."""
    changes = {}
    for name, norm in current.items():
        prev = None if previous is None else previous.get(name)
        changes[name] = float("inf") if prev is None or prev == 0 else abs(prev - norm) / prev
    return changes


def _monitored_by_reference(layer: Layer, min_numel: int) -> bool:
    """Whether the reference code would track ``layer`` when no compression level is switched.

    Tensors of two or more dimensions with at least ``min_numel`` elements (biases and normalisation weights are
    left out). Batch-size mode works with any compressor (``Identity`` included, which "compresses" every layer), so the
    tracked layers cannot be the compressor's own choice.
    """
    return layer.ndim >= 2 and layer.numel >= min_numel


class LocalGradientSum:
    """Sum, per parameter, of this rank's own gradients before DDP communicates them.

    DDP overwrites ``param.grad`` with the average of all ranks, so the local gradient is tapped where autograd
    produces it: a tensor hook on each parameter (``param.register_hook``) sees every backward pass's contribution
    before it is accumulated into ``.grad`` and before DDP's reducer hooks run. With gradient accumulation every
    micro-batch's contribution arrives separately; ``scale`` undoes Lightning's division of the loss by
    ``accumulate_grad_batches``, so the sum is the sum of the micro-batches' mean gradients whatever the
    accumulation (and a change of it does not look like a change of regime).

    Args:
        params: the parameters to tap, by name.
    """

    def __init__(self, params: Mapping[str, Tensor]) -> None:
        self.sums = {name: torch.zeros(p.shape, dtype=torch.float32, device=p.device) for name, p in params.items()}
        self.scale = 1.0
        self.backward_passes = 0
        self._handles = [p.register_hook(self._tap(name)) for name, p in params.items()]

    def _tap(self, name: str) -> Any:
        total = self.sums[name]

        def hook(grad: Tensor) -> None:
            total.add_(grad.detach(), alpha=self.scale)

        return hook

    def norms(self) -> dict[str, float]:
        """The L2 norm of every sum (one host sync per layer, once per epoch)."""
        return {name: float(torch.linalg.vector_norm(total)) for name, total in self.sums.items()}

    def reset(self) -> None:
        """Start a new epoch."""
        for total in self.sums.values():
            total.zero_()
        self.backward_passes = 0

    def remove(self) -> None:
        """Remove the tensor hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles = []


def _check_arguments(
    interval: Any, eta: Any, low: Any, high: Any, mode: Any, batch_size_factor: Any, lr_drop: Any
) -> None:
    """Refuse :class:`Accordion`'s arguments out of range, or set for a ``mode`` that does not use them, in one line."""
    check_positive_int(interval, "interval", error=_MiscError)
    check_number(eta, "eta", low=0, low_open=True, error=_MiscError)
    check_choice(mode, "mode", ("levels", "batch_size", "both"), error=_MiscError)
    if mode == "batch_size" and (low is not None or high is not None):
        raise MisconfigurationException(
            "`low_compression_level` and `high_compression_level` are set but `mode='batch_size'` does not switch"
            " compression levels (use mode='both')."
        )
    # NaN would compare false with everything and silently pass the order check in setup; a string is a
    # candidate's name (AutoCompression's limits), checked against the candidates in setup
    for name, level in (
        ("low_compression_level", low),
        ("high_compression_level", high),
    ):
        if not isinstance(level, str):
            check_number(level, name, low=0, low_open=True, allow_none=True, error=_MiscError)
    if batch_size_factor is not None:
        if mode == "levels":
            raise MisconfigurationException(
                "`batch_size_factor` is set but `mode='levels'` does not switch the batch size (use mode='both')."
            )
        check_int(batch_size_factor, "batch_size_factor", low=2, error=_MiscError)
    check_number(lr_drop, "lr_drop", low=0, high=1, error=_MiscError)


class Accordion(Callback):
    """Adapt each layer's compression to its learning regime (Accordion, Agarwal et al., MLSys 2021).

    Critical learning regimes (the first epochs, the epochs after a learning-rate decay) are when compressing hard
    costs accuracy; elsewhere it costs little. Accordion detects them per layer from how fast the gradient changes:

    1. every step, before compression, rank 0 adds its own local gradient of every compressed layer into a per-epoch
       sum ``A`` (a tensor hook on the parameter: DDP replaces ``.grad`` with the average, and the reference code
       sums the local gradient);
    2. at the end of every epoch ``e`` it stores ``N[e] = ||A||``;
    3. at the end of every epoch with ``e % interval == 0`` it compares ``|N[e - interval] - N[e]| / N[e -
       interval]`` with ``eta`` per layer: at least ``eta`` (or no earlier norm: the first check, a zero norm)
       means a critical regime and low compression for that layer until the next check, otherwise high
       compression. Rank 0 decides and broadcasts, so every rank compresses every layer alike;
    4. when the learning rate decays (checked at every epoch start), every layer goes to low compression at once
       and stays there at least until the next check after the decay's epoch: a check at the end of the decay's own
       epoch does not override it (the reference applies the decay rule after the check); a later check may raise
       compression again.

    Layers start at low compression. Levels are applied with :meth:`Compressor.set_levels` (PowerSGD ranks, top-k
    and random-k keep-ratios); error-feedback memory is kept across switches (the reference's default). In
    ``"batch_size"`` mode the regime instead switches the effective batch size (Accordion's second use): while any
    layer is critical, batches as configured; otherwise ``batch_size_factor`` times larger, by accumulating that many
    batches per optimizer step (so that many times fewer all-reduces). The learning rate is left alone.

    Logged at every epoch end, per tracked layer: ``accordion/level/<name>`` (the level it was compressed at during
    the epoch), ``accordion/critical/<name>`` (1 if that was the low-compression level), and at check epochs
    ``accordion/norm_change/<name>``; in batch-size mode ``accordion/accumulate_grad_batches``. The norm history,
    the decisions and every epoch's record (:attr:`history`) are the callback's ``state_dict``, so they are saved
    in checkpoints and a resumed run makes the same decisions.

    Args:
        interval: epochs between checks (the reference's ``switch_freq``: 10 for CIFAR and ImageNet, 5 for the
            WikiText-2 LSTM).
        eta: threshold on the relative change of a layer's accumulated-gradient norm (the reference's 0.5).
        low_compression_level: the level in critical regimes (compresses less). ``None``: the reference's, PowerSGD
            rank 2 or keep-ratio 0.99; with AutoCompression, its first candidate (``"dense"``).
        high_compression_level: the level otherwise. ``None``: PowerSGD rank 1 or keep-ratio 0.1; with
            AutoCompression, its last candidate (no limit).
        mode: ``"levels"`` switches compression levels per layer (needs a compressor with a level),
            ``"batch_size"`` switches the batch size (any compressor, ``Identity`` included), ``"both"`` does both.
        batch_size_factor: how many times larger the effective batch is outside critical regimes (batch-size
            modes only; ``None``: 8, the reference logs' 512 vs 4096).
        lr_drop: a learning-rate decay is a learning rate below ``lr_drop`` times its value at the previous epoch
            start, in any parameter group. ``1.0`` (the reference's rule) counts any decrease; with a smooth
            schedule (cosine) use e.g. ``0.5`` so that only real drops count; ``0`` turns the rule off.

    Raises:
        MisconfigurationException: If an argument is out of range or does not apply to ``mode``; in ``setup``, if
            the strategy is not ``CompressedDDP``, the compressor has no level in a levels mode, a level is invalid
            for the compressor or does not compress less than the other, or batch-size mode meets a
            ``GradientAccumulationScheduler`` or manual optimization.

    Example::

        >>> from lightning.pytorch import Trainer
        >>> from lightning_gradcomp import CompressedDDP
        >>> from lightning_gradcomp.callbacks import Accordion
        >>> from lightning_gradcomp.compressors import PowerSGD
        >>> trainer = Trainer(accelerator="cpu", devices=2, strategy=CompressedDDP(PowerSGD(rank=1)),
        ...                   callbacks=[Accordion(interval=10, low_compression_level=2, high_compression_level=1)])

    With :class:`~lightning_gradcomp.callbacks.AutoCompression` (listed before Accordion), a level is a *limit*: the
    most lossy candidate a layer may use (:class:`~lightning_gradcomp.compressors.Planned`). Accordion decides how
    much compression is safe, AutoCompression what is fastest within it; the defaults are the first candidate
    (``"dense"``) in critical regimes and no limit otherwise::

        >>> from lightning_gradcomp.callbacks import AutoCompression
        >>> callbacks = [AutoCompression(), Accordion(low_compression_level="bf16", high_compression_level="topk-1%")]
    """

    def __init__(
        self,
        interval: int = 10,
        eta: float = 0.5,
        low_compression_level: int | float | str | None = None,
        high_compression_level: int | float | str | None = None,
        mode: Mode = "levels",
        batch_size_factor: int | None = None,
        lr_drop: float = 1.0,
    ) -> None:
        _check_arguments(interval, eta, low_compression_level, high_compression_level, mode, batch_size_factor, lr_drop)
        self.interval = interval
        self.eta = float(eta)
        self.low_compression_level = low_compression_level
        self.high_compression_level = high_compression_level
        self.mode = mode
        self.batch_size_factor = batch_size_factor
        self.lr_drop = float(lr_drop)
        # resolved in setup
        self._levels: tuple[Any, Any] | None = None
        self._candidate_names: list[str] = []
        self._layers: list[str] = []
        self._base_accumulation = 1
        # state (saved in checkpoints; identical on every rank: rank 0's numbers are broadcast)
        self.norms: dict[int, dict[str, float]] = {}
        self.critical: dict[str, bool] = {}
        self.history: list[dict[str, Any]] = []
        self._epoch_lrs: list[float] | None = None
        self._lr_decay_epoch: int | None = None
        self._pending_sums: dict[str, Tensor] | None = None
        # rank 0 only, while training
        self._sums: LocalGradientSum | None = None

    @property
    def switches_levels(self) -> bool:
        """Whether compression levels are switched (modes ``"levels"`` and ``"both"``)."""
        return self.mode in ("levels", "both")

    @property
    def switches_batch_size(self) -> bool:
        """Whether the batch size is switched (modes ``"batch_size"`` and ``"both"``)."""
        return self.mode in ("batch_size", "both")

    @property
    def levels(self) -> dict[str, Any]:
        """The level every tracked layer is compressed at now (levels modes)."""
        if self._levels is None:
            return {}
        low, high = self._levels
        return {name: low if self.critical.get(name, True) else high for name in self._layers}

    # ------------------------------------------------------------------------------------------------------------
    # Setup
    # ------------------------------------------------------------------------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        strategy = CompressedDDP.require(trainer, self)
        compressor: Compressor = strategy.compressor
        min_numel = strategy.compression_state.min_compress_numel
        if self.switches_levels:
            self._levels = self._resolve_levels(compressor)
            self._candidate_names = list(compressor.candidates) if isinstance(compressor, Planned) else []
        if self.switches_batch_size:
            callbacks: list[Callback] = getattr(trainer, "callbacks", [])  # set at init, undeclared on Trainer
            if any(isinstance(cb, GradientAccumulationScheduler) for cb in callbacks):
                raise MisconfigurationException(
                    "`Accordion(mode='batch_size')` sets `accumulate_grad_batches` itself and cannot be combined with"
                    " a `GradientAccumulationScheduler`."
                )
            if not pl_module.automatic_optimization:
                raise MisconfigurationException(
                    "`Accordion(mode='batch_size')` switches the batch size through gradient accumulation, which"
                    " needs automatic optimization."
                )
            self._base_accumulation = trainer.accumulate_grad_batches
        # which layers take a level can depend on it (PowerSGD's minimum gain): ask a copy at both levels
        probe = copy.copy(compressor) if self._levels is not None else compressor
        self._layers = [
            name
            for i, (name, p) in enumerate(pl_module.named_parameters())
            if p.requires_grad and self._tracks(probe, Layer(name, i, p.shape), min_numel)
        ]
        if not self._layers:
            raise MisconfigurationException(
                f"`Accordion` found no layer that {compressor!r} compresses (with min_compress_numel={min_numel})."
            )

    def _resolve_levels(self, compressor: Compressor) -> tuple[Any, Any]:
        attribute = compressor.level_attribute
        if attribute is None:
            raise MisconfigurationException(
                f"`Accordion(mode={self.mode!r})` switches compression levels, but {compressor!r} has no level to"
                " switch (use PowerSGD, TopK or RandomK, or mode='batch_size'; with AutoCompression, list it before"
                " Accordion in `callbacks`)."
            )
        default_low: Any
        default_high: Any
        if isinstance(compressor, Planned):  # AutoCompression's: critical regimes plan without compression
            default_low, default_high = next(iter(compressor.candidates)), compressor.limit
        else:
            default_low, default_high = DEFAULT_LEVELS.get(attribute, (None, None))
        low = self.low_compression_level if self.low_compression_level is not None else default_low
        high = self.high_compression_level if self.high_compression_level is not None else default_high
        if low is None or high is None:
            raise MisconfigurationException(
                f"`Accordion` has no default levels for {type(compressor).__name__}'s `{attribute}`: pass"
                " `low_compression_level` and `high_compression_level`."
            )
        try:
            low, high = compressor.check_level(low), compressor.check_level(high)
        except ValueError as err:
            raise MisconfigurationException(f"`Accordion`: a level is invalid for {compressor!r}: {err}") from err
        if isinstance(compressor, Planned) and not compressor.lossiness(low) < compressor.lossiness(high):
            raise MisconfigurationException(
                f"`low_compression_level` is the limit of critical regimes and must name a less lossy candidate than"
                f" `high_compression_level` (candidates from the least lossy: {list(compressor.candidates)}), got"
                f" low_compression_level={low!r} and high_compression_level={high!r}."
            )
        if attribute in GENTLER_WHEN_LARGER and not low > high:
            raise MisconfigurationException(
                f"`low_compression_level` is the level of critical regimes and must compress less than"
                f" `high_compression_level`: for {type(compressor).__name__}'s `{attribute}` a larger value compresses"
                f" less, so `low_compression_level` must be the larger one, got low_compression_level={low!r} and"
                f" high_compression_level={high!r}" + (" (swapped?)." if low < high else ".")
            )
        return low, high

    def _tracks(self, probe: Compressor, layer: Layer, min_numel: int) -> bool:
        if self._levels is None:  # batch-size mode: whatever the compressor, the layers the reference monitors
            return _monitored_by_reference(layer, min_numel)
        for level in self._levels:
            probe.set_levels({layer.name: level})
            compresses = probe.may_compress if isinstance(probe, Planned) else probe.compresses
            if compresses(layer, min_numel):
                return True
        return False

    # ------------------------------------------------------------------------------------------------------------
    # Training
    # ------------------------------------------------------------------------------------------------------------
    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.critical:  # a fresh run: every layer starts at low compression
            self.critical = dict.fromkeys(self._layers, True)
        self._apply(trainer)
        if trainer.is_global_zero:
            params = dict(pl_module.named_parameters())
            self._sums = LocalGradientSum({name: params[name] for name in self._layers})
            if self._pending_sums is not None:  # resumed inside an epoch: rank 0's partial sums
                for name, total in self._pending_sums.items():
                    if name in self._sums.sums:
                        self._sums.sums[name].copy_(total)
        self._pending_sums = None
        low_high = f"levels {self._levels[0]!r} (critical) / {self._levels[1]!r}" if self._levels else ""
        batch = f"batch x1 (critical) / x{self._factor}" if self.switches_batch_size else ""
        rank_zero_info(
            f"Accordion: {len(self._layers)} layers, check every {self.interval} epochs, eta={self.eta};"
            f" {', '.join(s for s in (low_high, batch) if s)}."
        )

    @property
    def _factor(self) -> int:
        return self.batch_size_factor if self.batch_size_factor is not None else DEFAULT_BATCH_SIZE_FACTOR

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        lrs = [float(group["lr"]) for optimizer in trainer.optimizers for group in optimizer.param_groups]
        if self._lr_decay_epoch != trainer.current_epoch:  # kept when resuming inside the decay's epoch
            self._lr_decay_epoch = None
        decayed = (
            self._epoch_lrs is not None
            and len(lrs) == len(self._epoch_lrs)
            and any(new < self.lr_drop * old for new, old in zip(lrs, self._epoch_lrs))
        )
        if decayed:
            # the learning rate is the same on every rank, so is this decision: no broadcast needed
            self.critical = dict.fromkeys(self._layers, True)
            self._lr_decay_epoch = trainer.current_epoch
            rank_zero_info(f"Accordion: learning rate decayed at epoch {trainer.current_epoch}: low compression.")
        self._epoch_lrs = lrs
        self._apply(trainer)
        if self._sums is not None:
            scale = trainer.accumulate_grad_batches if pl_module.automatic_optimization else 1
            self._sums.scale = float(scale)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._sums is not None:
            self._sums.backward_passes += 1

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        epoch = trainer.current_epoch
        in_force = self.levels
        was_critical = dict(self.critical)
        message: dict[str, Any] | None = None
        if trainer.is_global_zero:
            assert self._sums is not None
            norms = self._sums.norms()
            self._sums.reset()
            decision = None
            if epoch % self.interval == 0:
                changes = relative_changes(norms, self.norms.get(epoch - self.interval))
                decision = {name: change >= self.eta for name, change in changes.items()}
            else:
                changes = None
            message = {"epoch": epoch, "norms": norms, "changes": changes, "critical": decision}
        shared = trainer.strategy.broadcast(message, src=0)  # rank 0 decides for every rank
        assert shared is not None  # rank 0's message
        self.norms[epoch] = shared["norms"]
        if shared["critical"] is not None:
            self.critical = {name: bool(shared["critical"].get(name, True)) for name in self._layers}
        if self._lr_decay_epoch == epoch:
            # the reference (auto_scale.py) applies the decay rule after the regime check, so the decay wins: a
            # check in the decay's own epoch must not switch back to high compression after one epoch
            self.critical = dict.fromkeys(self._layers, True)
        self.history.append(
            {
                "epoch": epoch,
                "lr_decay": self._lr_decay_epoch == epoch,
                "critical": was_critical,
                "levels": in_force,
                "accumulate_grad_batches": trainer.accumulate_grad_batches,
                "norms": shared["norms"],
                "changes": shared["changes"],
                "next_critical": dict(self.critical),
            }
        )
        self._apply(trainer)
        self._log(pl_module, was_critical, in_force, shared["changes"], trainer.accumulate_grad_batches)

    def _log(
        self,
        pl_module: pl.LightningModule,
        critical: dict[str, bool],
        levels: dict[str, Any],
        changes: dict[str, float] | None,
        accumulation: int,
    ) -> None:
        # the values are the same on every rank (broadcast decisions): syncing averages identical numbers
        def log(name: str, value: float) -> None:
            pl_module.log(name, value, on_step=False, on_epoch=True, batch_size=1, sync_dist=True)

        for name in self._layers:
            log(f"accordion/critical/{name}", float(critical.get(name, True)))
            if name in levels:
                level = levels[name]
                # a limit (AutoCompression's candidates) is logged as its position from the least lossy
                value = float(self._candidate_names.index(level)) if isinstance(level, str) else float(level)
                log(f"accordion/level/{name}", value)
            if changes is not None and changes.get(name, float("inf")) != float("inf"):
                log(f"accordion/norm_change/{name}", changes[name])
        if self.switches_batch_size:
            log("accordion/accumulate_grad_batches", float(accumulation))

    def _apply(self, trainer: pl.Trainer) -> None:
        """Set the compressor's per-layer levels and the accumulation from :attr:`critical` (on every rank)."""
        if self.switches_levels:
            compressor = CompressedDDP.require(trainer, self).compressor
            levels = self.levels
            if compressor.layer_levels != levels:
                compressor.set_levels(levels)  # the hook re-plans its buckets at the next step
        if self.switches_batch_size:
            any_critical = any(self.critical.get(name, True) for name in self._layers)
            trainer.accumulate_grad_batches = self._base_accumulation * (1 if any_critical else self._factor)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._remove_taps()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._remove_taps()

    def _remove_taps(self) -> None:
        if self._sums is not None:
            self._sums.remove()
            self._sums = None

    # ------------------------------------------------------------------------------------------------------------
    # State
    # ------------------------------------------------------------------------------------------------------------
    @override
    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "norms": {int(e): dict(n) for e, n in self.norms.items()},
            "critical": dict(self.critical),
            "history": list(self.history),
            "epoch_lrs": self._epoch_lrs,
            # saved inside the decay's epoch, the rule must still win at that epoch's end after a resume
            "lr_decay_epoch": self._lr_decay_epoch,
        }
        if self._sums is not None and self._sums.backward_passes:
            # saved inside an epoch: rank 0's partial sums (the checkpoint is rank 0's), so the epoch's norm is whole
            state["partial_sums"] = {name: t.detach().cpu().clone() for name, t in self._sums.sums.items()}
        return state

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.norms = {int(e): dict(n) for e, n in state_dict["norms"].items()}
        self.critical = dict(state_dict["critical"])
        self.history = list(state_dict["history"])
        self._epoch_lrs = state_dict["epoch_lrs"]
        self._lr_decay_epoch = state_dict.get("lr_decay_epoch")
        self._pending_sums = state_dict.get("partial_sums")
