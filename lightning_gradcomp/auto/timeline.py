"""The timeline model of one training step (Espresso-style) and the greedy per-bucket planner. Pure: no torch.

Times are seconds, measured from the start of the backward pass. For bucket ``b`` (in the order DDP reduces them):

* ``r_b``: when the bucket's gradients are ready (the hook is called);
* ``enc_b``, ``dec_b``: the candidate's encode and decode time for the bucket;
* ``rounds_b``, ``bytes_b``: how many dependent collectives it issues and how many bytes each rank moves, as the
  buffer of the ring all-reduce that moves as many (:func:`allreduce_equivalent`).

The model is::

    finish_b = max(r_b + shift_b + enc_b, finish_{b-1}) + rounds_b * alpha + wire_b / beta + dec_b
    step     = t_forward + max(finish_last, t_backward_end + shift_last) + t_tail + t_optimizer

where ``shift_b`` is the encode time of the buckets before ``b`` when encoding blocks the backward pass (the hook runs
on the autograd thread: on CPU every encode delays the rest of the backward; on CUDA it only enqueues kernels and the
shift is 0 when ``encode_blocks_backward`` is off). When the CPU is *contended* (fewer cores than workers times their
threads plus a communication thread each: CPU training on a small machine), the decoding of every earlier bucket runs
on a communication thread that takes its core from the backward pass, so ``shift_b`` gains it too. ``wire_b`` is
``bytes_b``. ``alpha`` and ``beta`` come from :func:`fit_link` on timed dense all-reduces of the real link, so they
already include the all-reduce algorithm's own factor.

What is *not* modelled, by measurement: gloo's own CPU work per byte. An earlier version of this model gave a
compressed bucket back the host CPU time its saved bytes would have cost (fitted from ``time.process_time()`` around
the probes); on ResNet-18 with 2 CPU workers that predicted PowerSGD up to 32 % too fast at 100 Mbit/s. Without
the term (and with the candidates timed through the real hook) the worst error at three links is 9 % (docs/auto.md).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning_gradcomp.engine.wire import Wire, all_reduce

DENSE = "dense"


@dataclass(frozen=True)
class Link:
    """The fitted link: ``seconds = alpha + bytes / beta`` for an all-reduce of ``bytes`` per rank.

    Attributes:
        alpha: latency per collective, seconds.
        beta: bandwidth, bytes per second (of all-reduce payload per rank).
    """

    alpha: float
    beta: float

    def time(self, nbytes: float, rounds: int = 1) -> float:
        """Seconds for ``rounds`` dependent collectives moving ``nbytes`` per rank in all."""
        return rounds * self.alpha + nbytes / self.beta


def fit_link(samples: Sequence[tuple[float, float]], alpha: float | None = None) -> Link:
    """Least-squares fit of ``seconds = alpha + bytes / beta`` to ``(bytes, seconds)`` pairs.

    ``alpha`` is clamped to >= 0 and the slope to a tiny positive number (a noisy fit of a very fast link). With
    ``alpha`` given (the time of a tiny all-reduce: on a shaped link a token bucket lets the first kilobytes through at
    line rate, so the intercept of larger sizes is not the latency), only the slope is fitted, on ``seconds - alpha``.

    Raises:
        ValueError: If fewer than two distinct sizes are given (one suffices with ``alpha``).
    """
    xs = [float(b) for b, _ in samples]
    ys = [float(s) for _, s in samples]
    if alpha is not None:
        if not any(xs):
            raise ValueError("Expected `samples` to hold a non-zero size.")
        alpha = max(0.0, float(alpha))
        slope = max(sum(x * (y - alpha) for x, y in zip(xs, ys)) / sum(x * x for x in xs), 1e-15)
        return Link(alpha=alpha, beta=1.0 / slope)
    if len(set(xs)) < 2:
        raise ValueError(f"Expected `samples` to hold at least two distinct sizes, got {sorted(set(xs))}.")
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    slope = max(sxy / sxx, 1e-15)
    alpha = my - slope * mx
    if alpha < 0:  # refit through the origin: the latency cannot be negative
        alpha = 0.0
        slope = max(sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs), 1e-15)
    return Link(alpha=alpha, beta=1.0 / slope)


def allreduce_equivalent(moved: Wire, world_size: int) -> float:
    """The buffer a ring all-reduce over ``world_size`` ranks is handed to move as much as ``moved`` does.

    ``beta`` is fitted on all-reduces of known buffers, so a compressor's traffic (its declared byte model,
    :meth:`Compressor.wire_bytes <lightning_gradcomp.compressors.Compressor.wire_bytes>`, whatever its collectives)
    is priced as the all-reduce that moves as many bytes: ``sent + received`` over ``4 (n - 1) / n``.
    """
    per_byte = all_reduce(1 << 20, world_size).moved / (1 << 20)
    return moved.moved / per_byte if per_byte else 0.0


@dataclass(frozen=True)
class Cost:
    """What one candidate costs on one bucket.

    Attributes:
        encode: seconds of encoding (error feedback and compression) on this rank.
        decode: seconds of decoding and averaging.
        nbytes: bytes per rank, as the buffer of the ring all-reduce that moves as much (:func:`allreduce_equivalent`).
        rounds: dependent collectives (each pays ``alpha``).
    """

    encode: float
    decode: float
    nbytes: float
    rounds: int = 1


@dataclass(frozen=True)
class Bucket:
    """One DDP bucket as measured.

    Attributes:
        ready: seconds from the start of the backward pass until the hook is called for it.
        numel: elements in the bucket.
        layers: the names of its parameters (stable across DDP's bucket rebuild).
        costs: each candidate's :class:`Cost` on it (``"dense"`` is plain all-reduce).
    """

    ready: float
    numel: int
    layers: tuple[str, ...]
    costs: Mapping[str, Cost]

    @classmethod
    def from_dict(cls, state: Mapping[str, Any]) -> Bucket:
        """The bucket ``dataclasses.asdict`` made ``state`` of (as checkpointed)."""
        costs = {name: Cost(**cost) for name, cost in state["costs"].items()}
        return cls(state["ready"], state["numel"], tuple(state["layers"]), costs)

    def restricted(self, allowed: Collection[str]) -> Bucket:
        """This bucket with the costs of the ``allowed`` candidates only."""
        return Bucket(self.ready, self.numel, self.layers, {n: c for n, c in self.costs.items() if n in allowed})


@dataclass(frozen=True)
class Timing:
    """The fixed parts of a step, in seconds.

    Attributes:
        forward: the forward pass.
        backward_end: when the backward pass's computation ends (the last bucket's ready time), from its start.
        optimizer: the optimizer step.
        tail: what the backward call still takes after its last reduction finished (DDP copies the averages into the
            gradients and finalises; measured, the same for every candidate).
    """

    forward: float
    backward_end: float
    optimizer: float
    tail: float = 0.0


@dataclass(frozen=True)
class Prediction:
    """The predicted timeline: per-bucket finish times, the communication's start per bucket, the step time."""

    finish: tuple[float, ...]
    start: tuple[float, ...]
    step: float
    backward_end: float

    @property
    def exposed(self) -> float:
        """Seconds the communication runs past the backward pass."""
        return max(0.0, (self.finish[-1] if self.finish else 0.0) - self.backward_end)


