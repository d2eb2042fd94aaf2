"""A rank that fails mid-training ends every rank, with an error naming it, and the last checkpoint resumes.

Each case runs ``tests/fault_worker.py`` as a user's script (Lightning's default launcher: rank 0 is the script's
process, rank 1 a child), two CPU processes, ``CompressedDDP(timeout=TIMEOUT)``, a checkpoint every step, and one
rank failing at step ``STEP``. The only timed assertions are generous upper bounds on how long the run takes to end
after the failure.
"""

import os
import re
import subprocess
import sys
import time

import pytest
import torch

from lightning_gradcomp.runtime.rank_state import checkpoint_file, load_rank_state
from tests.distributed import child_env
from tests.fault_worker import MAX_STEPS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT_S = 20  # the strategy's timeout: how long a collective waits for a rank that does not answer (and the
# rendezvous waits for the child rank to start: below about 15 s a loaded 2-core machine fails to start the run)
STEP = 3  # the step at which the rank fails (checkpoints of steps 1-3 exist by then)
DILOCO_TIMEOUT_S = 60
HANG_GRACE_S = 15  # a hung rank is found by the timeout, then killed: a few seconds more
# the hang case's collective timeout, set once both ranks have joined (the rendezvous keeps TIMEOUT_S): a step of this
# model takes milliseconds and a checkpoint a fraction of a second, so a rank that keeps the other waiting this long
# has hung, even on a loaded machine
HANG_TIMEOUT_S = 10


def _read(path) -> str:
    with open(path) as f:
        return f.read()


def _run(
    outdir,
    fault: str,
    rank: int,
    ckpt_path=None,
    strategy: str = "",
    timeout_s: float = TIMEOUT_S,
    collective_timeout_s: float | None = None,
) -> tuple[int, str, float]:
    """Run the worker; return its exit status, its output and the seconds from the injected failure to its end."""
    os.makedirs(outdir, exist_ok=True)
    command = [sys.executable, "-m", "tests.fault_worker", str(outdir), fault, str(rank), str(STEP), str(timeout_s)]
    env = child_env(OMP_NUM_THREADS="1", FAULT_STRATEGY=strategy)
    env["FAULT_COLLECTIVE_TIMEOUT_S"] = str(collective_timeout_s or "")
    env.pop("LOCAL_RANK", None)  # the script must launch its own child rank
    # output to a file, not a pipe: a rank left running would hold a pipe open and block the test until its timeout
    with open(os.path.join(outdir, "output.txt"), "w") as log:
        proc = subprocess.run(
            [*command, *([ckpt_path] if ckpt_path else [])],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=240,
        )
    ended = time.time()
    failed_at = os.path.join(outdir, "failed_at")
    latency = ended - float(_read(failed_at)) if os.path.exists(failed_at) else 0.0
    return proc.returncode, _read(os.path.join(outdir, "output.txt")), latency


def _left_running(outdir) -> list[int]:
    """The worker processes (by pid file) still running: none may outlive the launcher."""
    alive = []
    for rank in range(2):
        path = os.path.join(outdir, f"pid{rank}")
        if not os.path.exists(path):
            continue
        pid = int(_read(path))
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            continue
        if state not in ("Z", "X"):  # a zombie waits for its reaper, it runs nothing
            alive.append(pid)
    for pid in alive:  # leave the machine clean even when the test fails
        os.kill(pid, 9)
    return alive


def _assert_ended_naming(returncode: int, output: str, outdir, pattern: str) -> None:
    assert returncode not in (0, 134, -6), output[-4000:]
    assert "terminate called" not in output, output[-4000:]
    assert _left_running(outdir) == []
    assert re.search(pattern, output), output[-4000:]


@pytest.mark.slow
def test_a_rank_that_raises_ends_every_rank_naming_it_and_the_last_checkpoint_resumes(tmp_path):
    returncode, output, latency = _run(tmp_path / "failed", "raise", rank=1)
    # rank 0's error (the one the script ends with) names rank 1 and its error, not only "Connection closed"
    named = r"RankFailedError: CompressedDDP: rank 1 \(ValueError: injected failure at step 3\) exited with code 1"
    _assert_ended_naming(returncode, output, tmp_path / "failed", named)
    assert latency < TIMEOUT_S, f"{latency:.1f} s from the failure to the end"

    last = tmp_path / "failed" / "ckpt" / "last.ckpt"
    checkpoint = torch.load(checkpoint_file(last), weights_only=False)
    assert checkpoint["global_step"] == STEP  # written after the last step that every rank finished
    assert checkpoint["gradcomp"]["world_size"] == 2
    assert [load_rank_state(last, "gradcomp", rank).state["global_step"] for rank in range(2)] == [STEP, STEP]
    returncode, output, _ = _run(tmp_path / "resumed", "none", rank=1, ckpt_path=str(last))
    assert returncode == 0, output[-4000:]
    assert int(_read(tmp_path / "resumed" / "finished")) == MAX_STEPS


