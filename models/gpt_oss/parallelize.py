"""How gpt-oss is parallelized, in Llama 3's order (models/llama3/parallelize.py explains it):
float8 conversion -> tensor parallel (then expert parallel) -> context parallel -> activation
checkpointing -> compile -> FSDP (the MoE layers' own units first).

What differs from Qwen3-MoE: the attention's projections have biases (the column-wise ones are split with their
heads, the row-wise `wo`'s is added once, after the sum over the ranks), and each rank holds the sink logits of its
own heads (`shard_sink_logits`). The window and the sinks reach context parallelism through the attention
modules' declaration and `sdpa` arguments (components/attention.py); every method honours them.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

from components.config import DTYPES, Config, ConfigError
from components.distributed import ParallelDims
from components.layout_checks import uses_fsdp
from parallelisms.activation_checkpoint import apply_activation_checkpointing
from parallelisms.compile import compile_blocks
from parallelisms.context_parallel import apply_context_parallel, attention_runs_eagerly
from parallelisms.expert_parallel import apply_expert_parallel, moe_tensor_parallel_plan, shard_moe
from parallelisms.float8 import convert_to_float8, gathers_float8
from parallelisms.fsdp import apply_fsdp
from parallelisms.tensor_parallel import apply_tensor_parallel, enable_async_tensor_parallel

ROUTER = "router.gate"
"""Kept out of float8: the router's logits choose the experts, a small matmul where precision matters."""


def tensor_parallel_plan(model: nn.Module, float8_comm: bool) -> dict:
    """Llama 3's plan (Megatron-style TP with sequence parallelism, loss parallel output); every feed-forward is a
    mixture of experts, which routes this rank's sequence shard through whole experts."""
    if float8_comm:
        # The blocks' all-gathers then move float8 rather than bf16 activations.
        from torchao.float8.float8_tensor_parallel import (
            Float8ColwiseParallel as Colwise,
            Float8RowwiseParallel as Rowwise,
            PrepareFloat8ModuleInput as PrepareInput,
        )
    else:
        Colwise, Rowwise, PrepareInput = ColwiseParallel, RowwiseParallel, PrepareModuleInput
    plan = {}
    if model.tok_embeddings is not None:
        plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if model.norm is not None:
        plan["norm"] = SequenceParallel()
    if model.output is not None:
        plan["output"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)
    for name in model.layers:
        prefix = f"layers.{name}"
        plan |= {
            f"{prefix}.attention_norm": SequenceParallel(),
            f"{prefix}.attention": PrepareInput(input_layouts=(Shard(1), None),
                                                desired_input_layouts=(Replicate(), None)),
            f"{prefix}.attention.wq": Colwise(),
            f"{prefix}.attention.wk": Colwise(),
            f"{prefix}.attention.wv": Colwise(),
            f"{prefix}.attention.wo": Rowwise(output_layouts=Shard(1)),
            f"{prefix}.ffn_norm": SequenceParallel(),
            f"{prefix}.feed_forward": moe_tensor_parallel_plan(),
        }
    return plan


def shard_sink_logits(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Each tensor-parallel rank attends with its own heads (the column-wise wq's share) and so needs their sink
    logits only: Shard(0), read with to_local() in the attention's forward, the gradient staying per head."""
    for block in model.layers.values():
        attention = block.attention
        attention.sink_logits = nn.Parameter(distribute_tensor(attention.sink_logits, tp_mesh, [Shard(0)]))


def parallelize_gpt_oss(model: nn.Module, dims: ParallelDims, mesh: DeviceMesh, config: Config,
                        device: torch.device) -> nn.Module:
    fsdp = uses_fsdp(config, dims)
    if config.float8.enable:
        convert_to_float8(model, config.float8.recipe_name, [*config.float8.filter_fqns, ROUTER], device,
                          config.float8.enable_fsdp_float8_all_gather and fsdp,
                          skip_small_layers=config.float8.skip_small_layers)
    if dims.tp > 1:
        args = model.args
        for key, value in (("model.n_heads", args.n_heads), ("model.n_kv_heads", args.n_kv_heads)):
            if value % dims.tp:
                raise ConfigError(f"parallelism.tensor_parallel_degree {dims.tp} must divide {key} ({value})")
        float8_comm = gathers_float8(config.float8, mesh["tp"], device)
        apply_tensor_parallel(model, mesh["tp"], tensor_parallel_plan(model, float8_comm),
                              config.parallelism.sequence_parallel)
        shard_sink_logits(model, mesh["tp"])
        if config.parallelism.enable_async_tensor_parallel:
            enable_async_tensor_parallel(mesh["tp"])
    if dims.ep > 1:
        apply_expert_parallel(model, dims.ep_mesh)
    method = config.parallelism.context_parallel_method
    if dims.cp > 1:
        apply_context_parallel(model, mesh["cp"], config.training.seq_len, method,
                               heads_per_rank=model.args.n_heads // dims.tp,
                               document_masking=config.training.document_masking)
    apply_activation_checkpointing(model.layers, config.activation_checkpoint.mode,
                                   config.activation_checkpoint.selective_ac_option, compiled=config.compile.enable,
                                   ring_attention=dims.cp > 1 and method == "ring")
    if config.compile.enable:
        compile_blocks(model.layers, eager_attention=dims.cp > 1 and attention_runs_eagerly(
            method, config.training.document_masking))
    param_dtype = DTYPES[config.training.mixed_precision_param]
    reduce_dtype = DTYPES[config.training.mixed_precision_reduce]
    # Before the blocks: their FSDP units then leave the MoE layers' parameters to these.
    shard_moe(model, dims, fsdp, param_dtype, reduce_dtype, config.parallelism.fsdp_reshard_after_forward,
              config.parallelism.fsdp_cpu_offload)
    if fsdp:
        apply_fsdp(
            model,
            dims.fsdp_mesh,
            units=list(model.layers.values()),
            param_dtype=param_dtype,
            reduce_dtype=reduce_dtype,
            reshard_after_forward=config.parallelism.fsdp_reshard_after_forward,
            pipeline_parallel=dims.pp > 1,
            cpu_offload=config.parallelism.fsdp_cpu_offload,
        )
    return model
