"""ShardedDiLoCo: DiLoCo over FSDP2-sharded replica groups, on 4 CPU processes (2 groups x 2 shards, gloo).

The fits run under Lightning's default launcher through tests/sharded_worker.py, a few per launch; each module
fixture is one launch, and the tests compare its records.
"""

import os
import shutil
from functools import partial

import pytest
import torch
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from lightning_gradcomp import ShardedDiLoCo, TorchFT
from lightning_gradcomp.cli import GradcompCLI
from lightning_gradcomp.compressors import MinMax, PowerSGD
from lightning_gradcomp.diloco.sharded_mesh import checking_gradients
from lightning_gradcomp.tasks.sharded_language import ShardedGPTLanguageModel
from tests.sharded_worker import SAMPLES, run_launch

PARITY = ["sharded-h2", "diloco-h2-g2", "sharded-h4-eager", "diloco-h4-eager-g2"]
H1 = ["sharded-h1-sgd", "model-parallel-sgd", "sharded-hsdp"]
CHECKPOINTS = [
    "sharded-h3",
    "sharded-h3+sharded-h3",
    "sharded-h4-streaming",
    "sharded-h4-streaming+sharded-h4-streaming",
]
WARMUP = ["sharded-h2-w3", "diloco-h2-g2-w3"]
TENSOR_PARALLEL = [
    "sharded-tp-h2",
    "sharded-tp-only-h2",
    "sharded-tp-1x2x2",
    "sharded-tp-h2-nan4",
    "sharded-tp-fsdp-only",
]
TP_CHECKPOINTS = ["sharded-tp-h3", "sharded-tp-h3+sharded-tp-h3", "sharded-h3+sharded-tp-h3"]
EXTRAS = ["sharded-h2-offload", "sharded-h2-val3", "sharded-h2-nan4", "sharded-h2-mask", "sharded-h2-boolmask"]


def _launch(tmp_path_factory, devices: int, runs: list[str], copied: tuple = ()) -> dict:
    root = tmp_path_factory.mktemp("sharded")
    for source, run in copied:
        shutil.copytree(source / run, root / run)
    code, output, records = run_launch(root, devices, runs)
    assert code == 0, output[-4000:]
    return {"root": root, "output": output, "records": records}


@pytest.fixture(scope="module")
def parity(tmp_path_factory):
    """The parity runs, the extras and the warm-up in one launch (each launch starts 4 interpreters)."""
    return _launch(tmp_path_factory, 4, PARITY + EXTRAS + WARMUP)


@pytest.fixture(scope="module")
def h1(tmp_path_factory):
    return _launch(tmp_path_factory, 4, H1)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """The checkpoints, and the 2 x (2, 1) one after an epoch resumed on 2 x (1, 2) in the same launch."""
    return _launch(tmp_path_factory, 4, [*CHECKPOINTS, "sharded-tp-h3+sharded-h3"])


@pytest.fixture(scope="module")
def resharded(tmp_path_factory, checkpoints):
    """The 2 x 2 checkpoint after one epoch, resumed on 2 processes as 2 groups of 1."""
    return _launch(tmp_path_factory, 2, ["sharded-h3-2x1+sharded-h3"], copied=((checkpoints["root"], "sharded-h3"),))


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, checkpoints):
    """The 2 x 2 checkpoint after one epoch, resumed on one process."""
    return _launch(tmp_path_factory, 1, ["sharded-h3-1x1+sharded-h3"], copied=((checkpoints["root"], "sharded-h3"),))


@pytest.fixture(scope="module")
def tensor_parallel(tmp_path_factory):
    """2 x (S=1, T=2), 1 x (S=2, T=2) on 4 processes; 2 x (1, 2) saved after an epoch of 8 steps, resumed on
    2 x (1, 2) and on 2 x (2, 1), in the same launch."""
    return _launch(tmp_path_factory, 4, TENSOR_PARALLEL + TP_CHECKPOINTS)


