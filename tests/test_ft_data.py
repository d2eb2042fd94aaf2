"""Every replica group of a fault-tolerant DiLoCo run reads its own part of the training data by default."""

import warnings

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.trainer.states import RunningStage
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, TensorDataset

from lightning_gradcomp import DiLoCo, TorchFT
from lightning_gradcomp.ft.data import sampler_split, unsplit_warning
from tests.models import TinyNet

LIGHTHOUSE = "http://127.0.0.1:29510"


def _indices(config, rank, world_size, n=100, epoch=0):
    sampler = DistributedSampler(range(n), shuffle=True, seed=0, **sampler_split(config, rank, world_size))
    sampler.set_epoch(epoch)
    return list(sampler)


@pytest.mark.parametrize("world_size", [1, 2])
def test_two_groups_read_disjoint_parts_that_cover_the_data(world_size):
    # the docs' launch: TorchFT(min_replicas=1, start_replicas=2), REPLICA_GROUP_ID 0 and 1, the same seed
    groups = [TorchFT(lighthouse=LIGHTHOUSE, replica_group_id=g, start_replicas=2) for g in ("0", "1")]
    parts = [set(_indices(c, r, world_size, epoch=3)) for c in groups for r in range(world_size)]
    assert all(len(p) == 100 // (2 * world_size) for p in parts)
    for i, mine in enumerate(parts):
        for theirs in parts[i + 1 :]:
            assert not mine & theirs, "two groups (or ranks) read the same samples"
    assert set().union(*parts) == set(range(100))
    assert sampler_split(groups[1], 1, 2) == {"num_replicas": 4, "rank": 3}


def test_the_split_follows_num_groups_and_leaves_plain_jobs_alone():
    config = TorchFT(lighthouse=LIGHTHOUSE, replica_group_id=2, min_replicas=1, num_groups=3)
    assert (config.groups, config.group_index) == (3, 2)
    assert sampler_split(config, 0, 1) == {"num_replicas": 3, "rank": 2}
    assert sampler_split(None, 1, 2) == {"num_replicas": 2, "rank": 1}
    named = TorchFT(lighthouse=LIGHTHOUSE, replica_group_id="east", start_replicas=2)
    assert named.group_index is None
    assert sampler_split(named, 0, 1) == {"num_replicas": 1, "rank": 0}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_groups": 0}, "Expected `num_groups` to be an integer >= 1 or None, got 0."),
        ({"num_groups": 2, "replica_group_id": "2"}, "Expected `replica_group_id` to be an integer in [0, 2)"),
        ({"num_groups": 2, "replica_group_id": "east"}, "with `num_groups`=2 (the part of the data this group reads)"),
    ],
)
def test_a_group_outside_num_groups_is_refused_in_one_line(kwargs, message):
    with pytest.raises(ValueError, match="Expected") as error:
        TorchFT(**{"lighthouse": LIGHTHOUSE, "replica_group_id": "0", **kwargs})
    assert message in str(error.value)
    assert "\n" not in str(error.value)


def _resolved(config, stage_training=True):
    """The sampler Lightning installs in a plain shuffled loader under DiLoCo(fault_tolerance=config)."""
    trainer = Trainer(accelerator="cpu", devices=1, strategy=DiLoCo(sync_every=4, fault_tolerance=config), logger=False)
    model = TinyNet()
    model._trainer = trainer
    trainer.strategy.connect(model)
    trainer.training = stage_training
    loader = DataLoader(TensorDataset(torch.arange(40)), batch_size=4, shuffle=True)
    mode = RunningStage.TRAINING if stage_training else RunningStage.VALIDATING
    return trainer._data_connector._resolve_sampler(loader, shuffle=stage_training, mode=mode)


def test_lightnings_sampler_splits_training_data_over_the_groups_and_validation_over_the_job():
    samplers = [_resolved(TorchFT(lighthouse=LIGHTHOUSE, replica_group_id=g, start_replicas=2)) for g in (0, 1)]
    assert [(s.num_replicas, s.rank) for s in samplers] == [(2, 0), (2, 1)]
    assert not set(samplers[0]) & set(samplers[1])
    validation = _resolved(TorchFT(lighthouse=LIGHTHOUSE, replica_group_id=1, start_replicas=2), False)
    assert (validation.num_replicas, validation.rank) == (1, 0), "every group validates on the whole set"


class _Stream(IterableDataset):
    def __iter__(self):
        return iter(range(8))


def test_a_loader_that_cannot_be_split_is_named_with_the_way_to_split_it():
    config = TorchFT(lighthouse=LIGHTHOUSE, replica_group_id=1, start_replicas=2)
    line = unsplit_warning(config, DataLoader(_Stream()), 1)
    assert "an IterableDataset" in line
    assert "DistributedSampler(dataset, **trainer.strategy.distributed_sampler_kwargs)" in line
    plain = DataLoader(range(8), shuffle=True)
    assert "`use_distributed_sampler=False`, or a sampler of its own" in unsplit_warning(config, [plain], 1)
    split = DataLoader(range(8), sampler=DistributedSampler(range(8), num_replicas=2, rank=1))
    assert unsplit_warning(config, {"a": split}, 1) is None
    assert "is not an integer in [0, 2)" in unsplit_warning(
        TorchFT(lighthouse=LIGHTHOUSE, replica_group_id="east", start_replicas=2), split, 1
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        alone = TorchFT(lighthouse=LIGHTHOUSE, replica_group_id=0)  # one group: nothing to split
        assert unsplit_warning(alone, DataLoader(_Stream()), 1) is None
