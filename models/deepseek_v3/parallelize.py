"""How DeepSeek-V3 is parallelized, in every family's order (models/decoder_parallelize.py):
float8 conversion -> tensor parallel (then expert parallel) -> context parallel -> activation
checkpointing -> compile -> FSDP (the MoE layers' own units first).

What differs from Qwen3: multi-head latent attention. Tensor parallelism splits the heads: the column-wise
`wq_b` (or `wq`) and `wkv_b` give each rank its heads' queries, keys and values, the row-wise `wo` sums them.
The low-rank projections before them and their norms (`wq_a`, `q_norm`, `wkv_a`, `kv_norm`) are small and every
rank computes them whole on the gathered sequence (`ReplicateParallel`): their parameters are Replicate DTensors,
and the column-wise layers sum the gradient reaching them over the ranks, as does the shared rotated key
(models/deepseek_v3/model.py). They and the routers stay out of float8: they run on Replicate DTensors, which
torchao's float8 layers take only through its tensor-parallel styles, and they are a small share of the FLOPs.

The depths of multi-token prediction (`mtp`, model.num_mtp_layers) are parallelized as blocks: their blocks take
the blocks' plan, their norms and the projection joining two hidden states work per token on the sequence shards;
activation checkpointing, compile and FSDP take each depth whole as they take a block.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import PrepareModuleInput, SequenceParallel

from components.config import Config
from components.distributed.mesh import ParallelDims
from models.decoder_parallelize import (
    ends_tensor_parallel_plan,
    feed_forward_tensor_parallel_plan,
    parallelize_decoder,
)
from parallelisms.tensor_parallel import ReplicateParallel, tensor_parallel_styles

KEPT_IN_HIGH_PRECISION = ["router.gate", "attention.wq_a", "attention.wkv_a"]
"""Out of float8: the routers (their logits choose the experts) and the latent projections (see above)."""


def tensor_parallel_plan(model: nn.Module, float8_comm: bool) -> dict:
    """Llama 3's plan (Megatron-style TP with sequence parallelism, loss parallel output) with multi-head latent
    attention's: the heads split over the ranks, the latents computed whole on each. An MoE feed-forward routes
    this rank's sequence shard through whole experts."""
    Colwise, Rowwise, _ = tensor_parallel_styles(float8_comm)
    plan = ends_tensor_parallel_plan(model, "tok_embeddings", "norm", "output")
    blocks = {f"layers.{name}": block for name, block in model.layers.items()}
    for name, depth in model.mtp.items():  # multi-token prediction: per token, on the sequence shards
        blocks[f"mtp.{name}.block"] = depth.block
        plan |= {f"mtp.{name}.{norm}": SequenceParallel() for norm in ("enorm", "hnorm", "norm")}
        plan[f"mtp.{name}.eh_proj"] = SequenceParallel(use_local_output=True)  # into the block's residual stream
    for prefix, block in blocks.items():
        attention = f"{prefix}.attention"
        queries = {f"{attention}.wq_a": ReplicateParallel(), f"{attention}.q_norm": ReplicateParallel(),
                   f"{attention}.wq_b": Colwise()} if model.args.q_lora_rank else {f"{attention}.wq": Colwise()}
        plan |= {
            f"{prefix}.attention_norm": SequenceParallel(),
            # Gathered in high precision even under float8 TP: the input feeds the latent projections, which stay
            # out of float8 (KEPT_IN_HIGH_PRECISION); the heads' Colwise layers cast what reaches them.
            attention: PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
            **queries,
            f"{attention}.wkv_a": ReplicateParallel(),
            f"{attention}.kv_norm": ReplicateParallel(),
            f"{attention}.wkv_b": Colwise(),
            f"{attention}.wo": Rowwise(output_layouts=Shard(1)),
            f"{prefix}.ffn_norm": SequenceParallel(),
            **feed_forward_tensor_parallel_plan(f"{prefix}.feed_forward", block.feed_forward, float8_comm),
        }
    return plan


def parallelize_deepseek_v3(model: nn.Module, dims: ParallelDims, mesh: DeviceMesh, config: Config,
                            device: torch.device) -> nn.Module:
    return parallelize_decoder(model, dims, mesh, config, device, tensor_parallel_plan=tensor_parallel_plan,
                               high_precision=KEPT_IN_HIGH_PRECISION, block_groups=[model.layers, model.mtp])