@pytest.fixture(scope="module")
def tp_checkpoints(tensor_parallel):
    return tensor_parallel


@pytest.fixture(scope="module")
def tp_from_plain(checkpoints):
    return checkpoints


@pytest.fixture(scope="module")
def tp_references(tmp_path_factory):
    """On 2 processes: DiLoCo as 2 groups of 1 and as 1 group of 2."""
    return _launch(tmp_path_factory, 2, ["diloco-h2-g1", "diloco-h2-g2"])


@pytest.fixture(scope="module")
def tp_resharded(tmp_path_factory, tp_checkpoints):
    """The 2 x (1, 2) checkpoint resumed on 2 processes as 2 x (1, 1)."""
    run = "sharded-tp-h3-2x1+sharded-tp-h3"
    return _launch(tmp_path_factory, 2, [run], copied=((tp_checkpoints["root"], "sharded-tp-h3"),))


@pytest.fixture(scope="module")
def extras(parity):
    return parity


@pytest.fixture(scope="module")
def warmup(parity):
    return parity


def test_two_by_two_equals_two_level_diloco_at_every_step(parity):
    """AdamW inside, the paper's outer Nesterov SGD: theta_global and every rank's model as two-level DiLoCo's."""
    sharded, dense = parity["records"]["sharded-h2"], parity["records"]["diloco-h2-g2"]
    assert "2 replica groups of 2 FSDP2 shards" in parity["output"]
    for rank in range(4):
        assert len(sharded[rank]["steps"]) == len(dense[rank]["steps"]) == 8
        for i, (mine, theirs) in enumerate(zip(sharded[rank]["steps"], dense[rank]["steps"], strict=True)):
            assert mine["phase"] == theirs["phase"] == (i + 1) % 2
            torch.testing.assert_close(mine["global"], theirs["global"], rtol=0, atol=1e-5, msg=f"step {i + 1}")
            torch.testing.assert_close(mine["params"], theirs["params"], rtol=0, atol=1e-5, msg=f"step {i + 1}")
    first, last = sharded[0]["steps"][0]["global"], sharded[0]["steps"][-1]["global"]
    assert (last - first).abs().max() > 1e-2, "theta_global moved"
    # mid-round the groups differ, inside a group they agree; after the last sync every rank holds theta_global
    assert not torch.equal(sharded[0]["steps"][0]["params"], sharded[2]["steps"][0]["params"])
    for rank in range(4):
        torch.testing.assert_close(sharded[rank]["final"], sharded[0]["steps"][-1]["global"], rtol=0, atol=0)


def test_streaming_with_eager_updates_equals_two_level_diloco_at_every_step(parity):
    """2 fragments, each exchange overlapped with one inner step and merged by eager updates, on the shards."""
    sharded, dense = parity["records"]["sharded-h4-eager"], parity["records"]["diloco-h4-eager-g2"]
    for rank in range(4):
        _close_at_every_step(sharded[rank]["steps"], dense[rank]["steps"], atol=1e-5, steps=8)
    first, last = sharded[0]["steps"][0]["global"], sharded[0]["steps"][-1]["global"]
    assert (last - first).abs().max() > 1e-2, "theta_global moved"


def test_each_rank_holds_its_shards_of_the_outer_state_only(parity):
    sharded, dense = parity["records"]["sharded-h2"], parity["records"]["diloco-h2-g2"]
    whole = dense[0]["outer_numel"]
    assert whole == sharded[0]["steps"][0]["global"].numel()
    assert [r["outer_numel"] for r in sharded[:2]] == [r["outer_numel"] for r in sharded[2:]]
    assert sharded[0]["outer_numel"] + sharded[1]["outer_numel"] == whole
    assert max(r["outer_numel"] for r in sharded) <= whole // 2 + 16  # the last layer's 5 rows split 3 / 2


