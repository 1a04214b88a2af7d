"""The training loss, shared by train.py and the memory estimator, the optional z-loss added to it, the loss of
multi-token prediction, and the log-likelihoods evaluation scores choices by."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from components.config import ConfigError


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


def z_loss(logits: torch.Tensor) -> torch.Tensor:
    """The mean over tokens of logsumexp(logits)^2 (PaLM's z-loss), in fp32, from logits (batch, seq,
    vocab), which may be sharded over the vocabulary (loss parallel). Written out rather than with
    torch.logsumexp, which all-gathers a sharded vocabulary: these reductions stay on the shards, with
    all-reduces of one value per token."""
    logits = logits.float()
    peak = logits.detach().amax(-1, keepdim=True)  # against overflow; the result does not depend on it
    return ((logits - peak).exp().sum(-1, keepdim=True).log() + peak).square().mean()


def cross_entropy_and_z_loss(logits: torch.Tensor, labels: torch.Tensor,
                             weight: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The cross-entropy carrying the gradient of weight * z_loss, and the z-loss (detached). The value
    of the first is the cross-entropy's bit for bit (x - x is 0), so the logged loss stays comparable
    with runs without z-loss; a non-finite z-loss makes it NaN, which the step guard sees."""
    z = z_loss(logits)
    weighted = weight * z
    return cross_entropy_loss(logits, labels) + (weighted - weighted.detach()), z.detach()


class ZLoss:
    """The training loss with a z-loss of `weight` (training.z_loss), called like cross_entropy_loss.

    It also keeps the z-loss of every micro-batch it trains on (with gradients enabled: not validation)
    as a tensor on the device, which `step_mean` averages once per step, so that logging it costs no
    sync per micro-batch. Under pipeline parallelism only the last stage computes it (the others' mean
    is 0), and `settle` drops the schedule's calls on placeholder outputs."""

    def __init__(self, weight: float, device: torch.device, compile: bool = False):
        if not weight >= 0:  # NaN too
            raise ConfigError(f"training.z_loss must be >= 0 (0: off), got {weight}")
        self.weight, self.device = weight, device
        self.terms = torch.compile(cross_entropy_and_z_loss) if compile else cross_entropy_and_z_loss
        self.pending: list[torch.Tensor] = []
        self.kept: list[torch.Tensor] = []

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss, z = self.terms(logits, labels, self.weight)
        if torch.is_grad_enabled():
            self.pending.append(z.full_tensor() if isinstance(z, DTensor) else z)  # replicated: no communication
        return loss

    def settle(self, real_calls: int) -> None:
        """Keep the last `real_calls` values since the previous settle and drop the others: a pipeline
        schedule that (re)initializes its stages (its first step, the first after an eval) first calls
        the loss on placeholder outputs, to infer the shapes of the gradients."""
        self.kept += self.pending[len(self.pending) - real_calls:]
        self.pending = []

    def step_mean(self) -> torch.Tensor:
        """The mean z-loss of the micro-batches since the last call (0 where there were none)."""
        values, self.kept = self.kept + self.pending, []
        self.pending = []
        return torch.stack(values).mean() if values else torch.zeros((), device=self.device)


@dataclass
class MultiTokenLogits:
    """What a model with multi-token prediction returns while training (models/deepseek_v3: model.num_mtp_layers):
    the next token's logits and, for each extra depth k = 1, 2, ..., logits (batch, seq, vocab) of the token k + 1
    places after each position's input, whose last k positions predict nothing; `weight` scales their mean loss."""

    logits: torch.Tensor
    depths: list[torch.Tensor]
    weight: float


def multi_token_loss(depths: list[torch.Tensor], labels: torch.Tensor) -> torch.Tensor:
    """The mean over depths of each depth's cross-entropy on the positions that have a target: depth k's label at
    position i is the label k places later, labels[i + k]."""
    return torch.stack([cross_entropy_loss(logits[:, :-k], labels[:, k:])
                        for k, logits in enumerate(depths, 1)]).mean()


class MultiTokenLoss:
    """The training loss of a model with multi-token prediction, called like cross_entropy_loss: `loss_fn` (the
    cross-entropy, or a ZLoss) on the next token's logits, carrying the gradient of weight x the extra depths'
    loss. Its value is the next-token loss's bit for bit (x - x is 0): logged losses and validation stay
    comparable with runs without the extra depths. The extra loss of each micro-batch trained on is kept, as
    ZLoss keeps the z-loss, for `step_mean`. An output other than a MultiTokenLogits (the model in eval mode:
    validation, evaluation) goes to `loss_fn` as it is."""

    def __init__(self, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], device: torch.device):
        self.loss_fn, self.device = loss_fn, device
        self.kept: list[torch.Tensor] = []

    def __call__(self, output: torch.Tensor | MultiTokenLogits, labels: torch.Tensor) -> torch.Tensor:
        if not isinstance(output, MultiTokenLogits):
            return self.loss_fn(output, labels)
        extra = multi_token_loss(output.depths, labels)
        if torch.is_grad_enabled():
            self.kept.append((extra.full_tensor() if isinstance(extra, DTensor) else extra).detach())
        weighted = output.weight * extra
        return self.loss_fn(output.logits, labels) + (weighted - weighted.detach())

    def step_mean(self) -> torch.Tensor:
        """The mean extra-depth loss of the micro-batches since the last call (0 where there were none)."""
        values, self.kept = self.kept, []
        return torch.stack(values).mean() if values else torch.zeros((), device=self.device)
