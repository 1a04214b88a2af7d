"""Mixture-of-experts routing on fake tensors, which have no values to route by: every expert gets an equal
share of the (token, choice) slots, the balance load balancing aims at. Under expert parallelism the slots go
to their experts' ranks and back by the same collectives as parallelisms/expert_parallel.py's AllToAllDispatch
(the exchange of counts, then two all-to-alls whose autograd sends the gradients back), of balanced sizes."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd

from components.model.moe_layer import moe_layers


def even(total: int, parts: int) -> list[int]:
    return [total // parts + (i < total % parts) for i in range(parts)]


class BalancedDispatch:
    def __init__(self, group: dist.ProcessGroup | None, local_experts: int):
        """`local_experts`: the experts this rank holds, counted from the layer's, not from its stacks, which FSDP
        shards between the forwards (a recomputation would see other shapes than its forward)."""
        self.group, self.local_experts = group, local_experts

    def __call__(self, experts: nn.Module, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        local_experts = self.local_experts
        if self.group is None:
            return experts(x, even(x.shape[0], local_experts))
        ep = dist.get_world_size(self.group)
        dist.all_to_all_single(torch.empty_like(counts), counts, group=self.group)
        splits = even(x.shape[0], ep)  # each rank sends as many slots as it receives
        tokens = all_to_all_single_autograd(x, splits, splits, self.group)
        out = experts(tokens, even(tokens.shape[0], local_experts))
        return all_to_all_single_autograd(out, splits, splits, self.group)


def balance_routing(model: nn.Module, ep_group: dist.ProcessGroup | None) -> bool:
    """Route every mixture-of-experts layer of `model` evenly (over `ep_group`'s ranks under expert
    parallelism); whether it has any."""
    layers = list(moe_layers(model))
    ep = 1 if ep_group is None else dist.get_world_size(ep_group)
    for _, layer in layers:
        layer.dispatcher = BalancedDispatch(ep_group, layer.num_experts // ep)
    return bool(layers)
