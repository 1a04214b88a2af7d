"""Per-rank step times: on each logged step the fastest and slowest rank's, and a rank that stays slower than the
others named once (metrics.straggler_factor).

The ranks of a job wait for each other inside their collectives, so a step takes the same wall time on every rank.
What differs is how long each worked on its own: a rank's step time here is the wall time from one step to the
next less the time it waited in collectives. The slowest rank hardly waits; the others wait for it, so its figure
is the largest and the spread between the ranks is the time the others lost to it each step.

Waiting is the time the trainer's thread blocked in torch's two waits for a collective: `Work.wait()`
(torch.distributed's collectives: FSDP's all-gathers and reduce-scatters, all-reduces, pipeline sends and
receives, this module's gather) and functional collectives' `wait_tensor` (DTensor's: tensor parallelism, the
gradient norm). torch offers no hook for either on gloo (ProcessGroup's completion hook is NCCL's only), so
CollectiveWaits wraps both while the loop runs. With gloo (CPU) the host blocks in them until the collective is
done. NCCL's waits return at once (the device waits, not the host), so on CUDA these figures are not measured;
the hang report (components/run/heartbeat.py) and NCCL's flight recorder still name a rank that stops.

A rank is compared with the other ranks of its pipeline stage (stages do different work): it is named when its
step time is at least `factor` times theirs (the median) in PERSISTENT logged intervals in a row.
"""

from __future__ import annotations

import logging
import statistics
import threading
import time

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

logger = logging.getLogger("ingot")

PERSISTENT = 3
"""Logged intervals in a row a rank must be slow in before it is named: one slow interval is a hiccup."""


class CollectiveWaits:
    """Seconds the creating thread has blocked waiting for collectives since the last `take()`: in `Work.wait()`
    (torch.distributed's collectives) and in functional collectives' `wait_tensor` (DTensor's). `close()` puts
    both of torch's functions back. Other threads' waits (an asynchronous checkpoint save's) are not counted, nor
    are waits inside compiled code (the graph waits by itself)."""

    def __init__(self):
        self.seconds, self.thread = 0.0, threading.get_ident()
        self.originals = [(dist.Work, "wait", dist.Work.wait), (funcol, "wait_tensor", funcol.wait_tensor)]
        for owner, name, original in self.originals:
            setattr(owner, name, self.timed(original))

    def timed(self, original):
        def timed_wait(*args, **kwargs):
            if torch.compiler.is_compiling() or threading.get_ident() != self.thread:
                return original(*args, **kwargs)
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        return timed_wait

    def take(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds

    def close(self) -> None:
        for owner, name, original in self.originals:
            setattr(owner, name, original)


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
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.waits = CollectiveWaits() if self.world > 1 and device.type == "cpu" else None
        self.stage = dist.get_rank(pp_group) if pp_group is not None else 0  # the rank's pipeline stage
        self.last = None  # the clock when the previous step ended
        self.own, self.steps = 0.0, 0
        self.streaks, self.named = [0] * self.world, set()

    def after_step(self, step: int, skipped: torch.Tensor, log: bool) -> dict[str, float]:
        if self.waits is None:
            return {}
        now, waited = time.perf_counter(), self.waits.take()
        if self.last is not None:
            self.own, self.steps = self.own + now - self.last - waited, self.steps + 1
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

    def close(self) -> None:
        if self.waits is not None:
            self.waits.close()
