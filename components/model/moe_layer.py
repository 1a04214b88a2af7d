"""What code outside a model family needs of a mixture-of-experts layer, as an interface.

Shared code (the routing tally, expert parallelism, compile, FSDP, the memory estimator) finds a model's MoE
layers by these attributes, not by their class: models/moe.py's `MoE` has them, and so does a fork's copy of
that module, which keeps load balancing, its metrics, expert parallelism and the compile rules without
editing anything outside the fork's folder. As with context parallelism's `sdpa` seam, nothing else of the
layer is assumed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Protocol

import torch
from torch import nn

from components.model.protocols import provides


class MoELayer(Protocol):
    num_experts: int
    experts: nn.Module
    """Holds the experts' weights, each parameter a stack over the experts (dim 0, which expert parallelism
    shards), and is called as experts(tokens sorted by expert, [tokens per expert of this rank])."""
    dispatcher: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
    """dispatcher(experts, tokens sorted by expert, counts per expert) -> their outputs, in the same order;
    expert parallelism replaces it by one that sends the tokens to the ranks holding their experts."""
    expert_bias: torch.Tensor
    """(num_experts,) routing bias of auxiliary-loss-free balancing, a buffer the tally moves after each step."""
    bias_update_speed: float
    """How far the tally moves expert_bias per step; 0: not at all."""
    aux_loss_scale: float
    """Multiplies the gradient of the layer's auxiliary loss: the tally sets 1 / micro-batches per step."""
    tokens_per_expert: torch.Tensor
    """(num_experts,) tokens routed to each expert since the last reset_tally(), and the next two likewise:"""
    aux_loss_sum: torch.Tensor
    """the auxiliary balancing loss summed over the forwards,"""
    forwards: torch.Tensor
    """and the number of those (training) forwards."""

    def reset_tally(self) -> None: ...


def moe_layers(module: nn.Module) -> Iterator[tuple[str, MoELayer]]:
    """(name, layer) of every mixture-of-experts layer inside `module`."""
    return ((name, m) for name, m in module.named_modules() if is_moe_layer(m))


def is_moe_layer(module: nn.Module) -> bool:
    return provides(module, MoELayer)


def has_moe_layer(module: nn.Module) -> bool:
    return next(moe_layers(module), None) is not None
