"""The routed experts of models/moe.py under Hugging Face names, shared by the families whose HF form names them
alike (Qwen3-MoE, DeepSeek-V3): one (num_experts, ...) tensor per projection in ingot
(`layers.N.feed_forward.experts.w1`), one tensor per expert and projection in HF files
(`model.layers.N.mlp.experts.{i}.gate_proj.weight`, as save_pretrained writes them and the published checkpoints
hold them). transformers fuses them in memory (`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`), which is
read too. The family names its own side (a fork may rename its blocks)."""

from __future__ import annotations

import re

import torch
from torch.distributed.tensor import DTensor

from components.torch_private import shard_offset

PROJECTIONS = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
_FROM_HF = {hf: ours for ours, hf in PROJECTIONS.items()}


def local_experts(weight: torch.Tensor) -> tuple[int, torch.Tensor]:
    """The experts of a (num_experts, ...) weight that this rank holds, and the index of the first:
    all of them for a plain tensor, the local shard's for a DTensor (sharded on dim 0, if at all)."""
    if isinstance(weight, DTensor):
        return shard_offset(weight)[0], weight.to_local()
    return 0, weight


def experts_to_hf(block: str, projection: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """The per-expert HF tensors, views of `weight`, of one block's routed experts' `projection` (w1, w2, w3). A
    rank sharded by FSDP or expert parallelism holds whole experts, and only its own get HF names (loading into
    the views fills the model)."""
    first, local = local_experts(weight)
    return {f"model.layers.{block}.mlp.experts.{first + i}.{PROJECTIONS[projection]}.weight": expert
            for i, expert in enumerate(local)}


def experts_from_hf(state_dict: dict) -> tuple[dict, dict[tuple[str, str], torch.Tensor]]:
    """(the HF tensors other than the routed experts', {(block, projection): the block's experts stacked}), from
    either form; the family names them."""
    rest, stacked, experts = {}, {}, {}
    for name, tensor in state_dict.items():
        one = re.fullmatch(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)\.weight", name)
        fused = re.fullmatch(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)", name)
        if one and one[3] in _FROM_HF:
            experts.setdefault((one[1], _FROM_HF[one[3]]), {})[int(one[2])] = tensor
        elif fused and fused[2] == "down_proj":
            stacked[fused[1], "w2"] = tensor
        elif fused:  # gate and up projections concatenated along the hidden dimension, gate first
            stacked[fused[1], "w1"], stacked[fused[1], "w3"] = tensor.chunk(2, dim=1)
        else:
            rest[name] = tensor
    for key, by_index in experts.items():
        if sorted(by_index) != list(range(len(by_index))):
            raise ValueError(f"block {key[0]}'s experts ({PROJECTIONS[key[1]]}): the HF weights hold experts "
                             f"{sorted(by_index)}, not 0 to {len(by_index) - 1}")
        stacked[key] = torch.stack([by_index[i] for i in range(len(by_index))])
    return rest, stacked
