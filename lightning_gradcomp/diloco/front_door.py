"""What both DiLoCo front doors do alike on Lightning's side around their round.

``DiLoCo`` (over ``DDPStrategy``) and ``ShardedDiLoCo`` (over ``ModelParallelStrategy``) drive the same
:class:`~lightning_gradcomp.diloco.round.Round`, and around it Lightning asks the same of both: the round as
``outer_state``, DenseWarmup's ``synchronous`` switch, a partial last round closed when training ends, validation
during ``fit`` on theta_global, and the job as the round's membership sees it (its rank, its store for torchft, the
loop state a healing group takes). :class:`RoundFrontDoor` writes these once; each front door says which tensors
validation swaps (:meth:`RoundFrontDoor._evaluated`).
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor
from typing_extensions import override

from lightning_gradcomp.diloco.arguments import outer_optimizer_of
from lightning_gradcomp.diloco.defaults import default_outer_optimizer
from lightning_gradcomp.diloco.membership import Job, LoopState, Membership
from lightning_gradcomp.diloco.preflight import stale_weights
from lightning_gradcomp.diloco.round import Round
from lightning_gradcomp.runtime.loop_state import load_training_state, training_state
from lightning_gradcomp.runtime.replica_group import ReplicaGroupStrategy
from lightning_gradcomp.validation import check_bool

__all__ = ["RoundFrontDoor"]


class RoundFrontDoor(ReplicaGroupStrategy):
    """The hooks both DiLoCo front doors share; listed before the Lightning strategy among a front door's bases.

    A front door's ``__init__`` checks its arguments and calls :meth:`_start_round`, and it implements
    :meth:`_evaluated`.
    """

    #: the rounds' length: ``"auto"`` until fitting starts, then the H it resolved to
    sync_every: int | str
    fragments: int
    overlap_steps: int
    merge: str
    mixing_factor: float
    _sync_every_arg: int | str
    _outer_note: str | None  # what the outer optimizer's argument resolved to, logged at setup
    _round: Round
    _attached: bool
    _synchronous: bool
    _stale_noted: bool  # the note that validation runs on the last sync's weights, once per fit
    _local: list[Tensor] | None  # this rank's tensors while validation runs on theta_global

    def _start_round(
        self,
        sync_every: int | str,
        outer_optimizer: Any,
        fragments: int,
        overlap_steps: int,
        offload: bool,
        compressor: Any,
        membership: Membership,
    ) -> None:
        """The round of the front door's checked arguments (its ``merge`` and ``mixing_factor`` set first)."""
        self.sync_every = self._sync_every_arg = sync_every
        self.fragments, self.overlap_steps = fragments, overlap_steps
        outer, self._outer_note = outer_optimizer_of(outer_optimizer, MisconfigurationException)
        self._round = Round(
            sync_every if isinstance(sync_every, int) else fragments,  # "auto": set when fitting starts
            fragments,
            overlap_steps,
            outer or default_outer_optimizer,
            offload=offload,
            compressor=compressor,
            warn=rank_zero_warn,
            merge=self.merge,
            mixing_factor=self.mixing_factor,
            membership=membership,
        )
        self._attached = self._synchronous = self._stale_noted = False
        self._local = None

    @property
    def outer_state(self) -> Round:
        """The round: theta_global, the outer optimizer, the phase in the round and the outer exchange's counters."""
        return self._round

    @property
    def synchronous(self) -> bool:
        """Whether each step is data parallel (gradients averaged over every worker), with no rounds.

        :class:`~lightning_gradcomp.callbacks.DenseWarmup` sets it for its dense phase; rounds start from the
        synchronized weights when it is turned off.
        """
        return self._synchronous

    @synchronous.setter
    def synchronous(self, value: bool) -> None:
        self._synchronous = check_bool(value, "synchronous", error=MisconfigurationException)

    @abstractmethod
    def _evaluated(self) -> list[Tensor]:
        """This rank's tensors that validation swaps for theta_global: the trained parameters', then the buffers."""

    def _job(self, trainer: pl.Trainer) -> Job:
        """This rank's launch, as the round's membership sees it; Lightning's loop state for a heal."""
        environment = self.cluster_environment
        store = (str(environment.main_address), int(environment.main_port)) if environment is not None else ("", 0)
        loop = LoopState(lambda: training_state(trainer), lambda state: load_training_state(trainer, state))
        return Job(self.global_rank, self.world_size, self.num_nodes, store, self._round.process_group, loop)

    @override
    def on_train_end(self) -> None:
        """A partial last round ends with an outer step, so that every worker holds the same theta_global."""
        super().on_train_end()
        if self._attached:
            self._round.close(self.optimizers)

    @override
    def on_validation_start(self) -> None:
        """Keep this rank's tensors aside and evaluate theta_global (the model a checkpoint holds)."""
        super().on_validation_start()
        if self._attached and self._local is None:
            note = stale_weights(self._round.phase, self._round.pending is not None, checkpoint=False)
            if note is not None and not self._stale_noted and not self.synchronous:
                rank_zero_info(note)
                self._stale_noted = True
            self._local = self._round.weights_of().evaluate_global(self._evaluated())

    @override
    def on_validation_end(self) -> None:
        """Give this rank its own tensors back."""
        super().on_validation_end()
        if self._local is not None:
            self._round.weights_of().restore(self._evaluated(), self._local)
            self._local = None
