"""Validation and evaluation during training, as one object the training loop calls after every step.

Validation (`[validation]`): the mean loss over the first validation.steps batches of each validation
source, every validation.freq steps and after the last one. Evaluation (`[evaluation]`): the multiple-choice
tasks scored by log-likelihood (scoring.py), every evaluation.freq steps and after the last one. Both run on
every rank under any layout; their time does not count against the training throughput.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist

from components.config import Config, ConfigError
from components.data.batch_plan import BatchPlan
from components.data.loaders import build_validation_dataloader, validation_sources
from components.data.tokenizer import Tokenizer
from components.distributed.mesh import ParallelDims
from components.evaluation.scoring import evaluate_task, prepare_task
from components.evaluation.tasks import read_task
from components.metrics.reporting import MetricsLogger
from components.training.model_on_rank import (
    ModelOnRank,
    SequenceShare,
    forward_backward,
    loglikelihoods,
    over_ranks,
    prepare_batch,
)

logger = logging.getLogger("ingot")


class Evaluations:
    """Checks its sources at start-up (a bad validation.dataset_path fails then, not at the first
    validation) and tokenizes the tasks once; `after_step` runs what is due."""

    def __init__(self, config: Config, tokenizer: Tokenizer, model: ModelOnRank, dims: ParallelDims, plan: BatchPlan,
                 device: torch.device, eos_id: int | None, share: SequenceShare | None):
        self.config, self.tokenizer, self.model, self.dims, self.plan = config, tokenizer, model, dims, plan
        self.device, self.eos_id, self.share = device, eos_id, share
        self.dp_rank = dims.dp_mesh.get_local_rank()
        self.validation_paths = validation_sources(config.validation.dataset_path)
        self.short_validation: set[str | None] = set()
        """Sources found to hold fewer batches than validation.steps (said once)."""
        if config.validation.enable:
            for path in self.validation_paths.values():
                if next(iter(self._validation_loader(path)), None) is None:
                    raise ConfigError(f"validation.dataset_path {path} holds no batch of training.local_batch_size x "
                                      f"training.seq_len tokens for data-parallel rank {self.dp_rank}")
        evaluation, seq_len = config.evaluation, config.training.seq_len
        self.tasks = ([prepare_task(read_task(spec, evaluation.limit), tokenizer, seq_len) for spec in evaluation.tasks]
                      if evaluation.enable else [])

    def after_step(self, step: int, metrics: MetricsLogger) -> None:
        last = step == self.config.training.steps
        if self.config.validation.enable and (step % self.config.validation.freq == 0 or last):
            self.validate(step, metrics)
        if self.config.evaluation.enable and (step % self.config.evaluation.freq == 0 or last):
            self.evaluate(step, metrics)

    def _validation_loader(self, path: str):
        return build_validation_dataloader(self.config, self.tokenizer, self.dp_rank, self.dims.dp, path)

    def validate(self, step: int, metrics: MetricsLogger) -> None:
        start, losses, wanted = time.perf_counter(), {}, self.config.validation.steps
        for name, path in self.validation_paths.items():
            batches = (prepare_batch(batch, self.device, self.eos_id, self.share)
                       for batch in self._validation_loader(path))
            losses[name], used = validation_loss(self.model, batches, wanted, self.plan.grad_accum_steps, self.device)
            if used < wanted and name not in self.short_validation:
                self.short_validation.add(name)
                logger.warning(f"validation data {path} holds {used} batches, fewer than validation.steps "
                               f"{wanted}: validating on those {used}")
        metrics.log_validation(step, losses, time.perf_counter() - start)

    def evaluate(self, step: int, metrics: MetricsLogger) -> None:
        start, dims = time.perf_counter(), self.dims
        self.model.train(False)
        results = {
            prepared.task.name: evaluate_task(
                prepared, self._score, self._sum_over_ranks, self.dp_rank, dims.dp,
                self.config.training.local_batch_size, self.config.training.seq_len,
                multiple=math.lcm(64, 2 * dims.cp * dims.tp), fixed_length=dims.pp > 1, device=self.device,
            )
            for prepared in self.tasks
        }
        self.model.train()
        metrics.log_evaluation(step, results, time.perf_counter() - start)

    def _score(self, windows: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return loglikelihoods(self.model, *prepare_batch(windows, self.device, self.eos_id, self.share, labels))

    def _sum_over_ranks(self, totals: torch.Tensor) -> torch.Tensor:
        return over_ranks(self.model, totals, dist.ReduceOp.SUM)


@torch.no_grad()
def validation_loss(model: ModelOnRank, batches: Iterator, steps: int, grad_accum_steps: int,
                    device: torch.device) -> tuple[float, int]:
    """Mean loss over the first `steps` batches of the validation data, on every rank, and how many
    batches that was: fewer when the data holds fewer (every rank stops where the first runs out; start-up
    made sure there is at least one)."""
    model.train(False)
    loss_sum, done = torch.zeros((), device=device), 0
    for _ in range(steps):
        batch = next(batches, None)
        available = torch.tensor(int(batch is not None), device=device)
        dist.all_reduce(available, op=dist.ReduceOp.MIN)
        if not available.item():
            break
        loss_sum = loss_sum + forward_backward(model, *batch, grad_accum_steps, train=False)
        done += 1
    model.train()
    return (over_ranks(model, loss_sum) * grad_accum_steps).item() / done, done
