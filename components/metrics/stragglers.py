"""Per-rank step times: on each logged step the fastest and slowest rank's, and a rank that stays slower than the
others named once (metrics.straggler_factor).

The ranks of a job wait for each other inside their collectives, so a step takes the same wall time on every rank.
What differs is how long each worked on its own: a rank's step time here is the time the training loop's thread
ran or waited for a CPU between one step and the next (Linux's per-thread accounting, /proc/thread-self/schedstat:
time on a CPU plus time in the run queue), plus the time it waited for its data loader. A thread blocked in a
collective is neither, so the time a rank waits for the others is left out without timing torch's waits (torch
has no hook for them on gloo: ProcessGroup's completion hook is NCCL's only). The slowest rank hardly waits; the
others wait for it, so its figure is the largest and the spread between the ranks is the time the others lost to
it each step. A rank slowed by computing longer, or by sharing its CPUs, or by a data loader that cannot keep up,
is measured; one blocked on something else in the loop's thread (a sleep, a disk read) is not. With gloo (CPU)
the thread blocks in a collective until it is done; on CUDA the host waits for the device by spinning, so these
figures are not measured there, nor where the kernel keeps no such accounting; the hang report
(components/run/heartbeat.py) and NCCL's flight recorder still name a rank that stops.

A rank is compared with the other ranks of its pipeline stage (stages do different work): it is named when its
step time is at least `factor` times theirs (the median) in PERSISTENT logged intervals in a row.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist

logger = logging.getLogger("ingot")

PERSISTENT = 3
"""Logged intervals in a row a rank must be slow in before it is named: one slow interval is a hiccup."""


SCHEDSTAT = Path("/proc/thread-self/schedstat")


def active_seconds() -> float | None:
    """Seconds the calling thread has run on a CPU or waited in the run queue for one, since it started; None where
    the kernel does not say (not Linux, or no scheduler accounting)."""
    try:
        on_cpu, run_queue = SCHEDSTAT.read_text().split()[:2]
    except OSError:
        return None
    return (int(on_cpu) + int(run_queue)) / 1e9


def slow_ranks(times: list[float], stages: list[int], factor: float) -> list[int]:
    """The ranks whose step time is at least `factor` times the median of the other ranks of their stage."""
    slow = []
    for rank, (mine, stage) in enumerate(zip(times, stages)):
        others = [t for r, (t, s) in enumerate(zip(times, stages)) if s == stage and r != rank]
        if others and mine >= factor * statistics.median(others) and mine > 0:
            slow.append(rank)
    return slow


class StepTimes:
    """A loop feature (components/training/loop_features.py): rank_step_time_min / _max (seconds per step over the
    logged interval, the first step left out: it compiles and warms up) and slowest_rank on logged steps; a persistent
    straggler named once in the log. Measures nothing with one process or on CUDA."""

    def __init__(self, factor: float, pp_group: dist.ProcessGroup | None, device: torch.device):
        self.factor = factor
        self.rank, self.world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        self.measured = self.world > 1 and device.type == "cpu" and active_seconds() is not None
        self.data_wait = 0.0  # seconds blocked waiting for the data loader since the last step
        self.stage = dist.get_rank(pp_group) if pp_group is not None else 0  # the rank's pipeline stage
        self.last = None  # active_seconds() when the previous step ended
        self.own, self.steps = 0.0, 0
        self.streaks, self.named = [0] * self.world, set()

    def reading(self, batches: Iterable) -> Iterator:
        """`batches`, the time this thread is blocked waiting for each counted as its own (a data loader's worker
        processes work elsewhere: waiting for them is this rank's; loading in this thread is active time already)."""
        batches = iter(batches)
        while True:
            wall, active = time.perf_counter(), active_seconds() if self.measured else None
            try:
                batch = next(batches)
            except StopIteration:
                return
            if active is not None:
                self.data_wait += time.perf_counter() - wall - (active_seconds() - active)
            yield batch

    def after_step(self, step: int, skipped: torch.Tensor, log: bool) -> dict[str, float]:
        if not self.measured:
            return {}
        now, data_wait = active_seconds(), self.data_wait
        self.data_wait = 0.0
        if self.last is not None:
            self.own, self.steps = self.own + now - self.last + data_wait, self.steps + 1
        self.last = now
        if not log or not self.steps:
            return {}
        everyone = [torch.zeros(2, dtype=torch.float64) for _ in range(self.world)]
        dist.all_gather(everyone, torch.tensor([self.own / self.steps, self.stage], dtype=torch.float64))
        self.own, self.steps = 0.0, 0
        times, stages = [t[0].item() for t in everyone], [int(t[1].item()) for t in everyone]
        self.name_stragglers(step, times, stages)
        slowest = max(range(self.world), key=times.__getitem__)
        return {"rank_step_time_min": min(times), "rank_step_time_max": times[slowest], "slowest_rank": slowest}

    def name_stragglers(self, step: int, times: list[float], stages: list[int]) -> None:
        slow = slow_ranks(times, stages, self.factor) if self.factor else []
        self.streaks = [streak + 1 if rank in slow else 0 for rank, streak in enumerate(self.streaks)]
        for rank, streak in enumerate(self.streaks):
            if streak >= PERSISTENT and rank not in self.named:
                self.named.add(rank)
                if self.rank == 0:
                    peers = [t for r, t in enumerate(times) if stages[r] == stages[rank] and r != rank]
                    others = statistics.median(peers)
                    logger.warning(
                        f"straggler: rank {rank} took {times[rank]:.3f} s per step of its own work at step {step}, "
                        f"{times[rank] / others:.1f}x the {others:.3f} s of the other ranks of its pipeline stage, "
                        f"in each of the last {PERSISTENT} logged intervals (metrics.straggler_factor {self.factor}); "
                        f"the other ranks wait for it every step"
                    )