def test_offload_gives_the_same_model(parity, extras):
    plain, offloaded = parity["records"]["sharded-h2"], extras["records"]["sharded-h2-offload"]
    for rank in range(4):
        for i, (mine, theirs) in enumerate(zip(offloaded[rank]["steps"], plain[rank]["steps"], strict=True)):
            torch.testing.assert_close(mine["params"], theirs["params"], rtol=0, atol=0, msg=f"step {i + 1}")


def test_validation_runs_on_theta_global_and_leaves_the_local_training_alone(parity, extras):
    """Validated after steps 3 and 7 of rounds of 2 (one step into a round): on the last sync's theta_global."""
    plain, validated = parity["records"]["sharded-h2"], extras["records"]["sharded-h2-val3"]
    assert "validation runs on theta_global of the last sync (1 inner steps ago)" in extras["output"]
    for rank in range(4):
        seen = validated[rank]["validated"]
        assert len(seen) == 2
        for model, after in zip(seen, (2, 6)):
            torch.testing.assert_close(model, plain[rank]["steps"][after - 1]["global"], rtol=0, atol=0)
            assert not torch.equal(model, plain[rank]["steps"][after]["params"]), "the local model differs"
        for i, (mine, theirs) in enumerate(zip(validated[rank]["steps"], plain[rank]["steps"], strict=True)):
            torch.testing.assert_close(mine["params"], theirs["params"], rtol=0, atol=0, msg=f"step {i + 1}")


def test_a_shard_that_is_not_finite_skips_the_outer_step_on_every_shard_of_every_group(extras):
    """Rank 1's shards only are not finite at the sync of step 4: its peers' average is not finite, rank 0's peers'
    is; the verdict is agreed inside each group, so every rank skips, keeps theta_global and goes back to it."""
    ranks = extras["records"]["sharded-h2-nan4"]
    assert all(rank["skipped"] == 1 for rank in ranks)
    for rank in ranks:
        steps = rank["steps"]
        torch.testing.assert_close(steps[3]["global"], steps[1]["global"], rtol=0, atol=0)
        torch.testing.assert_close(steps[3]["params"], steps[1]["global"], rtol=0, atol=0)
        assert bool(rank["final"].isfinite().all())
        torch.testing.assert_close(rank["final"], ranks[0]["final"], rtol=0, atol=0)
    assert not torch.equal(ranks[0]["steps"][5]["global"], ranks[0]["steps"][3]["global"]), "training goes on"


def test_a_float_mask_buffer_trains_as_its_bool_twin(extras):
    """A constant float ``-inf`` mask buffer (not sharded: FSDP2 leaves buffers whole) skips no round and trains as
    its bool twin, on every rank."""
    floats, bools = extras["records"]["sharded-h2-mask"], extras["records"]["sharded-h2-boolmask"]
    for mine, twin in zip(floats, bools, strict=True):
        assert mine["skipped"] == 0
        torch.testing.assert_close(mine["final"], twin["final"], rtol=0, atol=0)
        assert not torch.equal(mine["steps"][-1]["global"], mine["steps"][0]["global"]), "theta_global moved"


def test_every_rank_reads_its_own_batches_and_the_groups_read_disjoint_data(parity):
    """ModelParallelStrategy's own sampler splits over the group only: both groups would read the same batches."""
    sharded, dense = parity["records"]["sharded-h2"], parity["records"]["diloco-h2-g2"]
    per_rank = [{i for batch in rank["batches"][:4] for i in batch} for rank in sharded]  # the first epoch
    for a in range(4):
        for b in range(a + 1, 4):
            assert not per_rank[a] & per_rank[b], f"ranks {a} and {b} read the same samples"
    assert set().union(*per_rank) == set(range(SAMPLES))
    assert [r["batches"] for r in sharded] == [r["batches"] for r in dense], "as DDPStrategy's sampler"


def test_sync_every_1_with_outer_sgd_lr_1_is_model_parallel_over_every_rank(h1):
    sharded, plain = h1["records"]["sharded-h1-sgd"], h1["records"]["model-parallel-sgd"]
    for rank in range(4):
        for i, (mine, theirs) in enumerate(zip(sharded[rank]["steps"], plain[rank]["steps"], strict=True)):
            torch.testing.assert_close(mine["params"], theirs["params"], rtol=0, atol=1e-5, msg=f"step {i + 1}")
    assert (sharded[0]["final"] - sharded[0]["steps"][0]["params"]).abs().max() > 1e-2, "it trained"


