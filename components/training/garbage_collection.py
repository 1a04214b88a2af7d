"""Python's garbage collector, run between steps at the same step on every rank instead of wherever allocations
trip it.

CPython collects whenever enough container objects have been allocated since the last collection: inside a step,
at a different point on every rank, and the other ranks wait for that one at the next collective, a straggler
that moves from rank to rank. Megatron (--manual-gc) and TorchTitan (gc_freq) turn automatic collection off and
collect every N steps; so does this loop feature. What is alive once it starts (modules, the model, the optimizer)
is frozen: no collection scans it again. Before freezing, only the young generations are collected, as TorchTitan
does at start-up: a full pass over everything torch's import made costs every process 0.2 CPU-seconds or more,
for the few cycles that outlived two collections.
"""

from __future__ import annotations

import gc
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class GarbageCollection:
    """Automatic collection off, a collection after every `every`-th step (0: Python's automatic collection), and
    the collector as it was after the loop (close), for a caller that goes on in the same process."""

    def __init__(self, every: int):
        self.every, self.was_enabled = every, gc.isenabled()
        if every:
            gc.collect(1)
            gc.freeze()
            gc.disable()

    def after_step(self, step: int, skipped: torch.Tensor, log: bool) -> dict[str, float]:
        if self.every and step % self.every == 0:
            gc.collect()  # what is frozen is not scanned: this covers only what the steps so far made
        return {}

    def close(self) -> None:
        if self.every:
            gc.unfreeze()
            if self.was_enabled:
                gc.enable()
