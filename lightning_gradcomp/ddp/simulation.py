"""Test a compressor without processes: ``n`` simulated ranks in one process, same code path as training.

:class:`SimulatedWorld` implements the collectives :class:`~lightning_gradcomp.engine.comm.Comm` runs on; a collective
completes when every simulated rank has issued it, and a rank that issues a different collective (or a payload of
another shape) at the same position raises, as gloo would. :func:`simulate_reduce` runs
:meth:`Compressor.reduce` for every rank, and :class:`SimulatedHook` the whole communication hook (dense layers,
error feedback, the step's commit). The contract tests use them (:mod:`lightning_gradcomp.testing` re-exports
them), and so does :class:`~lightning_gradcomp.callbacks.AutoCompression`, which measures candidates on them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_gradcomp.compressors.base import BucketContext, Compressor, Layer, ResidualBuffers
from lightning_gradcomp.ddp.hook import CompressionState
from lightning_gradcomp.engine.comm import Comm, ReduceOpName
from lightning_gradcomp.engine.telemetry import Telemetry
from lightning_gradcomp.engine.wire import Wire

__all__ = ["SimulatedHook", "SimulatedWorld", "hook_wire_bytes", "simulate_reduce"]


@dataclass
class _Pending:
    signature: tuple
    parts: list[Tensor | None]
    futures: list[torch.futures.Future | None]
    issued: int = 0
    src: int = 0
    splits: list[tuple[list[int], list[int]] | None] | None = None  # all-to-all: each rank's (send, receive) splits


class SimulatedWorld:
    """``world_size`` ranks in one process; collectives match by issue order per round, like gloo's."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._next: dict[tuple[int, int], int] = {}
        self._pending: dict[tuple[int, int], _Pending] = {}
        self.issued: list[tuple[int, tuple]] = []  # (rank, kind) in issue order, for tests of ordering

    def backend(self, rank: int) -> _SimulatedBackend:
        """The collectives as seen by ``rank``."""
        return _SimulatedBackend(self, rank)

    def _issue(
        self,
        rank: int,
        round: int,
        kind: tuple,
        tensor: Tensor,
        src: int = 0,
        splits: tuple[list[int], list[int]] | None = None,
    ) -> torch.futures.Future:
        seq = self._next.get((rank, round), 0)
        self._next[(rank, round)] = seq + 1
        self.issued.append((rank, kind))
        key = (round, seq)
        # an all-to-all's sizes differ between ranks by design; its splits are checked against each other instead
        shape = None if splits is not None else tuple(tensor.shape)
        signature = (*kind, shape, tensor.dtype)
        entry = self._pending.setdefault(key, _Pending(signature, [None] * self.world_size, [None] * self.world_size))
        if splits is not None:
            if entry.splits is None:
                entry.splits = [None] * self.world_size
            entry.splits[rank] = splits
        if entry.signature != signature:
            raise RuntimeError(
                f"Collective mismatch on round {round}, position {seq}: rank {rank} issued {signature}, another rank"
                f" issued {entry.signature} (ranks must issue the same collectives in the same order)."
            )
        future: torch.futures.Future = torch.futures.Future()
        entry.parts[rank] = tensor
        entry.futures[rank] = future
        entry.issued += 1
        entry.src = src
        if entry.issued == self.world_size:
            del self._pending[key]
            self._complete(entry)
        return future

    def _complete(self, entry: _Pending) -> None:
        parts = [p for p in entry.parts if p is not None]
        op = entry.signature[0]
        if op == "all_reduce":
            result = parts[0].clone()
            for part in parts[1:]:
                result = torch.maximum(result, part) if entry.signature[1] == "max" else result + part
            for part in parts:
                part.copy_(result)
            values: list[Tensor] = parts
        elif op == "all_gather":
            stacked = torch.stack(parts)
            values = [stacked.clone() for _ in parts]
        elif op == "all_to_all":
            values = self._all_to_all(parts, entry.splits)
        else:  # broadcast
            for part in parts:
                part.copy_(parts[entry.src])
            values = parts
        # completing a future runs its callbacks, which may issue the next round: all values are set first
        for future, value in zip(entry.futures, values):
            assert future is not None
            future.set_result(value)

    def _all_to_all(self, parts: list[Tensor], splits: list | None) -> list[Tensor]:
        assert splits is not None
        n = self.world_size
        for s in range(n):
            for d in range(n):
                if splits[s][0][d] != splits[d][1][s]:
                    raise RuntimeError(
                        f"all_to_all split mismatch: rank {s} sends {splits[s][0][d]} elements to rank {d}, which"
                        f" expects {splits[d][1][s]}."
                    )
        chunks = [list(torch.split(part, list(splits[s][0]))) for s, part in enumerate(parts)]
        return [torch.cat([chunks[s][d] for s in range(n)]).clone() for d in range(n)]

    def assert_quiescent(self) -> None:
        """Raise if some collective was issued by only part of the ranks (a hang in a real job)."""
        if self._pending:
            raise RuntimeError(f"Collectives issued by only some ranks: {list(self._pending)}")


