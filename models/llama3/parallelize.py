"""How Llama 3 is parallelized: its tensor-parallel plan, one dict; the order of the techniques is every
family's, models/decoder_parallelize.py (float8 -> TP -> EP -> CP -> activation checkpointing -> compile ->
FSDP), which `parallelize_llama` calls with the plan.
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
from models.decoder_parallelize import ends_tensor_parallel_plan, parallelize_decoder
from parallelisms.tensor_parallel import tensor_parallel_styles


def tensor_parallel_plan(model: nn.Module, float8_comm: bool) -> dict:
    """Megatron-style TP with sequence parallelism for every module this model (or stage) holds.

    Activations between blocks are sharded along the sequence (Shard(1)); attention and the MLP
    all-gather them, split their heads / hidden units over the ranks (column-wise in, row-wise out)
    and reduce-scatter back to sequence shards. The output layer leaves logits sharded over the
    vocabulary (Shard(-1)) for a loss computed without gathering them (loss parallel). QK-norm's weights
    are replicated, their gradients summed over the ranks (components/model/attention.py)."""
    Colwise, Rowwise, PrepareInput = tensor_parallel_styles(float8_comm)
    plan = ends_tensor_parallel_plan(model, "tok_embeddings", "norm", "output")
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
    return parallelize_decoder(model, dims, mesh, config, device, tensor_parallel_plan=tensor_parallel_plan)
