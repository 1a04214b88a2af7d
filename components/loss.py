"""The training loss, shared by train.py and the memory estimator, and the log-likelihoods evaluation
scores choices by."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor


def cross_entropy_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy, computed in fp32 whatever the logits' dtype."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def sequence_loglikelihoods(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Each row's summed log-probability of its labelled tokens (label -100: not counted), in fp32:
    (batch,) from logits (batch, seq, vocab), which may be sharded over the vocabulary (loss parallel)."""
    token_losses = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="none")
    if isinstance(token_losses, DTensor):
        token_losses = token_losses.full_tensor()
    return -token_losses.view(labels.shape).sum(1)
