"""The DDP communication hook and the state it keeps between steps.

``compression_hook(state, bucket)`` has exactly the signature of torch's hooks, so it works with plain DDP too::

    state = CompressionState(PowerSGD(rank=2))
    state.attach(ddp_model)
    ddp_model.register_comm_hook(state, compression_hook)

Per bucket it splits the layers into compressed and dense ones (the compressor decides, by default 1-D and small
tensors go dense), issues the dense all-reduce and the compressor's reduction, and returns one future of the
averaged bucket. Nothing on this path synchronises with the device or loops over elements in Python; the loops are
over layers.
"""

import logging
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn import Module

from lightning_gradcomp.compressors.base import Compressor, check_gradient_dtypes
from lightning_gradcomp.engine.collectives import TorchCollectives
from lightning_gradcomp.engine.comm import CollectiveBackend, Comm, when_all
from lightning_gradcomp.engine.context import Layer
from lightning_gradcomp.engine.error_feedback import ErrorFeedback
from lightning_gradcomp.engine.requests import StepUpdates
from lightning_gradcomp.engine.split import Reduction, Split, reduce_dense, reduce_split, split_layers
from lightning_gradcomp.engine.staging import CUDA_LAG, NonfiniteRun, to_cpu
from lightning_gradcomp.engine.telemetry import BucketRecord, Telemetry
from lightning_gradcomp.validation import check_int

log = logging.getLogger(__name__)

_STATE_FORMAT = 1


def _layers(names: dict[int, tuple[int, str]], params: list[Tensor], numel: int) -> tuple[Layer, ...]:
    """A bucket's layers at their offsets in its buffer; ``names`` maps a parameter's id to its index and name.

    Raises:
        RuntimeError: If the parameters do not fill the bucket's buffer.
    """
    layers: list[Layer] = []
    offset = 0
    for p in params:
        index, name = names.get(id(p), (-1, f"unnamed{len(layers)}"))
        layers.append(Layer(name, index, p.shape, offset))
        offset += p.numel()
    if offset != numel:
        raise RuntimeError(f"Bucket layout mismatch: parameters hold {offset} elements, the buffer {numel}.")
    return tuple(layers)