def test_a_native_hsdp_mesh_is_refused(h1):
    """Trap 1: FSDP2 on a 2-D HSDP mesh reduces across groups at every step (and with set_requires_all_reduce(False)
    leaves .grad None); the module must shard on the group's own 1-D mesh."""
    errors = [rank.get("error") for rank in h1["records"]["sharded-hsdp"]]
    assert all(e is not None and "sharded on the replica group's own 1-D mesh" in e for e in errors), errors
    assert "(ranks [0, 1]), got a 2-D mesh over ranks [0, 1, 2, 3]" in errors[0]
    assert "(ranks [2, 3])" in errors[3]
    assert h1["records"]["sharded-hsdp"][0]["steps"] == [], "no step was taken"


def test_resume_in_the_middle_of_a_round_is_bitwise(checkpoints):
    """Saved one step into a round of 3 (the groups' shards differ from theta_global): the resumed run is identical."""
    records = checkpoints["records"]
    full, resumed = records["sharded-h3"], records["sharded-h3+sharded-h3"]
    saved = full[0]["steps"][3]
    assert saved["phase"] == 1
    assert not torch.equal(saved["params"], saved["global"]), "mid-round: the model is not theta_global"
    for rank in range(4):
        assert resumed[rank]["start"]["step"] == 4
        torch.testing.assert_close(resumed[rank]["start"]["params"], full[rank]["steps"][3]["params"], rtol=0, atol=0)
        for i, (mine, theirs) in enumerate(zip(resumed[rank]["steps"], full[rank]["steps"][4:], strict=True)):
            assert mine["phase"] == theirs["phase"]
            torch.testing.assert_close(mine["params"], theirs["params"], rtol=0, atol=0, msg=f"step {i + 5}")
            torch.testing.assert_close(mine["global"], theirs["global"], rtol=0, atol=0, msg=f"step {i + 5}")


def test_resume_with_an_exchange_in_flight_and_compressor_residuals_is_bitwise(checkpoints):
    """Streaming (2 fragments, overlap 1) with MinMax: each rank's contribution and residuals are in its own file."""
    records = checkpoints["records"]
    full, resumed = records["sharded-h4-streaming"], records["sharded-h4-streaming+sharded-h4-streaming"]
    folder = checkpoints["root"] / "sharded-h4-streaming" / "epoch=0-step=4.ckpt"
    assert sorted(f for f in os.listdir(folder) if f.endswith(".pt")) == [
        *(f"diloco_sharded.rank{r}.pt" for r in range(4)),
        "meta.pt",
    ]
    own = torch.load(folder / "diloco_sharded.rank1.pt", weights_only=True)
    assert own["contribution"] is not None, "an exchange was in flight"
    assert own["exchange"]["residuals"], "MinMax compressed the wide layer's shard, with error feedback"
    for rank in range(4):
        for i, (mine, theirs) in enumerate(zip(resumed[rank]["steps"], full[rank]["steps"][4:], strict=True)):
            torch.testing.assert_close(mine["params"], theirs["params"], rtol=0, atol=0, msg=f"step {i + 5}")
        torch.testing.assert_close(resumed[rank]["final"], full[rank]["final"], rtol=0, atol=0)


