"""Where a DiLoCo round's time goes: a timestamped trace of the outer exchange on a shaped link (a benchmark).

Runs one configuration of ``benchmarks/diloco.py steps`` (the same model, data, workers and shaped namespace; needs
root for a rate other than ``none``) with every worker recording, on ``time.perf_counter`` and with the thread that
did it:

* each step's end, and the CPU seconds of every thread of the process at that moment (``/proc/self/task``);
* the round's exchange: ``OuterExchange.start`` (the compressor's encoding and its error feedback, the collectives
  issued) and ``Round.finish`` (the wait for the average, the outer step, the copy back);
* each collective issued through the package's process groups, and when its future completed;
* the compressor's ``compress`` and ``decompress`` (on which thread: the main one, or gloo's worker thread that runs
  the collective's callbacks).

It prints, per exchange, how long it held the main thread when it started, when its bytes were on the wire, when the
average was decoded, how long the main thread waited for it when it was applied, and over the run the CPU seconds of
every thread beyond those of plain inner steps. Examples::

    python benchmarks/diloco_trace.py --rate 100mbit --config h100-minmax8-streaming
    python benchmarks/diloco_trace.py --rate none --config h100-minmax8 --steps 40
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from typing import Any

#: (event, seconds since the worker started, on the main thread?, details)
EVENTS: list[tuple[str, float, bool, dict]] = []
_T0 = time.perf_counter()
_MAIN = threading.get_ident()


def _event(name: str, **details: Any) -> None:
    EVENTS.append((name, time.perf_counter() - _T0, threading.get_ident() == _MAIN, details))


def _thread_cpu() -> dict[str, float]:
    """CPU seconds (user + system) of every thread of this process, by ``tid:name``."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:  # the thread ended meanwhile
            continue
        out[f"{tid}:{name}"] = (int(fields[11]) + int(fields[12])) / tick
    return out


def _timed(owner: Any, attr: str, label: str) -> None:
    original = getattr(owner, attr)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        _event(label + ">")
        try:
            return original(*args, **kwargs)
        finally:
            _event(label + "<")

    setattr(owner, attr, wrapped)


def _collective(kind: str) -> None:
    from lightning_gradcomp.engine import collectives as process_groups

    original = getattr(process_groups.TorchCollectives, kind)

    def issued(self: Any, tensor: Any, *args: Any, **kwargs: Any) -> Any:
        nbytes = tensor.numel() * tensor.element_size()
        _event(f"issue {kind}", nbytes=nbytes)
        future = original(self, tensor, *args, **kwargs)
        future.add_done_callback(lambda _: _event(f"done {kind}", nbytes=nbytes))
        return future

    setattr(process_groups.TorchCollectives, kind, issued)


def _bench() -> Any:
    """``benchmarks/diloco.py``, whose configurations this traces (beside this script, on ``sys.path`` when it runs)."""
    import diloco

    return diloco


def _install() -> None:
    """Wrap the exchange's functions and the step clock with the recorders above."""
    from lightning_gradcomp.compressors import minmax, sparseloco
    from lightning_gradcomp.diloco import exchange, round

    _timed(exchange.OuterExchange, "start", "start")
    _timed(round.Round, "finish", "finish")
    _timed(round.Round, "pseudo_gradients", "pseudo-gradient")
    _timed(round.Round, "outer_step", "outer step")
    _timed(exchange.InFlight, "wait", "wait")
    for compressor in (minmax.MinMax, sparseloco.SparseLoCo):
        _timed(compressor, "compress", "compress")
        _timed(compressor, "decompress", "decompress")
    for kind in ("all_gather", "all_reduce"):
        _collective(kind)
    bench = _bench()
    make_clock = bench._make_clock

    def clock_with_cpu() -> Any:
        clock = make_clock()
        batch_end = clock.on_train_batch_end

        def on_train_batch_end(*args: Any, **kwargs: Any) -> None:
            batch_end(*args, **kwargs)
            _event("step", cpu=_thread_cpu())

        clock.on_train_batch_end = on_train_batch_end
        return clock

    bench._make_clock = clock_with_cpu


