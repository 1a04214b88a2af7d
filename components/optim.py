"""AdamW and the learning-rate schedule: linear warmup, an optional stable phase, then decay."""

from __future__ import annotations

import math

import torch
from torch import nn

from components.config import LRScheduler as LRSchedulerConfig
from components.config import Optimizer as OptimizerConfig


def build_optimizer(model: nn.Module, cfg: OptimizerConfig) -> torch.optim.Optimizer:
    impl = {"foreach": {"foreach": True}, "fused": {"fused": True}, "for-loop": {"foreach": False}}[cfg.implementation]
    return torch.optim.AdamW(
        model.parameters(), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=cfg.weight_decay, **impl
    )


def lr_factor(step: int, total_steps: int, cfg: LRSchedulerConfig) -> float:
    """Multiplier of the peak lr used for optimizer step `step` (counted from 1).

    Warmup rises linearly to 1 over `warmup_steps`; the last `decay_ratio` of all steps (or every
    step after warmup when decay_ratio is unset) fall from 1 to `min_lr_factor`; between the two
    the lr stays at its peak (warmup-stable-decay)."""
    warmup = cfg.warmup_steps
    if step <= warmup:
        return step / (warmup + 1)
    decay_steps = total_steps - warmup if cfg.decay_ratio is None else round(total_steps * cfg.decay_ratio)
    decay_start = total_steps - decay_steps
    if cfg.decay_type == "constant" or step <= decay_start or decay_steps <= 0:
        return 1.0
    progress = (step - decay_start) / decay_steps
    if cfg.decay_type == "linear":
        remaining = 1 - progress
    elif cfg.decay_type == "sqrt":
        remaining = 1 - math.sqrt(progress)
    else:
        remaining = 0.5 * (1 + math.cos(math.pi * progress))
    return cfg.min_lr_factor + (1 - cfg.min_lr_factor) * remaining


def build_lr_scheduler(optimizer: torch.optim.Optimizer, total_steps: int, cfg: LRSchedulerConfig):
    """A LambdaLR whose step count is saved in checkpoints; the schedule itself comes from config."""
    if cfg.decay_ratio is not None and not 0 <= cfg.decay_ratio <= 1:
        raise ValueError(f"lr_scheduler.decay_ratio must be between 0 and 1, got {cfg.decay_ratio}")
    if cfg.decay_ratio is not None and cfg.warmup_steps + round(total_steps * cfg.decay_ratio) > total_steps:
        raise ValueError(
            f"lr_scheduler.warmup_steps ({cfg.warmup_steps}) + decay_ratio*training.steps "
            f"({round(total_steps * cfg.decay_ratio)}) exceed training.steps ({total_steps})"
        )
    # LambdaLR counts from 0 for the first optimizer step; lr_factor counts steps from 1.
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: lr_factor(i + 1, total_steps, cfg))
