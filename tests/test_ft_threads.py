"""Fault-tolerant groups that share a machine each take their share of its cores, unless the user chose."""

import pytest
import torch

from lightning_gradcomp import TorchFT
from lightning_gradcomp.ft import threads


@pytest.fixture
def restore_threads(monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "_ENV_AT_IMPORT", None)
    monkeypatch.setattr(threads, "available_cores", lambda: 8)
    monkeypatch.setattr(threads, "_THREADS_AT_IMPORT", before)
    yield before
    torch.set_num_threads(before)


def _config(lighthouse="http://127.0.0.1:29510", **kwargs):
    return TorchFT(lighthouse=lighthouse, replica_group_id="0", **kwargs)


def test_groups_on_loopback_share_the_cores_and_say_so(restore_threads, monkeypatch):
    lines = []
    assert threads.share_cores(_config(start_replicas=2), 1, info=lines.append) == 4
    assert torch.get_num_threads() == 4
    assert lines == [
        "TorchFT: 4 compute threads per process: 8 cores for 2 processes on this machine (1 per group, 2 groups with"
        " the lighthouse on loopback); set OMP_NUM_THREADS to choose."
    ]
    # what Lightning's launcher set for a two-process job (half the cores, here 4) is not the user's choice
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    assert threads.share_cores(_config(start_replicas=4, lighthouse="http://localhost:1"), 2, info=lines.append) == 1
    assert torch.get_num_threads() == 1


def test_a_remote_lighthouse_counts_this_group_alone(restore_threads):
    lines = []
    assert threads.groups_on_this_host(_config(start_replicas=3, lighthouse="http://coordinator:29510")) == 1
    assert threads.share_cores(_config(start_replicas=3, lighthouse="http://10.0.0.2:29510"), 2, lines.append) == 4
    assert "2 per group, this group alone" in lines[0]


def test_the_users_own_setting_is_kept(restore_threads, monkeypatch):
    lines = []
    monkeypatch.setattr(threads, "_ENV_AT_IMPORT", "3")  # OMP_NUM_THREADS=3 in the environment at launch
    assert threads.share_cores(_config(start_replicas=2), 1, info=lines.append) == restore_threads
    monkeypatch.setattr(threads, "_ENV_AT_IMPORT", None)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # set by the script after importing the package
    assert threads.share_cores(_config(start_replicas=2), 1, info=lines.append) == restore_threads
    monkeypatch.delenv("OMP_NUM_THREADS")
    chosen = 3 if restore_threads != 3 else 5
    torch.set_num_threads(chosen)  # torch.set_num_threads of the user's
    assert threads.share_cores(_config(start_replicas=2), 1, info=lines.append) == chosen
    assert torch.get_num_threads() == chosen
    assert threads.share_cores(None, 1, info=lines.append) == chosen, "a plain job is left to Lightning"
    assert lines == []