def test_the_folder_holds_theta_global_and_one_copy_of_the_outer_state(checkpoints, tmp_path):
    """Consolidated without a process group: the weights are theta_global, the outer momentum whole and once, each
    group's own shards stacked over the groups."""
    records = checkpoints["records"]["sharded-h3"]
    folder = checkpoints["root"] / "sharded-h3" / "epoch=0-step=4.ckpt"
    dcp_to_torch_save(folder, tmp_path / "whole.pt")
    whole = torch.load(tmp_path / "whole.pt", weights_only=False)
    names = [f"net.{layer}.{kind}" for layer in (0, 2, 4) for kind in ("weight", "bias")]
    weights = torch.cat([whole["state_dict"][name].flatten() for name in names])
    torch.testing.assert_close(weights, records[0]["steps"][3]["global"], rtol=0, atol=0)
    outer = whole["diloco_sharded"]["outer"]
    assert outer["0.momentum_buffer"].shape == (16, 8)
    local = whole["diloco_sharded"]["local"]
    stacked = torch.cat([local[name].flatten(1) for name in names], dim=1)
    torch.testing.assert_close(stacked[0], records[0]["steps"][3]["params"], rtol=0, atol=0)
    torch.testing.assert_close(stacked[1], records[2]["steps"][3]["params"], rtol=0, atol=0)
    assert whole["diloco_sharded"]["inner"]["net.0.weight.exp_avg"].shape == (2, 16, 8)
    # one copy: every tensor replicated over the groups is written as the 2 shards of one group, not 4 chunks
    metadata = FileSystemReader(folder).read_metadata().state_dict_metadata
    for key in ("state_dict.net.0.weight", "diloco_sharded.outer.0.momentum_buffer"):
        assert len(metadata[key].chunks) == 2, key
    assert len(metadata["diloco_sharded.local.net.0.weight"].chunks) == 4, "each group's own: 2 groups x 2 shards"


def test_a_two_by_two_checkpoint_resumes_on_two_by_one_with_the_same_weights_and_step(checkpoints, resharded):
    full = checkpoints["records"]["sharded-h3"]
    ranks = resharded["records"]["sharded-h3-2x1+sharded-h3"]
    assert "2 replica groups of 1 FSDP2 shards" in resharded["output"]
    for group, rank in enumerate(ranks):
        start = rank["start"]
        assert (start["step"], start["phase"]) == (4, 1)
        torch.testing.assert_close(start["global"], full[0]["steps"][3]["global"], rtol=0, atol=0)
        torch.testing.assert_close(start["params"], full[2 * group]["steps"][3]["params"], rtol=0, atol=0)
        assert [s["phase"] for s in rank["steps"][:3]] == [2, 0, 1]


def test_a_two_by_two_checkpoint_resumes_on_one_process_from_theta_global_in_the_same_round(checkpoints, one_process):
    """Another number of groups: the groups' own state cannot be mapped, every group restarts from theta_global."""
    full = checkpoints["records"]["sharded-h3"]
    (rank,) = one_process["records"]["sharded-h3-1x1+sharded-h3"]
    assert "the checkpoint holds 2 groups of 2 shards (H=3, 1 fragments), this run 1 of 1" in one_process["output"]
    assert (rank["start"]["step"], rank["start"]["phase"]) == (4, 1)
    torch.testing.assert_close(rank["start"]["global"], full[0]["steps"][3]["global"], rtol=0, atol=0)
    torch.testing.assert_close(rank["start"]["params"], full[0]["steps"][3]["global"], rtol=0, atol=0)
    assert [s["phase"] for s in rank["steps"][:3]] == [2, 0, 1]


def test_dense_warmup_steps_are_hsdp_steps_then_rounds_as_two_level_diloco(warmup):
    sharded, dense = warmup["records"]["sharded-h2-w3"], warmup["records"]["diloco-h2-g2-w3"]
    for rank in range(4):
        for i, (mine, theirs) in enumerate(zip(sharded[rank]["steps"], dense[rank]["steps"], strict=True)):
            torch.testing.assert_close(mine["params"], theirs["params"], rtol=0, atol=1e-5, msg=f"step {i + 1}")
    for i in range(3):  # dense: every rank identical, theta_global follows
        steps = [rank["steps"][i] for rank in sharded]
        assert all(torch.equal(s["params"], steps[0]["params"]) for s in steps), f"step {i + 1}"
        assert torch.equal(steps[0]["params"], steps[0]["global"])
    assert not torch.equal(sharded[0]["steps"][3]["params"], sharded[2]["steps"][3]["params"]), "then rounds"


