"""Zen: the exact sparse sum (simulated ranks and real gloo), its bytes, the selector, bad input."""

import copy
import math
import pickle

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from lightning_gradcomp import CompressionState, compression_hook
from lightning_gradcomp.compressors import DGC, AdaComp, TopK, Zen
from lightning_gradcomp.compressors.base import BucketContext, layers_from_shapes
from lightning_gradcomp.compressors.transports.hashed_sum import (
    by_owner,
    choose,
    costs,
    owner_map,
    owner_of,
    tensor_input,
    zen_seed,
)
from lightning_gradcomp.engine.telemetry import Telemetry
from lightning_gradcomp.testing import SimulatedWorld, simulate_reduce
from tests.distributed import run_distributed


def _sparse_ints(n: int, numel: int, nnz: int, seed: int, dtype=torch.float32) -> list[torch.Tensor]:
    """Integer-valued sparse tensors (sums are exact), with non-zeros at index 0 and at the last index."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for r in range(n):
        x = torch.zeros(numel, dtype=dtype)
        idx = torch.randint(0, numel, (nnz,), generator=g)
        x[idx] = torch.randint(-8, 9, (nnz,), generator=g).to(dtype)
        x[0], x[-1] = r + 1, -(r + 2)
        out.append(x)
    return out


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("encoding", ["list", "bitmap", "auto"])
def test_zen_sum_is_the_dense_sum_bitwise(n, encoding):
    layers = layers_from_shapes([(37, 11), (5, 7)])  # 442 elements: not divisible by 3 or 4
    xs = _sparse_ints(n, 442, 30, seed=n)
    expected = sum(xs) / n
    outs = simulate_reduce([Zen(dense_threshold=1.0, index_encoding=encoding) for _ in range(n)], xs, layers)
    for out in outs:
        assert torch.equal(out, expected)


def test_a_rank_with_no_non_zeros_and_an_all_zero_bucket():
    layers = layers_from_shapes([(10, 31)])
    xs = _sparse_ints(3, 310, 12, seed=3)
    xs[1].zero_()  # sends nothing, still owns and receives
    outs = simulate_reduce([Zen(dense_threshold=1.0) for _ in range(3)], xs, layers)
    assert all(torch.equal(out, sum(xs) / 3) for out in outs)
    zeros = [torch.zeros(310) for _ in range(3)]
    outs = simulate_reduce([Zen(dense_threshold=1.0) for _ in range(3)], zeros, layers)
    assert all(torch.equal(out, zeros[0]) for out in outs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_zen_sums_half_precision_in_float32(dtype):
    """Owners add in float32 and round once: 256 + 1 + ... (bf16 alone would lose the ones) comes out as a dense
    float32 sum rounded to the gradient's dtype."""
    n, numel = 4, 301
    xs = _sparse_ints(n, numel, 20, seed=5, dtype=dtype)
    for x in xs:
        x[7] = 1.0
    xs[0][7] = 256.0
    outs = simulate_reduce([Zen(dense_threshold=1.0) for _ in range(n)], xs, layers_from_shapes([(numel,)]))
    exact = (sum(x.double() for x in xs) / n).to(dtype)
    for out in outs:
        assert out.dtype == dtype
        assert torch.equal(out, exact)


def test_the_partition_is_balanced_deterministic_and_complete():
    owners = owner_of(torch.arange(100_000), 4, seed=123)
    assert torch.equal(owners, owner_of(torch.arange(100_000), 4, seed=123))
    counts = torch.bincount(owners, minlength=4)
    assert counts.min() > 0.97 * 25_000
    assert counts.max() < 1.03 * 25_000
    # a skewed support (one embedding row of 64 values in 40 hot rows) is balanced too: the hash ignores locality
    hot = (torch.arange(40).unsqueeze(1) * 64 * 97 + torch.arange(64)).flatten()
    spread = torch.bincount(owner_of(hot, 4, seed=123), minlength=4)
    assert spread.max() < 1.2 * hot.numel() / 4
    omap = owner_map(1001, 3, seed=9, device=torch.device("cpu"))
    assert torch.equal(omap.order.sort().values, torch.arange(1001))  # every index has exactly one owner
    assert sum(omap.sizes) == 1001
    for p in range(3):
        mine = omap.indices_of(p)
        assert torch.all(omap.owners[mine] == p)
        assert torch.all(mine[1:] > mine[:-1])
        # the bit that stands for each index in its owner's bitmap: its place in P_p
        assert torch.equal(omap.positions[mine], torch.arange(mine.numel()))


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize(
    "factory",
    [
        lambda: TopK(ratio=0.05, transport="zen"),
        lambda: DGC(ratio=0.05, momentum=0.0, transport="zen"),
        lambda: AdaComp(bin_size_fc=8, transport="zen"),
        lambda: TopK(ratio=0.05, transport="zen-auto"),
    ],
    ids=["topk", "dgc", "adacomp", "topk-auto"],
)
def test_sparsifiers_over_zen_equal_their_allgather_bitwise(n, factory):
    """Same selection, same error feedback; the sum of integer-valued pairs is exact either way."""
    layers = layers_from_shapes([(40, 13), (9, 21)])
    numel = 40 * 13 + 9 * 21
    g = torch.Generator().manual_seed(n)
    xs = [torch.randint(-50, 51, (numel,), generator=g).float() for _ in range(n)]
    over = [factory() for _ in range(n)]
    plain = [copy.deepcopy(c) for c in over]
    for c in plain:
        c.transport = "allgather"
    res_over = [torch.zeros(numel) for _ in range(n)]
    res_plain = [torch.zeros(numel) for _ in range(n)]
    for step in range(3):
        a = simulate_reduce(over, xs, layers, step=step, residuals=res_over)
        b = simulate_reduce(plain, xs, layers, step=step, residuals=res_plain)
        for x, y in zip(a, b):
            assert torch.equal(x, y)
        for x, y in zip(res_over, res_plain):
            assert torch.equal(x, y)


