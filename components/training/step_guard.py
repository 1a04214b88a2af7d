"""Decide whether an optimizer step may update the weights: never for a non-finite loss or gradient
norm, and, with `training.spike_guard`, not for a loss spike.

The decision is a boolean tensor computed on the device from the step's loss and gradient norm
(both already the same on every rank), so it needs no device-to-host sync: the fused AdamW reads it
as `found_inf` and leaves weights and optimizer state untouched (Optimizers.step). The counters are
read on the host only where the loop syncs anyway (log steps, checkpoints, the end): `check` then
stops the run if the policy says so. A skipped step still consumes its batch and advances the
learning-rate schedule.

Spike statistics: a window of the loss and gradient norm of the last `spike_window` accepted steps;
a step whose loss or gradient norm exceeds the window's mean by more than `spike_sigma` standard
deviations is skipped (and not added to the window). The guard acts once the window is full.
"""

from __future__ import annotations

import logging

import torch
from torch.distributed.checkpoint.stateful import Stateful

from components.config import ConfigError, Training

logger = logging.getLogger(__name__)


class TrainingStopped(RuntimeError):
    """The run stopped on purpose (non-finite values, too many skipped steps); checkpoints are intact."""


class StepGuard(Stateful):
    def __init__(self, cfg: Training, device: torch.device):
        if cfg.spike_guard and (cfg.spike_window < 2 or cfg.spike_sigma <= 0):
            raise ConfigError("training.spike_window must be >= 2 and training.spike_sigma > 0, "
                              f"got {cfg.spike_window} and {cfg.spike_sigma}")
        self.cfg = cfg
        def zero() -> torch.Tensor:
            return torch.zeros((), dtype=torch.int64, device=device)

        self.window = torch.zeros(2, cfg.spike_window, dtype=torch.float64, device=device)
        self.accepted, self.nonfinite, self.spikes = zero(), zero(), zero()
        self.first_nonfinite_step, self.last_skipped_step = zero(), zero()
        self.reported = 0

    def describe(self) -> str:
        cfg = self.cfg
        spikes = (f"skips steps {cfg.spike_sigma} sigma above the last {cfg.spike_window} accepted ones, "
                  f"from step {cfg.spike_window + 1}" if cfg.spike_guard else "off")
        nonfinite = "stops the run" if cfg.on_nonfinite == "stop" else "skips the step"
        return f"step guard: a non-finite loss or gradient norm {nonfinite}; spike guard {spikes}"

    def decide(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor) -> torch.Tensor:
        """True (as a tensor) if step `step` must not update the weights; updates the counters."""
        values = torch.stack([loss.detach().double(), grad_norm.detach().double()])
        nonfinite = ~torch.isfinite(values).all()
        skip = nonfinite
        if self.cfg.spike_guard:
            full = self.accepted >= self.cfg.spike_window
            limit = self.window.mean(1) + self.cfg.spike_sigma * self.window.std(1)
            spike = full & ~nonfinite & (values > limit).any()
            self.spikes += spike
            skip = skip | spike
            slot = (self.accepted % self.cfg.spike_window).view(1)
            kept = torch.where(skip, self.window.index_select(1, slot).squeeze(1), values)
            self.window.index_copy_(1, slot, kept.view(2, 1))
        self.accepted += ~skip
        self.nonfinite += nonfinite
        at_step = torch.full_like(self.last_skipped_step, step)
        first_nonfinite = nonfinite & (self.first_nonfinite_step == 0)
        self.first_nonfinite_step = torch.where(first_nonfinite, at_step, self.first_nonfinite_step)
        self.last_skipped_step = torch.where(skip, at_step, self.last_skipped_step)
        return skip

    def check(self) -> dict[str, int]:
        """Read the counters (a device-to-host sync): warn about steps skipped since the last
        check, raise TrainingStopped if the policy says stop; return the counters for the metrics."""
        nonfinite, spikes, first_bad, last = torch.stack(
            [self.nonfinite, self.spikes, self.first_nonfinite_step, self.last_skipped_step]
        ).tolist()
        if nonfinite and self.cfg.on_nonfinite == "stop":
            raise TrainingStopped(
                f"non-finite loss or gradient norm at step {first_bad}; no optimizer step used it and the checkpoints "
                f"are intact (training.on_nonfinite = stop; 'skip' would skip such steps)"
            )
        skipped = nonfinite + spikes
        if skipped > self.reported:
            logger.warning(f"{skipped - self.reported} optimizer step(s) skipped since the last report, "
                           f"the last at step {last} ({nonfinite} non-finite and {spikes} loss spikes in all)")
            self.reported = skipped
        if 0 <= self.cfg.max_skipped_steps < skipped:
            raise TrainingStopped(
                f"{skipped} optimizer steps skipped ({nonfinite} non-finite, {spikes} loss spikes), more than "
                f"training.max_skipped_steps = {self.cfg.max_skipped_steps}; the last at step {last}"
            )
        return {"skipped_steps": skipped, "nonfinite_steps": nonfinite, "spike_steps": spikes}

    def state_dict(self) -> dict:
        return {"window": self.window, "accepted": self.accepted, "nonfinite": self.nonfinite, "spikes": self.spikes,
                "first_nonfinite_step": self.first_nonfinite_step, "last_skipped_step": self.last_skipped_step}

    def load_state_dict(self, state_dict: dict) -> None:
        for name, value in state_dict.items():
            getattr(self, name).copy_(value)
        self.reported = int(self.nonfinite + self.spikes)
