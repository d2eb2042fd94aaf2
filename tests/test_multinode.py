"""Trainer(num_nodes=2): two nodes of one process each, on one machine (multi-node is torch.distributed's job)."""

import os
import subprocess
import sys

import pytest
import torch

from tests.distributed import child_env, free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_two_nodes_train_with_identical_replicas(tmp_path):
    env = child_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1")
    env.pop("LOCAL_RANK", None)
    nodes = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.multinode_worker", str(tmp_path)],
            cwd=ROOT,
            env={**env, "NODE_RANK": str(node)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for node in range(2)
    ]
    outputs = [node.communicate(timeout=240)[0].decode() for node in nodes]
    for node, output in zip(nodes, outputs):
        assert node.returncode == 0, output[-3000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    assert all(rank["world_size"] == 2 for rank in ranks)
    assert torch.equal(ranks[0]["params"], ranks[1]["params"])
    assert all(s["stats"].compression_ratio > 2 for s in ranks[0]["steps"])
    assert "CompressedDDP: PowerSGD" in outputs[0]  # the setup log line names the compressor and what it covers
