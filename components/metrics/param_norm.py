"""param_norm: the L2 norm of all the model's weights, on the steps that log (OLMo logs it as total_param_norm).
Its slow rise is the first sign that weight decay is too weak; a jump marks an update that went wrong, even
one the step guard let through."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from components.training.optimizers import Optimizers


class ParamNorm:
    """A feature of the training loop (components/training/loop_features.py). The norm is taken per parameter group of
    the optimizers, whose parameters share a device mesh, and summed over the pipeline stages, as the gradient
    norm is (components/training/optimizers.py)."""

    def __init__(self, optimizers: Optimizers, pp_group: dist.ProcessGroup | None):
        self.optimizers, self.pp_group = optimizers, pp_group

    @torch.no_grad()
    def after_step(self, step: int, skipped: torch.Tensor, log: bool) -> dict[str, float]:
        if not log:
            return {}
        squared = torch.zeros((), dtype=torch.float64)
        for group in self.optimizers.param_groups:
            norm = torch.nn.utils.get_total_norm(group["params"], foreach=True)
            squared += (norm.full_tensor() if isinstance(norm, DTensor) else norm).double().cpu() ** 2
        if self.pp_group is not None:
            dist.all_reduce(squared, group=self.pp_group)
        return {"param_norm": squared.sqrt().item()}