class _SimulatedBackend:
    def __init__(self, world: SimulatedWorld, rank: int) -> None:
        self.world = world
        self.rank = rank
        self.world_size = world.world_size

    def all_reduce(self, tensor: Tensor, round: int, op: ReduceOpName) -> torch.futures.Future[Tensor]:
        return self.world._issue(self.rank, round, ("all_reduce", op), tensor)

    def all_gather(self, tensor: Tensor, round: int) -> torch.futures.Future[Tensor]:
        return self.world._issue(self.rank, round, ("all_gather",), tensor)

    def broadcast(self, tensor: Tensor, src: int, round: int) -> torch.futures.Future[Tensor]:
        return self.world._issue(self.rank, round, ("broadcast", src), tensor, src=src)

    def all_to_all(
        self, tensor: Tensor, send_splits: Sequence[int], recv_splits: Sequence[int], round: int
    ) -> torch.futures.Future[Tensor]:
        if sum(send_splits) != tensor.numel():
            raise RuntimeError(f"all_to_all: the input has {tensor.numel()} elements, the splits {sum(send_splits)}.")
        splits = (list(send_splits), list(recv_splits))
        return self.world._issue(self.rank, round, ("all_to_all",), tensor, splits=splits)


def simulate_reduce(
    compressors: Sequence[Compressor],
    tensors: Sequence[Tensor],
    layers: tuple[Layer, ...],
    *,
    step: int = 0,
    seed: int = 0,
    residuals: Sequence[Tensor | None] | None = None,
    index: int = 0,
    telemetry: Sequence[Telemetry] | None = None,
    new_residuals: Sequence[Tensor] | None = None,
) -> list[Tensor]:
    """Average ``tensors`` (one per rank) through ``compressors`` (one instance per rank, as in training).

    Args:
        compressors: one compressor per rank (their own state, e.g. PowerSGD's warm-start queries).
        tensors: each rank's flat gradient, laid out as ``layers``; not modified.
        layers: the layout of the flat tensors.
        step: the optimizer step the reduction belongs to.
        seed: the seed shared by all ranks.
        residuals: each rank's error-feedback memory (updated in place), or ``None`` for no error feedback.
        index: the bucket index.
        telemetry: each rank's counters (fresh ones if ``None``).
        new_residuals: with ``residuals``, each rank's buffer for the updated residual, kept between calls as the
            hook keeps its twin buffers (fresh ones if ``None``: on the CPU a fresh buffer's first write costs its
            page faults, several memory passes, inside the timed encode; ``benchmarks/codec.py`` passes its own).

    Returns:
        Every rank's averaged tensor.
    """
    world = SimulatedWorld(len(tensors))
    futures = []
    for rank, (compressor, tensor) in enumerate(zip(compressors, tensors)):
        comm = Comm(world.backend(rank), telemetry[rank] if telemetry else Telemetry(), tensor.device)
        ctx = BucketContext(
            index=index,
            step=step,
            rank=rank,
            world_size=len(tensors),
            layers=layers,
            dtype=tensor.dtype,
            device=tensor.device,
            seed=seed,
            comm=comm,
        )
        residual = None if residuals is None else residuals[rank]
        twin = None if new_residuals is None else new_residuals[rank]
        memory = None if residual is None else ResidualBuffers(residual, twin)
        futures.append(compressor.reduce(tensor.clone(), ctx, memory))
    world.assert_quiescent()
    return [future.wait() for future in futures]


