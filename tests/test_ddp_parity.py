"""Whatever Lightning's ``DDPStrategy`` accepts, ``CompressedDDP`` and ``DiLoCo`` accept, or refuse in one line.

Read from the signatures, not from a list written by hand: a constructor argument or a public method that a future
Lightning (or torch, for ``DistributedDataParallel``'s arguments) adds makes these tests fail until it is looked at.
"""

from __future__ import annotations

import inspect
from datetime import timedelta
from typing import Any

import pytest
import torch
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.plugins.precision import DoublePrecision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook, fp16_compress_wrapper
from torch.nn.parallel import DistributedDataParallel
from torch.nn.parallel.distributed import _MixedPrecision

from lightning_gradcomp import CompressedDDP, DiLoCo

STRATEGIES = [CompressedDDP, DiLoCo]


def _parameters(function: Any) -> dict[str, inspect.Parameter]:
    """The named parameters of ``function`` (no ``self``, ``*args`` or ``**kwargs``)."""
    kinds = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    return {n: p for n, p in inspect.signature(function).parameters.items() if n != "self" and p.kind not in kinds}


#: for every argument of DDPStrategy's constructor, a value other than its default (built afresh for each use)
NON_DEFAULT = {
    "accelerator": CPUAccelerator,
    "parallel_devices": lambda: [torch.device("cpu")] * 3,
    "cluster_environment": LightningEnvironment,
    "checkpoint_io": TorchCheckpointIO,
    "precision_plugin": DoublePrecision,
    "process_group_backend": lambda: "gloo",
    "timeout": lambda: timedelta(minutes=7),
    "start_method": lambda: "spawn",
}
#: DDPStrategy's arguments that configure the communication hook both strategies replace: refused unless None
HOOK_ARGUMENTS = {
    "ddp_comm_state": object,
    "ddp_comm_hook": lambda: allreduce_hook,
    "ddp_comm_wrapper": lambda: fp16_compress_wrapper,
    "model_averaging_period": lambda: 4,
}
#: for every argument of DistributedDataParallel's constructor, a value other than its default; names a torch
#: release does not have are skipped
DDP_NON_DEFAULT = {
    "output_device": lambda: 0,
    "dim": lambda: 1,
    "broadcast_buffers": lambda: False,
    "init_sync": lambda: False,
    "process_group": object,
    "bucket_cap_mb": lambda: 5,
    "find_unused_parameters": lambda: True,
    "check_reduction": lambda: True,
    "gradient_as_bucket_view": lambda: True,
    "static_graph": lambda: True,
    "delay_all_reduce_named_params": lambda: [("weight", torch.nn.Parameter(torch.zeros(1)))],
    "param_to_hook_all_reduce": lambda: torch.nn.Parameter(torch.zeros(1)),
    "device_mesh": object,
    "skip_all_reduce_unused_params": lambda: True,
    "bucket_cap_mb_list": lambda: [1, 25],
    "batched_grad_copy": lambda: True,
    "forward_sync_buffers": lambda: False,
}
#: set by Lightning when it wraps the model, and refused by CompressedDDP
DDP_SET_BY_LIGHTNING = {"module", "device_ids"}
#: DistributedDataParallel's arguments that register a communication hook of their own: refused by CompressedDDP
DDP_CONFLICTING = {"mixed_precision": lambda: _MixedPrecision(param_dtype=torch.bfloat16)}


def _same(a: Any, b: Any) -> bool:
    """Equal values, or objects of one type where the type has no equality of its own (a fresh helper object)."""
    if type(a).__eq__ is object.__eq__:
        return type(a) is type(b)
    return bool(a == b)


def _attributes(strategy: DDPStrategy) -> dict[str, Any]:
    """The attributes ``DDPStrategy.__init__`` sets (what a constructor argument can change)."""
    names = vars(DDPStrategy())
    return {name: value for name, value in vars(strategy).items() if name in names}


def test_every_ddp_strategy_argument_is_accounted_for():
    """The control: an argument a future Lightning adds to DDPStrategy fails here until both strategies take it."""
    assert set(_parameters(DDPStrategy.__init__)) == set(NON_DEFAULT) | set(HOOK_ARGUMENTS)
    assert "kwargs" in inspect.signature(DDPStrategy.__init__).parameters  # the keywords DDPStrategy gives DDP


def test_every_ddp_argument_is_accounted_for():
    """The control for torch's ``DistributedDataParallel``: a new argument fails here until it is looked at."""
    known = set(DDP_NON_DEFAULT) | DDP_SET_BY_LIGHTNING | set(DDP_CONFLICTING)
    assert set(_parameters(DistributedDataParallel.__init__)) <= known


