"""Per-step compression telemetry: bytes put on and taken off the wire, plain DDP's for comparison, encode/decode time.

Counted where the work happens (the collectives count what each rank moves from the sizes of the buffers they are
handed, by the algorithms of :mod:`lightning_gradcomp.engine.wire`; the driver times encode and decode), without any
host-device synchronisation on the hot path: on CUDA the times are CUDA events, read once per step when the numbers
are logged.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from lightning_gradcomp.engine import wire


@dataclass
class BucketRecord:
    """When one bucket's reduction ran, recorded by the hook while a measurement runs (``CompressionState.recorder``).

    The times are the host's ``time.perf_counter()`` (on CUDA, when the host issued the work, not when kernels ended).

    Attributes:
        entered: when the hook was called for the bucket (its gradients were ready).
        layers: the names of the bucket's parameters.
        numel: the elements in the bucket.
        finished: when its reduction finished; ``None`` until then.
    """

    entered: float
    layers: tuple[str, ...]
    numel: int
    finished: float | None = None


@dataclass(frozen=True)
class StepStats:
    """What one rank moved in one optimizer step.

    Every byte count is this rank's own, by the standard algorithm of each collective
    (:mod:`lightning_gradcomp.engine.wire`): a ring all-reduce sends and receives ``2 (n - 1) / n`` times its buffer, an
    all-gather ``n - 1`` times its payload, an all-to-all what actually goes to and comes from the other ranks, a
    broadcast a binomial tree's share. With two ranks, sent and received are each the payload handed to the
    collectives.

    Attributes:
        bytes_sent: bytes this rank put on the wire (every round, every bucket, the non-finite flags included).
        bytes_dense: bytes of the buckets, as plain DDP hands them to its all-reduce.
        encode_ms: time spent compressing (including error feedback), in milliseconds.
        decode_ms: time spent decompressing and averaging, in milliseconds.
        buckets: how many bucket reductions the step made.
        finite: whether the step's gradients were finite on every rank; a non-finite step leaves every compressor
            state as it was (its aggregate is non-finite on every rank, for the optimizer's or AMP's skip).
        bytes_guard: the part of ``bytes_sent`` that carried the non-finite flags (and the padding they add).
        bytes_received: bytes this rank took off the wire. For a sparse gradient's all-reduce (gloo gathers every
            rank's rows, whose counts are not exchanged), ``n - 1`` times this rank's rows: an estimate.
        bytes_payload: bytes of the buffers this rank handed to collectives (what ``bytes_sent`` counted before it
            counted the wire); independent of the world size.
        bytes_dense_moved: what plain DDP's ring all-reduce of the same buckets would send plus receive on this rank
            at this world size: ``4 (n - 1) / n * bytes_dense``.
    """

    bytes_sent: int
    bytes_dense: int
    encode_ms: float
    decode_ms: float
    buckets: int
    finite: bool = True
    bytes_guard: int = 0
    bytes_received: int = 0
    bytes_payload: int = 0
    bytes_dense_moved: int = 0

    @property
    def compression_ratio(self) -> float:
        """``bytes_dense_moved / (bytes_sent + bytes_received)``: plain DDP's traffic over this rank's, at this ``n``.

        1.0 for plain all-reduce; below 1 when compression moves more than DDP would (an all-gather at many ranks).
        """
        return wire.compression_ratio(
            wire.Wire(self.bytes_dense_moved, 0), wire.Wire(self.bytes_sent, self.bytes_received)
        )


class Telemetry:
    """Thread-safe counters for the step in progress, plus running totals.

    Collective callbacks run on the backend's worker threads, hence the lock: a counter update is a few integer
    additions, far below the cost of the collective it accounts for.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.world_size = 1  # set by the Comm that counts here: plain DDP's ring is counted at this size
        self._reset_step()
        self.total_bytes_sent = 0
        self.total_bytes_received = 0
        self.total_bytes_dense = 0
        self.total_bytes_payload = 0
        self.total_bytes_dense_moved = 0
        self.total_steps = 0
        self.total_encode_ms = 0.0
        self.total_decode_ms = 0.0
        self.total_nonfinite_steps = 0
        self.total_state_resets = 0  # CompressionState.reset_state calls (after runs of non-finite steps)
        self.last: StepStats | None = None  # the latest finished step, for callbacks that read after the monitor

    def _reset_step(self) -> None:
        self._sent = 0
        self._received = 0
        self._payload = 0
        self._dense = 0
        self._dense_moved = 0
        self._seconds = {"encode": 0.0, "decode": 0.0}
        self._events: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
        self._buckets = 0
        self._verdicts: list[torch.Tensor] = []
        self._guard = 0

    def add_guard(self, nbytes: int) -> None:
        """Count ``nbytes`` of what was sent as the non-finite flag (already counted as sent)."""
        with self._lock:
            self._guard += nbytes

    def add_verdict(self, ok: torch.Tensor | None) -> None:
        """Record whether the step was finite on every rank (a device tensor: read when the step is popped)."""
        if ok is not None:
            with self._lock:
                self._verdicts.append(ok)

    def add_state_reset(self) -> None:
        """Count one reset of the residuals and the compressor's state."""
        with self._lock:
            self.total_state_resets += 1

    def add_collective(self, payload_nbytes: int, moved: wire.Wire) -> None:
        """Count one collective: ``payload_nbytes`` handed to it, ``moved`` on this rank's wire."""
        with self._lock:
            self._payload += payload_nbytes
            self._sent += int(moved.sent)
            self._received += int(moved.received)

    def add_bucket(self, dense_nbytes: int, sparse: bool = False) -> None:
        """Count one bucket reduction that plain DDP would have all-reduced as ``dense_nbytes``.

        ``sparse``: a sparse gradient's rows, which DDP all-reduces as gloo does, by an all-gather.
        """
        count = wire.sparse_all_reduce if sparse else wire.all_reduce
        moved = count(dense_nbytes, self.world_size).moved
        with self._lock:
            self._dense += dense_nbytes
            self._dense_moved += int(moved)
            self._buckets += 1

    @contextmanager
    def timed(self, phase: str, device: torch.device) -> Iterator[None]:
        """Add the time spent inside the block to ``phase`` (CUDA events on CUDA, wall clock otherwise)."""
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            with self._lock:
                self._events.append((phase, start, end))
            return
        begin = time.perf_counter()
        yield
        elapsed = time.perf_counter() - begin
        with self._lock:
            self._seconds[phase] += elapsed

    def pop_step(self) -> StepStats | None:
        """Return the counters of the finished step and start a new one; ``None`` if no bucket was reduced."""
        with self._lock:
            if self._buckets == 0:
                return None
            seconds = dict(self._seconds)
            for phase, start, end in self._events:
                end.synchronize()  # one sync per step, when logging, never per tensor
                seconds[phase] += start.elapsed_time(end) / 1e3
            stats = StepStats(
                bytes_sent=self._sent,
                bytes_dense=self._dense,
                encode_ms=seconds["encode"] * 1e3,
                decode_ms=seconds["decode"] * 1e3,
                buckets=self._buckets,
                finite=all(bool(ok) for ok in self._verdicts),  # read when logging, never on the hook path
                bytes_guard=self._guard,
                bytes_received=self._received,
                bytes_payload=self._payload,
                bytes_dense_moved=self._dense_moved,
            )
            self.total_nonfinite_steps += not stats.finite
            self.total_bytes_sent += stats.bytes_sent
            self.total_bytes_received += stats.bytes_received
            self.total_bytes_dense += stats.bytes_dense
            self.total_bytes_payload += stats.bytes_payload
            self.total_bytes_dense_moved += stats.bytes_dense_moved
            self.total_steps += 1
            self.total_encode_ms += stats.encode_ms
            self.total_decode_ms += stats.decode_ms
            self.last = stats
            self._reset_step()
        return stats
