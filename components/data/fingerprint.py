"""data_hash: a fingerprint of the token ids each logged step trained on, the same under every layout of the same
global batch. Two runs whose data_hash agree step by step trained on the same global batches (the parity and
resume tests compare it); an ablation that changes only the layout shows it did not change the data."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist

PRIME = 2**31 - 1


class DataHash:
    """Passes a loader's batches through, hashing each window: h(w) = sum_i (w_i + 1) r_i mod PRIME with fixed
    random r, added up over the step's windows and over the data-parallel ranks (a sum: the rows' order and
    their ranks do not matter). A feature of the training loop (components/training/loop_features.py)."""

    def __init__(self, batches: Iterable[torch.Tensor], dp_group: dist.ProcessGroup | None, device: torch.device):
        self.batches, self.dp_group, self.device = batches, dp_group, device
        self.total = 0
        self._weights: torch.Tensor | None = None

    def __iter__(self) -> Iterator[torch.Tensor]:
        for batch in self.batches:
            if self._weights is None or len(self._weights) != batch.shape[1]:
                generator = torch.Generator().manual_seed(0)  # its own: the run's random state stays untouched
                self._weights = torch.randint(1, 1 << 20, (batch.shape[1],), generator=generator)
            windows = ((batch.long() + 1) * self._weights).sum(1) % PRIME
            self.total = (self.total + int(windows.sum())) % PRIME
            yield batch

    def after_step(self, step: int, skipped: torch.Tensor, log: bool) -> dict[str, float]:
        total, self.total = self.total, 0
        if not log:
            return {}
        value = torch.tensor([total], dtype=torch.int64, device=self.device)
        if self.dp_group is not None:
            dist.all_reduce(value, group=self.dp_group)
        return {"data_hash": int(value.item()) % PRIME}
