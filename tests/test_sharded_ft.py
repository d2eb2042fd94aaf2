"""Fault-tolerant ``ShardedDiLoCo`` on torchft: 2 replica groups of 2 FSDP2 shards, a lighthouse, SIGKILL.

Each group is a Lightning job of 2 processes (tests/sharded_ft_worker.py); rank ``j`` of each group exchanges shard
``j``. The scenario starts its own lighthouse on a free port, kills only the processes it started, by pid, and a group
dies where one of its ranks kills itself, at an exact step. The reference is plain ``ShardedDiLoCo`` 2 x 2 on 4
processes, fed the same data.
"""

import os
import signal
import subprocess

import pytest
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_gradcomp import ShardedDiLoCo, TorchFT
from lightning_gradcomp.compressors import MinMax
from lightning_gradcomp.demo.ports import free_port
from lightning_gradcomp.diloco.sharded_mesh import sharded_group_size
from lightning_gradcomp.ft.lighthouse import Lighthouse
from tests.ft_worker import log_of as _output
from tests.ft_worker import wait_for as _wait
from tests.sharded_ft_worker import launch, load

H, WARMUP = 4, 3  # 3 HSDP steps of DenseWarmup, then rounds of 4: syncs at steps 7, 11, 15
STEPS, KILL_AT, PAUSE_AT = 15, 5, 9  # group 1 dies inside the first round; group 0 waits inside the second
SCHEDULE = ["--sync-every", str(H), "--warmup-steps", str(WARMUP)]


def _stop(started) -> None:
    for proc in started:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """Plain ShardedDiLoCo 2 x 2 on 4 processes for 12 steps: the reference of both scenarios."""
    outdir = tmp_path_factory.mktemp("sharded-plain")
    proc = launch(outdir, "plain", "--devices", "4", "--steps", "12", *SCHEDULE)
    try:
        assert _wait(proc, outdir, "plain") == 0, _output(outdir, "plain")[-3000:]
    finally:
        _stop([proc])
    return {r: load(outdir, f"plain-rank{r}") for r in range(4)}


@pytest.fixture(scope="module")
def killed_mid_round(tmp_path_factory):
    """2 fault-tolerant groups of 2 shards for 15 steps: rank 1 of group 1 dies at step 5 and the group is restarted;
    group 0 waits before step 9 until it asks the lighthouse for a quorum, so that it joins the sync of step 11."""
    outdir = tmp_path_factory.mktemp("sharded-ft")
    started: list[subprocess.Popen] = []
    codes: dict[str, int] = {}
    try:
        with Lighthouse(min_replicas=1, port=free_port(), heartbeat_timeout_ms=2000) as lighthouse:
            common = ["--lighthouse", lighthouse.address, "--steps", str(STEPS), *SCHEDULE]
            survivor = launch(outdir, "0", *common, "--pause-at", str(PAUSE_AT), "--until-asking", "1")
            victim = launch(outdir, "1", *common, "--kill-at", str(KILL_AT))
            started += [survivor, victim]
            codes["1-killed"] = _wait(victim, outdir, "1")
            restarted = launch(outdir, "1", *common, "--attempt", "1")
            started.append(restarted)
            codes["0"] = _wait(survivor, outdir, "0")
            codes["1"] = _wait(restarted, outdir, "1")
    finally:
        _stop(started)
    return outdir, codes


