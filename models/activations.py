"""The feed-forward activations a model's `hidden_act` may name, shared by the families. The names are Hugging
Face's (transformers' ACT2FN), so that an export writes `hidden_act` as it is and transformers computes the
same function on reload."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F


def squared_relu(x: torch.Tensor) -> torch.Tensor:
    """relu(x)^2 (Primer, So et al. 2021)."""
    return F.relu(x).square()


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
    "relu": F.relu,
    "relu2": squared_relu,
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in ACTIVATIONS:
        raise ValueError(f"hidden_act {name!r} is not one of {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[name]
