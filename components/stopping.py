"""How a run ends: its exit status, and stopping cleanly when the job is about to be stopped.

Exit statuses (docs/reliability.md): 0 done; 1 a crash (a traceback); EXIT_BAD_INPUT (2) a config or input
that cannot be used, found at start-up with one line; EXIT_STOPPED (3) the step guard stopped the run
(non-finite values, too many skipped steps); EXIT_HUNG (4) a rank stopped making progress and a collective
timed out (one screen names the ranks); EXIT_PREEMPTED (75) stopped by a signal after saving a checkpoint.
`exit_status` maps what ended train() to them.

Preemption. SLURM sends SIGTERM before killing a job (preemption, scancel; SIGKILL follows after its
GraceTime/KillWait), and `#SBATCH --signal=USR1@<seconds>` sends SIGUSR1 that long before the time limit.
torchrun forwards both to the workers when told to (run_train.sh does: see docs/reliability.md). train.main
installs a handler that only notes the signal (StopSignals). At each step boundary the ranks agree whether
any of them got one (an all-reduce on a CPU group, so no device sync, whose answer is read one step later, so
that no step waits for it); if so, they all save a checkpoint of that step and exit with EXIT_PREEMPTED
(Preemption). Re-running the same command resumes.

A signal that reaches the whole process tree must not kill a data loader's worker process before the
checkpoint is saved: the loaders' workers ignore the stop signals (leave_signals_to_the_trainer).
"""

from __future__ import annotations

import ctypes
import json
import logging
import signal
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from components.config import ConfigError
from components.exit_codes import EXIT_BAD_INPUT, EXIT_HUNG, EXIT_PREEMPTED, EXIT_STOPPED
from components.heartbeat import Hung
from components.run_lock import FolderInUse
from components.step_guard import TrainingStopped

logger = logging.getLogger(__name__)

PREEMPTED_FILE = "preempted.json"
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


def exit_status(run: Callable[[], int], report: Callable[[str], None]) -> int:
    """run()'s status; where an exception ends it, the status that names its kind, after `report` got its one
    line: bad input (EXIT_BAD_INPUT) or a stop of the step guard (EXIT_STOPPED). Any other exception is a crash:
    it propagates, with its traceback."""
    try:
        return run()
    except (ConfigError, FileNotFoundError, ValueError, FolderInUse) as e:
        report(f"error: {e}")
        return EXIT_BAD_INPUT
    except TrainingStopped as e:
        report(f"training stopped: {e}")
        return EXIT_STOPPED
    except Hung as e:
        report(f"hang: {e}")
        return EXIT_HUNG


def leave_signals_to_the_trainer(worker_id: int = 0) -> None:
    """The `worker_init_fn` of the data loaders' worker processes. Schedulers signal every process of a job
    (SLURM), or its process group (timeout, Kubernetes), and torchrun passes a signal on to each worker's group,
    which holds its loader workers; torch's DataLoader makes a worker die of SIGTERM, so the trainer's next batch
    failed before it could save. Loader workers now ignore the stop signals and leave them to the trainer,
    which stops their processes once it has saved; and they die with it (Linux) if it is killed."""
    for signum in SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the trainer


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


class Preemption:
    """In the training loop: whether the ranks agreed to stop for a signal (`agreed`, once per step), and the
    stop itself (`stop`): a checkpoint of the step on every rank, preempted.json, EXIT_PREEMPTED."""

    def __init__(self, signals: StopSignals, checkpointer, dump_folder: Path, timeout_seconds: int):
        self.signals, self.checkpointer, self.dump_folder = signals, checkpointer, dump_folder
        # Agreeing without a device sync: a CPU group, with the training timeout.
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_seconds))
        if dist.get_rank() == 0:
            (dump_folder / PREEMPTED_FILE).unlink(missing_ok=True)

    def agreed(self) -> bool:
        return self.signals.agreed(self.group)

    def stop(self, step: int) -> int:
        """Save a checkpoint of `step` on every rank; return the exit status of a preempted run."""
        cause = self.signals.describe()
        if not self.checkpointer.cfg.enable:
            logger.warning(f"{cause} at step {step}: stopping without a checkpoint (checkpoint.enable is false)")
            return EXIT_PREEMPTED
        self.checkpointer.maybe_save(step, force=True)
        self.checkpointer.wait()
        path = self.checkpointer.folder / f"step-{step}"
        if dist.get_rank() == 0:
            write_preempted_record(self.dump_folder, step, path, cause)
        logger.info(f"{cause}: checkpoint {path} saved; exiting with status {EXIT_PREEMPTED} (rerun to resume)")
        return EXIT_PREEMPTED


def write_preempted_record(dump_folder: Path, step: int, checkpoint: Path, cause: str) -> Path:
    """<dump_folder>/preempted.json: what a job script reads to decide on requeueing."""
    path = dump_folder / PREEMPTED_FILE
    record = {"step": step, "checkpoint": str(checkpoint), "signal": cause, "time": time.time()}
    path.write_text(json.dumps(record) + "\n")
    return path