def _close_at_every_step(mine: list, theirs: list, atol: float, steps: int = 16) -> None:
    assert len(mine) == len(theirs) == steps
    for i, (a, b) in enumerate(zip(mine, theirs, strict=True)):
        assert a["phase"] == b["phase"]
        torch.testing.assert_close(a["global"], b["global"], rtol=0, atol=atol, msg=f"step {i + 1}")
        torch.testing.assert_close(a["params"], b["params"], rtol=0, atol=atol, msg=f"step {i + 1}")


def test_two_groups_of_two_tensor_parallel_ranks_equal_two_level_diloco_at_every_step(tensor_parallel, tp_references):
    """2 x (S=1, T=2): column-wise, row-wise, column-wise layers inside each group; as DiLoCo with 2 groups of 1
    (the two ranks of a tensor-parallel block read the same batches, the groups' batches as DiLoCo's ranks')."""
    sharded, dense = tensor_parallel["records"]["sharded-tp-h2"], tp_references["records"]["diloco-h2-g1"]
    assert "2 replica groups of 1 FSDP2 shards x 2 tensor-parallel ranks" in tensor_parallel["output"]
    assert sharded[0]["placements"][0].endswith("Shard(dim=0))"), "column-wise"
    assert sharded[0]["placements"][3].endswith("Replicate())"), "the row-wise layer's bias, whole on both ranks"
    for rank in range(4):
        assert sharded[rank]["batches"] == dense[rank // 2]["batches"]
        _close_at_every_step(sharded[rank]["steps"], dense[rank // 2]["steps"], 1e-5)
    assert not torch.equal(sharded[0]["steps"][0]["params"], sharded[2]["steps"][0]["params"])
    assert (sharded[0]["steps"][-1]["global"] - sharded[0]["steps"][0]["global"]).abs().max() > 1e-2


def test_tensor_parallelism_without_fsdp2_equals_two_level_diloco_at_every_step(tensor_parallel, tp_references):
    """2 x (S=1, T=2) with no ``fully_shard``: each parameter a DTensor on the group's 1-D tensor-parallel mesh."""
    sharded, dense = tensor_parallel["records"]["sharded-tp-only-h2"], tp_references["records"]["diloco-h2-g1"]
    assert sharded[0]["placements"][0] == "(Shard(dim=0),)"
    for rank in range(4):
        _close_at_every_step(sharded[rank]["steps"], dense[rank // 2]["steps"], 1e-5)


def test_fsdp2_over_tensor_parallelism_in_one_group_equals_diloco_over_its_ranks(tensor_parallel, tp_references):
    """1 x (S=2, T=2): each parameter a DTensor on the group's 2-D mesh (FSDP2's shard strided over the column-wise
    one), as DiLoCo with one group of 2 ranks."""
    sharded, dense = tensor_parallel["records"]["sharded-tp-1x2x2"], tp_references["records"]["diloco-h2-g2"]
    assert "_StridedShard(dim=0, sf=2), Shard(dim=0)" in sharded[0]["placements"][0]
    for rank in range(4):
        _close_at_every_step(sharded[rank]["steps"], dense[rank // 2]["steps"], 1e-5)


def test_a_tensor_parallel_shard_that_is_not_finite_skips_the_outer_step_on_every_rank(tensor_parallel):
    """Rank 1 is the second tensor-parallel rank of group 0: the vote spans both of the group's mesh dimensions."""
    ranks = tensor_parallel["records"]["sharded-tp-h2-nan4"]
    assert [rank["skipped"] for rank in ranks] == [1, 1, 1, 1]
    for rank in ranks:
        torch.testing.assert_close(rank["steps"][3]["global"], rank["steps"][1]["global"], rtol=0, atol=0)
        torch.testing.assert_close(rank["final"], ranks[0]["final"], rtol=0, atol=0)


def test_a_module_without_tensor_parallelism_under_tensor_parallel_size_2_is_refused(tensor_parallel):
    """FSDP2 alone shards over each rank's 1-rank data-parallel mesh: nothing would average over the group."""
    errors = [rank.get("error") for rank in tensor_parallel["records"]["sharded-tp-fsdp-only"]]
    assert all(e is not None and "not be averaged over the group's other ranks" in e for e in errors), errors
    assert "own 2-D mesh `self.device_mesh['data_parallel', 'tensor_parallel']`" in errors[0]
    assert "(ranks [0, 1]), got a 1-D mesh over ranks [0]" in errors[0]
    assert "(ranks [2, 3]), got a 1-D mesh over ranks [3]" in errors[3]
    assert "\n" not in errors[0]


def test_a_tensor_parallel_checkpoint_resumes_bitwise_and_on_other_layouts(tp_checkpoints, tp_resharded):
    """Saved two steps into a round of 3: resumed on 2 x (1, 2) bitwise; on 2 x (1, 1) (2 processes) and on
    2 x (2, 1) with the same weights, groups' own shards and step."""
    records = tp_checkpoints["records"]
    full = records["sharded-tp-h3"]
    saved = full[0]["steps"][7]
    assert saved["phase"] == 2
    assert not torch.equal(saved["params"], saved["global"]), "mid-round: the model is not theta_global"
    for rank in range(4):
        resumed = records["sharded-tp-h3+sharded-tp-h3"][rank]
        assert resumed["start"]["step"] == 8
        torch.testing.assert_close(resumed["start"]["params"], full[rank]["steps"][7]["params"], rtol=0, atol=0)
        for i, (mine, theirs) in enumerate(zip(resumed["steps"], full[rank]["steps"][8:], strict=True)):
            assert mine["phase"] == theirs["phase"]
            torch.testing.assert_close(mine["params"], theirs["params"], rtol=0, atol=0, msg=f"step {i + 9}")
            torch.testing.assert_close(mine["global"], theirs["global"], rtol=0, atol=0, msg=f"step {i + 9}")
    two_by_one = tp_resharded["records"]["sharded-tp-h3-2x1+sharded-tp-h3"]
    other = [(rank, rank["rank"]) for rank in two_by_one]
    other += [(rank, rank["rank"] // 2) for rank in records["sharded-h3+sharded-tp-h3"]]
    assert len(other) == 6
    for rank, group in other:
        start = rank["start"]
        assert (start["step"], start["phase"]) == (8, 2)
        torch.testing.assert_close(start["global"], saved["global"], rtol=0, atol=0)
        torch.testing.assert_close(start["params"], full[2 * group]["steps"][7]["params"], rtol=0, atol=0)
    for rank, dense in enumerate(two_by_one):  # the same batches: the run goes on as the tensor-parallel one
        for i, (mine, theirs) in enumerate(zip(dense["steps"], full[2 * rank]["steps"][8:], strict=True)):
            torch.testing.assert_close(mine["params"], theirs["params"], rtol=0, atol=1e-5, msg=f"step {i + 9}")


def test_a_checkpoint_without_tensor_parallelism_resumes_on_tensor_parallel_groups(checkpoints, tp_from_plain):
    """2 x (2, 1) saved one step into a round of 3, resumed on 2 x (1, 2): the same weights, groups' shards, step."""
    full = checkpoints["records"]["sharded-h3"]
    for rank in tp_from_plain["records"]["sharded-tp-h3+sharded-h3"]:
        start = rank["start"]
        assert (start["step"], start["phase"]) == (4, 1)
        torch.testing.assert_close(start["global"], full[0]["steps"][3]["global"], rtol=0, atol=0)
        group = rank["rank"] // 2
        torch.testing.assert_close(start["params"], full[2 * group]["steps"][3]["params"], rtol=0, atol=0)


# ----------------------------------------------------------------------------------------------------------------
# In this process: the registry and the refusals
# ----------------------------------------------------------------------------------------------------------------
def test_registered_by_name():
    assert "diloco_sharded" in StrategyRegistry
    assert isinstance(StrategyRegistry.get("diloco_sharded"), ShardedDiLoCo)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"replica_group": None}, 'Expected `replica_group` to be "node" (the ranks of a node) or an integer >= 1'),
        ({"replica_group": 0}, "an integer >= 1 (ranks per group), got 0."),
        ({"tensor_parallel_size": 0}, "Expected `tensor_parallel_size` to be 'auto' (1) or an integer >= 1"),
        ({"tensor_parallel_size": True}, "the module's tensor parallelism spans), got True."),
        ({"replica_group": 4, "tensor_parallel_size": 3}, "Expected `tensor_parallel_size` to divide the 4 ranks"),
        ({"replica_group": 4, "tensor_parallel_size": 2, "data_parallel_size": 4}, "'auto' or 2 (the 4 ranks"),
        ({"data_parallel_size": "all"}, "Expected `data_parallel_size` to be 'auto' or an integer >= 1"),
        (
            {"tensor_parallel_size": 2, "fault_tolerance": TorchFT(lighthouse="http://h:1", replica_group_id=0)},
            "with `fault_tolerance`",
        ),
        ({"save_distributed_checkpoint": False}, "Expected `save_distributed_checkpoint=True`"),
        ({"compressor": PowerSGD(rank=2)}, "got PowerSGD, which needs whole matrices."),
        ({"sync_every": 0}, "`sync_every`"),
        ({"sync_every": 4, "fragments": 3}, "Expected `fragments` to be an integer >= 1 that divides"),
        ({"merge": "eager"}, "Expected `overlap_steps` >= 1 with `merge`"),
        ({"sigterm_check": "never"}, "sigterm_check"),
        ({"offload": "yes"}, "offload"),
    ],
)
def test_bad_arguments_are_refused_in_one_line(kwargs, message):
    with pytest.raises(MisconfigurationException) as error:
        ShardedDiLoCo(**kwargs)
    text = str(error.value)
    assert message in text
    assert "\n" not in text


def test_element_wise_compressors_and_the_outer_optimizer_are_taken():
    strategy = ShardedDiLoCo(
        sync_every=4,
        compressor=MinMax(bits=8),
        outer_optimizer=partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True),
        replica_group=2,
        fragments=2,
        overlap_steps=1,
        merge="eager",
    )
    assert strategy.outer_state.exchange.compressor is not None
    assert (strategy.sync_every, strategy.fragments, strategy.overlap_steps, strategy.merge) == (4, 2, 1, "eager")


def test_the_recipe_builds_a_sharded_gpt_with_the_papers_outer_optimizer(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    recipe = os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes", "lm_diloco_sharded.yaml"
    )
    cli = GradcompCLI(args=["--config", recipe, "--trainer.accelerator", "cpu", "--trainer.devices", "1"], run=False)
    strategy = cli.trainer.strategy
    assert isinstance(strategy, ShardedDiLoCo)
    assert (strategy.sync_every, strategy.replica_group) == ("auto", 2)
    assert isinstance(cli.model, ShardedGPTLanguageModel)
    outer = strategy.outer_state.outer_optimizer([torch.zeros(2, requires_grad=True)])
    group = outer.param_groups[0]
    assert (type(outer), group["lr"], group["momentum"], group["nesterov"]) == (torch.optim.SGD, 0.7, 0.9, True)


def test_a_backward_that_leaves_every_gradient_none_is_refused():
    """Trap 1's symptom (FSDP2 keeps the reduced gradient to itself): the inner step would silently do nothing."""
    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    named = [("a", a), ("b", b)]
    with pytest.raises(MisconfigurationException, match="after backward `a` has no gradient \\(2 parameters in all\\)"):
        checking_gradients(lambda: "loss", named)()

    def backward_of_a() -> str:
        a.grad = torch.ones(2)
        return "loss"

    assert checking_gradients(backward_of_a, named)() == "loss", "an unused parameter is the module's business"
