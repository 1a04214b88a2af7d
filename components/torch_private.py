"""torch's private APIs that ingot uses, each here once with the reason: torch 2.11 to 2.13 has no public API that
does the same. A torch release that moves one breaks this file only. (Besides these, ring attention calls aten's
attention operators that return the log-sum-exp, and selective activation checkpointing lists them among the
operators whose outputs it keeps: operators, named where they are used, parallelisms/ring_attention.py and
parallelisms/activation_checkpoint.py.)"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch.distributed._functional_collectives import AsyncCollectiveTensor, all_to_all_single_autograd
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.utils._pytree import tree_map

__all__ = [
    "AsyncCollectiveTensor", "all_gather_autograd", "all_to_all_single_autograd", "checkpoint_wrapper", "tree_map",
    "default_store", "dump_memory_snapshot", "enable_micro_pipeline_tp", "grouped_mm", "has_grouped_mm",
    "in_backward", "record_memory_history", "seed_dtensor_random", "set_group_timeout", "shard_offset",
    "stop_async_checkpoint_process",
]
# Re-exported as they are:
# - all_to_all_single_autograd, AsyncCollectiveTensor: functional collectives, DTensor's own; the differentiable ones
#   torch.compile traces (torch.distributed.nn's are not traced), the tensor they return.
# - checkpoint_wrapper: activation checkpointing as a module wrapper, which FSDP2 and compile wrap in turn;
#   torch.utils.checkpoint has only the function.
# - tree_map: applying a function to every tensor of a nested state dict; torch has no public pytree module.


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """One matmul of token groups with their own weights (mixture-of-experts): torch.nn.functional.grouped_mm where
    torch has it public, else the operator under it."""
    public: Callable | None = getattr(F, "grouped_mm", None)
    return public(a, b, offs=offs) if public is not None else torch._grouped_mm(a, b, offs=offs)


def has_grouped_mm() -> bool:
    return hasattr(F, "grouped_mm") or hasattr(torch, "_grouped_mm")


def shard_offset(tensor: DTensor) -> tuple[int, ...]:
    """Where this rank's shard of `tensor` starts in the whole tensor, per dimension: DTensor says it only
    privately."""
    _, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    return tuple(offset)


def seed_dtensor_random(seed: int, mesh: DeviceMesh) -> None:
    """Seed DTensor's random ops (the initialization of sharded weights) on this rank with `seed`: its RNG tracker
    otherwise copies rank 0's state to every rank, and torch has no public way to give ranks their own (each
    pipeline stage draws its own weights)."""
    torch.distributed.tensor._random.manual_seed(seed, mesh)


def set_group_timeout(group: dist.ProcessGroup, seconds: float) -> None:
    """A process group's collective timeout, changed after it was made: no public setter; this is the one
    torch.distributed uses itself."""
    from datetime import timedelta

    dist.distributed_c10d._set_pg_timeout(timedelta(seconds=seconds), group)


def default_store() -> dist.Store:
    """The store the default process group was built on (torchrun's rendezvous store): no public handle."""
    return dist.distributed_c10d._get_default_store()


def in_backward() -> bool:
    """Whether autograd's engine is running a backward on this thread (activation checkpointing recomputes forwards
    inside it): no public query."""
    return torch._C._current_graph_task_id() != -1


def record_memory_history(enabled: bool) -> None:
    """CUDA's allocator history for memory snapshots: the API PyTorch's memory docs use, private in name."""
    if enabled:
        torch.cuda.memory._record_memory_history(max_entries=100_000)
    else:
        torch.cuda.memory._record_memory_history(enabled=None)


def dump_memory_snapshot(path: str) -> None:
    torch.cuda.memory._dump_snapshot(path)


def enable_micro_pipeline_tp(group_name: str) -> None:
    """Let inductor overlap tensor parallelism's collectives with the matmuls that use them (async TP): an inductor
    setting and CUDA symmetric memory for the group, both private."""
    import torch._inductor.config
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    torch._inductor.config._micro_pipeline_tp = True
    enable_symm_mem_for_group(group_name)


def all_gather_autograd(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Every rank's x concatenated along dim 0, differentiable (the backward reduce-scatters the gradients) and traced
    by torch.compile: the functional collective, all_gather_single_autograd from torch 2.13 (which deprecates the
    older name, all_gather_tensor_autograd, the one 2.11 has)."""
    gather = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd
    return gather(x, 0, group)


def stop_async_checkpoint_process() -> None:
    """End the background process that DCP starts for process-based async saves (checkpoint.async_mode
    async_with_pinned_mem), if one runs. DCP keeps it in a module global and stops it in its __del__, which never
    runs in a process that ends by os._exit as ingot's do (components/run/exit_codes.py): left alone, it dies of
    the closed pipe with an EOFError traceback in a run that went well."""
    from torch.distributed.checkpoint import _async_process_executor as executor

    process, executor._CHECKPOINT_PROCESS = getattr(executor, "_CHECKPOINT_PROCESS", None), None
    if process is not None:
        process.__del__()  # sends the termination request and joins; the collection later finds it stopped
