"""Fault-tolerant DiLoCo on torchft: real replica groups (one Lightning job each), a lighthouse, SIGKILL.

Every scenario starts its own lighthouse in this process on a free port and its groups as processes of their own
(tests/ft_worker.py), kills only the processes it started, by pid, and stops the lighthouse. A group dies where it
kills itself (an exact step, or inside an exchange), so nothing here depends on timing; a survivor that must outlive
a restart waits for the restarted group's file, bounded. The reference is plain ``DiLoCo`` on as many processes of
one job, fed the same shards.
"""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch.distributed import TCPStore

from lightning_gradcomp import DiLoCo, TorchFT
from lightning_gradcomp.demo.ports import free_port
from lightning_gradcomp.ft.lighthouse import Lighthouse
from tests.distributed import child_env
from tests.ft_worker import launch, load
from tests.ft_worker import log_of as _output
from tests.ft_worker import wait_for as _wait

STEPS, H = 24, 4
WAIT_S = 420  # one fit on a loaded 2-core machine takes well under a minute


def _cli_lighthouse(outdir, port: int) -> subprocess.Popen:
    """``lightning-gradcomp lighthouse`` as a user starts it, once it listens."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = open(os.path.join(str(outdir), "lighthouse.log"), "w")  # noqa: SIM115 (the process's output, closed below)
    command = [sys.executable, "-m", "lightning_gradcomp.cli", "lighthouse", "--min-replicas", "1", "--port", str(port)]
    proc = subprocess.Popen(
        [*command, "--heartbeat-timeout-ms", "2000"], cwd=root, env=child_env(), stdout=out, stderr=subprocess.STDOUT
    )
    out.close()
    deadline = time.monotonic() + WAIT_S
    while "listening on" not in _output(outdir, "lighthouse") and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    return proc


@pytest.fixture(scope="module")
def killed_between_syncs(tmp_path_factory):
    """2 groups, rounds of 4 steps: group 1 dies at step 10 (inside round 3) and is restarted; group 0 waits before
    step 14 until the restarted one asks the lighthouse for a quorum, so that it joins at the sync of step 16 (the
    lighthouse would form that sync's quorum at once with the groups of the last one). Beside it, plain DiLoCo on 2
    processes. The lighthouse is the command's, stopped with SIGTERM at the end."""
    outdir = tmp_path_factory.mktemp("ft")
    port = free_port()
    common = ["--lighthouse", f"http://127.0.0.1:{port}", "--steps", str(STEPS), "--sync-every", str(H)]
    common += ["--start-replicas", "2"]
    started = [launch(outdir, "plain", "--devices", "2", "--steps", "12", "--sync-every", str(H))]
    try:
        lighthouse = _cli_lighthouse(outdir, port)
        started.append(lighthouse)
        survivor = launch(outdir, "0", *common, "--pause-at", "14", "--until-asking", "1")
        victim = launch(outdir, "1", *common, "--kill-at", "10")
        started += [survivor, victim]
        killed = _wait(victim, outdir, "1")
        restarted = launch(outdir, "1", *common, "--attempt", "1")
        started.append(restarted)
        codes = {name: _wait(p, outdir, name) for name, p in [("0", survivor), ("1", restarted), ("plain", started[0])]}
        lighthouse.send_signal(signal.SIGTERM)
        codes["lighthouse"] = _wait(lighthouse, outdir, "lighthouse")
    finally:
        for proc in started:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()
    return outdir, killed, codes


@pytest.fixture(scope="module")
def masked_twins(tmp_path_factory):
    """2 groups of a model with a constant float ``-inf`` causal mask buffer, then the same 2 groups with its bool twin
    (the same float scores at every step), each pair with a lighthouse of its own."""
    outdirs, codes = {}, {}
    for mask in ("float", "bool"):
        outdir = outdirs[mask] = tmp_path_factory.mktemp(f"ft-{mask}")
        port = free_port()
        common = ["--lighthouse", f"http://127.0.0.1:{port}", "--steps", "12", "--sync-every", "4", "--mask", mask]
        started = [_cli_lighthouse(outdir, port)]
        try:
            groups = {g: launch(outdir, g, *common, "--start-replicas", "2") for g in ("0", "1")}
            started += list(groups.values())
            codes.update({(mask, g): _wait(proc, outdir, g) for g, proc in groups.items()})
            started[0].send_signal(signal.SIGTERM)
            _wait(started[0], outdir, "lighthouse")
        finally:
            for proc in started:
                if proc.poll() is None:
                    os.kill(proc.pid, signal.SIGKILL)
                    proc.wait()
    return outdirs, codes


def test_a_float_mask_buffer_trains_as_its_bool_twin_across_groups(masked_twins):
    outdirs, codes = masked_twins
    assert set(codes.values()) == {0}, _output(outdirs["float"], "0")[-3000:]
    for g in ("0", "1"):
        floats, bools = load(outdirs["float"], f"{g}-0")["steps"], load(outdirs["bool"], f"{g}-0")["steps"]
        assert floats[-1]["skipped"] == 0, "no round skipped"
        assert floats[-1]["syncs"] == bools[-1]["syncs"] == 3
        assert [s["loss"] for s in floats] == [s["loss"] for s in bools]
        assert torch.equal(floats[-1]["global"], bools[-1]["global"])


def test_no_failure_is_plain_diloco_bitwise_and_a_death_between_syncs_costs_the_survivor_nothing(killed_between_syncs):
    outdir, killed, codes = killed_between_syncs
    assert killed == -signal.SIGKILL
    assert codes == {"0": 0, "1": 0, "plain": 0, "lighthouse": 0}, _output(outdir, "0")[-3000:]
    assert "listening on http://127.0.0.1:" in _output(outdir, "lighthouse")  # loopback unless told otherwise
    assert "lighthouse stopped" in _output(outdir, "lighthouse")
    survivor, plain = load(outdir, "0-0")["steps"], load(outdir, "plain-rank0")["steps"]
    assert [s["global_step"] for s in survivor] == list(range(1, STEPS + 1))
    for i in range(10):  # before the death is noticed (the sync of step 12): plain DiLoCo, bit for bit
        assert torch.equal(survivor[i]["global"], plain[i]["global"]), f"step {i + 1}: theta_global"
        assert torch.equal(survivor[i]["params"], plain[i]["params"]), f"step {i + 1}: the local parameters"
    assert [survivor[i]["participants"] for i in (3, 7, 11)] == [2, 2, 1], "the sync of step 12 had group 0 alone"
    assert "(1 contributing; left: 1)." in _output(outdir, "0"), "the survivor names the group that left"
    assert "; joined: 1)." in _output(outdir, "0"), "and the one that came back"
    assert not torch.equal(survivor[11]["global"], plain[11]["global"]), "one pseudo-gradient, not two"
    assert torch.isfinite(survivor[11]["global"]).all()
    assert survivor[-1]["discarded"] == 0, "a group that dies between syncs costs the others no round"
    assert survivor[-1]["syncs"] == STEPS // H


def test_a_restarted_group_heals_before_its_first_inner_step_and_holds_the_survivors_theta_global(killed_between_syncs):
    outdir, _, _ = killed_between_syncs
    survivor, restarted = load(outdir, "0-0"), load(outdir, "1-1")
    mine, theirs = restarted["steps"], {s["global_step"]: s for s in survivor["steps"]}
    first = mine[0]
    assert first["global_step"] == 16, "it joined the sync of step 16: Lightning's counters are the survivor's"
    assert first["heals"] == 1
    assert torch.equal(first["params"], first["global"]), "no inner step of its own before the heal"
    assert torch.equal(first["global"], theirs[16]["global"]), "the survivors' theta_global, bit for bit"
    assert first["ft_step"] == theirs[16]["ft_step"]
    assert first["lr"] == theirs[16]["lr"], "the learning-rate schedule carried over"
    assert first["epoch"] == theirs[16]["epoch"]
    assert [s["global_step"] for s in mine] == list(range(16, STEPS + 1)), "max_steps means the same on both"
    by_step = {s["ft_step"]: s["global"] for s in survivor["steps"]}
    for step in mine:
        assert torch.equal(step["global"], by_step[step["ft_step"]]), f"theta_global at torchft step {step['ft_step']}"
    assert [theirs[s]["participants"] for s in (16, 20, 24)] == [1, 2, 2], "it counts from its first full round"
    # a fresh group joining a trained run does not reset it: the survivor's theta_global went on from its own
    assert not torch.equal(theirs[16]["global"], load(outdir, "plain-rank0")["steps"][0]["global"])
    assert restarted["logged"]["gradcomp/heals"] == 1
    assert "healed from a live peer at sync" in _output(outdir, "1")


def test_an_absent_lighthouse_is_a_clear_error_within_the_connect_timeout():
    from lightning_gradcomp.ft.session import LighthouseUnreachableError, Session

    port = free_port()
    store = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    config = TorchFT(lighthouse=f"http://127.0.0.1:{free_port()}", replica_group_id="0", connect_timeout=2)
    start = time.monotonic()
    with pytest.raises(LighthouseUnreachableError, match="no lighthouse answered at http://127.0.0.1:.* within 2 s"):
        Session(config, rank=0, world_size=1, store=("127.0.0.1", port), rounds=1, state_dict=dict)
    assert time.monotonic() - start < 30
    del store


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"lighthouse": "127.0.0.1:29510"}, "Expected `lighthouse` to be an address 'http://HOST:PORT'"),
        ({"replica_group_id": "a:b"}, "Expected `replica_group_id` to be a non-empty name without ':'"),
        ({"min_replicas": 0}, "Expected `min_replicas` to be an integer >= 1, got 0."),
        ({"quorum_timeout": 0}, "Expected `quorum_timeout` to be a finite number > 0, got 0."),
    ],
)
def test_bad_settings_are_refused_in_one_line(kwargs, message):
    settings = {"lighthouse": "http://127.0.0.1:29510", "replica_group_id": "0", **kwargs}
    with pytest.raises(ValueError, match="Expected") as error:
        TorchFT(**settings)
    assert message in str(error.value)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"replica_group": 2}, "Expected `replica_group=None` with `fault_tolerance`"),
    ],
)
def test_what_the_fault_tolerant_path_cannot_serve_is_refused_at_construction(kwargs, message):
    fault_tolerance = TorchFT(lighthouse="http://127.0.0.1:29510", replica_group_id="0")
    with pytest.raises(MisconfigurationException, match="Expected") as error:
        DiLoCo(sync_every=4, fault_tolerance=fault_tolerance, **kwargs)
    assert message in str(error.value)
    assert "\n" not in str(error.value)