@pytest.mark.parametrize(
    ("fault", "how"),
    [("exit", "exited with code 3"), pytest.param("kill", "was killed by SIGKILL", marks=pytest.mark.slow)],
)
def test_a_rank_that_dies_ends_every_rank_naming_it(tmp_path, fault, how):
    """``os._exit`` and SIGKILL: the rank leaves no Python error and no note; its exit status names it."""
    returncode, output, latency = _run(tmp_path, fault, rank=1)
    _assert_ended_naming(returncode, output, tmp_path, rf"RankFailedError: CompressedDDP: rank 1 {how}")
    assert latency < TIMEOUT_S, f"{latency:.1f} s from the failure to the end"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("strategy", "fault", "how"),
    [
        ("diloco", "kill", "was killed by SIGKILL"),  # in an inner step: rank 0 notices at its next sync
        ("diloco-overlap", "kill", "was killed by SIGKILL"),  # with an outer exchange in flight
        ("diloco", "raise", r"\(ValueError: injected failure at step 3\) exited with code 1"),
    ],
)
def test_a_diloco_rank_that_dies_ends_every_rank_naming_it(tmp_path, strategy, fault, how):
    """DiLoCo: no collective runs between syncs, so the other rank goes on until its sync fails, then ends naming the
    rank, within the timeout (a longer one than above: the child rank must start within it on a loaded machine)."""
    returncode, output, latency = _run(tmp_path, fault, rank=1, strategy=strategy, timeout_s=DILOCO_TIMEOUT_S)
    _assert_ended_naming(returncode, output, tmp_path, rf"RankFailedError: DiLoCo: rank 1 {how}")
    assert latency < DILOCO_TIMEOUT_S, f"{latency:.1f} s from the failure to the end"


@pytest.mark.slow
def test_rank_zero_raising_stops_the_other_ranks(tmp_path):
    """The main process's own error is kept (a user's ``except ValueError`` still works); its children are stopped,
    although they would wait in their collective for the whole timeout."""
    returncode, output, latency = _run(tmp_path, "raise", rank=0)
    _assert_ended_naming(returncode, output, tmp_path, r"ValueError: injected failure at step 3")
    assert "CompressedDDP: rank 0 failed (this error)" in output
    assert latency < TIMEOUT_S, f"{latency:.1f} s from the failure to the end"


@pytest.mark.slow
def test_a_rank_that_hangs_is_stopped_after_the_timeout(tmp_path):
    """Rank 1 sleeps in ``training_step``: rank 0's collective times out, then rank 1 is killed, not left running."""
    returncode, output, latency = _run(tmp_path, "hang", rank=1, collective_timeout_s=HANG_TIMEOUT_S)
    _assert_ended_naming(returncode, output, tmp_path, r"CompressedDDP: rank 1 did not answer within the timeout")
    assert latency < HANG_TIMEOUT_S + HANG_GRACE_S, f"{latency:.1f} s from the failure to the end"


def test_collective_failures_are_told_from_a_ranks_own_error():
    """What decides whether rank 0 blames another rank (waits for it, names it) or keeps its own error."""
    import torch.distributed as dist

    from lightning_gradcomp.runtime.faults import is_collective_failure

    consequences = [
        "Got the following error when running the callback: RuntimeError: [third_party/gloo/gloo/transport/tcp/"
        "pair.cc:561] Connection closed by peer [127.0.0.1]:13445.",
        "Application timeout caused pair closure",
        "[gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 20000ms for recv operation to complete",
    ]
    assert all(is_collective_failure(RuntimeError(message)) for message in consequences)
    assert is_collective_failure(dist.DistStoreError("Timed out after 16 seconds waiting for clients"))
    own = [ValueError("injected failure"), RuntimeError("DataLoader timed out after 10 seconds"), KeyboardInterrupt()]
    assert not any(is_collective_failure(error) for error in own)
