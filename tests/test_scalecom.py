"""ScaleCom (CLT-k) against its equations, and its bytes per rank with 2 and 4 processes."""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from lightning_gradcomp import CompressionState, compression_hook
from lightning_gradcomp.compressors import ScaleCom, TopK
from lightning_gradcomp.compressors.base import keep_count, layers_from_shapes
from lightning_gradcomp.compressors.ops.packing import index_nbytes
from lightning_gradcomp.engine.telemetry import Telemetry
from lightning_gradcomp.testing import simulate_reduce
from tests.distributed import run_distributed

LAYERS = layers_from_shapes([(40, 50), (8, 4, 3, 3), (30, 30)])
NUMEL = sum(layer.numel for layer in LAYERS)


def _grads(n, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(NUMEL, generator=g, dtype=dtype) * (1 + r) for r in range(n)]


@pytest.mark.parametrize("beta", [1.0, 0.3])
@pytest.mark.parametrize("ratio", [0.02, 0.2])  # int32 indices; bitmaps
def test_scalecom_equals_its_equations(beta, ratio):
    """p = m + g; the leader (step mod n) picks the top-k of its |p| per layer; the average of everyone's values
    there is the update; m <- (1 - beta) m + beta (p with the sent entries zeroed)."""
    n = 3
    compressors = [ScaleCom(ratio=ratio, beta=beta) for _ in range(n)]
    residuals = [torch.zeros(NUMEL, dtype=torch.float64) for _ in range(n)]
    memory = [torch.zeros(NUMEL, dtype=torch.float64) for _ in range(n)]
    for step in range(5):
        grads = _grads(n, seed=step)
        outs = simulate_reduce(compressors, grads, LAYERS, step=step, residuals=residuals)
        p = [m + g for m, g in zip(memory, grads)]
        leader = step % n
        chosen = torch.cat(
            [
                torch.topk(layer.flat(p[leader]).abs(), keep_count(layer.numel, ratio)).indices + layer.offset
                for layer in LAYERS
            ]
        )
        expected = torch.zeros(NUMEL, dtype=torch.float64)
        expected[chosen] = (p[0][chosen] / n + p[1][chosen] / n) + p[2][chosen] / n
        for out in outs:
            assert torch.equal(out, outs[0])
            torch.testing.assert_close(out, expected, rtol=1e-14, atol=1e-14)
        for r in range(n):
            sent_zeroed = p[r].clone()
            sent_zeroed[chosen] = 0
            memory[r] = (1 - beta) * memory[r] + beta * sent_zeroed
            torch.testing.assert_close(residuals[r], memory[r], rtol=1e-14, atol=1e-14)


@pytest.mark.parametrize("beta", [0.3, 0.5])
def test_low_pass_memory_is_the_filter_of_the_zeroed_copy_bit_for_bit(beta):
    """m <- (1 - beta) m + beta (p with the sent entries zeroed), in torch's fp32 ops, bit for bit: also where
    (1 - beta) m is -0.0 at a sent entry (adding beta * 0 makes it +0.0)."""
    n = 2
    compressors = [ScaleCom(ratio=0.1, beta=beta) for _ in range(n)]
    residuals = [torch.full((NUMEL,), -0.0) for _ in range(n)]
    grads = [g.float() for g in _grads(n, seed=7)]
    p = [g + -0.0 for g in grads]
    chosen = torch.cat(
        [torch.topk(layer.flat(p[0]).abs(), keep_count(layer.numel, 0.1)).indices + layer.offset for layer in LAYERS]
    )
    old = [m.clone() for m in residuals]
    simulate_reduce(compressors, grads, LAYERS, step=0, residuals=residuals)
    for r in range(n):
        expected = torch.mul(old[r], 1 - beta).add_(p[r].index_fill(0, chosen, 0), alpha=beta)
        assert torch.equal(residuals[r].view(torch.int32), expected.view(torch.int32))
        assert not residuals[r][chosen].signbit().any()