def test_the_lighthouse_and_the_group_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://127.0.0.1:29510/")
    monkeypatch.setenv("REPLICA_GROUP_ID", "7")
    config = TorchFT()
    assert (config.lighthouse, config.name) == ("http://127.0.0.1:29510", "7")
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE")
    with pytest.raises(ValueError, match="Expected `lighthouse` to be an address") as error:
        TorchFT()
    assert "or the TORCHFT_LIGHTHOUSE variable set" in str(error.value)
    assert str(error.value).endswith(", got None.")
    monkeypatch.delenv("REPLICA_GROUP_ID")
    with pytest.raises(ValueError, match="Expected `replica_group_id` to be a name unique among the groups"):
        TorchFT(lighthouse="http://127.0.0.1:29510")


def _run(outdir, plans: dict[str, list[str]], restart: dict[str, list[str]] | None = None, plain: int = 0, **kw):
    """Start the groups of ``plans`` (name: options) and, with ``plain``, plain DiLoCo on that many processes; when
    a group of ``restart`` has died, start it again with those options. Every process's return code, by name.
    ``log``: the groups' logs are ``NAME-LOG.log`` (else ``NAME.log``)."""
    started: dict[str, subprocess.Popen] = {}
    codes: dict[str, int] = {}
    restart = dict(restart or {})
    try:
        if plain:
            started["plain"] = launch(outdir, "plain", "--devices", str(plain), *kw.get("plain_options", []))
        for name, options in plans.items():
            started[name] = launch(outdir, name, *options, log=f"{name}-{kw['log']}.log" if "log" in kw else None)
        for name, options in restart.items():
            codes[f"{name}-killed"] = _wait(started[name], outdir, name)
            started[name] = launch(outdir, name, *options)
        for name, proc in started.items():
            codes[name] = _wait(proc, outdir, name)
    finally:
        for proc in started.values():
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()
    return codes