def predict(
    buckets: Sequence[Bucket],
    assignment: Sequence[str],
    link: Link,
    timing: Timing,
    encode_blocks_backward: bool = True,
    contended: bool = False,
) -> Prediction:
    """The step time of ``assignment`` (a candidate name per bucket) under the timeline model (module docstring)."""
    if len(assignment) != len(buckets):
        raise ValueError(f"Expected one candidate per bucket ({len(buckets)}), got {len(assignment)}.")
    finish: list[float] = []
    starts: list[float] = []
    previous = 0.0
    shift = 0.0
    compute_shift = 0.0  # the shift of the backward's end: every encode, the contention of all but the last bucket
    for bucket, name in zip(buckets, assignment):
        cost = bucket.costs[name]
        ready = bucket.ready + shift + cost.encode
        if encode_blocks_backward:
            shift += cost.encode
        compute_shift = shift
        start = max(ready, previous)
        previous = start + link.time(cost.nbytes, cost.rounds) + cost.decode
        starts.append(start)
        finish.append(previous)
        if contended:
            shift += cost.decode
    backward_end = timing.backward_end + compute_shift
    step = timing.forward + max(previous, backward_end) + timing.tail + timing.optimizer
    return Prediction(finish=tuple(finish), start=tuple(starts), step=step, backward_end=backward_end)


def exposed_tail(prediction: Prediction, buckets: Sequence[Bucket], link: Link) -> int:
    """Index of the first bucket of the last busy stretch of the communication timeline (Espresso's last group).

    Buckets before it finish with an idle gap after them: shortening their communication cannot shorten the step.
    Returns ``len(buckets)`` when the communication ends inside the backward pass (nothing exposed).
    """
    if not buckets or prediction.finish[-1] <= prediction.backward_end:
        return len(buckets)
    first = len(buckets) - 1
    while first > 0 and prediction.start[first] <= prediction.finish[first - 1] + 1e-12:
        first -= 1
    return first


@dataclass(frozen=True)
class Plan:
    """A per-bucket assignment with its prediction and why it was chosen.

    Attributes:
        assignment: a candidate name per bucket.
        predicted: the predicted step time, seconds.
        dense_predicted: the all-dense prediction, seconds.
        reasons: one line per decision.
    """

    assignment: tuple[str, ...]
    predicted: float
    dense_predicted: float
    reasons: tuple[str, ...] = field(default=())

    @classmethod
    def from_dict(cls, state: Mapping[str, Any]) -> Plan:
        """The plan ``dataclasses.asdict`` made ``state`` of (as checkpointed)."""
        return cls(tuple(state["assignment"]), state["predicted"], state["dense_predicted"], tuple(state["reasons"]))

    def layer_assignment(self, buckets: Sequence[Bucket]) -> dict[str, str]:
        """Layer name -> candidate, for every layer of every bucket."""
        return {name: cand for bucket, cand in zip(buckets, self.assignment) for name in bucket.layers}