def _kinds(compressor_factory, xs, layers, n):
    world = SimulatedWorld(n)
    from lightning_gradcomp.compressors.base import BucketContext
    from lightning_gradcomp.engine.comm import Comm

    futures = []
    compressors = [compressor_factory() for _ in range(n)]
    for rank, (c, x) in enumerate(zip(compressors, xs)):
        comm = Comm(world.backend(rank), Telemetry(), x.device)
        ctx = BucketContext(index=0, step=0, rank=rank, world_size=n, layers=layers, comm=comm)
        futures.append(c.reduce(x.clone(), ctx))
    for f in futures:
        f.wait()
    return {kind[0] for rank, kind in world.issued if rank == 0}, compressors


def test_dense_fallback_and_the_auto_selector_pick_by_density_and_overlap():
    layers = layers_from_shapes([(100, 50)])
    dense = [torch.randn(5000, generator=torch.Generator().manual_seed(r)) for r in range(2)]
    kinds, _ = _kinds(lambda: Zen(dense_threshold=0.5), dense, layers, 2)
    assert kinds == {"all_gather", "all_reduce"}  # counts, then one dense all-reduce
    sparse = _sparse_ints(2, 5000, 50, seed=1)
    kinds, _ = _kinds(lambda: Zen(dense_threshold=0.5), sparse, layers, 2)
    assert "all_to_all" in kinds
    # identical supports on 4 ranks: auto picks Zen (each rank receives ~1/4 of the pairs instead of 3 ranks' pairs)
    base = torch.zeros(5000)
    base[torch.randperm(5000, generator=torch.Generator().manual_seed(0))[:50]] = 100.0
    overlapping = [base + 0.01 * torch.randn(5000, generator=torch.Generator().manual_seed(r)) for r in range(4)]
    kinds, compressors = _kinds(lambda: TopK(ratio=0.01, transport="zen-auto"), overlapping, layers, 4)
    assert "all_to_all" in kinds
    assert "zen_union" in compressors[0].state_dict()  # the measured overlap is state (checkpointed)


def test_the_selector_formula():
    n, numel = 4, 100_000
    full = [[250] * 4 for _ in range(4)]  # every rank 1000 non-zeros, the same 1000 (union 1000)
    assert choose(full, numel, 1000, 4, 4) == "zen"
    assert choose(full, numel, 4000, 4, 4) == "allgather"  # disjoint supports: Zen's pull is all of them
    half = [[2_500] * 4 for _ in range(4)]  # 10% dense each, 40% in the sum: a bitmap pull still beats dense
    assert choose(half, numel, 40_000, 4, 4) == "zen"
    assert costs(half, numel, 40_000, 4, 4)["zen-bitmap"] < costs(half, numel, 40_000, 4, 4)["zen"]
    heavy = [[20_000] * 4 for _ in range(4)]  # 80% dense each
    assert choose(heavy, numel, numel, 4, 4) == "dense"
    c = costs(full, numel, 1000, 4, 4)
    assert c["dense"] == 2 * 3 / 4 * numel * 4
    assert c["allgather"] == 3 * 1000 * 8
    assert c["zen"] == 3 * 250 * 8 + 3 * 1000 / n * 8