def test_no_failure_is_plain_sharded_diloco_bitwise_and_the_survivor_never_stops(killed_mid_round, plain):
    outdir, codes = killed_mid_round
    assert codes["0"] == 0, _output(outdir, "0")[-3000:]
    assert codes["1-killed"] != 0, "the group whose rank was killed ended"
    for rank in (0, 1):
        survivor, reference = load(outdir, f"0-0-rank{rank}"), plain[rank]
        assert [s["global_step"] for s in survivor] == list(range(1, STEPS + 1)), "the survivor never stopped"
        for i in range(KILL_AT):  # HSDP steps, then the round group 1 died in: plain ShardedDiLoCo, bit for bit
            assert survivor[i]["batch"] == reference[i]["batch"], f"rank {rank}, step {i + 1}: the same data"
            assert torch.equal(survivor[i]["global"], reference[i]["global"]), f"rank {rank}, step {i + 1}"
            assert torch.equal(survivor[i]["params"], reference[i]["params"]), f"rank {rank}, step {i + 1}"
        # the sync of step 7 had group 0 alone; at step 11 the restarted group healed and sent zeros
        assert [survivor[i]["participants"] for i in (6, 10, 14)] == [1, 1, 2]
        assert not torch.equal(survivor[6]["global"], reference[6]["global"]), "one group's pseudo-gradient, not two"
        assert survivor[-1]["discarded"] == 0, "a group that died between syncs costs the others no round"
        assert survivor[-1]["syncs"] == (STEPS - WARMUP) // H


def test_a_group_killed_mid_round_heals_shard_by_shard_and_ends_bitwise_equal_to_the_survivor(killed_mid_round):
    outdir, codes = killed_mid_round
    assert codes["1"] == 0, _output(outdir, "1")[-3000:]
    assert _output(outdir, "1").count("healed from a live peer at sync") >= 1
    for rank in (0, 1):
        mine = load(outdir, f"1-1-rank{rank}")
        theirs = {s["global_step"]: s for s in load(outdir, f"0-0-rank{rank}")}
        first = mine[0]
        assert first["global_step"] == 11, "it joined the sync of step 11 with the survivor's counters"
        assert first["heals"] == 1
        assert torch.equal(first["params"], first["global"]), "no inner step of its own before the heal"
        assert first["inner"].numel() > 0
        assert torch.equal(first["inner"], theirs[11]["inner"]), "the inner AdamW state of the peer's shard"
        assert [s["global_step"] for s in mine] == list(range(11, STEPS + 1))
        for step in mine:  # theta_global equal to the survivor's at every step after the heal
            assert torch.equal(step["global"], theirs[step["global_step"]]["global"]), f"step {step['global_step']}"
        assert torch.equal(mine[-1]["params"], theirs[STEPS]["params"]), "both end with the same model"


@pytest.fixture(scope="module")
def saved_and_resumed(tmp_path_factory):
    """2 fault-tolerant groups of 2 shards for 12 steps, saving a checkpoint at step 4 (an epoch's end, one step into
    the first round); then both resumed from it (attempt 1)."""
    outdir = tmp_path_factory.mktemp("sharded-ft-resume")
    codes = {}
    with Lighthouse(min_replicas=1, port=free_port(), heartbeat_timeout_ms=2000) as lighthouse:
        common = ["--lighthouse", lighthouse.address, "--steps", "12", *SCHEDULE]
        for attempt, options in enumerate([["--save-every", "4"], ["--resume-at", "4"]]):
            started = {g: launch(outdir, g, *common, "--attempt", str(attempt), *options) for g in ("0", "1")}
            try:
                codes.update({f"{g}-{attempt}": _wait(proc, outdir, g) for g, proc in started.items()})
            finally:
                _stop(started.values())
    return outdir, codes


