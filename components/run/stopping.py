"""How a run ends: its exit status, and stopping cleanly when the job is about to be stopped.

Exit statuses (docs/reliability.md): 0 done; 1 a crash (a traceback); EXIT_BAD_INPUT (2) a config or input
that cannot be used, found at start-up with one line; EXIT_STOPPED (3) the step guard stopped the run
(non-finite values, too many skipped steps); EXIT_HUNG (4) a rank stopped making progress and a collective
timed out (one screen names the ranks); EXIT_DISK_FULL (74) a checkpoint the run needed found no space (one line);
EXIT_PREEMPTED (75) stopped by a signal after saving a checkpoint.
`exit_status` maps what ended train() to them.

Preemption. SLURM sends SIGTERM before killing a job (preemption, scancel; SIGKILL follows after its
GraceTime/KillWait), and `#SBATCH --signal=USR1@<seconds>` sends SIGUSR1 that long before the time limit.
torchrun forwards both to the workers when told to (run_train.sh does: see docs/reliability.md). Both are held
(blocked) from the launcher's start until a handler is in place (components/run/stop_signals.py), so one that comes
during start-up is never lost and never kills a worker by its default action. train.main installs a handler that
only notes the signal (StopSignals). Just before the first step the ranks agree whether any of them got one; if so,
they exit with EXIT_PREEMPTED having trained and written nothing (Preemption.before_first_step raises
StoppedAtStartUp, which exit_status maps to that status). At each step boundary the ranks agree whether any of
them got one (an all-reduce on a CPU group, so no device sync, whose answer is read one step later, so that no step
waits for it); if so, they all save a checkpoint of that step and exit with EXIT_PREEMPTED (Preemption).
Re-running the same command resumes.

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

from components.checkpoint.disk_full import DiskFull
from components.config import ConfigError
from components.run.exit_codes import EXIT_BAD_INPUT, EXIT_DISK_FULL, EXIT_HUNG, EXIT_PREEMPTED, EXIT_STOPPED
from components.run.heartbeat import Hung
from components.run.lock import FolderInUse
from components.run.stop_signals import STOP_SIGNALS, release_stop_signals
from components.training.step_guard import TrainingStopped

logger = logging.getLogger(__name__)

PREEMPTED_FILE = "preempted.json"


class StoppedAtStartUp(Exception):
    """A stop signal reached a rank during start-up: the run ends before its first step (EXIT_PREEMPTED)."""


def exit_status(run: Callable[[], int], report: Callable[[str], None]) -> int:
    """run()'s status; where an exception ends it, the status that names its kind, after `report` got its one
    line: bad input (EXIT_BAD_INPUT), a stop of the step guard (EXIT_STOPPED), a hang (EXIT_HUNG), a checkpoint
that found no space (EXIT_DISK_FULL); a stop signal during start-up is
    no failure: EXIT_PREEMPTED, with a line in the log. Any other exception is a crash: it propagates, with its
    traceback."""
    try:
        return run()
    except StoppedAtStartUp as e:
        logger.info(f"{e}; exiting with status {EXIT_PREEMPTED} (rerun to start)")
        return EXIT_PREEMPTED
    except (ConfigError, FileNotFoundError, ValueError, FolderInUse) as e:
        report(f"error: {e}")
        return EXIT_BAD_INPUT
    except TrainingStopped as e:
        report(f"training stopped: {e}")
        return EXIT_STOPPED
    except Hung as e:
        report(f"hang: {e}")
        return EXIT_HUNG
    except DiskFull as e:
        report(f"disk full: {e}")
        return EXIT_DISK_FULL


def leave_signals_to_the_trainer(worker_id: int = 0) -> None:
    """The `worker_init_fn` of the data loaders' worker processes. Schedulers signal every process of a job
    (SLURM), or its process group (timeout, Kubernetes), and torchrun passes a signal on to each worker's group,
    which holds its loader workers; torch's DataLoader makes a worker die of SIGTERM, so the trainer's next batch
    failed before it could save. Loader workers now ignore the stop signals and leave them to the trainer,
    which stops their processes once it has saved; and they die with it (Linux) if it is killed."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the trainer


class StopSignals:
    """While active (a context manager), SIGTERM and SIGUSR1 are noted instead of ending the process, those that
    came while they were held (since the launch, under the launcher) included; on exit the signal mask and the
    handlers are as before: a launcher's worker holds them again until it exits."""

    def __init__(self):
        self.received: int | None = None
        self.previous = {}
        self.previous_mask: set[int] = set()
        self.in_flight: tuple[torch.Tensor, dist.Work] | None = None

    def __enter__(self) -> StopSignals:
        for signum in STOP_SIGNALS:
            self.previous[signum] = signal.signal(signum, self._note)
        self.previous_mask = release_stop_signals()
        return self

    def __exit__(self, *exc) -> None:
        signal.pthread_sigmask(signal.SIG_SETMASK, self.previous_mask)
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)

    def _note(self, signum, frame) -> None:
        self.received = signum

    def agreed(self, group) -> bool:
        """Whether any rank of `group` (a gloo group: CPU tensors) had received a signal when the previous
        call was made. Each call starts the all-reduce of this rank's flag and reads the one the previous
        call started, which every rank has joined by now: the ranks agree one step later and never wait
        for each other here."""
        flag = self._flag()
        previous, self.in_flight = self.in_flight, (flag, dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group,
                                                                          async_op=True))
        if previous is None:
            return False
        previous_flag, work = previous
        work.wait()
        return bool(previous_flag.item())

    def agreed_now(self, group) -> bool:
        """Whether any rank of `group` has received a signal by now (a blocking all-reduce: before the first step)."""
        flag = self._flag()
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return bool(flag.item())

    def _flag(self) -> torch.Tensor:
        """This rank's vote to stop: 1 once it received a signal."""
        return torch.tensor([0 if self.received is None else 1])

    def describe(self) -> str:
        return signal.Signals(self.received).name if self.received is not None else "a stop signal on another rank"


class Preemption:
    """Before the first step, whether a signal came during start-up (`before_first_step`); in the training loop,
    whether the ranks agreed to stop for a signal (`agreed`, once per step), and the stop itself (`stop`): a
    checkpoint of the step on every rank, preempted.json, EXIT_PREEMPTED."""

    def __init__(self, signals: StopSignals, checkpointer, dump_folder: Path, timeout_seconds: int):
        self.signals, self.checkpointer, self.dump_folder = signals, checkpointer, dump_folder
        # Agreeing without a device sync: a CPU group, with the training timeout.
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_seconds))

    def before_first_step(self) -> None:
        """Raises StoppedAtStartUp where any rank got a stop signal during start-up: the run stops before its first
        step, having written nothing (a previous preemption's record stays, true still). Otherwise training starts,
        and the record of a previous preemption goes."""
        if self.signals.agreed_now(self.group):
            raise StoppedAtStartUp(f"{self.signals.describe()} during start-up: stopping before the first step, "
                                   f"nothing trained or written")
        if dist.get_rank() == 0:
            (self.dump_folder / PREEMPTED_FILE).unlink(missing_ok=True)

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