# ----------------------------------------------------------------------------------------------------------------
# The summary of one rank's trace
# ----------------------------------------------------------------------------------------------------------------


def _main_cpu(cpu: dict[str, float]) -> float:
    return min(cpu.items(), key=lambda kv: int(kv[0].split(":")[0]))[1]  # the main thread has the lowest id


def summarize(events: list, first: int, last: int) -> dict:
    """Per exchange and over steps ``first..last`` (1-based) of one rank's ``events``."""
    steps = [(t, d["cpu"]) for name, t, _, d in events if name == "step"]
    step_at = [t for t, _ in steps]

    def step_of(t: float) -> int:  # the step in progress at time t, 1-based
        return 1 + sum(1 for s in step_at if s <= t)

    exchanges: list[dict] = []
    current: dict | None = None
    for name, t, main, details in events:
        if name == "start>":
            current = {"start_step": step_of(t), "started": t, "decode_thread": set()}
            exchanges.append(current)
        elif current is None:
            continue
        elif name == "start<":
            current["start_s"] = t - current["started"]
        elif name == "compress<" and main and "encoded" not in current:
            current["encoded"] = t
        elif name == "issue all_gather" or (name == "issue all_reduce" and details["nbytes"] > 1 << 20):
            current["issued"], current["wire_bytes"] = t, details["nbytes"]
        elif name.startswith("done all_") and details["nbytes"] == current.get("wire_bytes"):
            current["on_wire_s"] = t - current["issued"]
            current["done"] = t
        elif name == "decompress<" and not main:
            current["decoded_after_s"] = t - current["done"]
            current["decode_thread"].add("gloo")
        elif name == "finish>":
            current["finish_step"], current["finishing"] = step_of(t), t
        elif name == "wait<" and "finishing" in current and "waited_s" not in current:
            current["waited_s"] = t - current["finishing"]
        elif name == "finish<" and "finishing" in current:
            current["finish_s"] = t - current["finishing"]
            current = None
    for x in exchanges:
        x["decode_thread"] = ", ".join(sorted(x["decode_thread"])) or "main"
        k = x["start_step"]  # the step after it: the first that runs while the exchange is on the wire
        if k < len(step_at):
            x["next_step_s"] = step_at[k] - step_at[k - 1]
    window = steps[first - 2 : last]  # the step before the window ends where the window starts
    durations = [b[0] - a[0] for a, b in zip(window, window[1:])]
    main = [_main_cpu(b[1]) - _main_cpu(a[1]) for a, b in zip(window, window[1:])]
    # the steps in which the main thread started or applied an exchange
    busy = {step_of(t) for name, t, _, _ in events if name in ("start>", "finish>")}
    numbers = range(first, first + len(main))
    plain = statistics.median(c for k, c in zip(numbers, main) if k not in busy)
    total = {k: window[-1][1][k] - window[0][1].get(k, 0.0) for k in window[-1][1]}
    threads: dict[str, float] = {}
    for key, value in total.items():
        threads[key.split(":", 1)[1]] = threads.get(key.split(":", 1)[1], 0.0) + value
    main_total = _main_cpu(window[-1][1]) - _main_cpu(window[0][1])
    # beyond plain steps: every other thread's CPU, and the main thread's beyond the median on its busy steps
    extra = sum(total.values()) - main_total + sum(c - plain for k, c in zip(numbers, main) if k in busy)
    return {
        "steps": len(durations),
        "wall_s": sum(durations),
        "median_step_s": statistics.median(durations),
        "plain_step_cpu_s": plain,
        "thread_cpu_s": threads,
        "extra_cpu_s": extra,
        "exchanges": [
            {k: v for k, v in x.items() if k not in ("started", "finishing", "done", "issued", "encoded")}
            for x in exchanges
            if first <= x["start_step"] <= last
        ],
    }