def test_a_dense_warmup_across_fault_tolerant_sharded_groups_is_plain_sharded_diloco_and_resumes_exactly(
    saved_and_resumed, plain
):
    outdir, codes = saved_and_resumed
    assert set(codes.values()) == {0}, (codes, _output(outdir, "0")[-3000:])
    for group in (0, 1):
        for rank in (0, 1):
            fault_tolerant = load(outdir, f"{group}-0-rank{rank}")
            for i, (a, b) in enumerate(zip(fault_tolerant, plain[2 * group + rank], strict=True)):
                assert torch.equal(a["global"], b["global"]), f"group {group} rank {rank}, step {i + 1}"
                assert torch.equal(a["params"], b["params"]), f"group {group} rank {rank}, step {i + 1}"
            resumed = load(outdir, f"{group}-1-rank{rank}")
            assert [s["global_step"] for s in resumed] == list(range(5, 13)), "resumed at step 4, mid-round"
            for a, b in zip(resumed, fault_tolerant[4:], strict=True):
                assert a["batch"] == b["batch"]
                assert a["ft_step"] == b["ft_step"]
                assert torch.equal(a["global"], b["global"]), f"resumed, step {a['global_step']}"
                assert torch.equal(a["params"], b["params"]), f"resumed, step {a['global_step']}"
                assert torch.equal(a["inner"], b["inner"]), f"resumed, step {a['global_step']}"


@pytest.fixture(scope="module")
def killed_in_an_exchange(tmp_path_factory):
    """2 fault-tolerant groups of 2 shards for 12 steps: rank 1 of group 1 dies as it sends its shard at the sync of
    step 7 (its 4th all-reduce across groups, after 3 dense steps), while rank 0's shard goes through."""
    outdir = tmp_path_factory.mktemp("sharded-ft-exchange")
    with Lighthouse(min_replicas=1, port=free_port(), heartbeat_timeout_ms=2000) as lighthouse:
        common = ["--lighthouse", lighthouse.address, "--steps", "12", *SCHEDULE]
        started = {"0": launch(outdir, "0", *common), "1": launch(outdir, "1", *common, "--kill-in-exchange", "4")}
        try:
            codes = {g: _wait(proc, outdir, g) for g, proc in started.items()}
        finally:
            _stop(started.values())
    return outdir, codes


@pytest.mark.slow
def test_a_death_in_an_exchange_discards_the_round_on_every_shard_of_the_survivor(killed_in_an_exchange):
    outdir, codes = killed_in_an_exchange
    assert codes["0"] == 0, _output(outdir, "0")[-3000:]
    assert codes["1"] != 0
    for rank in (0, 1):  # rank 0's shard was averaged, rank 1's was not: neither steps theta_global
        survivor = load(outdir, f"0-0-rank{rank}")
        assert [s["global_step"] for s in survivor] == list(range(1, 13))
        assert [s["discarded"] for s in survivor][5:7] == [0, 1], "the sync of step 7 is discarded"
        assert torch.equal(survivor[6]["global"], survivor[5]["global"]), "theta_global as before the sync"
        assert torch.equal(survivor[6]["params"], survivor[6]["global"]), "the shards back to theta_global"
        assert survivor[-1]["discarded"] == 1
        assert survivor[-1]["syncs"] == 1, "the sync of step 11 commits, with group 0 alone"
        assert survivor[10]["participants"] == 1


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"fault_tolerance": object()}, "Expected `fault_tolerance` to be lightning_gradcomp.TorchFT("),
        ({"compressor": MinMax(bits=8)}, "Expected `compressor=None` with `fault_tolerance`"),
    ],
)
def test_what_sharded_fault_tolerance_cannot_serve_is_refused_in_one_line(kwargs, message):
    config = TorchFT(lighthouse="http://127.0.0.1:1", replica_group_id="0")
    arguments = {"fault_tolerance": config, **kwargs}
    with pytest.raises(MisconfigurationException, match=message.replace("(", r"\(")) as raised:
        ShardedDiLoCo(**arguments)
    assert "\n" not in str(raised.value)


def test_with_fault_tolerance_the_job_is_the_replica_group():
    assert sharded_group_size("node", 2, 1, fault_tolerance=True) == 2
    assert sharded_group_size(2, 2, 1, fault_tolerance=True) == 2
    with pytest.raises(MisconfigurationException, match="Expected `replica_group` to be 'node' or 4 with") as raised:
        sharded_group_size(2, 4, 1, fault_tolerance=True)
    assert "\n" not in str(raised.value)
