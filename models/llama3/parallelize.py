"""How Llama 3 is parallelized: which technique is applied to which part of the model, in order.

float8 conversion -> tensor parallel -> context parallel -> activation checkpointing -> compile ->
FSDP. float8 comes first because it swaps nn.Linear modules for Float8Linear ones, and the hooks
that tensor parallelism installs live on the modules. FSDP comes last and wraps what the others
made. A pipeline stage (a model with some modules set to None) goes through the same function.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

from components.attention import qk_norm_tensor_parallel_plan
from components.config import DTYPES, Config, ConfigError
from components.distributed import ParallelDims
from components.layout_checks import uses_fsdp
from parallelisms.activation_checkpoint import apply_activation_checkpointing
from parallelisms.compile import compile_blocks
from parallelisms.context_parallel import apply_context_parallel, attention_runs_eagerly
from parallelisms.float8 import convert_to_float8, gathers_float8
from parallelisms.fsdp import apply_fsdp
from parallelisms.tensor_parallel import apply_tensor_parallel, enable_async_tensor_parallel


def check_tp_fits(model: nn.Module, tp: int) -> None:
    args = model.args
    for key, value in (("model.n_heads", args.n_heads), ("model.n_kv_heads", args.n_kv_heads or args.n_heads)):
        if value % tp:
            raise ConfigError(f"parallelism.tensor_parallel_degree {tp} must divide {key} ({value})")


def tensor_parallel_plan(model: nn.Module, float8_comm: bool) -> dict:
    """Megatron-style TP with sequence parallelism for every module this model (or stage) holds.

    Activations between blocks are sharded along the sequence (Shard(1)); attention and the MLP
    all-gather them, split their heads / hidden units over the ranks (column-wise in, row-wise out)
    and reduce-scatter back to sequence shards. The output layer leaves logits sharded over the
    vocabulary (Shard(-1)) for a loss computed without gathering them (loss parallel). QK-norm's weights
    are replicated, their gradients summed over the ranks (components/attention.py)."""
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
        block = f"layers.{name}"
        plan |= {
            f"{block}.attention_norm": SequenceParallel(),
            f"{block}.attention": PrepareInput(input_layouts=(Shard(1), None),
                                               desired_input_layouts=(Replicate(), None)),
            f"{block}.attention.wq": Colwise(),
            f"{block}.attention.wk": Colwise(),
            f"{block}.attention.wv": Colwise(),
            f"{block}.attention.wo": Rowwise(output_layouts=Shard(1)),
            f"{block}.ffn_norm": SequenceParallel(),
            f"{block}.feed_forward": PrepareInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            f"{block}.feed_forward.w1": Colwise(),
            f"{block}.feed_forward.w2": Rowwise(output_layouts=Shard(1)),
            f"{block}.feed_forward.w3": Colwise(),
        }
        if model.args.qk_norm:
            plan |= qk_norm_tensor_parallel_plan(f"{block}.attention")
    return plan


def parallelize_llama(model: nn.Module, dims: ParallelDims, mesh: DeviceMesh, config: Config,
                      device: torch.device) -> nn.Module:
    if config.float8.enable:
        convert_to_float8(model, config.float8.recipe_name, config.float8.filter_fqns, device,
                          config.float8.enable_fsdp_float8_all_gather and uses_fsdp(config, dims),
                          skip_small_layers=config.float8.skip_small_layers)
    if dims.tp > 1:
        check_tp_fits(model, dims.tp)
        float8_comm = gathers_float8(config.float8, mesh["tp"], device)
        apply_tensor_parallel(model, mesh["tp"], tensor_parallel_plan(model, float8_comm),
                              config.parallelism.sequence_parallel)
        if model.args.tie_embeddings and model.tok_embeddings is not None and model.output is not None:
            # TP gave each module its own DTensor of the tied matrix, both sharded along the vocabulary
            # (dim 0): share one again.
            model.output.weight = model.tok_embeddings.weight
        if config.parallelism.enable_async_tensor_parallel:
            enable_async_tensor_parallel(mesh["tp"])
    if dims.cp > 1:
        apply_context_parallel(model, mesh["cp"], config.training.seq_len, config.parallelism.context_parallel_method,
                               heads_per_rank=model.args.n_heads // dims.tp,
                               document_masking=config.training.document_masking)
    apply_activation_checkpointing(model.layers, config.activation_checkpoint.mode,
                                   config.activation_checkpoint.selective_ac_option, compiled=config.compile.enable,
                                   ring_attention=dims.cp > 1 and config.parallelism.context_parallel_method == "ring")
    if config.compile.enable:
        compile_blocks(model.layers, eager_attention=dims.cp > 1 and attention_runs_eagerly(
            config.parallelism.context_parallel_method, config.training.document_masking))
    if uses_fsdp(config, dims):
        apply_fsdp(
            model,
            dims.fsdp_mesh,
            units=list(model.layers.values()),
            param_dtype=DTYPES[config.training.mixed_precision_param],
            reduce_dtype=DTYPES[config.training.mixed_precision_reduce],
            reshard_after_forward=config.parallelism.fsdp_reshard_after_forward,
            pipeline_parallel=dims.pp > 1,
            cpu_offload=config.parallelism.fsdp_cpu_offload,
        )
    return model
