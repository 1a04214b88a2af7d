"""How gpt-oss is parallelized, in every family's order (models/decoder_parallelize.py):
float8 conversion -> tensor parallel (then expert parallel) -> context parallel -> activation
checkpointing -> compile -> FSDP (the MoE layers' own units first).

What differs from Qwen3-MoE: the attention's projections have biases (the column-wise ones are split with their
heads, the row-wise `wo`'s is added once, after the sum over the ranks), and each rank holds the sink logits of its
own heads (`shard_sink_logits`). The window and the sinks reach context parallelism through the attention
modules' declaration and `sdpa` arguments (components/model/attention.py); every method honours them.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import SequenceParallel

from components.config import Config
from components.distributed.mesh import ParallelDims
from models.decoder_parallelize import ends_tensor_parallel_plan, parallelize_decoder
from parallelisms.expert_parallel import moe_tensor_parallel_plan
from parallelisms.tensor_parallel import tensor_parallel_styles

ROUTER = "router.gate"
"""Kept out of float8: the router's logits choose the experts, a small matmul where precision matters."""


def tensor_parallel_plan(model: nn.Module, float8_comm: bool) -> dict:
    """Llama 3's plan (Megatron-style TP with sequence parallelism, loss parallel output); every feed-forward is a
    mixture of experts, which routes this rank's sequence shard through whole experts."""
    Colwise, Rowwise, PrepareInput = tensor_parallel_styles(float8_comm)
    plan = ends_tensor_parallel_plan(model, "tok_embeddings", "norm", "output")
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
    return parallelize_decoder(model, dims, mesh, config, device, tensor_parallel_plan=tensor_parallel_plan,
                               high_precision=[ROUTER], after_tensor_parallel=shard_sink_logits)
