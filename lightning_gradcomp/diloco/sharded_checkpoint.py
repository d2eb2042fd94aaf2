"""``ShardedDiLoCo``'s training state inside Lightning's distributed-checkpoint folder, re-shardable.

DiLoCo's state (Douillard et al. 2023, arXiv 2311.08105, Algorithm 1) has a part shared by every replica group
(theta_global, the outer optimizer's state, the phase) and a part each group holds on its own (its parameters and inner
optimizer state in the middle of a round). With FSDP2 inside the groups both are sharded, and both go into the
folder's ``.distcp`` files as DTensors, so that torch's distributed checkpoint writes each element once and reads it
back on another number of shards:

- the weights (``state_dict``) are theta_global, laid out as the parameters: one copy, whatever the number of groups;
- the outer optimizer's state, ``diloco_sharded/outer/I.KEY``, as DTensors ``(Replicate() over groups, the
  parameter's placement inside)``: one copy;
- each group's own shards and inner optimizer state, ``diloco_sharded/local/NAME`` and ``inner/NAME.KEY``, stacked
  over the groups (global shape ``(G, *shape)``, ``Shard(0)`` over groups): they resume exactly on any number of
  shards per group with the same number of groups;
- the rest (phase, counters, the outer optimizer's settings) in ``meta.pt`` with Lightning's own keys, and each rank's
  exchange state (residuals, a contribution in flight) in a file of its own, read back on the same layout only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import lightning.pytorch as pl
import torch
import torch.distributed.checkpoint as dcp
from lightning.fabric.strategies.model_parallel import _METADATA_FILENAME
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard
from torch.optim import Optimizer

from lightning_gradcomp.diloco.checkpoint import restart_from_global
from lightning_gradcomp.diloco.round import Round, floating_point
from lightning_gradcomp.diloco.sharded_mesh import local_shards


class ShardedStrategy(Protocol):
    """What this module reads of the strategy (``ShardedDiLoCo``): its mesh, groups, optimizers and ranks."""

    groups: int
    group_size: int
    tensor_parallel: int

    @property
    def global_rank(self) -> int: ...  # noqa: D102

    @property
    def device_mesh(self) -> DeviceMesh: ...  # noqa: D102

    @property
    def lightning_module(self) -> pl.LightningModule | None: ...  # noqa: D102

    @property
    def optimizers(self) -> list[Optimizer]: ...  # noqa: D102

    @property
    def root_device(self) -> torch.device: ...  # noqa: D102

    def broadcast(self, obj: Any, src: int = 0) -> Any: ...  # noqa: D102


__all__ = ["SECTION", "ShardedCheckpoints"]

#: the key of the state in the checkpoint (in ``meta.pt``) and of its tensors in the ``.distcp`` files
SECTION = "diloco_sharded"


def _contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def _stacked(local: Tensor, mesh: DeviceMesh, p: DTensor) -> DTensor:
    """``local`` (this rank's shard of a group's own tensor laid out as ``p``) as one row of ``(G, *p.shape)``."""
    full = (mesh.size(0), *p.shape)
    row = local.unsqueeze(0)
    placed = (Shard(0), *_shifted(p.placements))
    return DTensor.from_local(row, mesh, placed, shape=torch.Size(full), stride=_contiguous_stride(full))


def _shifted(placements: Sequence[Placement]) -> list[Placement]:
    """A parameter's placements inside the group, one dimension further in (behind the groups' dimension).

    FSDP2 over tensor parallelism shards a dimension twice, its own shard strided (``_StridedShard``): kept so.
    """
    return [
        _StridedShard(p.dim + 1, split_factor=p.split_factor)
        if isinstance(p, _StridedShard)
        else Shard(p.dim + 1)
        if isinstance(p, Shard)
        else p
        for p in placements
    ]


class ShardedCheckpoints:
    """Writes a :class:`~lightning_gradcomp.diloco.round.Round` over local shards into the DCP folder, and reads it.

    Args:
        round: the strategy's round (attached to this rank's local shards).
    """

    def __init__(self, round: Round) -> None:
        self.round = round
        self._strategy: ShardedStrategy | None = None
        self._named: list[tuple[str, Tensor]] = []
        self._scalars: dict[str, str] = {}  # the inner optimizer's one-element states (its step) and their dtypes

    def setup(self, strategy: ShardedStrategy, named: Sequence[tuple[str, Tensor]]) -> None:
        """Bind to the strategy and its trained parameters (FSDP2's DTensors), once the round is attached."""
        self._strategy, self._named = strategy, list(named)

    def _mesh(self, p: DTensor) -> DeviceMesh:
        """The groups' dimension and ``p``'s own inside the group (FSDP2's, tensor parallelism's or both)."""
        assert self._strategy is not None
        names = ("diloco", *(p.device_mesh.mesh_dim_names or ("data_parallel",)))
        return self._strategy.device_mesh[names]

    def _row(self, row: Tensor) -> DTensor:
        """A group's one-element value (its inner step count) as its row over the groups."""
        assert self._strategy is not None
        mesh = self._strategy.device_mesh
        return DTensor.from_local(row, mesh, (Shard(0), *[Replicate()] * (mesh.ndim - 1)))

    def _dtensor(self, local: Tensor, p: Tensor, over_groups: Placement) -> DTensor:
        assert isinstance(p, DTensor)
        local = local.to(p.to_local().device)
        placements = (over_groups, *p.placements)
        return DTensor.from_local(local, self._mesh(p), placements, shape=p.shape, stride=p.stride())

    # ------------------------------------------------------------------------------------------------------------
    # Saving
    # ------------------------------------------------------------------------------------------------------------
    def with_theta_global(self, state: dict[str, Any]) -> dict[str, Any]:
        """``state`` (the module's sharded state dict) with theta_global and the last sync's buffers as its values."""
        round = self.round
        for i, (name, _) in enumerate(self._named):
            value = state.get(name)
            if isinstance(value, DTensor):
                theta = round.params[i].detach().to(value.to_local().device, copy=True)
                state[name] = DTensor.from_local(
                    theta, value.device_mesh, value.placements, shape=value.shape, stride=value.stride()
                )
        assert self._strategy is not None
        module = self._strategy.lightning_module
        assert module is not None
        floats = {id(b): g for b, g in zip(floating_point(list(module.buffers())), round.weights_of().buffers)}
        for name, b in module.named_buffers():
            if id(b) in floats and name in state:
                state[name] = floats[id(b)].detach().clone().to(state[name].device)
        return state

    def save(self, checkpoint: dict[str, Any], filepath: _PATH, local: list[Tensor] | None) -> None:
        """Write Lightning's distributed-checkpoint folder with the round's state in it (call it on every rank).

        ``local``: this rank's shards and buffers when validation has swapped theta_global in (else the model's).
        Lightning's ``optimizer_states`` (each group's inner state, of which the folder would keep one group's copy)
        are replaced by the per-group stacked tensors.
        """
        strategy = self._strategy
        assert strategy is not None
        path = Path(strategy.broadcast(str(filepath)))
        if path.is_file():
            path.unlink()
        path.mkdir(parents=True, exist_ok=True)
        tensors = self._section(checkpoint, local)
        converted = {"state_dict": checkpoint.pop("state_dict"), SECTION: tensors}
        checkpoint.pop("optimizer_states", None)
        dcp.save(converted, checkpoint_id=path)
        own = self.round.own_state()
        if checkpoint[SECTION]["own_file"]:
            torch.save(own, path / f"{SECTION}.rank{strategy.global_rank}.pt")
        if strategy.global_rank == 0:
            torch.save(checkpoint, path / _METADATA_FILENAME)

    def _section(self, checkpoint: dict[str, Any], local: list[Tensor] | None) -> dict[str, Any]:
        """Put the round's state without its tensors into ``checkpoint``; return its tensors as DTensors."""
        strategy, round = self._strategy, self.round
        assert strategy is not None
        assert round.optimizer is not None
        shared = round.state_dict()
        outer_state = shared["optimizer"]["state"]
        tensors: dict[str, Any] = {"outer": {}, "local": {}, "inner": self._inner_tensors()}
        outer_scalars: dict[int, dict[str, Any]] = {}
        for i, (name, p) in enumerate(self._named):
            assert isinstance(p, DTensor)
            for key, value in outer_state.get(i, {}).items():
                if isinstance(value, Tensor) and value.dim() and value.shape == round.params[i].shape:
                    tensors["outer"][f"{i}.{key}"] = self._dtensor(value, p, Replicate())
                else:
                    outer_scalars.setdefault(i, {})[key] = value
            shard = local[i] if local is not None else p.to_local()
            tensors["local"][name] = _stacked(shard.detach(), self._mesh(p), p)
        del shared["params"]  # theta_global: the weights
        shared["optimizer"] = {"state": outer_scalars, "param_groups": shared["optimizer"]["param_groups"]}
        own = round.own_state()
        checkpoint[SECTION] = {
            "sync_every": round.sync_every,
            "fragments": round.fragments,
            "groups": strategy.groups,
            "group_size": strategy.group_size,
            "tensor_parallel": strategy.tensor_parallel,
            "outer": shared,
            "outer_keys": sorted(tensors["outer"]),
            "inner_keys": sorted(tensors["inner"]),
            "inner_groups": strategy.optimizers[0].state_dict()["param_groups"],
            "inner_scalars": dict(self._scalars),
            "own_file": own["contribution"] is not None or bool(own["exchange"]["residuals"]),
        }
        return tensors

    def _inner_tensors(self) -> dict[str, DTensor]:
        """The inner optimizer's state of this group, stacked over the groups (its step count one row per group)."""
        strategy = self._strategy
        assert strategy is not None
        inner, tensors = strategy.optimizers[0], {}
        self._scalars = {}
        for name, p in self._named:
            assert isinstance(p, DTensor)
            for key, value in inner.state.get(p, {}).items():
                if isinstance(value, DTensor):
                    tensors[f"{name}.{key}"] = _stacked(value.to_local(), self._mesh(p), p)
                elif isinstance(value, Tensor) and value.numel() == 1:
                    self._scalars[key] = str(value.dtype).removeprefix("torch.")
                    row = value.detach().reshape(1).to(p.to_local().device, torch.float64)
                    tensors[f"{name}.{key}"] = self._row(row)
        return tensors

    # ------------------------------------------------------------------------------------------------------------
    # Loading
    # ------------------------------------------------------------------------------------------------------------
    def restore(self, checkpoint: dict[str, Any], path: _PATH) -> None:
        """Resume from a folder written by :meth:`add_to` (the weights are loaded already: theta_global).

        Exactly with the same number of groups (on any number of shards per group, unless an exchange was in flight
        or a compressor's residuals are kept, which need the same layout); otherwise from theta_global.
        """
        section = checkpoint.pop(SECTION, None)
        strategy, round = self._strategy, self.round
        assert strategy is not None
        if section is None:
            round.weights_of().follow()  # a checkpoint of another strategy: its weights become theta_global
            return
        folder = Path(strategy.broadcast(str(path)))
        same_groups = section["groups"] == strategy.groups
        same_layout = same_groups and section["group_size"] == strategy.group_size
        same_layout = same_layout and section.get("tensor_parallel", 1) == strategy.tensor_parallel
        same_schedule = section["sync_every"] == round.sync_every and section["fragments"] == round.fragments
        outer = dict(section["outer"])
        # theta_global: the weights, loaded already into the model's shards
        outer["params"] = [t.detach().clone() for t in local_shards([p for _, p in self._named])]
        outer["optimizer"] = self._outer_optimizer_state(section, folder)
        own = self._own(folder, strategy.global_rank) if same_layout and section["own_file"] else None
        exact = same_schedule and same_groups and (own is not None or not section["own_file"])
        if not exact:
            rank_zero_warn(
                f"ShardedDiLoCo: the checkpoint holds {section['groups']} groups of {section['group_size']} shards"
                f" (H={section['sync_every']}, {section['fragments']} fragments), this run {strategy.groups} of"
                f" {strategy.group_size} (H={round.sync_every}, {round.fragments}): theta_global and the outer state"
                " carry over; every group restarts from theta_global with a fresh inner optimizer."
            )
            restart_from_global(round, outer, not same_schedule, None)
            return
        round.load_state_dict(outer)
        self._load_local(section, folder)
        if own is not None:
            round.load_own_state(own, strategy.root_device)

    def _outer_optimizer_state(self, section: Mapping[str, Any], folder: Path) -> dict[str, Any]:
        """The outer optimizer's state dict, its tensors read into this run's shards."""
        templates = {}
        for key in section["outer_keys"]:
            i = int(key.split(".", 1)[0])
            p = self._named[i][1]
            templates[key] = self._dtensor(torch.empty_like(local_shards([p])[0]), p, Replicate())
        if templates:
            dcp.load({SECTION: {"outer": templates}}, checkpoint_id=folder)
        state: dict[int, dict[str, Any]] = {int(k): dict(v) for k, v in section["outer"]["optimizer"]["state"].items()}
        for key, value in templates.items():
            i, name = key.split(".", 1)
            state.setdefault(int(i), {})[name] = value.to_local()
        return {"state": state, "param_groups": section["outer"]["optimizer"]["param_groups"]}

    def _load_local(self, section: Mapping[str, Any], folder: Path) -> None:
        """This group's shards and inner optimizer state, read into this run's layout."""
        local, inner = {}, {}
        by_name = dict(self._named)
        for name, p in self._named:
            assert isinstance(p, DTensor)
            local[name] = _stacked(torch.empty_like(p.to_local()), self._mesh(p), p)
        for key in section["inner_keys"]:
            name, state_key = key.rsplit(".", 1)
            p = by_name[name]
            assert isinstance(p, DTensor)
            if state_key in section["inner_scalars"]:
                row = torch.empty(1, device=p.to_local().device, dtype=torch.float64)
                inner[key] = self._row(row)
            else:
                inner[key] = _stacked(torch.empty_like(p.to_local()), self._mesh(p), p)
        dcp.load({SECTION: {"local": local, "inner": inner}}, checkpoint_id=folder)
        with torch.no_grad():
            for name, p in self._named:
                local_shards([p])[0].copy_(local[name].to_local()[0])
        self._set_inner_state(section, inner)

    def _set_inner_state(self, section: Mapping[str, Any], inner: Mapping[str, DTensor]) -> None:
        """Load the rows of ``inner`` into the inner optimizer (keyed by its own parameter order)."""
        strategy = self._strategy
        assert strategy is not None
        optimizer = strategy.optimizers[0]
        order = {id(p): i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
        by_name = dict(self._named)
        state: dict[int, dict[str, Any]] = {}
        for key, value in inner.items():
            name, state_key = key.rsplit(".", 1)
            p = by_name[name]
            assert isinstance(p, DTensor)
            row = value.to_local()[0]
            scalar = section["inner_scalars"].get(state_key)
            if scalar is not None:
                loaded: Tensor = row.to("cpu", getattr(torch, scalar))
            else:
                loaded = DTensor.from_local(
                    row.contiguous(), p.device_mesh, p.placements, shape=p.shape, stride=p.stride()
                )
            state.setdefault(order[id(p)], {})[state_key] = loaded
        optimizer.load_state_dict({"state": state, "param_groups": section["inner_groups"]})

    def _own(self, folder: Path, rank: int) -> dict[str, Any] | None:
        """This rank's own exchange state saved with the folder, if its file is there."""
        file = folder / f"{SECTION}.rank{rank}.pt"
        return torch.load(file, map_location="cpu", weights_only=True) if file.exists() else None