@pytest.mark.parametrize("strategy_class", STRATEGIES)
def test_a_ddp_strategy_argument_named_by_a_strategy_keeps_its_default(strategy_class):
    """Arguments a strategy names itself (to refuse them) keep DDPStrategy's default, so that None means unset."""
    own = _parameters(strategy_class.__init__)
    for name, parameter in _parameters(DDPStrategy.__init__).items():
        if name in own:
            assert own[name].default == parameter.default, name
        else:  # passed on through **kwargs: DDPStrategy's default applies
            assert "kwargs" in inspect.signature(strategy_class.__init__).parameters, name


@pytest.mark.parametrize("strategy_class", STRATEGIES)
def test_with_no_arguments_a_strategy_starts_from_ddp_strategys_defaults(strategy_class):
    built, reference = _attributes(strategy_class()), _attributes(DDPStrategy())
    assert set(built) == set(reference)
    different = [name for name in reference if not _same(built[name], reference[name])]
    assert different == []


@pytest.mark.parametrize("strategy_class", STRATEGIES)
@pytest.mark.parametrize("name", sorted(NON_DEFAULT))
def test_a_ddp_strategy_argument_is_forwarded_not_dropped(strategy_class, name):
    value = NON_DEFAULT[name]()
    reference, default = _attributes(DDPStrategy(**{name: value})), _attributes(DDPStrategy())
    changed = [attribute for attribute in reference if not _same(reference[attribute], default[attribute])]
    assert changed, f"`{name}` changes nothing on DDPStrategy: the test's value is its default"  # control
    built = _attributes(strategy_class(**{name: value}))
    for attribute in changed:
        mine, theirs = built[attribute], reference[attribute]
        assert mine is theirs or (type(mine).__eq__ is not object.__eq__ and mine == theirs), (name, attribute)


@pytest.mark.parametrize("strategy_class", STRATEGIES)
@pytest.mark.parametrize("name", sorted(HOOK_ARGUMENTS))
def test_a_hook_argument_is_refused_in_one_line_not_ignored(strategy_class, name):
    with pytest.raises(MisconfigurationException, match=f"`{name}`") as refused:
        strategy_class(**{name: HOOK_ARGUMENTS[name]()})
    assert "\n" not in str(refused.value)
    assert DDPStrategy(**{name: HOOK_ARGUMENTS[name]()}) is not None  # control: DDPStrategy itself takes it
    strategy_class(**{name: None})  # None, what LightningCLI passes for an unset argument, is accepted


def _ddp_arguments() -> list[str]:
    return sorted(n for n in _parameters(DistributedDataParallel.__init__) if n in DDP_NON_DEFAULT)


@pytest.mark.parametrize("name", _ddp_arguments())
def test_a_ddp_argument_reaches_distributed_data_parallel_through_compressed_ddp(name):
    value = DDP_NON_DEFAULT[name]()
    assert DDPStrategy(**{name: value})._ddp_kwargs[name] is value  # control: what DDPStrategy does with it
    assert CompressedDDP(**{name: value})._ddp_kwargs == {name: value}
    assert CompressedDDP(**{name: value})._ddp_kwargs[name] is value


@pytest.mark.parametrize("name", sorted(DDP_SET_BY_LIGHTNING | set(DDP_CONFLICTING)))
def test_a_ddp_argument_that_conflicts_is_refused_by_compressed_ddp_in_one_line(name):
    value = DDP_CONFLICTING.get(name, object)()
    with pytest.raises(MisconfigurationException, match=f"`{name}`") as refused:
        CompressedDDP(**{name: value})
    assert "\n" not in str(refused.value)
    if name in DDP_CONFLICTING:
        CompressedDDP(**{name: None})  # its default, as LightningCLI passes it, is accepted


@pytest.mark.parametrize("name", _ddp_arguments())
def test_diloco_refuses_a_ddp_argument_it_would_ignore_and_takes_its_default(name):
    """DiLoCo does not wrap the model in DDP: DDP's arguments would be ignored, so a value other than the default is
    refused in one line; the default (what LightningCLI passes) is accepted."""
    with pytest.raises(MisconfigurationException, match=f"`{name}`") as refused:
        DiLoCo(**{name: DDP_NON_DEFAULT[name]()})
    assert "\n" not in str(refused.value)
    default = inspect.signature(DistributedDataParallel.__init__).parameters[name].default
    assert DiLoCo(**{name: default})._ddp_kwargs == {}


