"""Where each rank is, so that a run that hangs names the ranks that stopped.

Every rank publishes where it is in the job's c10d store (the key-value store the process group was built on):
its step, and whether it has passed that step's optimizer step. When a collective times out
(comm.train_timeout_seconds), the ranks still running read everyone's last heartbeat: the ranks behind the
furthest (or never heard from) are the ones that stopped (a stopped or frozen process, a dead peer, a rank
stuck in its data or in another collective). train.py turns the timeout into Hung, which ends the run with
EXIT_HUNG (components/stopping.py) and that one screen. On CUDA the NCCL flight recorder also dumps each
rank's last collectives (comm.trace_buf_size, comm.flight_recorder_folder).
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch.distributed as dist

KEY = "ingot/heartbeat/"
PHASES = ("before its optimizer step", "after its optimizer step")
"""A step's phases, in order: forward, backward and the optimizer step; then metrics, evaluation, checkpoints."""


class Hung(RuntimeError):
    """A collective timed out: the message names the ranks that stopped and where."""


def is_timeout(error: BaseException) -> bool:
    """Whether `error` is a collective that timed out (gloo, NCCL)."""
    text = str(error).lower()
    return "timed out" in text or "timeout" in text and "collective" in text


class Heartbeat:
    def __init__(self, timeout_seconds: int):
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.timeout = timeout_seconds
        # torch's handle on the store its default group was built on (private: there is no public one).
        self.store = dist.distributed_c10d._get_default_store() if self.world > 1 else None

    def beat(self, step: int, phase: int) -> None:
        """This rank has reached `phase` (an index into PHASES) of `step`."""
        if self.store is not None:
            self.store.set(f"{KEY}{self.rank}", f"{step} {phase} {time.time()}")

    def stopped(self, error: BaseException) -> Hung:
        """The Hung to raise after `error`, a collective that timed out on this rank."""
        heard = {}
        if self.store is not None:
            self.store.set_timeout(timedelta(seconds=5))
            for rank in range(self.world):
                try:
                    step, phase, at = self.store.get(f"{KEY}{rank}").decode().split()
                    heard[rank] = (int(step), int(phase), float(at))
                except Exception:  # noqa: BLE001 - a rank that never published, or a store that is gone
                    heard[rank] = None
        now = time.time()
        furthest = max((h[:2] for h in heard.values() if h), default=(0, 0))
        stopped = [rank for rank, h in heard.items() if h is None or h[:2] < furthest]
        where = "; ".join(f"rank {rank} " + (f"in step {heard[rank][0]} {PHASES[heard[rank][1]]}, last heard "
                                             f"{now - heard[rank][2]:.0f} s ago" if heard[rank] else "never heard from")
                          for rank in stopped[:8])
        more = f" and {len(stopped) - 8} more" if len(stopped) > 8 else ""
        summary = (f"{len(stopped)} rank(s) stopped making progress: {where}{more}" if stopped
                   else "no rank is behind the others (a collective they all entered timed out)")
        mine = heard.get(self.rank)
        at = f" in step {mine[0]} {PHASES[mine[1]]}" if mine else ""
        return Hung(f"a collective timed out after comm.train_timeout_seconds {self.timeout} s on rank {self.rank}"
                    f"{at}: {summary} ({str(error).strip().splitlines()[0][:200]})")
