"""This rank's share of the model and how a batch runs through it: the training step (train.py), validation
and evaluation (components/evaluation/in_loop.py) all go through `forward_backward` and `over_ranks`, so
that pipeline stages, loss parallelism and the averaging over data- and context-parallel ranks are
handled in one place."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from components.data.documents import document_ids
from components.training.loss import ZLoss, sequence_loglikelihoods


class StagesDriver(Protocol):
    """What runs a batch through this rank's pipeline stages (parallelisms/pipeline.py's Pipeline)."""

    def run(self, inputs: torch.Tensor, labels: torch.Tensor, train: bool,
            documents: torch.Tensor | None = None) -> list[torch.Tensor]: ...

    def score(self, inputs: torch.Tensor, labels: torch.Tensor,
              score_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
              documents: torch.Tensor | None = None) -> torch.Tensor | None: ...


SequenceShare = Callable[..., torch.Tensor]
"""`share(tensor, document_ids=ids)`: this rank's share of a (batch, seq) tensor's sequence under context
parallelism (parallelisms/context_parallel.py's shard_sequence, bound to the cp mesh by train.py)."""


@dataclass
class ModelOnRank:
    """This rank's share of the model and what running a batch through it needs."""

    parts: list[nn.Module]
    """The whole model, or this rank's pipeline stages."""
    pipeline: StagesDriver | None
    """Drives the stages under pipeline parallelism; None without it."""
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    loss_parallel: bool
    """Tensor parallelism leaves the logits sharded over the vocabulary; the loss is taken on the shards."""
    pp_group: dist.ProcessGroup | None
    """The pipeline ranks, which each hold part of the gradients (None without pipeline parallelism)."""
    loss_group: dist.ProcessGroup | None
    """The data- and context-parallel ranks, whose losses are averaged (None when this rank is alone)."""
    cp_largest_logits: Callable | None = None
    """Under context parallelism, an attention call's largest logits per head, this rank's queries against every
    rank's keys (parallelisms/context_parallel.py's sequence_largest_logits, for QK-clip); None without it."""

    def train(self, mode: bool = True) -> None:
        for part in self.parts:
            part.train(mode)


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor, or the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def gathered(tensor: torch.Tensor) -> torch.Tensor:
    """A plain tensor, gathered if it is a DTensor (a loss computed under loss parallel)."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def prepare_batch(
    batch: torch.Tensor, device: torch.device, eos_id: int | None, share: SequenceShare | None,
    labels: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """This rank's inputs, labels and (with document masking: an eos_id) document ids of a batch of
    windows; under context parallelism (a `share`), its share of the sequence (by documents under document
    masking), the ids still of the whole sequence. The labels are the windows' next tokens unless given."""
    batch = batch.to(device, non_blocking=True)
    inputs = batch[:, :-1]
    labels = batch[:, 1:] if labels is None else labels.to(device, non_blocking=True)
    documents = document_ids(inputs, eos_id) if eos_id is not None else None
    if share is not None:
        inputs, labels = (share(t, document_ids=documents) for t in (inputs, labels))
    return inputs, labels, documents


def forward_backward(
    model: ModelOnRank, inputs: torch.Tensor, labels: torch.Tensor, documents: torch.Tensor | None,
    grad_accum_steps: int, train: bool,
) -> torch.Tensor:
    """One micro-batch through this rank's model, and backward when `train`: its loss divided by
    grad_accum_steps (its share of the step's mean loss). Under pipeline parallelism the pipeline runs
    forward and backward of its own micro-batches, and only the last stage has a loss (others: 0)."""
    with loss_parallel() if model.loss_parallel else nullcontext():
        if model.pipeline is not None:
            losses = model.pipeline.run(inputs, labels, train, documents)
            if isinstance(model.loss_fn, ZLoss):
                model.loss_fn.settle(len(losses))
            if not losses:
                return torch.zeros((), device=inputs.device)
            return torch.stack([gathered(loss) for loss in losses]).detach().sum()
        loss = model.loss_fn(model.parts[0](inputs, documents), labels) / grad_accum_steps
        if train:
            loss.backward()
        return gathered(loss).detach()


def over_ranks(model: ModelOnRank, value: torch.Tensor, op=dist.ReduceOp.AVG) -> torch.Tensor:
    """A value computed on the last pipeline stage (zeros elsewhere), reduced with `op` over the data-
    and context-parallel ranks: the mean of their losses, or the sum of their shares of log-likelihoods."""
    if model.pp_group is not None:
        dist.all_reduce(value, group=model.pp_group)
    if model.loss_group is not None:
        dist.all_reduce(value, op=op, group=model.loss_group)
    return value


@torch.no_grad()
def loglikelihoods(model: ModelOnRank, inputs: torch.Tensor, labels: torch.Tensor,
                   documents: torch.Tensor | None) -> torch.Tensor:
    """Each row's summed log-probability of its labelled tokens, as far as this rank sees them (its
    context-parallel share; zeros off the last pipeline stage); the model is in eval mode."""
    with loss_parallel() if model.loss_parallel else nullcontext():
        if model.pipeline is not None:
            scores = model.pipeline.score(inputs, labels, sequence_loglikelihoods, documents)
            return scores if scores is not None else torch.zeros(len(inputs), device=inputs.device)
        return sequence_loglikelihoods(model.parts[0](inputs, documents), labels)
