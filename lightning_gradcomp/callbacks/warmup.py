"""``DenseWarmup``: plain (dense) gradient averaging for the first epochs or steps, then the compressor or DiLoCo."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_gradcomp.compressors.dgc import WARMUP_RATIOS
from lightning_gradcomp.ddp.strategy import CompressedDDP
from lightning_gradcomp.diloco import DiLoCo
from lightning_gradcomp.diloco.sharded import ShardedDiLoCo
from lightning_gradcomp.validation import check_int, check_positive_int, check_ratio

#: Deep Gradient Compression's warm-up densities (Lin et al., ICLR 2018): 75 %, 93.75 %, 98.4375 %, 99.6 % sparsity,
#: one epoch each, before the final density. One constant, defined beside the DGC compressor that also ramps by it.
DGC_RAMP: tuple[float, ...] = WARMUP_RATIOS


def _check_count(value: Any, name: str) -> int | None:
    return check_int(value, name, low=0, allow_none=True, error=MisconfigurationException)


def _check_ramp(ramp: Any) -> tuple[float, ...] | None:
    if ramp == "dgc":
        return DGC_RAMP
    if ramp is None:
        return None
    if isinstance(ramp, str) or not isinstance(ramp, Sequence) or not ramp:
        raise MisconfigurationException(
            f"Expected `ramp` to be None, 'dgc' or a non-empty list of keep-ratios in (0, 1], got {ramp!r}."
        )
    return tuple(check_ratio(d, "ramp", error=MisconfigurationException) for d in ramp)


class DenseWarmup(Callback):
    """Average gradients densely (as plain DDP) for the first ``epochs`` or ``steps``, then compress.

    Compressing from the very first step hurts most methods: early gradients change fast and error feedback has
    nothing to correct with yet. PowerSGD (Vogels et al., NeurIPS 2019) and torch's ``powerSGD_hook``
    (``start_powerSGD_iter``) start with plain all-reduce; Deep Gradient Compression (Lin et al., "Deep Gradient
    Compression: Reducing the Communication Bandwidth for Distributed Training", ICLR 2018) instead ramps the density
    of its top-k selection down over the first epochs: 25 %, 6.25 %, 1.5625 %, 0.4 %, then 0.1 %. This callback does
    either or both: a dense phase, then optionally such a ramp for sparsifying compressors (those whose level is a
    keep-``ratio``: ``TopK``, ``RandomK``, ``DGC``, ``ScaleCom``), then the compressor as configured.

    The decision is a function of ``trainer.global_step`` (``steps``) or ``trainer.current_epoch`` (``epochs``),
    taken in ``on_train_batch_start`` on every rank: the same on every rank, and after a resume it follows the
    restored step, so the callback keeps no state of its own. It sets ``CompressedDDP.compression_enabled`` (and,
    during the ramp, the compressor's ``ratio``) between steps. Error-feedback residuals are empty during the dense
    phase; what is still owed when compression is switched off is paid into the dense all-reduce.

    With :class:`~lightning_gradcomp.DiLoCo` the dense phase is plain data parallelism: at every step the gradients
    (and floating-point buffers) are averaged over every rank before the inner optimizer's step, as
    ``DDPStrategy`` does; DiLoCo's rounds start when it ends, from the synchronized weights, with a fresh outer
    optimizer. Local-SGD methods have lost accuracy on small-batch CNNs with BatchNorm when run from the first step
    (pytorch/pytorch#74157); a dense start is the usual remedy (Lin et al., "Don't Use Large Mini-Batches, Use Local
    SGD", ICLR 2020: post-local SGD). No ``ramp`` with DiLoCo.

    The dense phase keeps the method's optimizer semantics: a method whose update is not the averaged gradient
    applies its own rule to the exact average (``Compressor.finish_dense``). With ``DGC`` the dense phase is momentum
    SGD (DGC's momentum correction on the average; the optimizer has none), with ``SignSGD`` it takes the sign of the
    average (the learning rate stays a per-coordinate step); every other method averages plainly.

    Args:
        epochs: dense for the first ``epochs`` epochs (give this or ``steps``, not both).
        steps: dense for the first ``steps`` optimizer steps (``trainer.global_step``).
        ramp: after the dense phase, compress with these keep-ratios (densities) in turn, each for ``ramp_length``
            epochs or steps (the unit of the dense phase), before the compressor's own ``ratio``. ``"dgc"`` is
            :data:`DGC_RAMP` (DGC's schedule, one epoch per stage with ``epochs=0``). A density below the
            compressor's ratio is raised to it (the ramp never compresses harder than the target). Only for
            compressors whose level is a ``ratio``; ``None`` (default) means no ramp.
        ramp_length: how many epochs or steps each ramp density lasts.

    Raises:
        MisconfigurationException: If not exactly one of ``epochs`` and ``steps`` is given, an argument is out of
            range, or (in ``setup``) the strategy is neither ``CompressedDDP`` nor ``DiLoCo``, or a ramp is asked for
            ``DiLoCo`` or for a compressor whose level is not a keep-ratio.

    Example::

        >>> from lightning.pytorch import Trainer
        >>> from lightning_gradcomp import CompressedDDP
        >>> from lightning_gradcomp.callbacks import DenseWarmup
        >>> from lightning_gradcomp.compressors import TopK
        >>> trainer = Trainer(accelerator="cpu", devices=2, strategy=CompressedDDP(TopK(ratio=0.001)),
        ...                   callbacks=[DenseWarmup(epochs=1, ramp="dgc")])
    """

    def __init__(
        self,
        epochs: int | None = None,
        steps: int | None = None,
        ramp: Literal["dgc"] | Sequence[float] | None = None,
        ramp_length: int = 1,
    ) -> None:
        epochs, steps = _check_count(epochs, "epochs"), _check_count(steps, "steps")
        if (epochs is None) == (steps is None):
            raise MisconfigurationException(
                f"`DenseWarmup` needs exactly one of `epochs` and `steps` (the length of the dense phase),"
                f" got epochs={epochs!r}, steps={steps!r}."
            )
        ramp = _check_ramp(ramp)
        check_positive_int(ramp_length, "ramp_length", error=MisconfigurationException)
        if ramp is None and ramp_length != 1:
            raise MisconfigurationException("`ramp_length` is set but there is no `ramp` to apply it to.")
        # private, behind validated properties: a value set after construction is checked as the constructor does
        self._epochs, self._steps = epochs, steps
        self._ramp: tuple[float, ...] | None = ramp
        self._ramp_length = ramp_length
        self._target: tuple[Any, float] | None = None  # (compressor, its configured ratio) while training

    @property
    def epochs(self) -> int | None:
        """The dense phase's length in epochs (``None`` when counted in steps); settable to an integer >= 0."""
        return self._epochs

    @epochs.setter
    def epochs(self, value: int) -> None:
        if self._epochs is None:
            raise MisconfigurationException("`DenseWarmup` counts in steps: set `steps`, not `epochs`.")
        self._epochs = check_int(value, "epochs", low=0, error=MisconfigurationException)

    @property
    def steps(self) -> int | None:
        """The dense phase's length in optimizer steps (``None`` when counted in epochs); settable to an int >= 0."""
        return self._steps

    @steps.setter
    def steps(self, value: int) -> None:
        if self._steps is None:
            raise MisconfigurationException("`DenseWarmup` counts in epochs: set `epochs`, not `steps`.")
        self._steps = check_int(value, "steps", low=0, error=MisconfigurationException)

    @property
    def ramp(self) -> tuple[float, ...] | None:
        """The keep-ratios of the ramp after the dense phase (``None``: no ramp); set as the constructor's."""
        return self._ramp

    @ramp.setter
    def ramp(self, value: Literal["dgc"] | Sequence[float] | None) -> None:
        self._ramp = _check_ramp(value)

    @property
    def ramp_length(self) -> int:
        """How many epochs or steps each ramp density lasts; settable to an integer >= 1."""
        return self._ramp_length

    @ramp_length.setter
    def ramp_length(self, value: int) -> None:
        self._ramp_length = check_positive_int(value, "ramp_length", error=MisconfigurationException)

    @property
    def unit(self) -> Literal["epochs", "steps"]:
        """What the dense phase and the ramp are counted in."""
        return "epochs" if self.epochs is not None else "steps"

    @property
    def length(self) -> int:
        """The dense phase's length, in :attr:`unit`."""
        return self.epochs if self.epochs is not None else self.steps  # type: ignore[return-value]

    def phase(self, position: int) -> tuple[bool, int | None]:
        """At ``position`` (an epoch or a step, as :attr:`unit`): whether to compress, and which ramp stage.

        Returns ``(False, None)`` during the dense phase, ``(True, i)`` during ramp stage ``i`` and ``(True, None)``
        afterwards.
        """
        if position < self.length:
            return False, None
        stage = (position - self.length) // self.ramp_length
        if self.ramp is not None and stage < len(self.ramp):
            return True, stage
        return True, None

    # ------------------------------------------------------------------------------------------------------------
    # Lightning hooks
    # ------------------------------------------------------------------------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if isinstance(trainer.strategy, (DiLoCo, ShardedDiLoCo)):
            if self.ramp is not None:
                raise MisconfigurationException(
                    f"`DenseWarmup(ramp=...)` ramps a compressor's keep-ratio and needs CompressedDDP; with DiLoCo"
                    f" give no ramp, got ramp={list(self.ramp)}."
                )
            return
        if not isinstance(trainer.strategy, CompressedDDP):
            raise MisconfigurationException(
                "`DenseWarmup` requires `Trainer(strategy=CompressedDDP(...))` or `Trainer(strategy=DiLoCo(...))`, got"
                f" `{type(trainer.strategy).__name__}`."
            )
        compressor = trainer.strategy.compressor
        if self.ramp is not None and compressor.level_attribute != "ratio":
            raise MisconfigurationException(
                f"`DenseWarmup(ramp=...)` ramps a keep-ratio down and needs a sparsifying compressor (whose level is"
                f" `ratio`, e.g. TopK or RandomK), got {compressor!r}."
            )

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        what = f"the first {self.length} {self.unit}" if self.length else "no"
        if isinstance(trainer.strategy, (DiLoCo, ShardedDiLoCo)):
            rank_zero_info(f"DenseWarmup: plain data parallelism for {what}, then DiLoCo's rounds.")
            return
        ramp = f", then keep-ratios {list(self.ramp)} for {self.ramp_length} {self.unit} each" if self.ramp else ""
        compressor = CompressedDDP.require(trainer, self).compressor
        rank_zero_info(f"DenseWarmup: dense all-reduce for {what}{ramp}, then {compressor!r}.")

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        position = trainer.current_epoch if self.epochs is not None else trainer.global_step
        compress, stage = self.phase(position)
        if isinstance(trainer.strategy, (DiLoCo, ShardedDiLoCo)):
            trainer.strategy.synchronous = not compress
            return
        strategy = CompressedDDP.require(trainer, self)
        strategy.compression_enabled = compress
        if self.ramp is None:
            return
        compressor = strategy.compressor
        if self._target is None or self._target[0] is not compressor:
            # the configured ratio, remembered once per compressor (the ramp overwrites the attribute; setup checked
            # that the compressor's level is its keep-ratio ``ratio``)
            self._target = (compressor, getattr(compressor, "ratio"))
        target = self._target[1]
        ratio = target if stage is None else max(self.ramp[stage], target)
        if getattr(compressor, "ratio") != ratio:
            setattr(compressor, "ratio", compressor.check_level(ratio))  # the hook re-plans when the level changes

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # leave the compressor as configured (a run that ends inside the ramp must not change a later fit)
        if self._target is not None:
            compressor, ratio = self._target
            setattr(compressor, "ratio", ratio)
            self._target = None
