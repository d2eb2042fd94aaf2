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
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn import Module

from lightning_gradcomp.comm import CollectiveBackend, Comm, TorchCollectives
from lightning_gradcomp.compressors.base import BucketContext, Compressor, Layer
from lightning_gradcomp.error_feedback import ErrorFeedback
from lightning_gradcomp.telemetry import Telemetry

log = logging.getLogger(__name__)

_STATE_FORMAT = 1


@dataclass(frozen=True)
class _BucketPlan:
    """How one bucket layout is split between the compressor and the dense all-reduce (cached per layout)."""

    signature: tuple[int, ...]
    compressor_key: tuple
    compressed: tuple[Layer, ...]  # offsets into the gathered compressed tensor
    dense: tuple[Layer, ...]  # offsets into the gathered dense tensor
    every: tuple[Layer, ...]  # offsets into the bucket buffer
    compressed_runs: tuple[tuple[int, int], ...]  # [start, end) ranges of the bucket buffer
    dense_runs: tuple[tuple[int, int], ...]
    numel: int

    @property
    def whole_bucket(self) -> bool:
        return not self.dense and self.compressed_runs == ((0, self.numel),)


def _gather(buffer: Tensor, runs: tuple[tuple[int, int], ...], scratch: dict[str, Tensor], key: str) -> Tensor:
    """The elements of ``runs``, contiguous: a view if they are, else a copy into a buffer reused every step.

    Reusing the buffer matters on the CPU: a fresh allocation of a bucket-sized tensor every step costs page faults
    (glibc maps and unmaps chunks near its 32 MB threshold) that exceed the copy itself.
    """
    if len(runs) == 1:
        start, end = runs[0]
        return buffer[start:end]
    out = scratch.get(key)
    if out is None:
        out = scratch[key] = torch.empty(sum(end - start for start, end in runs), dtype=buffer.dtype,
                                         device=buffer.device)  # fmt: skip
    return torch.cat([buffer[start:end] for start, end in runs], out=out)


def _scatter(buffer: Tensor, runs: tuple[tuple[int, int], ...], values: Tensor) -> None:
    offset = 0
    for start, end in runs:
        n = end - start
        buffer[start:end].copy_(values[offset : offset + n])
        offset += n


def _runs(layers: list[Layer]) -> tuple[tuple[int, int], ...]:
    runs: list[list[int]] = []
    for layer in layers:
        if runs and runs[-1][1] == layer.offset:
            runs[-1][1] = layer.offset + layer.numel
        else:
            runs.append([layer.offset, layer.offset + layer.numel])
    return tuple((start, end) for start, end in runs)


def _relayout(layers: list[Layer]) -> tuple[Layer, ...]:
    out, offset = [], 0
    for layer in layers:
        out.append(Layer(layer.name, layer.index, layer.shape, offset))
        offset += layer.numel
    return tuple(out)