@pytest.fixture(scope="module", params=["mix", "eager"])
def killed_in_an_exchange(tmp_path_factory, request):
    """3 groups, each exchange overlapped with the next inner step (Streaming DiLoCo's ``overlap_steps=1``, with the
    mixing factor's merge and with eager updates): group 2 dies inside the exchange started at step 8 (after its
    quorum, as it sends) and is restarted; the others wait before step 14 until it asks the lighthouse for a quorum.
    Beside it, plain DiLoCo on 3 processes."""
    outdir = tmp_path_factory.mktemp("ft")
    overlap = ["--overlap", "1", "--merge", request.param]
    with Lighthouse(min_replicas=1, port=free_port(), heartbeat_timeout_ms=2000) as lighthouse:
        common = ["--lighthouse", lighthouse.address, "--steps", str(STEPS), "--shards", "3", "--start-replicas", "3"]
        common += overlap
        survivor = [*common, "--pause-at", "14", "--until-asking", "1"]
        codes = _run(
            outdir,
            {"0": survivor, "1": survivor, "2": [*common, "--kill-in-exchange", "2"]},
            restart={"2": [*common, "--attempt", "1"]},
            plain=3,
            plain_options=["--shards", "3", "--steps", "8", *overlap],
        )
    return outdir, codes


