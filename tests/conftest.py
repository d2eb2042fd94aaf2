import os
import shutil
import tempfile

import pytest
import torch

from tests.selection import beyond_core

# two CPU cores: one thread per process keeps the two-process tests from oversubscribing the machine
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")

# One temporary folder for the whole session, removed when it passes. Without it a run leaves in the machine's
# temporary folder an empty folder per spawned fit (Lightning's spawn launcher saves rank 0's weights under a
# `mkdtemp()` and removes only the file), torch.compile's kernel cache (about 150 MB) and pytest's own `tmp_path`s.
# Set here, before any test: the spawned ranks and the subprocesses inherit TMPDIR, and this process's `tempfile`
# is pointed at it too (it caches the folder it found first).
SESSION_TMPDIR = tempfile.mkdtemp(prefix="gradcomp-tests-")
os.environ["TMPDIR"] = tempfile.tempdir = SESSION_TMPDIR


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if not session.testsfailed:
        shutil.rmtree(SESSION_TMPDIR, ignore_errors=True)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, exitstatus: int) -> None:
    if os.path.isdir(SESSION_TMPDIR):  # kept for a failure's files
        terminalreporter.write_line(f"this session's temporary files (tmp_path, the workers' files): {SESSION_TMPDIR}")


@pytest.fixture(autouse=True)
def _restore_default_dtype():
    dtype = torch.get_default_dtype()
    yield
    torch.set_default_dtype(dtype)


@pytest.fixture
def in_process_ddp():
    """For a Lightning DDP run inside the test process: leave no process group and none of its environment behind.

    Lightning's spawn launcher leaves ``MASTER_PORT`` in this process's environment and every later run reuses it; an
    in-process run would listen on that port itself (its store outlives the process group) and every later spawned
    run would fail to listen on it. So the in-process run gets a port of its own, and the environment is put back.
    """
    saved = dict(os.environ)
    os.environ.pop("MASTER_PORT", None)
    try:
        yield
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        os.environ.clear()
        os.environ.update(saved)


@pytest.hookimpl(tryfirst=True)  # before the -m selection reads the marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if beyond_core(item):
            item.add_marker(pytest.mark.slow)