def markdown(summary: dict, args: argparse.Namespace, load: str) -> str:
    s = summary
    lines = [
        f"`{args.config}` at {args.rate}, rank {args.rank}, steps {args.first}..{args.last}; load average before the"
        f" run: {load}.",
        "",
        f"{s['steps']} steps in {s['wall_s']:.2f} s (median step {s['median_step_s']:.3f} s); the main thread's"
        f" median CPU in a step that neither starts nor applies an exchange {s['plain_step_cpu_s']:.3f} s; CPU"
        f" seconds beyond plain steps (the other threads', and the main thread's beyond that median in the steps that"
        f" do): {s['extra_cpu_s']:.2f} s ({s['extra_cpu_s'] / s['steps']:.4f} s per step,"
        f" {s['extra_cpu_s'] / s['steps'] / s['plain_step_cpu_s']:.3f}x a step's CPU).",
        "",
        "CPU seconds by thread: " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(s["thread_cpu_s"].items())),
        "",
        "| started in step | main thread held at start (s) | the next step (s) | bytes of the largest collective"
        " | on the wire (s) | decoded after (s), by | applied in step | main thread waited (s) | finish held (s) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for x in s["exchanges"]:

        def f(key: str, fmt: str = "{:.3f}", x: dict = x) -> str:
            return fmt.format(x[key]) if key in x else ""

        lines.append(
            f"| {f('start_step', '{}')} | {f('start_s')} | {f('next_step_s')} | {f('wire_bytes', '{:,}')}"
            f" | {f('on_wire_s')} | {f('decoded_after_s')} ({x['decode_thread']}) | {f('finish_step', '{}')}"
            f" | {f('waited_s')} | {f('finish_s')} |"
        )
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "_worker":
        spec = json.loads(sys.argv[2])
        _install()
        _bench()._worker(spec)
        with open(f"{spec['trace']}.rank{spec['rank']}.json", "w") as f:
            json.dump(EVENTS, f)
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", default="100mbit", help="tc rate of the shaped loopback; 'none' for unshaped")
    bench = _bench()
    parser.add_argument("--config", default="h100-minmax8-streaming", choices=bench.STEP_CONFIGS[3:])
    parser.add_argument("--steps", type=int, default=115, help="optimizer steps to run")
    parser.add_argument("--first", type=int, default=16, help="first step of the CPU accounting window")
    parser.add_argument("--last", type=int, default=115, help="last step of the CPU accounting window")
    parser.add_argument("--rank", type=int, default=0, help="whose trace to summarize")
    parser.add_argument("--fragments", type=int, default=5)
    parser.add_argument("--overlap-steps", type=int, default=15)
    parser.add_argument("--n-layer", type=int, default=8)
    parser.add_argument("--n-embd", type=int, default=512)
    parser.add_argument(
        "--out",
        default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "diloco_trace"),
        help="writes OUT.md, OUT.json (the summary) and OUT.rank<r>.json (the events)",
    )
    args = parser.parse_args()
    from _netns import shaped_namespace

    model = {
        "block_size": 32,
        "n_layer": args.n_layer,
        "n_head": args.n_embd // 64,
        "n_embd": args.n_embd,
        "warmup_steps": 0,
    }
    spec = {
        "task": "steps",
        "world": 2,
        "threads": 1,
        "seed": 0,
        "model": model,
        "batch_size": 1,
        "probe_every": 3,
        "fragments": args.fragments,
        "overlap_steps": args.overlap_steps,
        "alone": False,
        "runs": [{"config": args.config, "steps": args.steps, "alone": False}],
        "trace": os.path.abspath(args.out),
    }
    os.makedirs(os.path.dirname(spec["trace"]) or ".", exist_ok=True)
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    script = os.path.abspath(__file__)
    if args.rate == "none":
        bench.launch(spec, None, script)
    else:
        with shaped_namespace(args.rate) as name:
            bench.launch(spec, name, script)
    with open(f"{spec['trace']}.rank{args.rank}.json") as f:
        summary = summarize(json.load(f), args.first, min(args.last, args.steps))
    text = markdown(summary, args, load)
    with open(args.out + ".md", "w") as f:
        f.write(text + "\n")
    with open(args.out + ".json", "w") as f:
        json.dump({"args": vars(args), "load": load, **summary}, f, indent=1)
    print(text)


if __name__ == "__main__":
    main()