@pytest.mark.slow
def test_three_overlapped_groups_are_plain_diloco_bitwise_and_a_death_in_an_exchange_costs_one_round(
    killed_in_an_exchange,
):
    outdir, codes = killed_in_an_exchange
    assert codes == {"2-killed": -signal.SIGKILL, "plain": 0, "0": 0, "1": 0, "2": 0}, _output(outdir, "0")[-3000:]
    survivors = [load(outdir, f"{name}-0")["steps"] for name in ("0", "1")]
    for rank, steps in enumerate(survivors):
        plain = load(outdir, f"plain-rank{rank}")["steps"]  # group g reads the shard of plain DiLoCo's rank g
        for i in range(8):  # up to the exchange group 2 died in: plain DiLoCo on 3 processes, bit for bit
            assert torch.equal(steps[i]["global"], plain[i]["global"]), f"group {rank}, step {i + 1}"
            assert torch.equal(steps[i]["params"], plain[i]["params"]), f"group {rank}, step {i + 1}"
        # sent at step 8, applied at step 9: discarded there
        assert torch.equal(steps[8]["global"], steps[4]["global"]), "the round sent at step 8 was discarded"
        assert torch.equal(steps[8]["params"], steps[4]["global"]), "back to theta_global"
        assert steps[-1]["discarded"] == 1, "at most the interrupted round is lost"
        assert steps[-1]["global_step"] == STEPS
    by_step = [{s["ft_step"]: s["global"] for s in steps} for steps in survivors]
    restarted = {s["ft_step"]: s["global"] for s in load(outdir, "2-1")["steps"]}
    assert set(by_step[0]) == set(by_step[1])
    for step, theta in by_step[0].items():  # identical after every committed round, on every live group
        assert torch.equal(theta, by_step[1][step]), f"torchft step {step}"
        if step in restarted:
            assert torch.equal(theta, restarted[step]), f"the restarted group at torchft step {step}"
    first = load(outdir, "2-1")["steps"][0]
    assert first["heals"] == 1
    assert first["global_step"] == 16
    assert "discarded on replica group '0'" in _output(outdir, "0")