class _Bucket:
    """What the hook reads of a ``torch.distributed.GradBucket``: one bucket holding every parameter."""

    def __init__(self, buffer: Tensor, params: list[Tensor]) -> None:
        self._buffer, self._params = buffer, params

    def buffer(self) -> Tensor:
        return self._buffer

    def parameters(self) -> list[Tensor]:
        return self._params

    def index(self) -> int:
        return 0

    def is_last(self) -> bool:
        return True


def _module_with(layers: tuple[Layer, ...]) -> torch.nn.Module:
    """A module whose parameters have ``layers``' names and shapes, in order (``"a.weight"`` nests ``a``)."""
    root = torch.nn.Module()
    for layer in layers:
        *path, leaf = layer.name.split(".")
        module = root
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, torch.nn.Module())
            module = getattr(module, part)
        module.register_parameter(leaf, torch.nn.Parameter(torch.zeros(layer.shape)))
    return root


class SimulatedHook:
    """The real communication hook (:class:`~lightning_gradcomp.ddp.hook.CompressionState`) on simulated ranks.

    Every rank holds one bucket laid out as ``layers``; :meth:`step` runs the hook on every rank, so the split into
    compressed and dense layers, error feedback, the dense update and the step's commit are the hook's own::

        hook = SimulatedHook([CompressionState(DGC()) for _ in range(2)], layers)
        averages = hook.step([g0, g1])
    """

    def __init__(self, states: Sequence[CompressionState], layers: tuple[Layer, ...]) -> None:
        self.states = list(states)
        self.layers = layers
        self.world = SimulatedWorld(len(self.states))
        modules = [_module_with(layers) for _ in self.states]
        self._params = [list(module.parameters()) for module in modules]
        for rank, (state, module) in enumerate(zip(self.states, modules)):
            state.attach(module, backend=self.world.backend(rank))

    def step(self, tensors: Sequence[Tensor]) -> list[Tensor]:
        """One step: every rank's flat gradient (not modified) in, every rank's average out."""
        futures = [
            state.reduce(_Bucket(tensor.clone(), params))  # type: ignore[arg-type]
            for state, tensor, params in zip(self.states, tensors, self._params)
        ]
        self.world.assert_quiescent()
        return [future.wait() for future in futures]

    def residual(self, rank: int, name: str) -> Tensor | None:
        """Rank ``rank``'s error-feedback residual of parameter ``name`` (``None`` if it has none)."""
        return self.states[rank].residuals.state_dict().get(name)


def hook_wire_bytes(
    make: Callable[[], Compressor], layers: tuple[Layer, ...], tensor: Tensor, world_size: int, steps: int = 1
) -> list[Wire]:
    """What each rank's telemetry counted, per step, when ``world_size`` simulated ranks all reduce ``tensor``.

    The real hook (:class:`SimulatedHook`) with a fresh compressor per rank from ``make`` and the strategy's defaults;
    each entry is the mean over the ranks of one step's ``bytes_sent`` and ``bytes_received``, what a compressor's
    declared byte model (:func:`~lightning_gradcomp.engine.wire_model.bucket_wire_bytes`) predicts for it.
    """
    states = [CompressionState(make()) for _ in range(world_size)]
    hook = SimulatedHook(states, layers)
    out = []
    for _ in range(steps):
        hook.step([tensor] * world_size)
        stats = [state.telemetry.pop_step() for state in states]
        sent = sum(s.bytes_sent for s in stats if s is not None) / world_size
        received = sum(s.bytes_received for s in stats if s is not None) / world_size
        out.append(Wire(sent, received))
    return out
