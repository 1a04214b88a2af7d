"""DiLoCo's outer step for replica groups (fault_tolerance.semi_sync_method diloco; Douillard et al. 2023,
arXiv:2311.08105). The groups train apart for fault_tolerance.sync_every steps from the same weights, each on its
own share of the data with its own inner optimizer; then each group's pseudo-gradient (the weights it started the
interval with minus its weights now) is averaged over the groups, and one outer Nesterov SGD step from the start
weights gives every group the same new weights. The groups exchange one model's worth of numbers every sync_every
steps instead of every step. components/distributed/fault_tolerance.py decides when to synchronise and averages over the
groups; this holds the outer step's state.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.checkpoint.stateful import Stateful

from components.checkpoint.dcp import ModelState
from components.config import FaultTolerance


class OuterStep(Stateful):
    """The weights every group started the interval with and the outer SGD's momentum, keyed as the model's state dict
    (components.checkpoint.dcp.ModelState: every floating-point entry, the routing biases of mixture-of-experts layers
    included), next to the weights on their own devices: one more copy of this rank's
    shards, and one of the momentum. Checkpointed with the run, and taken by a rejoining group with the rest of a live
    group's state. `last_sync`: the step of the last synchronisation."""

    def __init__(self, model_parts: list[nn.Module], cfg: FaultTolerance):
        self.model, self.lr, self.momentum = ModelState(model_parts), cfg.outer_lr, cfg.outer_momentum
        self.snapshot()
        self.velocity = {name: torch.zeros_like(weight) for name, weight in self.start.items()}
        self.last_sync = 0

    def snapshot(self) -> None:
        """Start the interval from the model's weights as they are (a fresh run's, once initialised or loaded)."""
        now = self.model.state_dict()
        self.start = {name: value.detach().clone() for name, value in now.items() if torch.is_floating_point(value)}

    def pseudo_gradients(self) -> dict[str, torch.Tensor]:
        """This group's move since the interval began, start - now, per entry (DTensors as the weights are)."""
        now = self.model.state_dict()
        return {name: start - now[name] for name, start in self.start.items()}

    @torch.no_grad()
    def step(self, pseudo_gradients: dict[str, torch.Tensor], step: int) -> None:
        """The outer step with the groups' mean pseudo-gradients, Nesterov SGD as torch.optim.SGD takes it
        (v = m v + g; w -= lr (g + m v)); the model's weights become the new start."""
        for name, gradient in pseudo_gradients.items():
            velocity = self.velocity[name].mul_(self.momentum).add_(gradient)
            self.start[name].sub_(gradient.add(velocity, alpha=self.momentum), alpha=self.lr)
        self.restore()
        self.last_sync = step

    def restore(self) -> None:
        """The model's weights back to the interval's start (after a synchronisation, or one not committed)."""
        self.model.load_state_dict(self.start)

    def state_dict(self) -> dict:
        return {"start": self.start, "velocity": self.velocity, "last_sync": self.last_sync}

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        for mine, theirs in ((self.start, state_dict["start"]), (self.velocity, state_dict["velocity"])):
            for name, value in mine.items():
                if theirs[name] is not value:  # DCP loads in place; a live group's state comes as new tensors
                    value.copy_(theirs[name])
        self.last_sync = state_dict["last_sync"]