@pytest.fixture(scope="module")
def refused(tmp_path_factory):
    """2 groups train; a third built with another ``sync_every`` starts once they are past the sync of step 8 (at
    step 9) and joins at step 12 (the others wait after step 10 until it asks the lighthouse for a quorum); once they
    finished, a fresh group alone asks the same lighthouse to start a new model."""
    outdir = tmp_path_factory.mktemp("ft")
    started = str(outdir / "started")
    with Lighthouse(min_replicas=1, port=free_port(), heartbeat_timeout_ms=2000) as lighthouse:
        common = ["--lighthouse", lighthouse.address, "--steps", "16"]
        good = [*common, "--start-replicas", "2", "--pause-at", "10", "--until-asking", "1"]
        good += ["--touch", started, "--touch-at", "9"]
        odd = [*common, "--shards", "3", "--sync-every", "5", "--wait-for", started]
        codes = _run(outdir, {"0": good, "1": good, "2": odd})
        codes["3"] = _run(outdir, {"3": [*common, "--shards", "4"]})["3"]
    return outdir, codes


@pytest.mark.slow
def test_a_group_that_does_not_belong_or_would_reset_the_run_is_refused(refused):
    outdir, codes = refused
    assert (codes["0"], codes["1"]) == (0, 0), _output(outdir, "0")[-3000:]
    assert codes["2"] != 0
    assert codes["3"] != 0
    odd = _output(outdir, "2")
    assert "MembershipError: TorchFT: replica group '2' does not belong in the run at http://127.0.0.1:" in odd
    assert "another sync_every (5 here, 4 there). It is refused before it averages anything." in odd
    assert "would start a new model, but the lighthouse" in _output(outdir, "3")
    groups = [load(outdir, f"{name}-0")["steps"] for name in ("0", "1")]
    for steps in groups:
        assert steps[-1]["discarded"] == 1, "the sync the odd group asked to join is discarded, nothing averaged"
        assert torch.equal(steps[11]["global"], steps[7]["global"])
        assert steps[-1]["global_step"] == 16
    by_step = [{s["ft_step"]: s["global"] for s in steps} for steps in groups]
    assert all(torch.equal(theta, by_step[1][step]) for step, theta in by_step[0].items())


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """Streaming DiLoCo (2 fragments) with PowerSGD on the outer exchange (two rounds, a process group each): 2 groups
    for 24 steps, beside plain DiLoCo on 2 processes; the same 2 groups for 16 steps, saving a checkpoint at step 16
    (an epoch's end), then a whole-job restart of both from their checkpoints on the same lighthouse, to step 24."""
    outdir = tmp_path_factory.mktemp("ft")
    codes = {}
    variant = ["--fragments", "2", "--compressor", "powersgd"]
    with Lighthouse(min_replicas=1, port=free_port(), heartbeat_timeout_ms=2000) as lighthouse:
        common = ["--lighthouse", lighthouse.address, "--start-replicas", "2", *variant]
        first = [*common, "--steps", "16", "--save-at", "16"]
        codes["saved"] = _run(outdir, {"0": first, "1": first})
        later = [*common, "--steps", "24", "--resume", "--attempt", "1"]
        codes["resumed"] = _run(outdir, {"0": later, "1": later})
    with Lighthouse(min_replicas=1, port=free_port(), heartbeat_timeout_ms=2000) as lighthouse:
        whole = ["--lighthouse", lighthouse.address, "--start-replicas", "2", "--steps", "24", "--attempt", "9"]
        plain = {"plain_options": ["--steps", "24", *variant]}
        codes["whole"] = _run(outdir, {"0": [*whole, *variant], "1": [*whole, *variant]}, plain=2, log="whole", **plain)
    return outdir, codes


@pytest.mark.slow
def test_streaming_and_a_two_round_compressor_are_plain_diloco_bitwise_and_resume_exactly(resumed):
    outdir, codes = resumed
    expected = {"saved": {"0": 0, "1": 0}, "resumed": {"0": 0, "1": 0}, "whole": {"0": 0, "1": 0, "plain": 0}}
    assert codes == expected, _output(outdir, "0")[-3000:]
    for name in ("0", "1"):
        again, whole = load(outdir, f"{name}-1")["steps"], load(outdir, f"{name}-9")["steps"]
        plain = load(outdir, f"plain-rank{name}")["steps"]
        for mine, theirs in zip(whole, plain, strict=True):
            assert torch.equal(mine["global"], theirs["global"]), f"group {name}, step {mine['global_step']}"
            assert torch.equal(mine["params"], theirs["params"])
        assert [s["global_step"] for s in again] == list(range(17, 25))
        assert again[0]["heals"] == 0, "every group resumed at the same step: nobody heals"
        for mine, theirs in zip(again, whole[16:]):
            assert torch.equal(mine["global"], theirs["global"]), f"group {name}, step {mine['global_step']}"
            assert torch.equal(mine["params"], theirs["params"])


