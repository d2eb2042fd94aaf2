"""The meshes and process groups of DiLoCo over FSDP2-sharded replica groups, and the checks that keep them right.

DiLoCo (Douillard et al. 2023, arXiv 2311.08105) with each worker a replica group of ``S`` processes that shard the
model with FSDP2, as INTELLECT-1 (Jaghouar et al. 2024, arXiv 2412.01152) and torchft run it: the inner steps run
FSDP2 on the group's own 1-D mesh, the outer state is each rank's local shards, and the pseudo-gradient is averaged
over the ranks that hold the same shard in every group. The device mesh is ``("diloco", "data_parallel",
"tensor_parallel")`` = ``(G, S, T)``: ``mesh["data_parallel", "tensor_parallel"]`` is the group's own (FSDP2 over
``S``, the module's tensor parallelism over ``T``), ``mesh["diloco"]`` the same-shard ranks of every group.

Two traps are avoided here. torch's native HSDP cannot skip its cross-group reduction on inner steps:
``set_requires_all_reduce(False)`` on a 2-D mesh leaves ``.grad`` as ``None`` (FSDP2 keeps the reduce-scattered
gradient in a private buffer), so inner steps would silently do nothing; :func:`check_sharded_parameters` refuses any
parameter not on a mesh of the group's ranks, and :func:`checking_gradients` any trained parameter left without a
gradient. And every rank reads its own part of the data (the strategy's sampler), not its part of its group's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from lightning_gradcomp.compressors.base import Compressor
from lightning_gradcomp.diloco.round import split_fragments

__all__ = [
    "GROUP_DIMS",
    "announce",
    "broadcast_from_first_group",
    "build_mesh",
    "check_refused",
    "check_sharded_parameters",
    "check_whole_matrix",
    "checking_gradients",
    "data_parallel_of",
    "global_fragments",
    "local_shards",
    "replica_process_group",
    "sharded_group_size",
]

#: the mesh's dimensions: replica groups (DiLoCo's workers), FSDP2 inside a group, tensor parallelism inside a group
GROUP_DIMS = ("diloco", "data_parallel", "tensor_parallel")
_ACCEPTED = '"node" (the ranks of a node) or an integer >= 1 (ranks per group)'
#: compressors that need whole matrices (a low-rank factorization, a learned autoencoder): on a shard they would
#: compress a different operator than DiLoCo's, so they are refused rather than silently changed
_WHOLE_MATRIX = ("PowerSGD", "LGC", "LGCAllReduce")


def _positive(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def sharded_group_size(replica_group: Any, world_size: int, num_nodes: int, fault_tolerance: bool = False) -> int:
    """Ranks per replica group ``S``: the processes of a node for ``"node"``, else ``replica_group``.

    Raises:
        MisconfigurationException: If ``replica_group`` is neither, ``S`` does not divide ``world_size``, or, with
            ``fault_tolerance``, the group is not the whole job.
    """
    if not (replica_group == "node" or _positive(replica_group)):
        raise MisconfigurationException(f"Expected `replica_group` to be {_ACCEPTED}, got {replica_group!r}.")
    size = world_size // max(num_nodes, 1) if replica_group == "node" else int(replica_group)
    if fault_tolerance and size != world_size:
        raise MisconfigurationException(
            f"Expected `replica_group` to be 'node' or {world_size} with `fault_tolerance`: each Lightning job is one"
            f" replica group of FSDP2 shards (here {world_size} processes on {num_nodes} nodes), got {replica_group!r}."
        )
    if size < 1 or world_size % size:
        raise MisconfigurationException(
            f"Expected `replica_group` to divide the {world_size} processes into equal groups, got {size} ranks per"
            " group."
        )
    return size


def check_whole_matrix(compressor: Compressor | None) -> None:
    """Refuse a compressor that needs whole matrices: each rank holds a shard of every parameter."""
    if compressor is not None and type(compressor).__name__ in _WHOLE_MATRIX:
        raise MisconfigurationException(
            "Expected `compressor` to be element- or block-wise (e.g. MinMax, SparseLoCo, TopK, QSGD) or None: each"
            f" rank compresses its own shard with no all-gather, got {type(compressor).__name__}, which needs whole"
            " matrices."
        )


def data_parallel_of(group_size: int, data_parallel_size: Any, tensor_parallel_size: int) -> int:
    """FSDP2's shards ``S`` of a group of ``group_size = S * T`` ranks.

    Raises:
        MisconfigurationException: If ``tensor_parallel_size`` does not divide the group, or ``data_parallel_size``
            is neither ``"auto"`` nor the quotient.
    """
    if group_size % tensor_parallel_size:
        raise MisconfigurationException(
            f"Expected `tensor_parallel_size` to divide the {group_size} ranks of a replica group (`replica_group` ="
            f" data_parallel_size x tensor_parallel_size), got {tensor_parallel_size}."
        )
    size = group_size // tensor_parallel_size
    if data_parallel_size not in ("auto", size) or isinstance(data_parallel_size, bool):
        raise MisconfigurationException(
            f"Expected `data_parallel_size` to be 'auto' or {size} (the {group_size} ranks of a replica group over"
            f" tensor_parallel_size {tensor_parallel_size}), got {data_parallel_size!r}."
        )
    return size


def build_mesh(device_type: str, groups: int, size: int, tensor_parallel: int = 1) -> DeviceMesh:
    """The ``(G, S, T)`` mesh of :data:`GROUP_DIMS` (a collective: every rank makes every group, in order).

    Ranks ``g*S*T .. (g+1)*S*T-1`` are group ``g``: Lightning numbers a node's ranks consecutively.
    """
    return init_device_mesh(device_type, (groups, size, tensor_parallel), mesh_dim_names=GROUP_DIMS)


def replica_process_group(mesh: DeviceMesh) -> Any:
    """The process group of this rank's whole replica group (every rank makes every group's, in the same order).

    With ``T = 1`` it is the group's 1-D ``data_parallel`` mesh's own; otherwise the group spans two mesh dimensions,
    whose mesh has no single process group.
    """
    if mesh.size(2) == 1:
        return mesh["data_parallel"].get_group()
    mine = None
    for ranks in mesh.mesh.reshape(mesh.size(0), -1).tolist():
        created = dist.new_group(ranks=ranks)
        if dist.get_rank() in ranks:
            mine = created
    return mine


def check_sharded_parameters(named: Sequence[tuple[str, Tensor]], group_mesh: DeviceMesh) -> None:
    """Refuse a trained parameter that is not a DTensor on a mesh of exactly the group's ranks, in one line.

    The group's own mesh is ``data_parallel`` (FSDP2), ``tensor_parallel`` or both. A plain tensor would get no
    in-group gradient average (the group's replicas drift apart); one on a mesh over fewer ranks (FSDP2 alone beside
    tensor parallelism) is not synchronized over the others; one on another mesh (a 2-D HSDP mesh, or one spanning
    several groups) would be reduced across groups at every inner step, or with ``set_requires_all_reduce(False)``
    keep no ``.grad`` at all; one on a mesh of other dimensions has no place in the checkpoint's layout.
    """
    ranks = sorted(group_mesh.mesh.flatten().tolist())
    own = "`self.device_mesh['data_parallel']`"
    if group_mesh.ndim > 1:  # the module's tensor parallelism first, FSDP2 over it
        own = "`self.device_mesh['data_parallel', 'tensor_parallel']` (parallelize_module, then fully_shard)"
    for name, p in named:
        if not isinstance(p, DTensor):
            raise MisconfigurationException(
                f"ShardedDiLoCo: expected every trained parameter sharded by `fully_shard(...,"
                f" mesh=self.device_mesh['data_parallel'])` in `configure_model`, got `{name}` as a plain tensor."
            )
        mesh = p.device_mesh
        theirs, names = sorted(mesh.mesh.flatten().tolist()), mesh.mesh_dim_names or ()
        if theirs != ranks or not set(names) <= set(GROUP_DIMS[1:]):
            if set(theirs) < set(ranks):
                why = "its gradient would not be averaged over the group's other ranks"
            elif theirs == ranks:  # the checkpoint lays the outer state out on the strategy's own dimensions
                why = f"its dimensions {names} are not the strategy's {GROUP_DIMS[1:]}"
            else:
                why = (
                    "native HSDP reduces across groups at every step, and with set_requires_all_reduce(False) leaves"
                    " `.grad` None"
                )
            raise MisconfigurationException(
                f"ShardedDiLoCo: expected `{name}` sharded on the replica group's own {group_mesh.ndim}-D mesh"
                f" {own} (ranks {ranks}), got a {mesh.ndim}-D mesh over ranks {theirs}: {why}."
            )


def local_shards(params: Sequence[Tensor]) -> list[Tensor]:
    """Each parameter's local shard, sharing storage with it (what the round reads and writes in place).

    Detached: ``to_local()`` is a view made by a custom autograd function, and autograd forbids reading such a view
    in grad mode once it was written in place (the round writes theta_global into it, then checks it is finite).
    """
    return [(p.to_local() if isinstance(p, DTensor) else p).detach() for p in params]


def global_fragments(params: Sequence[Tensor], fragments: int) -> list[list[int]]:
    """Streaming DiLoCo's fragments cut by the whole parameters' sizes, the same on every rank and as ``DiLoCo``'s.

    The round would cut them by the local shards' sizes, which differ between the ranks of a group when a
    parameter's rows do not divide evenly.
    """
    return split_fragments([p.numel() for p in params], fragments)


def broadcast_from_first_group(shards: Sequence[Tensor], buffers: Sequence[Tensor], peers: Any) -> None:
    """Start every group from group 0's parameters (shard by shard) and every rank from rank 0's buffers.

    What DDP's wrapper does at construction: FSDP2 keeps each rank's own initialization of its shard, so groups
    seeded differently would start DiLoCo from different theta_global.
    """
    source = dist.get_global_rank(peers, 0)
    with torch.no_grad():
        for t in shards:
            dist.broadcast(t, src=source, group=peers)
        for b in buffers:
            dist.broadcast(b, src=0)


def checking_gradients(closure: Callable[[], Any], named: Sequence[tuple[str, Tensor]]) -> Callable[[], Any]:
    """``closure`` (forward and backward), then refuse a backward that left every trained parameter without ``.grad``.

    FSDP2 on an HSDP mesh with ``set_requires_all_reduce(False)`` (or with gradient sync off) keeps the reduced
    gradient in its own buffers: the inner step would silently do nothing. One unused parameter without a gradient is
    a module's own business (the inner optimizer skips it).
    """

    def run() -> Any:
        output = closure()
        missing = [name for name, p in named if p.grad is None]
        if missing and len(missing) == len(named):
            raise MisconfigurationException(
                f"ShardedDiLoCo: after backward `{missing[0]}` has no gradient ({len(missing)} parameters in all):"
                " FSDP2 must run on `self.device_mesh['data_parallel']` with its cross-group reduction left on."
            )
        return output

    return run


def named_trained(module: nn.Module) -> list[tuple[str, Tensor]]:
    """The module's trained parameters with their names (FSDP2 adds no prefix)."""
    return [(n, p) for n, p in module.named_parameters() if p.requires_grad]


