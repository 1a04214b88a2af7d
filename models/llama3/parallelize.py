"""How Llama 3 is parallelized: the order in which train.py's techniques are applied to it.

Tensor, context and pipeline parallelism, float8, activation checkpointing and compile are applied
here (in that order) as they become available; FSDP always comes last, wrapping what the others made.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from components.config import Config, ConfigError
from components.distributed import ParallelDims
from parallelisms.fsdp import apply_fsdp

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def check_supported(config: Config, dims: ParallelDims) -> None:
    """Name the settings this version cannot apply yet rather than silently ignoring them."""
    unsupported = {
        "parallelism.tensor_parallel_degree": dims.tp > 1,
        "parallelism.pipeline_parallel_degree": dims.pp > 1,
        "parallelism.context_parallel_degree": dims.cp > 1,
        "activation_checkpoint.mode": config.activation_checkpoint.mode != "none",
        "compile.enable": config.compile.enable,
        "float8.enable": config.float8.enable,
        "validation.enable": config.validation.enable,
        "profiling.enable_profiling": config.profiling.enable_profiling,
    }
    named = [key for key, used in unsupported.items() if used]
    if named:
        raise ConfigError(f"not available yet: {', '.join(named)}; leave these at their defaults")


def uses_fsdp(config: Config, dims: ParallelDims) -> bool:
    """FSDP shards over data-parallel ranks; on one rank it still provides bf16 mixed precision."""
    return dims.dp > 1 or config.training.mixed_precision_param != "float32"


def parallelize_llama(model: nn.Module, dims: ParallelDims, mesh: DeviceMesh, config: Config) -> nn.Module:
    check_supported(config, dims)
    if uses_fsdp(config, dims):
        apply_fsdp(
            model,
            dims.fsdp_mesh,
            units=list(model.layers.values()),
            param_dtype=DTYPES[config.training.mixed_precision_param],
            reduce_dtype=DTYPES[config.training.mixed_precision_reduce],
            reshard_after_forward=config.parallelism.fsdp_reshard_after_forward,
            pipeline_parallel=dims.pp > 1,
        )
    return model