def _two_process_groups(tmp_path_factory, *options: str):
    """2 groups of 2 processes each (dense data parallelism inside a group), beside plain DiLoCo's two levels on 4
    processes (``replica_group=2``), both with ``options``."""
    outdir = tmp_path_factory.mktemp("ft")
    with Lighthouse(min_replicas=1, port=free_port(), heartbeat_timeout_ms=2000) as lighthouse:
        group = ["--lighthouse", lighthouse.address, "--devices", "2", "--shards", "4", "--steps", "8", *options]
        group += ["--start-replicas", "2"]
        plain = {"plain_options": ["--shards", "4", "--steps", "8", "--replica-group", "2", *options]}
        codes = _run(outdir, {"0": group, "1": group}, plain=4, **plain)
    return outdir, codes


@pytest.fixture(scope="module")
def two_process_groups(tmp_path_factory):
    return _two_process_groups(tmp_path_factory)


@pytest.mark.slow
def test_groups_of_two_processes_are_plain_two_level_diloco_bitwise(two_process_groups):
    outdir, codes = two_process_groups
    assert codes == {"plain": 0, "0": 0, "1": 0}, _output(outdir, "0")[-3000:]
    for group in (0, 1):
        for rank in (0, 1):
            mine = load(outdir, f"{group}-0-rank{rank}")["steps"]
            theirs = load(outdir, f"plain-rank{2 * group + rank}")["steps"]
            for step, (a, b) in enumerate(zip(mine, theirs, strict=True)):
                assert torch.equal(a["global"], b["global"]), f"group {group} rank {rank}, step {step + 1}"
                assert torch.equal(a["params"], b["params"]), f"group {group} rank {rank}, step {step + 1}"


@pytest.fixture(scope="module")
def killed_in_a_dense_warmup(tmp_path_factory):
    """2 groups with ``DenseWarmup(steps=4)`` (steps 1-4 dense, then rounds of 4): group 1 dies inside the
    all-reduce of dense step 3 and is restarted; group 0 waits before step 4 until it asks the lighthouse for a
    quorum, so that it joins at that dense step. Beside it, plain DiLoCo with the same warm-up on 2 processes."""
    outdir = tmp_path_factory.mktemp("ft")
    with Lighthouse(min_replicas=1, port=free_port(), heartbeat_timeout_ms=2000) as lighthouse:
        common = ["--lighthouse", lighthouse.address, "--steps", "16", "--start-replicas", "2", "--warmup-steps", "4"]
        codes = _run(
            outdir,
            {"0": [*common, "--pause-at", "3", "--until-asking", "1"], "1": [*common, "--kill-in-exchange", "3"]},
            restart={"1": [*common, "--attempt", "1"]},
            plain=2,
            plain_options=["--steps", "16", "--warmup-steps", "4"],
        )
    return outdir, codes


