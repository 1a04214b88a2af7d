"""The batch plan: how the configured batch sizes and the data-parallel degree make one optimizer step.

train.py, the memory estimator, sweeps and autotune all derive the step from here, so a rule about
batches is written once."""

from __future__ import annotations

from dataclasses import dataclass

from components.config import ConfigError, Training


@dataclass(frozen=True)
class BatchPlan:
    local_batch: int
    """Windows each data-parallel rank runs per micro-step (training.local_batch_size)."""
    dp: int
    """Data-parallel ranks (replicas x shards): ranks that see different windows."""
    global_batch: int
    """Windows per optimizer step over all ranks."""
    seq_len: int

    @property
    def grad_accum_steps(self) -> int:
        """Micro-steps per optimizer step: the global batch over local batch x dp."""
        return self.global_batch // (self.local_batch * self.dp)

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len


def batch_plan(training: Training, dp: int) -> BatchPlan:
    """The plan of `training` on `dp` data-parallel ranks; global_batch_size -1 means local x dp."""
    per_micro_step = training.local_batch_size * dp
    global_batch = per_micro_step if training.global_batch_size == -1 else training.global_batch_size
    if global_batch < 1 or global_batch % per_micro_step:
        raise ConfigError(
            f"training.global_batch_size {global_batch} must be a multiple of training.local_batch_size "
            f"({training.local_batch_size}) x data-parallel degree ({dp}) = {per_micro_step}"
        )
    return BatchPlan(training.local_batch_size, dp, global_batch, training.seq_len)