def check_refused(
    replica_group: Any,
    fault_tolerance: Any,
    compressor: Any,
    sizes: tuple[Any, Any],
    distributed: Any,
) -> None:
    """Refuse, in one line each, what ``ShardedDiLoCo`` does not do; ``sizes``: ``(data_parallel, tensor_parallel)``."""
    data_parallel_size, tensor_parallel_size = sizes
    if not (replica_group == "node" or _positive(replica_group)):
        raise MisconfigurationException(
            f'Expected `replica_group` to be "node" (the ranks of a node) or an integer >= 1 (ranks per group), got'
            f" {replica_group!r}."
        )
    if fault_tolerance is not None and compressor is not None:
        raise MisconfigurationException(
            "Expected `compressor=None` with `fault_tolerance`: a compressed outer exchange between fault-tolerant"
            f" replica groups of several processes is not supported, got {type(compressor).__name__}."
        )
    if tensor_parallel_size != "auto" and not _positive(tensor_parallel_size):
        raise MisconfigurationException(
            "Expected `tensor_parallel_size` to be 'auto' (1) or an integer >= 1 (the ranks of a replica group that"
            f" the module's tensor parallelism spans), got {tensor_parallel_size!r}."
        )
    if fault_tolerance is not None and tensor_parallel_size not in ("auto", 1):
        raise MisconfigurationException(
            "Expected `tensor_parallel_size` to be 'auto' or 1 with `fault_tolerance`: torchft's healing of groups"
            f" with tensor parallelism is not supported, got {tensor_parallel_size!r}."
        )
    if data_parallel_size != "auto" and not _positive(data_parallel_size):
        raise MisconfigurationException(
            f"Expected `data_parallel_size` to be 'auto' or an integer >= 1 (FSDP2's shards in a replica group), got"
            f" {data_parallel_size!r}."
        )
    if _positive(replica_group):  # an integer: the three sizes known before the processes start
        tensor = 1 if tensor_parallel_size == "auto" else tensor_parallel_size
        data_parallel_of(replica_group, data_parallel_size, tensor)
    if distributed is not True:
        raise MisconfigurationException(
            "Expected `save_distributed_checkpoint=True`: the outer state is saved sharded in the distributed"
            f" checkpoint folder, got {distributed!r}."
        )


def announce(strategy: Any, numel: int, notes: Sequence[str | None]) -> None:
    """The line logged once set up (what is synced, how often, over which groups), then the preflight warnings."""
    rank_zero_info(
        f"ShardedDiLoCo: {numel:,} parameters synced every {strategy.sync_every} optimizer steps;"
        f" {strategy.outer_state.membership.describe(strategy.world_size)}."
    )
    for line in notes:
        if line is not None:
            rank_zero_warn(line)