class CompressionState:
    """Everything :func:`compression_hook` needs between steps. Plain and picklable until :meth:`attach`.

    Args:
        compressor: how compressed layers are reduced.
        error_feedback: keep each rank's compression error and add it to the next step's gradient; ``None`` uses
            the compressor's default (on for biased compressors).
        min_compress_numel: layers with fewer elements are averaged densely (see :meth:`Compressor.compresses`).
        seed: seed of the randomness shared by all ranks.
        enabled: when ``False`` the hook is a plain all-reduce (dense warm-up); residuals are paid into it.
        reset_state_after: after this many consecutive steps that were not finite on every rank, forget every
            rank's error-feedback residuals and the compressor's state between steps (:meth:`reset_state`), so that
            state which makes every step non-finite cannot stall training for good; ``None``: never.
    """

    __slots__ = (
        # configuration (callbacks may change these between steps, on every rank alike)
        "compressor",
        "error_feedback",
        "min_compress_numel",
        "seed",
        "enabled",
        "reset_state_after",
        "step",
        "after_reduce",
        "recorder",
        # internal
        "layout_version",
        "telemetry",
        "residuals",
        "_comm",
        "_names",
        "_plans",
        "_updates",
        "_in_flight",
        "_nonfinite_run",
    )

    def __init__(
        self,
        compressor: Compressor,
        *,
        error_feedback: bool | None = None,
        min_compress_numel: int = 1024,
        seed: int = 0,
        enabled: bool = True,
        reset_state_after: int | None = 3,
    ) -> None:
        compressor.check_error_feedback(error_feedback)  # a setting that needs the memory is never ignored
        self.compressor = compressor
        self.error_feedback = error_feedback
        self.min_compress_numel = min_compress_numel
        self.seed = seed
        self.enabled = enabled
        self.reset_state_after = check_int(reset_state_after, "reset_state_after", low=1, allow_none=True)
        self.step = 0
        # called with (bucket, future of its average) for every bucket; its future is what DDP receives (the
        # strategy sets it to a fused optimizer's bucket_step; runtime binding, not pickled)
        self.after_reduce: Callable[[dist.GradBucket, torch.futures.Future], torch.futures.Future] | None = None
        # a list while a measurement runs (start_recording): one BucketRecord per bucket; None otherwise (then the
        # hook does nothing extra)
        self.recorder: list[BucketRecord] | None = None
        self.layout_version = 0  # counts DDP's bucket layouts (rebuilds, resumes), for callbacks that measure them
        self.telemetry = Telemetry()
        self.residuals = ErrorFeedback()
        self._comm: Comm | None = None
        self._names: dict[int, tuple[int, str]] = {}
        self._plans: dict[int, tuple[tuple[int, ...], Split]] = {}  # bucket index: (its parameters, split)
        self._updates = StepUpdates()  # the step's staged state changes, committed after its last bucket
        self._in_flight: list[torch.futures.Future] = []  # the step's bucket reductions so far
        self._nonfinite_run = NonfiniteRun()  # consecutive steps non-finite on every rank (reset_state_after)

    # ------------------------------------------------------------------------------------------------------------
    # Setup
    # ------------------------------------------------------------------------------------------------------------
    def attach(
        self,
        model: Module,
        process_group: dist.ProcessGroup | None = None,
        backend: CollectiveBackend | None = None,
    ) -> None:
        """Bind to a (DDP-wrapped) model before training: learn parameter names, create the round groups.

        Call on every rank, at the same point, after the process group exists. Attaching again (a new DDP wrapper
        over a changed model) keeps the residuals of parameters that still exist and drops the others.

        Raises:
            ValueError: If ``model`` reduces its gradients without buckets (:func:`check_bucketed_reducer`), or the
                compressor refuses a gradient's dtype (:meth:`check_gradient_dtypes`).
        """
        check_bucketed_reducer(model)
        module = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
        self.check_gradient_dtypes(module)
        self._names = {id(p): (i, name) for i, (name, p) in enumerate(module.named_parameters())}
        dropped = self.residuals.drop_except({name for _, name in self._names.values()})
        if dropped:
            log.info("gradcomp: dropped error-feedback residuals of %d parameters no longer in the model", len(dropped))
        self._plans.clear()
        if backend is None:
            backend = TorchCollectives(process_group)
        device = next(module.parameters()).device
        self._comm = Comm(backend, self.telemetry, device)
        self.ensure_rounds()

    def check_gradient_dtypes(self, model: Module, compressor: Compressor | None = None) -> None:
        """Have ``compressor`` (default: the current one) check the gradient dtype of every layer it compresses.

        :meth:`attach` calls it, and ``CompressedDDP`` before it wraps the model and when its compressor is replaced:
        a cast that would not narrow 16-bit gradients (``FP16`` in ``bf16-true`` training) is refused before a step.

        Raises:
            ValueError: The compressor's error for the first layer it refuses.
        """
        module = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
        layers = [
            (Layer(name, i, p.shape), p.dtype)
            for i, (name, p) in enumerate(module.named_parameters())
            if p.requires_grad
        ]
        check_gradient_dtypes(compressor or self.compressor, layers, self.min_compress_numel)

    def detach(self, failed: bool = False) -> None:
        """Let go of the collectives, the future chains they keep between steps and the bucket plans.

        The configuration, the residuals and the telemetry stay (they are training state); :meth:`attach` binds
        again. ``CompressedDDP.teardown`` calls it so that nothing that gloo's worker threads may still touch
        outlives training (see :func:`lightning_gradcomp.engine.collectives.release_round_groups`).
        """
        if self._comm is not None and isinstance(self._comm.backend, TorchCollectives):
            # a failed step's collectives end now, not during interpreter shutdown
            self._comm.backend.settle(failed)
        self._comm = None
        self._plans.clear()
        self._in_flight.clear()  # futures of an unfinished step (a step that failed midway)
        self._updates = StepUpdates()

    def ensure_rounds(self) -> None:
        """Make sure the current compressor's rounds have process groups (a collective call: all ranks at once)."""
        if self._comm is not None and isinstance(self._comm.backend, TorchCollectives):
            self._comm.backend.ensure_rounds(self.compressor.rounds)

    @property
    def comm(self) -> Comm:
        """The collectives (available after :meth:`attach`)."""
        if self._comm is None:
            raise RuntimeError("CompressionState.attach(ddp_model) must be called before the first backward pass.")
        return self._comm

    def uses_error_feedback(self, compressor: Compressor | None = None) -> bool:
        """Whether error feedback is on for ``compressor`` (default: the current one)."""
        return (compressor or self.compressor).resolve_error_feedback(self.error_feedback)

    def reset_state(self) -> None:
        """Forget every residual and the compressor's state between steps, as at the start of training.

        The hook calls it on every rank at the same step, after ``reset_state_after`` consecutive non-finite steps;
        call it yourself only between steps and on every rank alike. The configuration, the per-layer levels and
        the step counter stay.
        """
        self.residuals.clear()
        self.compressor.reset_state()
        self._nonfinite_run.clear()
        self.telemetry.add_state_reset()

    def _reset_if_stalled(self) -> None:
        """At a step's first bucket: :meth:`reset_state` after ``reset_state_after`` non-finite steps in a row."""
        if self.reset_state_after is None:
            return
        lag = CUDA_LAG if self.comm.device.type == "cuda" else 0
        run = self._nonfinite_run.length_before(self.step, lag)
        if run < self.reset_state_after:
            return
        self.reset_state()
        resets = self.telemetry.total_state_resets
        # a model that stays non-finite resets every few steps: warn at the 1st, 2nd, 4th, 8th, ... reset
        log.log(
            logging.WARNING if resets & (resets - 1) == 0 else logging.DEBUG,
            "gradcomp: %d consecutive steps were not finite on every rank (through step %d); the error-feedback"
            " residuals and the compressor's state are reset, as at the start of training, so that state that makes"
            " every step non-finite cannot stall training (reset %d; CompressedDDP(reset_state_after=None) never"
            " resets)",
            run,
            self.step - lag,
            resets,
        )

    # ------------------------------------------------------------------------------------------------------------
    # Bucket plans
    # ------------------------------------------------------------------------------------------------------------
    def plan(self, bucket: dist.GradBucket, compressor: Compressor) -> Split:
        """The cached split of ``bucket``; rebuilt when DDP re-buckets, the compressor or its levels change."""
        params = bucket.parameters()
        signature = tuple(map(id, params))
        cached = self._plans.get(bucket.index())
        if cached is not None and cached[0] == signature and cached[1].compressor_key == compressor.plan_key():
            return cached[1]
        split = split_layers(_layers(self._names, params, bucket.buffer().numel()), compressor, self.min_compress_numel)
        if cached is None or cached[0] != signature:
            self.layout_version += 1
        if cached is not None:
            # the layout or the compressor changed: residuals must follow their parameters, not the bucket
            self.residuals.spill()
            self._plans.clear()
        self._plans[bucket.index()] = (signature, split)
        return split

    def start_recording(self) -> None:
        """From the next bucket on, record when each bucket reaches the hook and when its reduction finishes."""
        self.recorder = []

    def stop_recording(self) -> list[BucketRecord] | None:
        """Stop recording; what was recorded since :meth:`start_recording` (``None`` when nothing was recording)."""
        records, self.recorder = self.recorder, None
        return records

    def bucket_layouts(self) -> set[tuple[str, ...]]:
        """The layer names of every bucket DDP has handed the hook in its current layout (see ``layout_version``)."""
        return {tuple(layer.name for layer in split.every) for _, split in self._plans.values()}

    # ------------------------------------------------------------------------------------------------------------
    # The reduction of one bucket
    # ------------------------------------------------------------------------------------------------------------
    def reduce(self, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
        """Average ``bucket`` over the ranks; what :func:`compression_hook` does.

        While ``enabled`` is ``False`` it is DDP's own reduction (scale by ``1 / world_size``, sum), plus any
        error-feedback residual still owed; a sparse gradient's bucket is always averaged as DDP averages it.
        Otherwise the bucket's dense layers are all-reduced and its compressed layers go through
        :meth:`Compressor.reduce`; both are issued here, in bucket order, on every rank. State
        changes of the whole step are committed after its last bucket, only if the step was finite on every rank;
        this is also where the step counter advances (its one writer, besides :meth:`load_state_dict`).
        """
        entered = time.perf_counter() if self.recorder is not None else 0.0
        if not self._in_flight:  # the step's first bucket
            self._reset_if_stalled()
        buffer = bucket.buffer()
        plan = None
        if buffer.is_sparse:
            reduced = self._reduce_sparse(buffer)
        else:
            plan = self.plan(bucket, self.compressor)
            reduction = Reduction(self.comm, self.residuals, self._updates, bucket.index(), self.step, self.seed)
            if self.enabled:
                reduced = reduce_split(buffer, plan, reduction, error_feedback=self.error_feedback)
            else:
                reduced = reduce_dense(buffer, plan, reduction)
        if self.recorder is not None:  # the layers' names only while a measurement runs, not on every step
            names = (
                tuple(layer.name for layer in plan.every)
                if plan is not None
                else tuple(self._names.get(id(p), (-1, "unnamed"))[1] for p in bucket.parameters())
            )
            entry = BucketRecord(entered, names, buffer.numel())
            self.recorder.append(entry)
            reduced = reduced.then(lambda fut: _stamp(fut, entry))
        self._in_flight.append(reduced)
        if not bucket.is_last():
            return reduced
        self.step += 1
        return self._end_step(reduced)

    def _reduce_sparse(self, buffer: Tensor) -> torch.futures.Future[Tensor]:
        """Average a sparse gradient as DDP's default reduction does: divide by the world size, sparse all-reduce.

        DDP gives every parameter with a sparse gradient (``nn.Embedding(sparse=True)``, ``nn.EmbeddingBag``) a
        bucket of its own, whose buffer is that gradient. It is not compressed (it already holds only the rows the
        batch touched) and keeps no error-feedback residual. It is coalesced after the division, where gloo
        coalesces it, so the average is bitwise DDP's; what is counted, sent and dense alike, is its rows.
        """
        gradient = buffer.div_(self.comm.world_size).coalesce()
        self.telemetry.add_bucket(gradient._indices().nbytes + gradient._values().nbytes, sparse=True)
        return self.comm.all_reduce_sparse(gradient)

    def _end_step(self, last: torch.futures.Future[Tensor]) -> torch.futures.Future[Tensor]:
        """After every bucket of the step: commit the staged state (if finite everywhere), count the verdict."""
        in_flight, updates = self._in_flight, self._updates
        self._in_flight, self._updates = [], StepUpdates()
        telemetry, run, step = self.telemetry, self._nonfinite_run, self.step

        def commit(fut: torch.futures.Future[list[Tensor]]) -> Tensor:
            fut.value()  # a failed bucket fails the step: nothing is committed
            ok = updates.commit()
            telemetry.add_verdict(ok)
            run.add(step, ok)
            return last.wait()

        return when_all(in_flight, self.comm.device).then(commit)

    # ------------------------------------------------------------------------------------------------------------
    # Checkpointing
    # ------------------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This rank's state: residuals per parameter, the compressor's own state, the step (tensors on the CPU)."""
        return {
            "format": _STATE_FORMAT,
            "step": self.step,
            "compressor_class": type(self.compressor).__qualname__,
            "compressor": to_cpu(self.compressor.state_dict()),
            "residuals": self.residuals.state_dict(),
            "nonfinite_run": self._nonfinite_run.state_dict(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; residuals are laid into buckets at the next step."""
        self.step = int(state_dict["step"])
        self.residuals.load_state_dict(state_dict["residuals"])
        self._nonfinite_run.load_state_dict(state_dict["nonfinite_run"])
        if state_dict["compressor_class"] == type(self.compressor).__qualname__:
            self.compressor.load_state_dict(state_dict["compressor"])
        else:
            log.warning(
                "gradcomp: the checkpoint's compressor state belongs to %s, not %s; it is not restored",
                state_dict["compressor_class"],
                type(self.compressor).__qualname__,
            )
        self._plans.clear()

    def __getstate__(self) -> dict[str, Any]:
        # process groups and futures do not pickle: a state travels (spawn) unattached, like torch's PowerSGDState
        return {
            "compressor": self.compressor,
            "error_feedback": self.error_feedback,
            "min_compress_numel": self.min_compress_numel,
            "seed": self.seed,
            "enabled": self.enabled,
            "reset_state_after": self.reset_state_after,
            "step": self.step,
            "residuals": self.residuals.state_dict(),
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        residuals = state.pop("residuals")
        self.__init__(**{k: v for k, v in state.items() if k != "step"})  # type: ignore[misc]
        self.step = state["step"]
        self.residuals.load_state_dict(residuals)


def check_bucketed_reducer(model: Module) -> None:
    """Refuse a DDP model whose gradients bypass the bucketed reducer, the only one that calls this module's hook.

    With ``torch._dynamo.config.optimize_ddp = "python_reducer"`` (for compiled autograd) DistributedDataParallel
    reduces each parameter's gradient in Python as it is accumulated and calls a registered communication hook once
    per parameter with ``(grad, param)``, never with a :class:`~torch.distributed.GradBucket`: the compression hook
    would fail at the first backward pass. DDP records the mode it was built in (``_use_python_reducer``); that is
    what is read here, so a later change of the setting does not matter.

    Raises:
        ValueError: Naming the setting, what DDP was built with, and the modes that keep the buckets.
    """
    if not getattr(model, "_use_python_reducer", False):
        return
    raise ValueError(
        "Expected a DistributedDataParallel model that reduces its gradients in buckets, got one built with"
        " `torch._dynamo.config.optimize_ddp = 'python_reducer'`: DDP then reduces every parameter's gradient in"
        " Python and calls communication hooks per parameter, so the compression hook cannot run. Accepted: the other"
        " modes ('ddp_optimizer', the default, with which torch.compile'd models train compressed;"
        " 'python_reducer_without_compiled_forward'; 'no_optimization'), set before the model is wrapped."
    )


def _stamp(fut: torch.futures.Future[Tensor], entry: BucketRecord) -> Tensor:
    entry.finished = time.perf_counter()
    return fut.value()


def compression_hook(state: CompressionState, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
    """DDP communication hook that averages ``bucket`` through ``state.compressor``.

    It has the signature of torch's hooks; the work is :meth:`CompressionState.reduce`, then ``state.after_reduce``
    (a fused optimizer's per-bucket update) when one is set.
    """
    reduced = state.reduce(bucket)
    return reduced if state.after_reduce is None else state.after_reduce(bucket, reduced)
