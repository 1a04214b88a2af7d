"""The training loop's seam for features: a feature is an object with

    after_step(step, skipped, log) -> {name: value}

which train.py calls on every rank once per step, after the optimizer step (`skipped`: the step guard's
boolean tensor, true where the update was not taken), in the order of its list. Every rank calls it at the
same steps, so it may communicate. What it returns on the steps that log (`log`) joins that step's record in
metrics.jsonl, TensorBoard, W&B and the log line's figures. A new periodic metric is a new module with such a
class, plus one entry in that list.

The routing tally (components/training/routing.py), float8's scale precompute (parallelisms/float8.py) and the
features below are such objects.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist

from components.training.loss import MultiTokenLoss, ZLoss
from components.training.model_on_rank import ModelOnRank, over_ranks


class LoopFeature(Protocol):
    def after_step(self, step: int, skipped: torch.Tensor, log: bool) -> dict[str, float]: ...


class LossFigure:
    """A term the training loss keeps per micro-batch, logged unweighted and averaged like the loss: z_loss (ZLoss,
    training.z_loss) and mtp_loss (MultiTokenLoss, a model's multi-token prediction)."""

    def __init__(self, name: str, term: ZLoss | MultiTokenLoss, model: ModelOnRank):
        self.name, self.term, self.model = name, term, model

    def after_step(self, step: int, skipped: torch.Tensor, log: bool) -> dict[str, float]:
        mean = self.term.step_mean()  # every step: it also clears the step's values
        return {self.name: over_ranks(self.model, mean).item()} if log else {}


def loss_figures(model: ModelOnRank) -> list[LossFigure]:
    """The figures of the loss's own terms: mtp_loss with multi-token prediction, z_loss with a z-loss."""
    figures, loss_fn = [], model.loss_fn
    if isinstance(loss_fn, MultiTokenLoss):
        figures.append(LossFigure("mtp_loss", loss_fn, model))
        loss_fn = loss_fn.loss_fn
    if isinstance(loss_fn, ZLoss):
        figures.append(LossFigure("z_loss", loss_fn, model))
    return figures


class SourceTokens:
    """data_tokens/<source>: the tokens each source of an hf blend gave the batches so far, over all
    data-parallel ranks (nothing for one source)."""

    def __init__(self, dataloader, dp_group: dist.ProcessGroup | None, device: torch.device):
        self.dataloader, self.dp_group, self.device = dataloader, dp_group, device

    def after_step(self, step: int, skipped: torch.Tensor, log: bool) -> dict[str, float]:
        by_source = getattr(self.dataloader, "tokens_by_source", {})
        if not log or len(by_source) < 2:
            return {}
        counts = torch.tensor(list(by_source.values()), dtype=torch.float64, device=self.device)
        if self.dp_group is not None:
            dist.all_reduce(counts, group=self.dp_group)
        return {f"data_tokens/{name}": int(n) for name, n in zip(by_source, counts.tolist())}