def test_a_dense_warmup_is_plain_diloco_bitwise_a_death_in_it_costs_one_step_and_the_restarted_group_heals_in_it(
    killed_in_a_dense_warmup,
):
    outdir, codes = killed_in_a_dense_warmup
    assert codes == {"1-killed": -signal.SIGKILL, "plain": 0, "0": 0, "1": 0}, _output(outdir, "0")[-3000:]
    survivor, plain = load(outdir, "0-0")["steps"], load(outdir, "plain-rank0")["steps"]
    assert [s["global_step"] for s in survivor] == list(range(1, 17))
    for i in range(2):  # two groups at each dense step: plain data parallelism, as plain DiLoCo's warm-up
        assert torch.equal(survivor[i]["params"], plain[i]["params"]), f"step {i + 1}: the parameters"
        assert torch.equal(survivor[i]["global"], survivor[i]["params"]), "theta_global follows a dense step"
        assert survivor[i]["participants"] == 2
    assert survivor[2]["discarded"] == 1, "group 1 died in the all-reduce of step 3: the step is discarded"
    assert torch.equal(survivor[2]["params"], survivor[1]["params"]), "no inner step on a failed exchange"
    assert torch.isfinite(survivor[-1]["global"]).all()
    assert survivor[-1]["discarded"] == 1
    assert survivor[-1]["syncs"] == 3, "the rounds of steps 5-16 after the warm-up"
    restarted = load(outdir, "1-1")
    mine, theirs = restarted["steps"], {s["global_step"]: s for s in survivor}
    first = mine[0]
    assert first["global_step"] == 4, "it joined the dense step 4: Lightning's counters are the survivor's"
    assert first["heals"] == 1
    assert torch.equal(first["params"], theirs[4]["params"]), "the survivor's step from the survivor's weights"
    assert first["lr"] == theirs[4]["lr"], "the learning-rate schedule carried over"
    assert theirs[4]["participants"] == 1, "the healed group took part without contributing"
    assert [s["global_step"] for s in mine] == list(range(4, 17))
    for step in mine:
        assert torch.equal(step["global"], theirs[step["global_step"]]["global"]), f"step {step['global_step']}"
    assert theirs[8]["participants"] == 2, "both groups in the first round after the warm-up"
    assert "healed from a live peer at sync" in _output(outdir, "1")


@pytest.fixture(scope="module")
def two_process_groups_warmed_up(tmp_path_factory):
    return _two_process_groups(tmp_path_factory, "--warmup-steps", "4")


@pytest.mark.slow
def test_a_dense_warmup_on_groups_of_two_processes_is_plain_two_level_diloco_to_rounding(two_process_groups_warmed_up):
    outdir, codes = two_process_groups_warmed_up
    assert codes == {"plain": 0, "0": 0, "1": 0}, _output(outdir, "0")[-3000:]
    reference = load(outdir, "0-0-rank0")["steps"]
    for group in (0, 1):
        for rank in (0, 1):
            mine = load(outdir, f"{group}-0-rank{rank}")["steps"]
            theirs = load(outdir, f"plain-rank{2 * group + rank}")["steps"]
            assert len(mine) == len(theirs) == 8
            for step, (a, b, first) in enumerate(zip(mine, theirs, reference, strict=True)):
                # the mean inside the group, then across the groups: the plain run's mean over 4 ranks, reordered
                torch.testing.assert_close(a["params"], b["params"], rtol=0, atol=1e-6, msg=f"step {step + 1}")
                assert torch.equal(a["global"], first["global"]), f"group {group} rank {rank}, step {step + 1}"
                if step < 4:  # a dense step leaves every rank of every group with the same weights
                    assert torch.equal(a["params"], first["params"]), f"group {group} rank {rank}, step {step + 1}"


@pytest.mark.slow
def test_two_groups_launched_as_the_docs_say_read_different_batches(tmp_path):
    """``TorchFT(min_replicas=1, start_replicas=2)``, groups 0 and 1, the same seed, a plain ``shuffle=True`` loader and
    Lightning's own sampler: every step of one group reads samples the other never reads."""
    with Lighthouse(min_replicas=1, port=free_port(), heartbeat_timeout_ms=2000) as lighthouse:
        common = ["--lighthouse", lighthouse.address, "--steps", "8", "--start-replicas", "2", "--lightning-sampler"]
        codes = _run(tmp_path, {"0": common, "1": common})
    assert codes == {"0": 0, "1": 0}, _output(tmp_path, "0")[-3000:]
    read = [[x for step in load(tmp_path, f"{g}-0")["steps"] for x in step["batch"]] for g in ("0", "1")]
    assert [len(r) for r in read] == [64, 64]
    assert len(set(read[0])) == len(set(read[1])) == 64, "each group reads its 128 samples without repeats"
    assert not set(read[0]) & set(read[1]), "the two groups read the same samples"
    assert "reads the same training data" not in _output(tmp_path, "0") + _output(tmp_path, "1")