def _accepts(child: inspect.Signature, parent: inspect.Signature) -> str | None:
    """Why a call that fits ``parent`` may not fit ``child``; ``None``: every such call fits, with the same defaults."""
    P = inspect.Parameter
    child_params = list(child.parameters.values())
    var_positional = any(p.kind == P.VAR_POSITIONAL for p in child_params)
    var_keyword = any(p.kind == P.VAR_KEYWORD for p in child_params)
    positional = [p for p in child_params if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)]
    for i, p in enumerate(parent.parameters.values()):
        if p.kind == P.VAR_POSITIONAL and not var_positional:
            return "takes no *args"
        if p.kind == P.VAR_KEYWORD and not var_keyword:
            return "takes no **kwargs"
        if p.kind in (P.VAR_POSITIONAL, P.VAR_KEYWORD):
            continue
        mine = child.parameters.get(p.name)
        if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD):
            at = positional[i] if i < len(positional) else None
            if at is None and not var_positional:
                return f"no positional parameter {i} (`{p.name}`)"
            if at is not None and at.name != p.name:
                return f"positional parameter {i} is `{at.name}`, not `{p.name}`"
        if mine is None:
            if not var_keyword:
                return f"does not take `{p.name}`"
            continue
        if p.default is not P.empty and mine.default != p.default:
            return f"`{p.name}` defaults to {mine.default!r}, not {p.default!r}"
        if p.default is P.empty and mine.default is not P.empty:
            continue  # optional where the parent requires it: every call still fits
    extra = [
        p.name
        for p in child_params
        if p.name not in parent.parameters and p.default is P.empty and p.kind not in (P.VAR_POSITIONAL, P.VAR_KEYWORD)
    ]
    return f"requires `{extra[0]}` as well" if extra else None


def _public_members(cls: type) -> dict[str, Any]:
    return {name: inspect.getattr_static(cls, name) for name in dir(cls) if not name.startswith("_")}


@pytest.mark.parametrize("strategy_class", STRATEGIES)
def test_every_public_method_and_property_of_ddp_strategy_is_kept_with_a_compatible_signature(strategy_class):
    theirs, mine = _public_members(DDPStrategy), _public_members(strategy_class)
    problems, overridden = [], []
    for name, member in theirs.items():
        if name not in mine:
            problems.append(f"{name}: missing")
            continue
        if mine[name] is member:
            continue  # inherited as it is
        overridden.append(name)
        if type(mine[name]) is not type(member):
            problems.append(f"{name}: a {type(member).__name__} on DDPStrategy, a {type(mine[name]).__name__} here")
        elif callable(getattr(DDPStrategy, name)):
            signatures = (inspect.signature(getattr(cls, name)) for cls in (strategy_class, DDPStrategy))
            why = _accepts(*signatures)
            if why:
                problems.append(f"{name}: {why}")
    assert problems == []
    assert {"setup", "configure_ddp", "teardown"} <= set(overridden)  # control: overrides are compared, not skipped


def test_the_signature_check_finds_an_incompatible_override():
    """The comparison itself can fail: a renamed, a re-defaulted, a dropped and an added required parameter."""

    def parent(self, checkpoint, strict=True): ...
    def renamed(self, state, strict=True): ...
    def redefaulted(self, checkpoint, strict=False): ...
    def dropped(self, checkpoint): ...
    def required(self, checkpoint, strict=True, *, rank): ...
    def widened(self, checkpoint, *args, **kwargs): ...

    reference = inspect.signature(parent)
    for child in (renamed, redefaulted, dropped, required):
        assert _accepts(inspect.signature(child), reference) is not None, child.__name__
    assert _accepts(inspect.signature(widened), reference) is None
    assert _accepts(reference, reference) is None


def test_the_hook_averages_over_the_group_ddp_uses_also_one_given_by_a_device_mesh(tmp_path, in_process_ddp):
    """``device_mesh=`` gives DDP its group; the hook's collectives must run in that group, not in the world."""
    import torch.distributed as dist
    from lightning.pytorch import Callback, Trainer

    from tests.models import TinyNet

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    mesh_group = dist.new_group(ranks=[0])
    assert mesh_group is not dist.group.WORLD  # control: the world's group would not tell the two apart

    class Mesh:
        """A 1-D device mesh as DDP reads one (with one process, torch's own meshes reuse the world's group)."""

        ndim = 1

        def get_group(self, mesh_dim: int = 0) -> dist.ProcessGroup:
            return mesh_group

        def _get_root_mesh(self) -> Mesh:
            return self

    mesh = Mesh()
    seen = {}

    class Record(Callback):
        def on_train_batch_end(self, trainer, *args: Any) -> None:
            strategy = trainer.strategy
            seen["ddp"], seen["strategy"] = strategy.model.process_group, strategy.ddp_process_group
            seen["hook"] = strategy.compression_state.comm.backend._groups[0]

    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        strategy=CompressedDDP(device_mesh=mesh),
        max_steps=1,
        callbacks=[Record()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        default_root_dir=str(tmp_path),
    )
    trainer.fit(TinyNet())
    assert seen["ddp"] is mesh_group
    assert seen["strategy"] is mesh_group
    assert seen["hook"] is mesh_group