def _zen_bytes(xs, n, encoding):
    """What the documented formula says rank r sends and receives (docs/zen.md), fp32 values, int32 indices."""
    numel = xs[0].numel()
    supports = [torch.nonzero(x).squeeze(1) for x in xs]
    from lightning_gradcomp.compressors.base import BucketContext
    from lightning_gradcomp.compressors.transports.hashed_sum import zen_seed

    seed = zen_seed(BucketContext(index=0, step=0, rank=0, world_size=n, layers=()))
    counts = [torch.bincount(owner_of(s, n, seed), minlength=n).tolist() for s in supports]
    union = torch.unique(torch.cat(supports))
    unions = torch.bincount(owner_of(union, n, seed), minlength=n).tolist()
    sizes = owner_map(numel, n, seed, torch.device("cpu")).sizes
    if encoding == "list":
        pull = [8 * u for u in unions]
    else:
        pull = [math.ceil(math.ceil(size / 8) / 4) * 4 + 4 * u for size, u in zip(sizes, unions)]
    counts_round = math.ceil(4 * n / 8) * 8 + 8  # n int32 counts packed with the 4-byte non-finite flag
    out = []
    for r in range(n):
        # the all-gathers are rings: each rank forwards n - 1 blocks (docs/concepts.md, telemetry)
        sent = (n - 1) * counts_round + 8 * (sum(counts[r]) - counts[r][r]) + (n - 1) * 4 + (n - 1) * max(pull)
        received = (n - 1) * counts_round + 8 * sum(counts[s][r] for s in range(n) if s != r)
        received += (n - 1) * 4 + (n - 1) * max(pull)
        out.append((sent, received))
    return out


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("encoding", ["list", "bitmap"])
def test_telemetry_bytes_match_the_formula(n, encoding):
    xs = _sparse_ints(n, 3001, 400, seed=7)
    telemetry = [Telemetry() for _ in range(n)]
    for t in telemetry:
        t.add_bucket(3001 * 4)
    compressors = [Zen(dense_threshold=1.0, index_encoding=encoding) for _ in range(n)]
    simulate_reduce(compressors, xs, layers_from_shapes([(3001,)]), telemetry=telemetry)
    for t, (sent, received) in zip(telemetry, _zen_bytes(xs, n, encoding)):
        stats = t.pop_step()
        assert (stats.bytes_sent, stats.bytes_received) == (sent, received)


def test_bytes_received_stay_flat_over_zen_when_supports_overlap():
    """TopK(0.01) with the same large entries on every rank: over the all-gather each rank receives every other
    rank's pairs (3x more at 4 ranks than at 2); over Zen its share of the push and of the pull, ``2 (n - 1) / n``
    times the pairs of one rank (1.5x more at 4 ranks than at 2, and never more than 2x at any number of ranks)."""
    received = {}
    for n in (2, 4):
        numel = 50_000
        base = torch.zeros(numel)
        base[torch.randperm(numel, generator=torch.Generator().manual_seed(0))[:500]] = 100.0
        xs = [base + 0.01 * torch.randn(numel, generator=torch.Generator().manual_seed(r)) for r in range(n)]
        for transport in ("allgather", "zen"):
            telemetry = [Telemetry() for _ in range(n)]
            for t in telemetry:
                t.add_bucket(numel * 4)
            compressors = [TopK(ratio=0.01, transport=transport) for _ in range(n)]
            simulate_reduce(compressors, xs, layers_from_shapes([(500, 100)]), telemetry=telemetry)
            received[transport, n] = max(t.pop_step().bytes_received for t in telemetry)
    assert received["allgather", 4] / received["allgather", 2] > 2.9
    assert received["zen", 4] / received["zen", 2] < 1.7
    assert received["zen", 4] < 2.2 * 500 * 8  # within 10% of 2 (n - 1) / n * m * 8 < 2 m * 8
    assert received["zen", 4] < 0.6 * received["allgather", 4]


def test_resume_of_the_auto_selector_is_exact():
    layers = layers_from_shapes([(100, 50)])
    g = torch.Generator().manual_seed(3)
    data = [[torch.randn(5000, generator=g) for _ in range(2)] for _ in range(4)]
    straight = [TopK(ratio=0.05, transport="zen-auto") for _ in range(2)]
    for step in range(2):
        simulate_reduce(straight, data[step], layers, step=step)
    resumed = [TopK(ratio=0.05, transport="zen-auto") for _ in range(2)]
    for a, b in zip(resumed, straight):
        a.load_state_dict(pickle.loads(pickle.dumps(b.state_dict())))
    for step in range(2, 4):
        for x, y in zip(
            simulate_reduce(straight, data[step], layers, step=step),
            simulate_reduce(resumed, data[step], layers, step=step),
        ):
            assert torch.equal(x, y)


@pytest.mark.parametrize(
    ("factory", "match"),
    [
        (lambda: Zen(dense_threshold=1.5), "dense_threshold"),
        (lambda: Zen(dense_threshold=-0.1), "dense_threshold"),
        (lambda: Zen(dense_threshold=float("nan")), "dense_threshold"),
        (lambda: Zen(index_encoding="rle"), "index_encoding"),
        (lambda: Zen(layers="embedding"), "layers"),
        (lambda: TopK(transport="nccl"), "transport"),
        (lambda: TopK(transport=None), "transport"),
        (lambda: DGC(transport="Zen"), "transport"),
        (lambda: AdaComp(transport="sparse"), "transport"),
    ],
)
def test_bad_arguments_are_refused(factory, match):
    with pytest.raises(ValueError, match=f"`{match}`"):
        factory()


