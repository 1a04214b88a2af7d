"""How Qwen3.5 is parallelized, in every family's order (models/decoder_parallelize.py): float8 conversion -> tensor
parallel (then expert parallel) -> context parallel -> activation checkpointing -> compile -> FSDP.

Tensor parallelism splits both kinds of layer by heads. The full-attention layers as Qwen3's (the query
projection's gate goes with its head). A Gated DeltaNet layer: its projections column-wise by heads (q and k by
key heads, v, z, b and a by value heads, each rank's value heads those of its key heads), its convolution's weights,
dt_bias and A_log sharded alike (`shard_delta_net_heads`), its output projection row-wise; the gated output norm,
whose one weight serves every head, replicated with its gradient summed over the ranks. Context parallelism
carries the convolution and the delta rule's state through parallelisms/sequence_mixers.py.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import SequenceParallel

from components.config import Config, ConfigError
from components.distributed.mesh import ParallelDims
from components.model.attention import qk_norm_tensor_parallel_plan
from models.decoder_parallelize import (
    ends_tensor_parallel_plan,
    feed_forward_tensor_parallel_plan,
    parallelize_decoder,
)
from models.qwen3_5.model import GatedDeltaNet
from parallelisms.tensor_parallel import tensor_parallel_styles

KEPT_IN_HIGH_PRECISION = ["router.gate", "feed_forward.shared_gate", "attention.wa", "attention.wb"]
"""Kept out of float8: small matmuls whose outputs gate what follows, where precision matters: the router's logits
choose the experts, the shared expert's gate scales it, and a DeltaNet layer's wa and wb give each head's decay
(through an exponential) and write strength."""
HEAD_PARAMETERS = ("conv_q", "conv_k", "conv_v", "dt_bias", "A_log")
"""A DeltaNet layer's own parameters, one row per channel or head: split over the tp ranks as its heads are."""


def tensor_parallel_plan(model: nn.Module, float8_comm: bool) -> dict:
    """Megatron-style TP with sequence parallelism and a loss-parallel output, as Llama 3's, for both layer kinds
    (the module docstring); an MoE feed-forward routes this rank's sequence shard through whole experts."""
    Colwise, Rowwise, PrepareInput = tensor_parallel_styles(float8_comm)
    plan = ends_tensor_parallel_plan(model, "tok_embeddings", "norm", "output")
    for name, block in model.layers.items():
        prefix = f"layers.{name}"
        mixer = f"{prefix}.attention"
        if isinstance(block.attention, GatedDeltaNet):
            plan |= {mixer: PrepareInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))}
            plan |= {f"{mixer}.{w}": Colwise() for w in ("wq", "wk", "wv", "wz", "wb", "wa")}
        else:
            plan |= {mixer: PrepareInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None))}
            plan |= {f"{mixer}.{w}": Colwise() for w in ("wq", "wk", "wv")} | qk_norm_tensor_parallel_plan(mixer)
        plan |= {
            f"{prefix}.attention_norm": SequenceParallel(),
            f"{mixer}.wo": Rowwise(output_layouts=Shard(1)),
            f"{prefix}.ffn_norm": SequenceParallel(),
            **feed_forward_tensor_parallel_plan(f"{prefix}.feed_forward", block.feed_forward, float8_comm),
        }
    return plan


def shard_delta_net_heads(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """After the plan: each DeltaNet layer's HEAD_PARAMETERS sharded by heads (DTensors, Shard(0)), and its gated
    norm computed on this rank's heads with its weight replicated (a Replicate DTensor, whose gradient DTensor sums
    over the ranks)."""
    for block in model.layers.values():
        layer = block.attention
        if not isinstance(layer, GatedDeltaNet):
            continue
        for name in HEAD_PARAMETERS:
            param = getattr(layer, name)
            layer.register_parameter(name, nn.Parameter(distribute_tensor(param, tp_mesh, [Shard(0)])))
        distribute_module(layer.norm, tp_mesh, input_fn=_heads_as_dtensors, output_fn=_local_heads)


def _heads_as_dtensors(module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
    return tuple(DTensor.from_local(x, mesh, [Shard(2)], run_check=False) for x in inputs)


def _local_heads(module: nn.Module, output: DTensor, mesh: DeviceMesh) -> torch.Tensor:
    return output.to_local()


def check_tp_fits(model: nn.Module, tp: int) -> None:
    """Tensor parallelism splits both layer kinds' heads: the degree must divide each count."""
    args = model.args
    for key in ("n_heads", "n_kv_heads", "linear_n_key_heads", "linear_n_value_heads"):
        value = getattr(args, key) or args.n_heads
        if value % tp:
            raise ConfigError(f"parallelism.tensor_parallel_degree {tp} must divide model.{key} ({value})")


def parallelize_qwen3_5(model: nn.Module, dims: ParallelDims, mesh: DeviceMesh, config: Config,
                        device: torch.device) -> nn.Module:
    return parallelize_decoder(model, dims, mesh, config, device, tensor_parallel_plan=tensor_parallel_plan,
                               check_tp_fits=check_tp_fits, high_precision=KEPT_IN_HIGH_PRECISION,
                               after_tensor_parallel=shard_delta_net_heads)
