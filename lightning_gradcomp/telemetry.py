"""Per-step compression telemetry: bytes put on the wire, dense bytes, encode/decode time.

Counted where the work happens (the collectives count bytes from the sizes of the tensors they are handed; the
compressor template times encode and decode), without any host-device synchronisation on the hot path: on CUDA the
times are CUDA events, read once per step when the numbers are logged.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch


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
    """What one rank sent in one optimizer step.

    Attributes:
        bytes_sent: bytes of the payloads this rank handed to collectives (every round, every bucket). With two ranks
            this is also the number of bytes the rank puts on the wire; with more, ring all-reduce moves
            ``2 (n - 1) / n`` times it and all-gather ``n - 1`` times it (see docs/concepts.md).
        bytes_dense: bytes plain DDP would all-reduce for the same buckets.
        encode_ms: time spent compressing (including error feedback), in milliseconds.
        decode_ms: time spent decompressing and averaging, in milliseconds.
        buckets: how many bucket reductions the step made.
        finite: whether the step's gradients were finite on every rank; a non-finite step leaves every compressor
            state as it was (its aggregate is non-finite on every rank, for the optimizer's or AMP's skip).
        bytes_guard: the part of ``bytes_sent`` that carried the non-finite flags (and the padding they add).
        bytes_received: bytes of other ranks' payloads this rank received: ``(n - 1)`` times the buffer of an
            all-gather, what the other ranks' splits of an all-to-all hold, the buffer of a broadcast on every rank but
            its source, and ``2 (n - 1) / n`` times the buffer of an all-reduce (what a ring all-reduce receives);
            for a sparse gradient's all-reduce, ``n - 1`` times this rank's rows (an estimate: gloo gathers every
            rank's rows, whose counts are not exchanged).
    """

    bytes_sent: int
    bytes_dense: int
    encode_ms: float
    decode_ms: float
    buckets: int
    finite: bool = True
    bytes_guard: int = 0
    bytes_received: int = 0

    @property
    def compression_ratio(self) -> float:
        """``bytes_dense / bytes_sent`` (1.0 for plain all-reduce)."""
        return self.bytes_dense / self.bytes_sent if self.bytes_sent else float("inf")


class Telemetry:
    """Thread-safe counters for the step in progress, plus running totals.

    Collective callbacks run on the backend's worker threads, hence the lock: a counter update is a few integer
    additions, far below the cost of the collective it accounts for.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reset_step()
        self.total_bytes_sent = 0
        self.total_bytes_received = 0
        self.total_bytes_dense = 0
        self.total_steps = 0
        self.total_encode_ms = 0.0
        self.total_decode_ms = 0.0
        self.total_nonfinite_steps = 0
        self.total_state_resets = 0  # CompressionState.reset_state calls (after runs of non-finite steps)
        self.last: StepStats | None = None  # the latest finished step, for callbacks that read after the monitor

    def _reset_step(self) -> None:
        self._sent = 0
        self._received = 0
        self._dense = 0
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

    def add_sent(self, nbytes: int) -> None:
        """Count ``nbytes`` handed to a collective."""
        with self._lock:
            self._sent += nbytes

    def add_received(self, nbytes: int) -> None:
        """Count ``nbytes`` of other ranks' payloads received by this rank."""
        with self._lock:
            self._received += nbytes

    def add_bucket(self, dense_nbytes: int) -> None:
        """Count one bucket reduction whose plain all-reduce would have moved ``dense_nbytes``."""
        with self._lock:
            self._dense += dense_nbytes
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
            )
            self.total_nonfinite_steps += not stats.finite
            self.total_bytes_sent += stats.bytes_sent
            self.total_bytes_received += stats.bytes_received
            self.total_bytes_dense += stats.bytes_dense
            self.total_steps += 1
            self.total_encode_ms += stats.encode_ms
            self.total_decode_ms += stats.decode_ms
            self.last = stats
            self._reset_step()
        return stats
