"""Tensor parallelism with sequence parallelism, through DTensor's `parallelize_module`.

Linear layers are split across the `tp` ranks (column-wise: each rank computes some output
features; row-wise: each rank holds some input features and the partial results are reduced).
Between the split regions, activations stay sharded along the sequence (sequence parallelism), so
norms and residuals also cost 1/tp of the memory. The model's own parallelize.py says which layer
gets which style; the functions here apply such a plan."""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import parallelize_module


def apply_tensor_parallel(module: nn.Module, tp_mesh: DeviceMesh, plan: dict) -> nn.Module:
    """Apply a `{submodule name: ParallelStyle}` plan to `module` over the tp mesh."""
    return parallelize_module(module, tp_mesh, plan)


def enable_async_tensor_parallel(tp_mesh: DeviceMesh) -> None:
    """Let inductor overlap TP's all-gathers/reduce-scatters with the matmuls that use them
    ("micro-pipelining"). It needs CUDA symmetric memory and torch.compile; the caller checks both."""
    import torch._inductor.config
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    torch._inductor.config._micro_pipeline_tp = True
    enable_symm_mem_for_group(tp_mesh.get_group().group_name)