class CompressionState:
    """Everything :func:`compression_hook` needs between steps. Plain and picklable until :meth:`attach`.

    Args:
        compressor: how compressed layers are reduced.
        error_feedback: keep each rank's compression error and add it to the next step's gradient; ``None`` uses
            the compressor's default (on for biased compressors).
        min_compress_numel: layers with fewer elements are averaged densely (see :meth:`Compressor.compresses`).
        seed: seed of the randomness shared by all ranks.
        enabled: when ``False`` the hook is a plain all-reduce (dense warm-up); residuals are paid into it.
    """

    __slots__ = (
        # configuration (callbacks may change these between steps, on every rank alike)
        "compressor",
        "error_feedback",
        "min_compress_numel",
        "seed",
        "enabled",
        "step",
        # internal
        "telemetry",
        "residuals",
        "_comm",
        "_names",
        "_plans",
        "_scratch",
    )

    def __init__(
        self,
        compressor: Compressor,
        *,
        error_feedback: bool | None = None,
        min_compress_numel: int = 1024,
        seed: int = 0,
        enabled: bool = True,
    ) -> None:
        self.compressor = compressor
        self.error_feedback = error_feedback
        self.min_compress_numel = min_compress_numel
        self.seed = seed
        self.enabled = enabled
        self.step = 0
        self.telemetry = Telemetry()
        self.residuals = ErrorFeedback()
        self._comm: Comm | None = None
        self._names: dict[int, tuple[int, str]] = {}
        self._plans: dict[int, _BucketPlan] = {}
        self._scratch: dict[int, dict[str, Tensor]] = {}  # per bucket: gather buffers reused every step

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
        """
        module = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
        self._names = {id(p): (i, name) for i, (name, p) in enumerate(module.named_parameters())}
        dropped = self.residuals.drop_except({name for _, name in self._names.values()})
        if dropped:
            log.info("gradcomp: dropped error-feedback residuals of %d parameters no longer in the model", len(dropped))
        self._plans.clear()
        self._scratch.clear()
        if backend is None:
            backend = TorchCollectives(process_group)
        device = next(module.parameters()).device
        self._comm = Comm(backend, self.telemetry, device)
        self.ensure_rounds()

    def detach(self) -> None:
        """Let go of the collectives, the future chains they keep between steps and the bucket plans.

        The configuration, the residuals and the telemetry stay (they are training state); :meth:`attach` binds
        again. ``CompressedDDP.teardown`` calls it so that nothing that gloo's worker threads may still touch
        outlives training (see :func:`lightning_gradcomp.comm.release_round_groups`).
        """
        self._comm = None
        self._plans.clear()
        self._scratch.clear()

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
        if self.error_feedback is not None:
            return self.error_feedback
        return (compressor or self.compressor).default_error_feedback

    # ------------------------------------------------------------------------------------------------------------
    # Bucket plans
    # ------------------------------------------------------------------------------------------------------------
    def plan(self, bucket: dist.GradBucket, compressor: Compressor) -> _BucketPlan:
        """The cached split of ``bucket``; rebuilt when DDP re-buckets, the compressor or its levels change."""
        params = bucket.parameters()
        signature = tuple(map(id, params))
        cached = self._plans.get(bucket.index())
        if cached is not None and cached.signature == signature and cached.compressor_key == compressor.plan_key():
            return cached
        plan = self._make_plan(signature, params, bucket.buffer().numel(), compressor)
        if cached is not None:
            # the layout or the compressor changed: residuals must follow their parameters, not the bucket
            self.residuals.spill()
            self._plans.clear()
            self._scratch.clear()
        self._scratch.pop(bucket.index(), None)  # buffers sized for another layout
        self._plans[bucket.index()] = plan
        return plan

    def _make_plan(
        self, signature: tuple[int, ...], params: list[Tensor], numel: int, compressor: Compressor
    ) -> _BucketPlan:
        every, compressed, dense = [], [], []
        offset = 0
        for p in params:
            index, name = self._names.get(id(p), (-1, f"unnamed{len(every)}"))
            layer = Layer(name, index, p.shape, offset)
            every.append(layer)
            (compressed if compressor.compresses(layer, self.min_compress_numel) else dense).append(layer)
            offset += layer.numel
        if offset != numel:
            raise RuntimeError(f"Bucket layout mismatch: parameters hold {offset} elements, the buffer {numel}.")
        return _BucketPlan(
            signature=signature,
            compressor_key=compressor.plan_key(),
            compressed=_relayout(compressed),
            dense=_relayout(dense),
            every=tuple(every),
            compressed_runs=_runs(compressed),
            dense_runs=_runs(dense),
            numel=numel,
        )

    # ------------------------------------------------------------------------------------------------------------
    # Checkpointing
    # ------------------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This rank's state: residuals per parameter, the compressor's own state, the step (tensors on the CPU)."""
        return {
            "format": _STATE_FORMAT,
            "step": self.step,
            "compressor_class": type(self.compressor).__qualname__,
            "compressor": _to_cpu(self.compressor.state_dict()),
            "residuals": self.residuals.state_dict(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; residuals are laid into buckets at the next step."""
        self.step = int(state_dict["step"])
        self.residuals.load_state_dict(state_dict["residuals"])
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
            "step": self.step,
            "residuals": self.residuals.state_dict(),
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        residuals = state.pop("residuals")
        self.__init__(**{k: v for k, v in state.items() if k != "step"})  # type: ignore[misc]
        self.step = state["step"]
        self.residuals.load_state_dict(residuals)


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def compression_hook(state: CompressionState, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
    """DDP communication hook that averages ``bucket`` through ``state.compressor``.

    While ``state.enabled`` is ``False`` it is torch's ``allreduce_hook`` (divide by the world size, sum), plus any
    error-feedback residual still owed. Otherwise the bucket's dense layers are all-reduced and its compressed layers
    go through :meth:`Compressor.reduce`; both are issued here, in bucket order, on every rank.
    """
    comm = state.comm
    buffer = bucket.buffer()
    compressor = state.compressor
    world_size = comm.world_size
    state.telemetry.add_bucket(buffer.numel() * buffer.element_size())
    if bucket.is_last():
        step = state.step
        state.step += 1
    else:
        step = state.step

    if not state.enabled:
        if state.residuals:
            state.residuals.spill()
            state.residuals.drain_into(buffer, state.plan(bucket, compressor).every)
        return comm.all_reduce((buffer.div_(world_size),)).then(lambda fut: fut.value()[0])

    plan = state.plan(bucket, compressor)
    scratch = state._scratch.setdefault(bucket.index(), {})
    futures: list[torch.futures.Future] = []
    dense = None
    if plan.dense:
        dense = _gather(buffer, plan.dense_runs, scratch, "dense")
        if state.residuals:
            state.residuals.drain_into(dense, plan.dense)
        futures.append(comm.all_reduce((dense.div_(world_size),)))
    if not plan.compressed:
        return futures[0].then(lambda fut: _finish(buffer, plan, None, fut.value()[0]))

    tensor = _gather(buffer, plan.compressed_runs, scratch, "compressed")
    if state.uses_error_feedback(compressor):
        residual = state.residuals.residual(bucket.index(), plan.compressed, tensor)
    else:
        residual = None
        if state.residuals:  # error feedback was on for a previous compressor: pay what is owed, once
            state.residuals.spill()
            state.residuals.drain_into(tensor, plan.compressed)
    ctx = BucketContext(
        index=bucket.index(),
        step=step,
        rank=comm.rank,
        world_size=world_size,
        layers=plan.compressed,
        dtype=buffer.dtype,
        device=buffer.device,
        seed=state.seed,
        residual=residual,
        comm=comm,
    )
    reduced = compressor.reduce(tensor, ctx)
    if plan.whole_bucket:
        return reduced
    futures.append(reduced)

    def finish(fut: torch.futures.Future[list[torch.futures.Future]]) -> Tensor:
        done = fut.value()
        dense_avg = done[0].value()[0] if dense is not None else None
        return _finish(buffer, plan, done[-1].value(), dense_avg)

    return torch.futures.collect_all(futures).then(finish)


def _finish(buffer: Tensor, plan: _BucketPlan, compressed: Tensor | None, dense: Tensor | None) -> Tensor:
    if compressed is not None:
        _scatter(buffer, plan.compressed_runs, compressed)
    if dense is not None:
        _scatter(buffer, plan.dense_runs, dense)
    return buffer
