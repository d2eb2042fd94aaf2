"""Fault-tolerant DiLoCo (``DiLoCo(fault_tolerance=TorchFT(...))``) under churn, and what its sync costs (a benchmark).

``overhead``: the same small GPT (vocab 256, 32 positions, 2 blocks of width 64, 2 heads: 118,528 parameters, the
model of ../shared/docs/torchft-side-by-side.md) for ``--rounds`` rounds of ``--sync-every`` steps, as plain
``DiLoCo`` on 2 processes of one job and as 2 replica groups of one process each on a lighthouse. Each sync's cost is
the time of the round's ``send`` call that runs it (the quorum, the members' check when they changed, the
exchange, the commit vote, the outer step), median over the rounds after the first; plus the quorum's own time.

``soak``: ``--groups`` replica groups (3) on the language task (``TextDataModule``: Python's standard library as
bytes, each group its own shard; a GPT of 4 blocks, width 128; AdamW, constant learning rate after a warm-up) for
``--minutes`` minutes; a group chosen at random is killed with SIGKILL about every ``--kill-every`` seconds (uniform
in [0.5, 1.5] of it; never a group that has not joined yet) and started again at once, as a supervisor would. Every
group process appends one JSON line per optimizer step (its wall time, global step, torchft step, commits, discards,
heals, the CRC32 of theta_global at a sync) to ``OUT/steps.jsonl``; the report counts:

* rounds committed (distinct torchft steps) and discarded (per group), hangs (a process past the deadline);
* divergence: syncs whose theta_global differs between the groups that committed the same torchft step;
* time to heal: from a restarted group's launch to the end of its heal step (it trains from the next step on);
* goodput: the inner steps that reached a committed theta_global (``sync_every`` x the contributors of every
  committed sync) over all inner steps every process took, killed ones included;
* the final validation loss of theta_global against a run with no failure for the same number of committed rounds.

Each process ends by writing its sync timings and the CRC32 of its theta_global to ``OUT.d/final-NAME.json`` (text,
the result) and theta_global itself to ``OUT.d/final-NAME.pt`` (scratch for the validation loss; git ignores it).

Examples::

    python benchmarks/elastic.py overhead --out benchmarks/results/elastic_overhead
    nice -n 10 python benchmarks/elastic.py soak --minutes 10 --out benchmarks/results/elastic_soak
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
import zlib
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = {"block_size": 32, "n_layer": 2, "n_head": 2, "n_embd": 64}
SOAK = {"block_size": 64, "n_layer": 4, "n_head": 4, "n_embd": 128}


# ----------------------------------------------------------------------------------------------------------------
# One replica group (or, with --plain N, plain DiLoCo on N processes): run as `elastic.py group ...`
# ----------------------------------------------------------------------------------------------------------------


def _shard_datamodule(args: argparse.Namespace, shards: int, **kwargs: Any) -> Any:
    """The language task's data, this group's shard of it (rank r's of a job for plain DiLoCo)."""
    from torch.utils.data import DataLoader, DistributedSampler

    from lightning_gradcomp.tasks import TextDataModule

    class Shard(TextDataModule):
        def train_dataloader(self) -> DataLoader:
            rank = int(args.name) if not args.plain else self.trainer.global_rank
            sampler = DistributedSampler(self.train_set, num_replicas=shards, rank=rank, shuffle=True, seed=0)
            return DataLoader(self.train_set, batch_size=self.batch_size, sampler=sampler, drop_last=True)

    return Shard(**kwargs)


def _log_callback(args: argparse.Namespace, launched: float) -> Any:
    """A callback that appends a line per optimizer step to ``OUT/steps.jsonl`` and times each sync."""
    import lightning.pytorch as pl
    import torch

    class Log(pl.Callback):
        def __init__(self) -> None:
            self.out = open(os.path.join(args.outdir, "steps.jsonl"), "a")  # noqa: SIM115 (one line per step)
            self.sync_s: list[float] = []
            self.quorum_s: list[float] = []
            self.vote_s: list[float] = []

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            self.fit_started = time.time()
            round = trainer.strategy.outer_state
            members, real = round.membership, round.send

            def timed(fragment: int, optimizers: Any, overlap: int | None = None) -> None:
                start, before = time.perf_counter(), round.syncs + members.discarded
                real(fragment, optimizers, overlap)
                if round.syncs + members.discarded != before:
                    self.sync_s.append(time.perf_counter() - start)

            round.send = timed
            session = getattr(members, "session", None)
            if session is not None:
                real_quorum, real_vote = session.quorum, session.should_commit

                def quorum() -> Any:
                    found = real_quorum()
                    self.quorum_s.append(found.seconds)
                    return found

                def vote(ok: bool, reason: str = "") -> bool:
                    start = time.perf_counter()
                    committed = real_vote(ok, reason)
                    self.vote_s.append(time.perf_counter() - start)
                    return committed

                session.quorum, session.should_commit = quorum, vote

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            round = trainer.strategy.outer_state
            members = round.membership
            session = getattr(members, "session", None)
            heals = getattr(members, "heals", 0)
            line = {
                "t": time.time(),
                "launched": launched,
                "fit_started": self.fit_started,
                "group": args.name,
                "attempt": args.attempt,
                "step": trainer.global_step,
                "ft": session.step if session is not None else round.syncs,
                "syncs": round.syncs,
                "discarded": members.discarded,
                "heals": heals,
                "heal_s": getattr(members, "heal_seconds", 0.0),
                "contributors": getattr(members, "contributors", 0),
                "inner": not (heals and trainer.global_step == self._first_step(trainer)),
                "phase": round.phase,
            }
            if round.phase == 0:
                line["crc"] = zlib.crc32(b"".join(p.detach().numpy().tobytes() for p in round.params))
            self.out.write(json.dumps(line) + "\n")
            self.out.flush()
            stop = os.path.join(args.outdir, "stop")
            if os.path.exists(stop):  # the soak's end: every group stops after the same sync
                with open(stop) as f:
                    trainer.should_stop = trainer.should_stop or trainer.global_step >= int(f.read() or 0)

        def _first_step(self, trainer: Any) -> int:
            if not hasattr(self, "first"):
                self.first = trainer.global_step
            return self.first

        def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
            """The timings and theta_global's CRC32 as text (a result); theta_global itself as scratch (ignored)."""
            round = trainer.strategy.outer_state
            name = f"plain-rank{trainer.global_rank}" if args.plain else f"{args.name}-{args.attempt}"
            crc = zlib.crc32(b"".join(p.detach().numpy().tobytes() for p in round.params))
            timings = {"sync_s": self.sync_s, "quorum_s": self.quorum_s, "vote_s": self.vote_s, "crc32": crc}
            with open(os.path.join(args.outdir, f"final-{name}.json"), "w") as f:
                json.dump(timings, f, indent=1)
            torch.save([p.clone() for p in round.params], os.path.join(args.outdir, f"final-{name}.pt"))

    return Log()


def group(args: argparse.Namespace) -> None:
    import lightning.pytorch as pl
    import torch

    from lightning_gradcomp import DiLoCo, TorchFT
    from lightning_gradcomp.tasks import GPTLanguageModel

    torch.set_num_threads(1)
    launched = float(os.environ.get("ELASTIC_LAUNCHED", time.time()))
    shards = args.plain or args.groups
    model_args = TINY if args.model == "tiny" else SOAK
    fault_tolerance = None
    if not args.plain:
        fault_tolerance = TorchFT(
            lighthouse=args.lighthouse,
            replica_group_id=args.name,
            start_replicas=args.groups,
            timeout=30,
            quorum_timeout=300,
            connect_timeout=30,
        )
    strategy = DiLoCo(sync_every=args.sync_every, fault_tolerance=fault_tolerance, process_group_backend="gloo")
    pl.seed_everything(0, verbose=False)
    model = GPTLanguageModel(**model_args, lr=args.lr, warmup_steps=args.warmup, min_lr_ratio=1.0)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.plain or 1,
        strategy=strategy,
        max_steps=args.steps,
        max_epochs=-1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=[_log_callback(args, launched)],
    )
    datamodule = _shard_datamodule(args, shards, seq_len=model_args["block_size"], batch_size=args.batch_size)
    trainer.fit(model, datamodule=datamodule)


