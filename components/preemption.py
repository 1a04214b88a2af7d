"""Checkpoint and exit cleanly when the job is about to be stopped.

SLURM sends SIGTERM before killing a job (preemption, scancel; SIGKILL follows after its
GraceTime/KillWait), and `#SBATCH --signal=USR1@<seconds>` sends SIGUSR1 that long before the time
limit. torchrun forwards both to the workers when told to (run_train.sh does: see
docs/reliability.md). train.main installs a handler that only notes the signal. At each step boundary the ranks
agree whether any of them got one (an all-reduce on a CPU group, so no device sync, whose answer is read one step
later, so that no step waits for it); if so, they all save a checkpoint of that step and train.py exits with
EXIT_PREEMPTED. Re-running the same command resumes.

The handler is installed before the data loader starts its worker processes, which inherit it:
a signal that reaches the whole process tree must not kill a worker before the checkpoint is saved.
"""

from __future__ import annotations

import json
import logging
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

EXIT_PREEMPTED = 75
"""Exit status of a run stopped by a signal after saving its checkpoint (EX_TEMPFAIL of sysexits.h:
"try again later")."""
PREEMPTED_FILE = "preempted.json"
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopSignals:
    """While active (a context manager), SIGTERM and SIGUSR1 are noted instead of ending the
    process; the previous handlers come back on exit."""

    def __init__(self):
        self.received: int | None = None
        self.previous = {}
        self.in_flight: tuple[torch.Tensor, dist.Work] | None = None

    def __enter__(self) -> StopSignals:
        for signum in SIGNALS:
            self.previous[signum] = signal.signal(signum, self._note)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)

    def _note(self, signum, frame) -> None:
        self.received = signum

    def agreed(self, group) -> bool:
        """Whether any rank of `group` (a gloo group: CPU tensors) had received a signal when the previous
        call was made. Each call starts the all-reduce of this rank's flag and reads the one the previous
        call started, which every rank has joined by now: the ranks agree one step later and never wait
        for each other here."""
        flag = torch.tensor([0 if self.received is None else 1])
        previous, self.in_flight = self.in_flight, (flag, dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group,
                                                                          async_op=True))
        if previous is None:
            return False
        previous_flag, work = previous
        work.wait()
        return bool(previous_flag.item())

    def describe(self) -> str:
        return signal.Signals(self.received).name if self.received is not None else "a stop signal on another rank"


def write_preempted_record(dump_folder: Path, step: int, checkpoint: Path, cause: str) -> Path:
    """<dump_folder>/preempted.json: what a job script reads to decide on requeueing."""
    path = dump_folder / PREEMPTED_FILE
    record = {"step": step, "checkpoint": str(checkpoint), "signal": cause, "time": time.time()}
    path.write_text(json.dumps(record) + "\n")
    return path
