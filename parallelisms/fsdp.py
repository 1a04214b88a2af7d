"""Fully sharded data parallel with FSDP2 (`fully_shard`): parameters, gradients and optimizer
state are sharded over the data-parallel ranks and gathered one unit at a time.

Given a 2-D mesh (replicate, shard) the same call gives HSDP: shards within a group of ranks,
replicas across groups.

With CPU offload the sharded parameters, their gradients and so the optimizer state live in host
memory; each unit's parameters are copied to the device for its all-gather, and its reduced gradients
back to the host, where the optimizer steps. It trades step time for device memory."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard


def resharding(mode: str, pipeline_parallel: bool) -> bool:
    """Whether units free their gathered parameters after forward, for fsdp_reshard_after_forward `mode`."""
    return {"always": True, "never": False, "default": not pipeline_parallel}[mode]


def offload_policy(cpu_offload: bool, device_type: str) -> OffloadPolicy:
    """Keep shards in host memory (pinned for fast copies to a GPU) when `cpu_offload`, else on the device."""
    return CPUOffloadPolicy(pin_memory=device_type == "cuda") if cpu_offload else OffloadPolicy()


def offload_parameters(model: nn.Module) -> None:
    """Move the parameters of a model sharded with CPU offload to host memory, where FSDP expects
    them, and leave its buffers (RoPE tables, MoE statistics) on the device that reads them. For
    weights initialized on a GPU, where DTensor draws the same random numbers under any layout."""
    device = next(model.parameters()).device
    model.cpu()
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[name] = buffer.to(device)


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    units: list[nn.Module],
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    reshard_after_forward: str = "default",
    pipeline_parallel: bool = False,
    cpu_offload: bool = False,
) -> nn.Module:
    """Shard each module of `units` (typically the transformer blocks) as its own unit, then the root.

    reshard_after_forward: "always" frees gathered parameters after forward (least memory, a second
    all-gather in backward); "never" keeps them until backward; "default" is "always" except under
    pipeline parallelism, whose many micro-batches would repeat the all-gathers.
    cpu_offload: shards, gradients and optimizer state in host memory (see the module docstring)."""
    reshard = resharding(reshard_after_forward, pipeline_parallel)
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    offload = offload_policy(cpu_offload, mesh.device_type)
    for unit in units:
        fully_shard(unit, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=reshard, offload_policy=offload)
    # The root's own parameters (embeddings, final norm, output) are used last in forward and first
    # in backward, so they are never resharded between the two.
    fully_shard(model, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=False, offload_policy=offload)
    return model
