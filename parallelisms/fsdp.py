"""Fully sharded data parallel with FSDP2 (`fully_shard`): parameters, gradients and optimizer
state are sharded over the data-parallel ranks and gathered one unit at a time.

Given a 2-D mesh (replicate, shard) the same call gives HSDP: shards within a group of ranks,
replicas across groups.

With CPU offload the sharded parameters, their gradients and so the optimizer state live in host
memory; each unit's parameters are copied to the device for its all-gather, and its reduced gradients
back to the host, where the optimizer steps. It trades step time for device memory."""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

logger = logging.getLogger(__name__)


def resharding(mode: str, pipeline_parallel: bool) -> bool:
    """Whether units free their gathered parameters after forward, for fsdp_reshard_after_forward `mode`."""
    return {"always": True, "never": False, "default": not pipeline_parallel}[mode]


def offload_policy(cpu_offload: bool, device_type: str) -> OffloadPolicy:
    """Keep shards in host memory (pinned for fast copies to a GPU) when `cpu_offload`, else on the device."""
    return CPUOffloadPolicy(pin_memory=device_type == "cuda") if cpu_offload else OffloadPolicy()


def initialize_on_device(model: nn.Module, device: torch.device, cpu_offload: bool) -> None:
    """Materialize a sharded model on `device` and draw its weights there (`to_empty`, `init_weights`); with CPU
    offload, then move the parameters to pinned host memory.

    FSDP pins offloaded shards whenever the module's parameters are replaced (FSDPParam.reset_sharded_param,
    which `to_empty` triggers), so without a pause `init_weights` would draw on the CPU: other numbers than the
    same run without offload draws on the GPU through DTensor's layout-independent generator (the CUDA lane
    found first losses 8.7481 against 8.7279). The pause goes through FSDP's private per-parameter flag; where a
    torch release lacks it, the weights are drawn on the CPU and the log says so."""
    params = [param for module in model.modules() if isinstance(module, FSDPModule)
              for group in _param_groups(module) for param in group.fsdp_params] if cpu_offload else []
    if cpu_offload and not params:
        logger.warning("FSDP CPU offload: cannot keep the shards on the device while drawing the initial weights "
                       "(torch's FSDP internals changed): they are drawn on the CPU, unlike a run without offload")
    pinning = [param for param in params if getattr(param, "pin_memory", False)]
    for param in pinning:
        param.pin_memory = False
    try:
        model.to_empty(device=device)
        model.init_weights()
    finally:
        for param in pinning:
            param.pin_memory = True
    if cpu_offload:
        offload_parameters(model)


def _param_groups(module: FSDPModule) -> list:
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)  # torch 2.13; 2.11 has the one group below
    if groups is None:
        groups = [state._fsdp_param_group] if getattr(state, "_fsdp_param_group", None) is not None else []
    return [group for group in groups if hasattr(group, "fsdp_params")]


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
