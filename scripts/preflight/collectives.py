"""The collectives one training step issues, recorded from the dispatcher as they are called, grouped by the
mesh dimension whose process group carries them: FSDP's and pipeline's c10d calls and DTensor's functional
ones alike."""

from __future__ import annotations

import itertools
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional")
SKIPPED = {"wait", "wait_tensor", "barrier", "monitored_barrier", "_wrap_tensor_autograd"}  # these move no data
PUBLIC_NAMES = {
    "_allgather_base": "all_gather_into_tensor", "allgather": "all_gather",
    "allgather_into_tensor_coalesced": "all_gather_into_tensor_coalesced",
    "_reduce_scatter_base": "reduce_scatter_tensor", "allreduce": "all_reduce",
    "allreduce_coalesced": "all_reduce_coalesced", "alltoall_base": "all_to_all_single", "alltoall": "all_to_all",
}
"""c10d's operator names (what FSDP and the pipeline call) by torch.distributed's public name of the same operation,
which DTensor's functional collectives already carry: one row per operation."""


@dataclass
class Collective:
    count: int = 0
    bytes: int = 0
    group_size: int = 0
    ranks: tuple[int, ...] = ()
    """Of the group (this rank's): which nodes the collective spans."""


DATA_PARALLEL = ("dp", "expert_shard", "moe_shard")
"""Names (prefixes) of the dimensions whose groups carry FSDP's and HSDP's collectives."""


def is_data_parallel(label: str) -> bool:
    return label.startswith(DATA_PARALLEL) or label.endswith("=dp")


def group_names(meshes: list[DeviceMesh]) -> dict[tuple[int, ...], str]:
    """The ranks of each named dimension's group (this rank's, sorted), by the first name that has them: the world
    mesh's dimensions, then those ParallelDims.build_mesh made of several (`dp`, `dp_cp`, `dp_shard_cp`, ...); `ep=dp`
    where a group of another dimension is also a data-parallel one (expert parallelism over all the shard ranks);
    then groups over several of the world mesh's dimensions that no name has, by theirs (`dp_shard+tp`: DTensor
    reduces a norm sharded over both at once)."""
    names: dict[tuple[int, ...], list[str]] = {}
    for mesh in meshes:
        for name in mesh.mesh_dim_names:
            names.setdefault(tuple(sorted(dist.get_process_group_ranks(mesh[name].get_group()))), []).append(name)
    named = {ranks: first if is_data_parallel(first) or not any(map(is_data_parallel, rest)) else f"{first}=dp"
             for ranks, (first, *rest) in names.items()}
    return _spans(meshes[0]) | named


def _spans(mesh: DeviceMesh) -> dict[tuple[int, ...], str]:
    """This rank's group along each combination of two or more of `mesh`'s dimensions of more than one rank."""
    dims = [name for name in mesh.mesh_dim_names if mesh[name].size() > 1]
    here = mesh.get_coordinate()
    spans = {}
    for n in range(2, len(dims) + 1):
        for combo in itertools.combinations(dims, n):
            index = tuple(slice(None) if name in combo else here[i] for i, name in enumerate(mesh.mesh_dim_names))
            spans[tuple(sorted(mesh.mesh[index].flatten().tolist()))] = "+".join(combo)
    return spans


def is_wrapper(kind: type) -> bool:
    """A tensor subclass that holds other tensors (DTensor its local shard, torchao's float8 tensors theirs)."""
    return hasattr(kind, "__tensor_flatten__")


def _group(args) -> dist.ProcessGroup | None:
    for arg in args:
        if isinstance(arg, dist.ProcessGroup):
            return arg
        if isinstance(arg, str):
            try:
                return dist.distributed_c10d._resolve_process_group(arg)  # a functional collective's group name
            except (KeyError, RuntimeError, ValueError):
                continue
        if isinstance(arg, torch.ScriptObject):
            try:
                return dist.ProcessGroup.unbox(arg)
            except (AttributeError, RuntimeError):
                continue
    return None


class CollectiveRecorder(TorchDispatchMode):
    """Counts each collective by (operation, mesh dimension), with the bytes of the tensors it sends: the input
    of a gather, a reduction or a send. Waits, barriers and autograd wrappers move no data and are left out.

    An operator on a tensor subclass that holds other tensors (DTensor, torchao's float8 tensors) is handed back to
    it (NotImplemented) rather than called here: torch sets a mode aside while it runs the mode's own handler, so
    the collectives the subclass issues inside the operator would pass unseen (DTensor's implicit redistributions,
    such as a norm's Partial sum made Replicate); handed back, what it runs on the tensors it holds comes here, and
    is counted at their dtype (a float8 tensor's float8 data, not the high-precision dtype it shows)."""

    def __init__(self, meshes: list[DeviceMesh]):
        super().__init__()
        self.names = group_names(meshes)
        self.calls: dict[tuple[str, str], Collective] = defaultdict(Collective)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(map(is_wrapper, types)):
            return NotImplemented
        namespace, op = func.namespace, func._schema.name.split("::")[-1]
        if namespace in NAMESPACES and op not in SKIPPED:
            flat, _ = tree_flatten((args, kwargs or {}))
            group = _group(flat)
            ranks = tuple(sorted(dist.get_process_group_ranks(group))) if group is not None else ()
            dim = self.names.get(ranks, f"group of {len(ranks)}") if ranks else "?"
            sent = _sent(op, flat)
            record = self.calls[(PUBLIC_NAMES.get(op.rstrip("_"), op.rstrip("_")), dim)]
            record.count, record.bytes = record.count + 1, record.bytes + sent
            record.group_size, record.ranks = len(ranks), ranks
        return func(*args, **(kwargs or {}))


def _sent(op: str, flat: list) -> int:
    """The bytes this rank puts in: a gather's or an all-to-all's input (c10d passes the outputs first), a
    reduce-scatter's whole buffer, the tensors of a reduction, broadcast or send."""
    tensors = [t for t in flat if isinstance(t, torch.Tensor)]
    if not tensors:
        return 0
    if any(kind in op for kind in ("allgather", "all_gather", "alltoall", "all_to_all")):
        tensors = tensors[-1:]
    elif "reduce_scatter" in op:
        tensors = [max(tensors, key=torch.Tensor.nbytes.__get__)]
    unique = {id(t): t for t in tensors}.values()
    return sum(t.numel() * t.element_size() for t in unique)
