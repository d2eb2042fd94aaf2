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

    Lightning writes ``MASTER_ADDR``/``MASTER_PORT`` (and the rank variables) into ``os.environ``; later tests that
    spawn workers would inherit that port and fail to listen on it.
    """
    saved = dict(os.environ)
    try:
        yield
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        os.environ.clear()
        os.environ.update(saved)