def plan_greedy(
    buckets: Sequence[Bucket],
    candidates: Sequence[str],
    link: Link,
    timing: Timing,
    margin: float = 0.03,
    encode_blocks_backward: bool = True,
    contended: bool = False,
) -> Plan:
    """Choose a candidate per bucket: dense where communication is hidden, the least lossy one that pays elsewhere.

    ``candidates`` are ordered from the least lossy (``"dense"`` first) to the most. Repeatedly: predict the
    timeline, take the exposed tail (:func:`exposed_tail`), and for its buckets, largest first, find the candidate
    with the lowest predicted step; then take the least lossy candidate whose step is within ``margin`` of that best
    one, and keep the switch only if it shortens the predicted step by more than ``margin`` times the step. The
    result is compared with every uniform assignment; a uniform one replaces it only if it is faster by more than
    ``margin`` too. The final plan must beat all-dense by more than ``margin``, else all-dense is returned.
    """
    if not 0 <= margin < 1:
        raise ValueError(f"Expected `margin` to be in [0, 1), got {margin!r}.")
    names = [DENSE, *[c for c in candidates if c != DENSE]]
    rank = {name: i for i, name in enumerate(names)}

    def step_of(assign: Sequence[str]) -> float:
        return predict(buckets, assign, link, timing, encode_blocks_backward, contended).step

    dense = [DENSE] * len(buckets)
    dense_step = step_of(dense)
    assign = list(dense)
    reasons: list[str] = []
    tried: set[int] = set()
    while True:
        prediction = predict(buckets, assign, link, timing, encode_blocks_backward, contended)
        current = prediction.step
        tail = [b for b in range(exposed_tail(prediction, buckets, link), len(buckets)) if b not in tried]
        if not tail:
            break
        b = max(tail, key=lambda i: (buckets[i].numel, -i))
        tried.add(b)
        options = {}
        for name in names:
            if name not in buckets[b].costs:
                continue
            trial = list(assign)
            trial[b] = name
            options[name] = step_of(trial)
        best = min(options.values())
        choice = min((n for n, s in options.items() if s <= best + margin * current), key=rank.__getitem__)
        if choice != assign[b] and options[choice] < current * (1 - margin):
            reasons.append(
                f"bucket {b}: {assign[b]} -> {choice}, predicted {current * 1e3:.1f} -> {options[choice] * 1e3:.1f} ms"
            )
            assign[b] = choice  # every bucket is visited at most once: the loop ends
    best_assign, best_step = assign, step_of(assign)
    for name in names[1:]:
        if all(name in bucket.costs for bucket in buckets):
            uniform = [name] * len(buckets)
            s = step_of(uniform)
            if s < best_step * (1 - margin):
                reasons.append(f"uniform {name} beats the greedy plan: {best_step * 1e3:.1f} -> {s * 1e3:.1f} ms")
                best_assign, best_step = uniform, s
    if best_step >= dense_step * (1 - margin):
        if best_assign != dense:
            reasons.append(
                f"kept dense: the best plan ({best_step * 1e3:.1f} ms) does not gain more than {margin:.0%} over"
                f" dense ({dense_step * 1e3:.1f} ms)"
            )
        elif not reasons:
            reasons.append(f"dense: communication is hidden or compression does not pay ({dense_step * 1e3:.1f} ms)")
        best_assign, best_step = dense, dense_step
    return Plan(tuple(best_assign), best_step, dense_step, tuple(reasons))


def speedup_curve(
    buckets: Sequence[Bucket],
    candidates: Sequence[str],
    link: Link,
    timing: Timing,
    bandwidths: Sequence[float],
    encode_blocks_backward: bool = True,
    contended: bool = False,
) -> dict[str, list[float]]:
    """Predicted step time of every uniform candidate (and ``"auto"``) at each bandwidth (bytes/s), latency kept."""
    out: dict[str, list[float]] = {name: [] for name in [DENSE, *[c for c in candidates if c != DENSE], "auto"]}
    for beta in bandwidths:
        at = Link(link.alpha, beta)
        for name in out:
            if name == "auto":
                plan = plan_greedy(buckets, candidates, at, timing, 0.03, encode_blocks_backward, contended)
                out[name].append(plan.predicted)
            elif all(name in b.costs for b in buckets):
                step = predict(buckets, [name] * len(buckets), at, timing, encode_blocks_backward, contended).step
                out[name].append(step)
    return out