# ----------------------------------------------------------------------------------------------------------------
# Real gloo, through DDP: an embedding model, Zen on the embedding only, against plain DDP
# ----------------------------------------------------------------------------------------------------------------
class _Bag(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embedding = nn.Embedding(500, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embedding(tokens).mean(1))


def _train(rank: int, world_size: int, zen: bool) -> dict:
    model = _Bag()
    ddp = DDP(model)
    state = None
    if zen:
        state = CompressionState(Zen(layers=["embedding.weight"]))
        state.attach(ddp)
        ddp.register_comm_hook(state, compression_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    received = []
    for step in range(3):
        g = torch.Generator().manual_seed(100 * step + rank)
        tokens = torch.randint(0, 500, (4, 6), generator=g)
        tokens[0, 0] = 0 if rank == 0 else 499  # the first and the last row of the embedding
        y = torch.randint(0, 4, (4,), generator=g)
        optimizer.zero_grad()
        nn.functional.cross_entropy(ddp(tokens), y).backward()
        optimizer.step()
        if state is not None:
            received.append(state.telemetry.pop_step().bytes_received)
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    everyone = [torch.empty_like(flat) for _ in range(world_size)]
    dist.all_gather(everyone, flat)
    return {"params": flat, "identical": all(torch.equal(everyone[0], e) for e in everyone), "received": received}


def _both(rank: int, world_size: int) -> dict:
    return {"plain": _train(rank, world_size, False), "zen": _train(rank, world_size, True)}


@pytest.mark.slow
def test_zen_on_gloo_ddp_equals_plain_ddp_bitwise():
    """Two processes: the embedding's gradient (a few rows of 500) goes through Zen, the head is averaged densely;
    with two ranks (a + b) / 2 is exactly a / 2 + b / 2, so training is bitwise plain DDP, and replicas agree."""
    results = run_distributed(_both)
    for result in results:
        assert result["plain"]["identical"]
        assert result["zen"]["identical"]
        assert torch.equal(result["plain"]["params"], result["zen"]["params"])
        dense_embedding = 500 * 16 * 4
        assert all(0 < r < dense_embedding / 4 for r in result["zen"]["received"])


def test_counts_on_the_cpu_are_the_split_by_owner_and_a_dense_rank_skips_it():
    """The counts round's input: every owner's non-zeros (NaN included, -0.0 not), or, for a rank above the dense
    fallback's bound, its total under owner 0; the result is the dense mean bitwise either way."""
    n, numel = 3, 442
    layers = layers_from_shapes([(37, 11), (5, 7)])
    xs = _sparse_ints(n, numel, 30, seed=5)
    xs[1][7], xs[1][8] = float("nan"), -0.0
    ctx = BucketContext(index=0, step=0, rank=1, world_size=n, layers=layers)
    owners = owner_map(numel, n, zen_seed(ctx), torch.device("cpu")).owners
    nonzero = xs[1] != 0
    split = tensor_input(xs[1], ctx, dense_above=float(numel))
    assert torch.equal(split.counts, torch.bincount(owners[nonzero], minlength=n).to(torch.int32))
    indices, values = split.rows()
    assert sorted(indices.tolist()) == torch.nonzero(nonzero).squeeze(1).tolist()
    assert torch.all(owners[indices.long()][1:] >= owners[indices.long()][:-1])  # grouped by owner
    unsplit = tensor_input(xs[1], ctx, dense_above=10.0)
    assert unsplit.counts.tolist() == [int(nonzero.sum()), 0, 0]
    with pytest.raises(RuntimeError, match="not split"):
        unsplit.rows()
    # one dense rank among sparse ones: every rank takes the dense path, as with the true split
    xs = _sparse_ints(n, numel, 30, seed=6)
    xs[2] = torch.arange(1, numel + 1, dtype=torch.float32)
    outs = simulate_reduce([Zen(dense_threshold=0.5) for _ in range(n)], xs, layers)
    assert all(torch.equal(out, sum(xs) / n) for out in outs)


@pytest.mark.parametrize("n", [1, 2, 3, 300])
@pytest.mark.parametrize("size", [0, 1, 5000])
def test_by_owner_is_torch_stable_sort(n, size):
    owners = torch.randint(0, n, (size,), generator=torch.Generator().manual_seed(size + n))
    order = by_owner(owners, n)
    assert order.dtype == torch.int64
    assert torch.equal(order, torch.sort(owners, stable=True).indices)
