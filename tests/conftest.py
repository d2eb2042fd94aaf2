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