# ----------------------------------------------------------------------------------------------------------------
# The driver
# ----------------------------------------------------------------------------------------------------------------


def _free_port() -> int:
    from lightning_gradcomp.demo.ports import free_port

    return free_port()


def _start(outdir: str, name: str, options: list[str], log: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONWARNINGS", "TORCHFT_LIGHTHOUSE")}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), OMP_NUM_THREADS="1")
    env.update(PYTHONPATH=ROOT, ELASTIC_LAUNCHED=repr(time.time()))
    with open(os.path.join(outdir, log), "a") as out:
        command = [sys.executable, os.path.abspath(__file__), "group", outdir, name, *options]
        return subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)


def _lighthouse(outdir: str, port: int, heartbeat_ms: int) -> subprocess.Popen:
    log = open(os.path.join(outdir, "lighthouse.log"), "w")  # noqa: SIM115 (the process's output)
    command = [sys.executable, "-m", "lightning_gradcomp.cli", "lighthouse", "--min-replicas", "1", "--port", str(port)]
    proc = subprocess.Popen(
        [*command, "--heartbeat-timeout-ms", str(heartbeat_ms)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT},
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        with open(os.path.join(outdir, "lighthouse.log")) as f:
            if "listening on" in f.read():
                return proc
        time.sleep(0.2)
    raise RuntimeError("the lighthouse did not start within 120 s")


def _stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _steps(outdir: str) -> list[dict]:
    with open(os.path.join(outdir, "steps.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def overhead(args: argparse.Namespace) -> dict:
    outdir = os.path.abspath(args.out + ".d")
    os.makedirs(outdir, exist_ok=True)
    steps = args.rounds * args.sync_every
    common = ["--model", "tiny", "--steps", str(steps), "--sync-every", str(args.sync_every), "--batch-size", "8"]
    results: dict[str, Any] = {"command": " ".join(sys.argv), "rounds": args.rounds, "sync_every": args.sync_every}
    for repeat in range(args.repeats):
        plain = _start(outdir, "x", [*common, "--plain", "2"], "plain.log")
        if plain.wait(timeout=1800):
            raise RuntimeError("the plain run failed: see plain.log")
        port = _free_port()
        lighthouse = _lighthouse(outdir, port, 5000)
        address = ["--lighthouse", f"http://127.0.0.1:{port}", "--groups", "2"]
        groups = [_start(outdir, str(g), [*common, *address, "--attempt", str(repeat)], f"{g}.log") for g in (0, 1)]
        try:
            if any(p.wait(timeout=1800) for p in groups):
                raise RuntimeError("a replica group failed: see its log")
        finally:
            _stop([*groups, lighthouse])
        with open(os.path.join(outdir, "final-plain-rank0.json")) as f:
            ours = json.load(f)
        with open(os.path.join(outdir, f"final-0-{repeat}.json")) as f:
            ft = json.load(f)
        row = {
            "plain_sync_ms": 1e3 * statistics.median(ours["sync_s"][1:]),
            "ft_sync_ms": 1e3 * statistics.median(ft["sync_s"][1:]),
            "ft_quorum_ms": 1e3 * statistics.median(ft["quorum_s"][2:]),
            "ft_vote_ms": 1e3 * statistics.median(ft["vote_s"][2:]),
            "same_theta_global": ours["crc32"] == ft["crc32"],
        }
        row["overhead_ms"] = row["ft_sync_ms"] - row["plain_sync_ms"]
        results.setdefault("repeats", []).append(row)
        print(json.dumps(row), flush=True)
    return results


def soak(args: argparse.Namespace) -> dict:
    outdir = os.path.abspath(args.out + ".d")
    os.makedirs(outdir, exist_ok=True)
    for stale in ("steps.jsonl", "stop"):
        if os.path.exists(os.path.join(outdir, stale)):
            os.remove(os.path.join(outdir, stale))
    rng = random.Random(args.seed)
    port = _free_port()
    lighthouse = _lighthouse(outdir, port, args.heartbeat_ms)
    common = ["--lighthouse", f"http://127.0.0.1:{port}", "--groups", str(args.groups), "--steps", str(args.steps)]
    common += ["--sync-every", str(args.sync_every)]
    names = [str(g) for g in range(args.groups)]
    attempts = dict.fromkeys(names, 0)
    procs = {n: _start(outdir, n, [*common, "--attempt", "0"], f"{n}.log") for n in names}
    launches: list[dict] = []
    kills: list[dict] = []
    start = time.time()
    deadline = start + 60 * args.minutes
    next_kill = start + args.kill_every * rng.uniform(0.5, 1.5)
    hangs, stopping = 0, False
    try:
        while any(p.poll() is None for p in procs.values()):
            now = time.time()
            if now > deadline + args.grace:
                hangs = sum(p.poll() is None for p in procs.values())
                break
            if now >= deadline and not stopping and os.path.exists(os.path.join(outdir, "steps.jsonl")):
                top = max(s["step"] for s in _steps(outdir))  # every group stops after the same sync, soon
                with open(os.path.join(outdir, "stop"), "w") as f:
                    f.write(str((top // args.sync_every + 3) * args.sync_every))
                stopping = True
            if now >= next_kill and now < deadline - args.quiet:
                joined = _joined(outdir, attempts)
                live = [n for n in names if procs[n].poll() is None and n in joined]
                if len(live) > 1:
                    victim = rng.choice(live)
                    procs[victim].send_signal(signal.SIGKILL)
                    procs[victim].wait()
                    kills.append({"t": now - start, "group": victim, "attempt": attempts[victim]})
                    attempts[victim] += 1
                    options = [*common, "--attempt", str(attempts[victim])]
                    procs[victim] = _start(outdir, victim, options, f"{victim}.log")
                    launches.append({"t": time.time(), "group": victim, "attempt": attempts[victim]})
                next_kill = now + args.kill_every * rng.uniform(0.5, 1.5)
            time.sleep(0.2)
        codes = {n: p.poll() for n, p in procs.items()}
    finally:
        _stop([*procs.values(), lighthouse])
    wall = time.time() - start
    report = _report(outdir, args, launches, codes, hangs, wall)
    report["kills"] = kills
    return report


def _joined(outdir: str, attempts: dict[str, int]) -> set[str]:
    """The groups whose current process has taken a step (joined): only those are killed."""
    path = os.path.join(outdir, "steps.jsonl")
    if not os.path.exists(path):
        return set()
    return {s["group"] for s in _steps(outdir) if s["attempt"] == attempts[s["group"]]}


def _report(outdir: str, args: argparse.Namespace, launches: list[dict], codes: dict, hangs: int, wall: float) -> dict:
    steps = _steps(outdir)
    h = args.sync_every
    committed: dict[int, dict[str, Any]] = {}  # torchft step -> the contributors and every committer's CRC
    for s in steps:
        if "crc" in s and s["contributors"]:
            entry = committed.setdefault(s["ft"], {"contributors": s["contributors"], "crcs": set()})
            entry["crcs"].add(s["crc"])
    divergent = sorted(step for step, entry in committed.items() if len(entry["crcs"]) > 1)
    useful = sum(h * entry["contributors"] for entry in committed.values())
    inner = sum(bool(s["inner"]) for s in steps)
    heals, starts = [], []
    for launch in launches:
        mine = [s for s in steps if s["group"] == launch["group"] and s["attempt"] == launch["attempt"]]
        if mine:
            heals.append(mine[0]["t"] - launch["t"])
            starts.append(mine[0]["fit_started"] - launch["t"])  # of which: the process and Lightning starting
    last: dict[str, dict] = {}
    for s in steps:
        last[f"{s['group']}-{s['attempt']}"] = s
    discarded = {key: s["discarded"] for key, s in last.items()}
    return {
        "command": " ".join(sys.argv),
        "wall_s": wall,
        "exit_codes": codes,
        "hangs": hangs,
        "rounds_committed": len(committed),
        "rounds_discarded_per_process": discarded,
        "divergent_syncs": divergent,
        "goodput": useful / max(inner, 1),
        "inner_steps": inner,
        "useful_inner_steps": useful,
        "seconds_to_heal": heals,
        "seconds_to_fit_start": starts,
        "heal_transfer_s": [s["heal_s"] for s in steps if s["heals"] and not s["inner"]],
    }


def validation_loss(outdir: str, name: str, model: dict) -> float:
    """The validation loss of theta_global saved by group ``name`` (the language task's held-out bytes)."""
    import torch

    from lightning_gradcomp.tasks import GPTLanguageModel, TextDataModule

    torch.manual_seed(0)
    net = GPTLanguageModel(**model)
    saved = torch.load(os.path.join(outdir, f"final-{name}.pt"))
    with torch.no_grad():
        for p, value in zip([p for p in net.parameters() if p.requires_grad], saved, strict=True):
            p.copy_(value)
    data = TextDataModule(seq_len=model["block_size"], batch_size=32)
    data.setup("validate")
    net.eval()
    with torch.no_grad():
        losses = [float(net._loss(batch)) for batch in data.val_dataloader()]
    return statistics.fmean(losses)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    one = sub.add_parser("group", help="one replica group (internal)")
    one.add_argument("outdir")
    one.add_argument("name")
    one.add_argument("--lighthouse")
    one.add_argument("--plain", type=int, default=0)
    one.add_argument("--groups", type=int, default=3)
    one.add_argument("--attempt", type=int, default=0)
    one.add_argument("--model", choices=("tiny", "soak"), default="soak")
    one.add_argument("--steps", type=int, default=100_000)
    one.add_argument("--sync-every", type=int, default=20)
    one.add_argument("--batch-size", type=int, default=16)
    one.add_argument("--lr", type=float, default=1e-3)
    one.add_argument("--warmup", type=int, default=50)
    cost = sub.add_parser("overhead", help="the fault-tolerant sync against plain DiLoCo's, on loopback")
    cost.add_argument("--rounds", type=int, default=20)
    cost.add_argument("--sync-every", type=int, default=5)
    cost.add_argument("--repeats", type=int, default=3)
    cost.add_argument("--out", default="benchmarks/results/elastic_overhead")
    churn = sub.add_parser("soak", help="groups killed at random and restarted, for minutes")
    churn.add_argument("--minutes", type=float, default=10)
    churn.add_argument("--kill-every", type=float, default=60)
    churn.add_argument("--groups", type=int, default=3)
    churn.add_argument("--steps", type=int, default=1_000_000, help="max_steps (the soak stops at --minutes)")
    churn.add_argument("--quiet", type=float, default=90, help="no kill in the last seconds: restarts join")
    churn.add_argument("--sync-every", type=int, default=20)
    churn.add_argument("--heartbeat-ms", type=int, default=5000)
    churn.add_argument("--grace", type=float, default=600, help="seconds past --minutes before a process is a hang")
    churn.add_argument("--seed", type=int, default=0)
    churn.add_argument("--no-failure", action="store_true", help="also run the groups without kills")
    churn.add_argument("--out", default="benchmarks/results/elastic_soak")
    args = parser.parse_args(argv)
    if args.command == "group":
        group(args)
        return
    if args.command == "overhead":
        result = overhead(args)
    else:
        result = soak(args)
        outdir = os.path.abspath(args.out + ".d")
        survivor = max(result["exit_codes"], key=lambda n: result["exit_codes"][n] == 0)
        attempt = max(s["attempt"] for s in _steps(outdir) if s["group"] == survivor)
        result["val_loss"] = validation_loss(outdir, f"{survivor}-{attempt}", SOAK)
        if args.no_failure:
            result["no_failure"] = _no_failure(args, result["rounds_committed"] * args.sync_every)
    with open(args.out + ".json", "w") as f:
        json.dump(result, f, indent=1, default=sorted)
    print(json.dumps({k: v for k, v in result.items() if k != "kills"}, indent=1, default=sorted))


def _no_failure(args: argparse.Namespace, steps: int) -> dict:
    """The same groups without a kill, for ``steps`` steps: the same number of committed rounds."""
    quiet = argparse.Namespace(**{**vars(args), "minutes": 1e6, "kill_every": 1e9, "steps": steps, "grace": 1e6})
    quiet.out = args.out + "_no_failure"
    report = soak(quiet)
    outdir = os.path.abspath(quiet.out + ".d")
    report["val_loss"] = validation_loss(outdir, "0-0", SOAK)
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
