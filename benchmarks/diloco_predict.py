"""``advise``'s DiLoCo prediction against the step ``diloco.py steps`` measured on the same shaped link (a benchmark).

``lightning-gradcomp advise`` predicts DiLoCo's step from the step with no communication, the link fitted on timed
all-reduces and the outer payload's codec time (:mod:`lightning_gradcomp.auto.periodic`). This script does the same
from a ``diloco.py steps`` result: the measured no-communication step (its ``compute`` row), the link fitted by
``probe_link`` (advise's own probe) in a fresh namespace shaped to the same rate, and ``MinMax(bits=8)``'s codec timed
by ``outer_costs`` (advise's own timing) on one thread, as the workers ran; then it compares the predicted step of the
``h100-minmax8`` (blocking) and ``h100-minmax8-streaming`` rows with their measured ones. Needs root::

    python benchmarks/diloco.py steps --rates 10mbit --per-worker --configs compute h100-minmax8 \\
        h100-minmax8-streaming --out benchmarks/results/diloco_steps_10mbit_perworker_mix
    python benchmarks/diloco_predict.py benchmarks/results/diloco_steps_10mbit_perworker_mix.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile


def _probe(spec: dict) -> None:
    """One rank of the link probe: join the process group, time advise's all-reduces, rank 0 writes the fit."""
    import torch
    import torch.distributed as dist

    from lightning_gradcomp.auto.measure import probe_link

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(spec["port"]))
    dist.init_process_group("gloo", rank=spec["rank"], world_size=spec["world"])
    link = probe_link(torch.device("cpu"))
    if spec["rank"] == 0:
        with open(spec["out"], "w") as f:
            json.dump({"alpha": link.alpha, "beta": link.beta}, f)
    dist.destroy_process_group()


def probe(rate: str, world: int) -> dict:
    """The link fitted by advise's probe in a fresh namespace shaped to ``rate`` (the loopback all workers share)."""
    from _netns import shaped_namespace

    from lightning_gradcomp.demo.ports import free_port

    with tempfile.TemporaryDirectory() as tmp, shaped_namespace(rate) as name:
        out = os.path.join(tmp, "link.json")
        port = free_port()
        procs = [
            subprocess.Popen(
                ["ip", "netns", "exec", name, sys.executable, os.path.abspath(__file__), "_probe"]
                + [json.dumps({"rank": r, "world": world, "port": port, "out": out})]
            )
            for r in range(world)
        ]
        codes = [p.wait() for p in procs]
        if any(codes):
            raise RuntimeError(f"the link probe's ranks exited with {codes}")
        with open(out) as f:
            return json.load(f)


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "_probe":
        _probe(json.loads(sys.argv[2]))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("steps_json", help="a diloco.py steps result with compute and h100-minmax8* rows")
    parser.add_argument("--out", default=None, help="writes OUT.md, OUT.json (default: the input with _predicted)")
    args = parser.parse_args()
    import torch
    from _netns import rate_bytes_per_second

    from lightning_gradcomp.auto.measure import outer_costs, outer_payloads
    from lightning_gradcomp.auto.periodic import predict_periodic
    from lightning_gradcomp.auto.timeline import Link

    with open(args.steps_json) as f:
        result = json.load(f)
    run, rows = result["args"], [r for r in result["table"] if "error" not in r]
    rate = run["rates"][0]
    shaped = f"{rate_bytes_per_second(rate) * 8 * run['workers'] / 1e3:g}kbit" if run["per_worker"] else rate
    link = Link(**probe(shaped, run["workers"]))
    torch.set_num_threads(1)
    cost = outer_costs(result["parameters"], run["workers"], {"8-bit": outer_payloads()["8-bit"]})["8-bit"]
    compute = next(r["step_s"] for r in rows if r["config"] == "compute")
    schedules = {"h100-minmax8": (1, 0), "h100-minmax8-streaming": (run["fragments"], run["overlap_steps"])}
    lines = [
        f"advise's DiLoCo prediction against the measured step, {rate}{' per worker' if run['per_worker'] else ''}"
        f" ({result['parameters'] / 1e6:.1f}M parameters, {run['workers']} workers): link fitted by advise's probe,"
        f" alpha {link.alpha * 1e3:.2f} ms, beta {link.beta * 8 / 1e6:.2f} Mbit/s; MinMax(bits=8) codec"
        f" {(cost.encode + cost.decode):.3f} s and {cost.nbytes / 1e6:.1f} MB (as an all-reduce) per exchange;"
        f" no-communication step {compute * 1e3:.1f} ms (measured). From `{args.steps_json}`.",
        "",
        "| configuration | measured s / step | predicted s / step | predicted / measured |",
        "|---|---|---|---|",
    ]
    out: dict = {"link": vars(link), "cost": vars(cost), "compute": compute, "rows": []}
    for row in rows:
        if row["config"] not in schedules:
            continue
        fragments, overlap = schedules[row["config"]]
        predicted, _ = predict_periodic(compute, link, cost, 100, fragments, overlap)
        ratio = predicted / row["step_s"]
        lines.append(f"| {row['config']} | {row['step_s']:.3f} | {predicted:.3f} | {ratio:.2f} |")
        out["rows"].append({"config": row["config"], "measured": row["step_s"], "predicted": predicted})
    path = args.out or args.steps_json.removesuffix(".json") + "_predicted"
    with open(path + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(path + ".json", "w") as f:
        json.dump(out, f, indent=1)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