def test_identical_gradients_reduce_to_single_worker_top_k():
    """With the same p on every rank, CLT-k is top-k and the update is single-worker top-k with error feedback."""
    scalecom = [ScaleCom(ratio=0.05), ScaleCom(ratio=0.05)]
    single = [TopK(ratio=0.05)]
    res_s = [torch.zeros(NUMEL, dtype=torch.float64) for _ in range(2)]
    res_t = [torch.zeros(NUMEL, dtype=torch.float64)]
    for step in range(4):
        (g,) = _grads(1, seed=step)
        a = simulate_reduce(scalecom, [g, g.clone()], LAYERS, step=step, residuals=res_s)[0]
        b = simulate_reduce(single, [g], LAYERS, step=step, residuals=res_t)[0]
        assert torch.equal(a, b)
    assert torch.equal(res_s[0], res_t[0])


def _expected_bytes(ratio, layers):
    indices = sum(index_nbytes(keep_count(layer.numel, ratio), layer.numel)[1] for layer in layers)
    values = 4 * sum(keep_count(layer.numel, ratio) for layer in layers)
    return -(-indices // 8) * 8, values


@pytest.mark.parametrize("ranks", [2, 4])
def test_bytes_per_rank_do_not_depend_on_the_number_of_ranks_simulated(ranks):
    indices, values = _expected_bytes(0.01, LAYERS)
    compressors = [ScaleCom(ratio=0.01) for _ in range(ranks)]
    for step in range(2 * ranks):
        telemetry = [Telemetry() for _ in range(ranks)]
        for t in telemetry:
            t.add_bucket(NUMEL * 4)
        simulate_reduce(compressors, _grads(ranks, step, torch.float32), LAYERS, step=step, telemetry=telemetry)
        for rank, t in enumerate(telemetry):
            leader = step % ranks == rank
            # + 4: the non-finite flag rides with the values (fp32)
            assert t.pop_step().bytes_payload == values + 4 + (indices if leader else 0)


def _small_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10))


def _bytes_per_rank(rank: int, world_size: int) -> dict:
    model = _small_net()
    ddp = DDP(model, bucket_cap_mb=0.02)
    state = CompressionState(ScaleCom(ratio=0.01), min_compress_numel=256)
    state.attach(ddp)
    ddp.register_comm_hook(state, compression_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    sent = []
    for step in range(4):
        state.step = step
        g = torch.Generator().manual_seed(100 * rank + step)
        x, y = torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)
        optimizer.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        optimizer.step()
        # each bucket with compressed layers also sends the 4-byte non-finite flag, and DDP rebuilds its buckets
        # after the first step: count the payload alone
        flags = 4 * sum(1 for _, split in state._plans.values() if split.compressed)
        sent.append(state.telemetry.pop_step().bytes_payload - flags)  # handed to the collectives
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    everyone = [torch.empty_like(flat) for _ in range(world_size)]
    dist.all_gather(everyone, flat)
    return {"sent": sent, "identical": all(torch.equal(everyone[0], e) for e in everyone)}


@pytest.mark.slow
def test_bytes_per_rank_with_2_and_4_processes():
    """Real gloo processes: every rank all-reduces the same values each step and broadcasts indices when it leads
    (step mod n); those numbers are the same with 4 processes as with 2, so bytes per rank do not grow with n."""
    two = run_distributed(_bytes_per_rank, world_size=2)
    four = run_distributed(_bytes_per_rank, world_size=4)
    for runs, n in ((two, 2), (four, 4)):
        assert all(r["identical"] for r in runs)
        for rank, r in enumerate(runs):
            led = [s for step, s in enumerate(r["sent"]) if step % n == rank]
            followed = [s for step, s in enumerate(r["sent"]) if step % n != rank]
            assert len(set(followed)) == 1
            assert len(set(led)) <= 1
            assert not led or led[0] > followed[0]
    follower_bytes = {s for runs in (two, four) for r in runs for s in r["sent"]}
    assert len(follower_bytes) == 2, "followers send the same, leaders the same, whatever the number of ranks"


def test_bad_arguments():
    with pytest.raises(ValueError, match="`ratio`"):
        ScaleCom(ratio=0)
    with pytest.raises(ValueError, match="`beta`"):
        ScaleCom(beta=1.5)


def test_a_low_pass_memory_without_error_feedback_is_refused_before_training():
    """``beta`` acts only on the error-feedback memory: below 1 without it, it would be silently ignored."""
    with pytest.raises(ValueError, match="`beta`.*error feedback"):
        CompressionState(ScaleCom(beta=0.5), error_feedback=False)
    assert not CompressionState(ScaleCom(), error_feedback=False).uses_error_feedback()
    assert CompressionState(ScaleCom(beta=0.5)).uses_error_feedback()
