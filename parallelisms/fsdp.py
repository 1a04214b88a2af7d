"""Fully sharded data parallel with FSDP2 (`fully_shard`): parameters, gradients and optimizer
state are sharded over the data-parallel ranks and gathered one unit at a time.

Given a 2-D mesh (replicate, shard) the same call gives HSDP: shards within a group of ranks,
replicas across groups."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


def resharding(mode: str, pipeline_parallel: bool) -> bool:
    """Whether units free their gathered parameters after forward, for fsdp_reshard_after_forward `mode`."""
    return {"always": True, "never": False, "default": not pipeline_parallel}[mode]


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    units: list[nn.Module],
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    reshard_after_forward: str = "default",
    pipeline_parallel: bool = False,
) -> nn.Module:
    """Shard each module of `units` (typically the transformer blocks) as its own unit, then the root.

    reshard_after_forward: "always" frees gathered parameters after forward (least memory, a second
    all-gather in backward); "never" keeps them until backward; "default" is "always" except under
    pipeline parallelism, whose many micro-batches would repeat the all-gathers."""
    reshard = resharding(reshard_after_forward, pipeline_parallel)
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for unit in units:
        fully_shard(unit, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=reshard)
    # The root's own parameters (embeddings, final norm, output) are used last in forward and first
    # in backward, so they are never resharded between the two.
    fully_shard(model, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=False)
    return model
