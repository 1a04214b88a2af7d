"""How Qwen3 is parallelized, in every family's order (models/decoder_parallelize.py):
float8 conversion -> tensor parallel (then expert parallel) -> context parallel -> activation
checkpointing -> compile -> FSDP (the MoE layers' own units first).

What differs from Llama 3: the QK-norms are in the tensor-parallel plan, so that their gradients are
summed over the tensor-parallel ranks, which hold different heads; an MoE feed-forward is not split by
tensor parallelism but takes its rank's sequence shard whole (parallelisms/expert_parallel.py); the
routers stay out of float8.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import SequenceParallel

from components.config import Config
from components.distributed.mesh import ParallelDims
from components.model.attention import qk_norm_tensor_parallel_plan
from models.decoder_parallelize import (
    ends_tensor_parallel_plan,
    feed_forward_tensor_parallel_plan,
    parallelize_decoder,
)
from parallelisms.tensor_parallel import tensor_parallel_styles

ROUTER = "router.gate"
"""Kept out of float8: the router's logits choose the experts, a small matmul where precision matters."""


def tensor_parallel_plan(model: nn.Module, float8_comm: bool) -> dict:
    """Llama 3's plan (Megatron-style TP with sequence parallelism, loss parallel output), plus:

    - the QK-norms, whose weights are replicated and their gradients summed over the tp ranks, which
      hold different heads (components/model/attention.py, qk_norm_tensor_parallel_plan).
    - an MoE feed-forward routes this rank's sequence shard through whole experts."""
    Colwise, Rowwise, PrepareInput = tensor_parallel_styles(float8_comm)
    plan = ends_tensor_parallel_plan(model, "tok_embeddings", "norm", "output")
    for name, block in model.layers.items():
        prefix = f"layers.{name}"
        plan |= {
            f"{prefix}.attention_norm": SequenceParallel(),
            f"{prefix}.attention": PrepareInput(input_layouts=(Shard(1), None),
                                                desired_input_layouts=(Replicate(), None)),
            f"{prefix}.attention.wq": Colwise(),
            f"{prefix}.attention.wk": Colwise(),
            f"{prefix}.attention.wv": Colwise(),
            **qk_norm_tensor_parallel_plan(f"{prefix}.attention"),
            f"{prefix}.attention.wo": Rowwise(output_layouts=Shard(1)),
            f"{prefix}.ffn_norm": SequenceParallel(),
            **feed_forward_tensor_parallel_plan(f"{prefix}.feed_forward", block.feed_forward, float8_comm),
        }
    return plan


def parallelize_qwen3(model: nn.Module, dims: ParallelDims, mesh: DeviceMesh, config: Config,
                      device: torch.device) -> nn.Module:
    return parallelize_decoder(model, dims, mesh, config, device, tensor_parallel_plan=tensor_parallel_plan,
                               high_precision=[ROUTER])
