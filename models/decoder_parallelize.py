"""The order in which a decoder family is parallelized, written once for every family: which technique is applied to
which part of the model, in order.

float8 conversion -> tensor parallel (its plan the family's) -> expert parallel -> context parallel -> activation
checkpointing -> compile -> FSDP (the mixture-of-experts layers' units first). float8 comes first because it swaps
nn.Linear modules for Float8Linear ones, and the hooks that tensor parallelism installs live on the modules. FSDP
comes last and wraps what the others made. A pipeline stage (a model with some modules set to None) goes through
the same function.

A family's `parallelize` calls `parallelize_decoder` with what is its own: its tensor-parallel plan and the check
that the degree fits its heads, the modules float8 must leave in high precision, what its plan leaves to do after
tensor parallelism, and its groups of blocks (multi-token prediction depths besides the blocks). A fork that needs
another order copies this function into its folder."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

from components.config import DTYPES, Config, ConfigError
from components.distributed.mesh import ParallelDims
from components.model.layout_checks import uses_fsdp
from components.model.moe_layer import is_moe_layer
from components.training.qk_clip import measures_attention_logits
from parallelisms.activation_checkpoint import apply_activation_checkpointing
from parallelisms.compile import compile_blocks
from parallelisms.context_parallel import apply_context_parallel, attention_runs_eagerly
from parallelisms.expert_parallel import apply_expert_parallel, moe_tensor_parallel_plan, shard_moe
from parallelisms.float8 import convert_to_float8, gathers_float8
from parallelisms.fsdp import apply_fsdp
from parallelisms.tensor_parallel import apply_tensor_parallel, enable_async_tensor_parallel, tensor_parallel_styles


def parallelize_decoder(model: nn.Module, dims: ParallelDims, mesh: DeviceMesh, config: Config, device: torch.device,
                        *, tensor_parallel_plan: Callable[[nn.Module, bool], dict],
                        check_tp_fits: Callable[[nn.Module, int], None] | None = None,
                        high_precision: Sequence[str] = (),
                        after_tensor_parallel: Callable[[nn.Module, DeviceMesh], None] | None = None,
                        block_groups: Sequence[nn.ModuleDict] | None = None) -> nn.Module:
    """Parallelize `model` (a whole decoder or a pipeline stage) as `config` and the mesh say. `block_groups`: the
    ModuleDicts whose blocks are checkpointed, compiled and FSDP units (default: the model's transformer_blocks());
    `check_tp_fits(model, tp)` refuses a degree the model cannot split (default: `tp_divides_heads`)."""
    fsdp = uses_fsdp(config, dims)
    groups = [model.transformer_blocks()] if block_groups is None else list(block_groups)
    p = config.parallelism
    if config.float8.enable:
        convert_to_float8(model, config.float8.recipe_name, [*config.float8.filter_fqns, *high_precision], device,
                          config.float8.enable_fsdp_float8_all_gather and fsdp,
                          skip_small_layers=config.float8.skip_small_layers)
    if dims.tp > 1:
        (check_tp_fits or tp_divides_heads)(model, dims.tp)
        tied = tied_parameters(model)
        plan = tensor_parallel_plan(model, gathers_float8(config.float8, mesh["tp"], device))
        apply_tensor_parallel(model, mesh["tp"], plan, p.sequence_parallel)
        tie_again(tied)
        if after_tensor_parallel is not None:
            after_tensor_parallel(model, mesh["tp"])
        if p.enable_async_tensor_parallel:
            enable_async_tensor_parallel(mesh["tp"])
    if dims.ep > 1:
        apply_expert_parallel(model, dims.ep_mesh)
    if dims.cp > 1:
        apply_context_parallel(model, mesh["cp"], config.training.seq_len, p.context_parallel_method,
                               heads_per_rank=model.args.n_heads // dims.tp,
                               document_masking=config.training.document_masking, mixers=p.context_parallel_mixers)
    for blocks in groups:
        apply_activation_checkpointing(blocks, config.activation_checkpoint.mode,
                                       config.activation_checkpoint.selective_ac_option, compiled=config.compile.enable,
                                       ring_attention=dims.cp > 1 and p.context_parallel_method == "ring")
        if config.compile.enable:
            compile_blocks(blocks, eager_attention=dims.cp > 1 and attention_runs_eagerly(
                p.context_parallel_method, config.training.document_masking, measures_attention_logits(config)))
    param_dtype = DTYPES[config.training.mixed_precision_param]
    reduce_dtype = DTYPES[config.training.mixed_precision_reduce]
    # Before the blocks: their FSDP units then leave the MoE layers' parameters to these.
    shard_moe(model, dims, fsdp, param_dtype, reduce_dtype, p.fsdp_reshard_after_forward, p.fsdp_cpu_offload)
    if fsdp:
        apply_fsdp(model, dims.fsdp_mesh, units=[block for blocks in groups for block in blocks.values()],
                   param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                   reshard_after_forward=p.fsdp_reshard_after_forward, pipeline_parallel=dims.pp > 1,
                   cpu_offload=p.fsdp_cpu_offload)
    return model


def ends_tensor_parallel_plan(model: nn.Module, embedding: str, norm: str, output: str) -> dict:
    """The tensor-parallel plan of a decoder's ends that this model (or pipeline stage) holds, by their names: the
    embedding's output reduce-scattered to sequence shards (Shard(1)), the final norm on those shards, the output
    layer's logits left sharded over the vocabulary (Shard(-1)) for a loss computed without gathering them (loss
    parallel)."""
    plan = {}
    if getattr(model, embedding) is not None:
        plan[embedding] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if getattr(model, norm) is not None:
        plan[norm] = SequenceParallel()
    if getattr(model, output) is not None:
        plan[output] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)
    return plan


def feed_forward_tensor_parallel_plan(prefix: str, feed_forward: nn.Module, float8_comm: bool) -> dict:
    """The plan of the feed-forward at `prefix` (a block's): a mixture of experts routes this rank's sequence shard
    through whole experts (parallelisms/expert_parallel.py); a SwiGLU one gathers the sequence, splits its hidden
    units column-wise in (w1, w3) and row-wise out (w2), and reduce-scatters back to sequence shards."""
    if is_moe_layer(feed_forward):
        return {prefix: moe_tensor_parallel_plan()}
    Colwise, Rowwise, PrepareInput = tensor_parallel_styles(float8_comm)
    return {
        prefix: PrepareInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        f"{prefix}.w1": Colwise(),
        f"{prefix}.w2": Rowwise(output_layouts=Shard(1)),
        f"{prefix}.w3": Colwise(),
    }


def tp_divides_heads(model: nn.Module, tp: int) -> None:
    """Tensor parallelism splits the query heads and the key/value heads (`args.n_heads`, `args.n_kv_heads` where
    the model has them) over the ranks: the degree must divide both."""
    args = model.args
    for key in ("n_heads", "n_kv_heads"):
        value = getattr(args, key, None) or args.n_heads
        if value % tp:
            raise ConfigError(f"parallelism.tensor_parallel_degree {tp} must divide model.{key} ({value})")


def tied_parameters(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """The places (module, attribute) of each parameter that more than one module holds (tied embeddings)."""
    places: dict[int, list[tuple[nn.Module, str]]] = {}
    for _, module in model.named_modules(remove_duplicate=False):
        for name, param in module._parameters.items():
            if param is not None:
                places.setdefault(id(param), []).append((module, name))
    return [group for group in places.values() if len(group) > 1]


def tie_again(tied: list[list[tuple[nn.Module, str]]]) -> None:
    """Tensor parallelism gives each module its own DTensor of a tied matrix (both sharded alike): share the first
    module's again, before FSDP wraps them."""
    for (first, name), *others in tied:
        for module, attribute in others:
            setattr(module, attribute, getattr(first, name))
