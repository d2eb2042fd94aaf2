import os

import pytest
import torch

# two CPU cores: one thread per process keeps the two-process tests from oversubscribing the machine
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")


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
