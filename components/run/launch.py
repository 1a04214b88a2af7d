"""The launcher of run_train.sh and docs/multinode_trainer.slurm: torchrun, exiting with its workers' status and
showing a failure once.

torchrun alone exits with 1 whenever a worker fails, whatever the worker's status (2: bad config or input, 3: stopped
by the step guard, 75: stopped by a signal after a checkpoint; docs/reliability.md), and adds its own traceback and
summary to what every rank printed. `python -m components.run.launch <torchrun's arguments>` runs torchrun itself
(torch.distributed.run: its arguments, rendezvous, signal forwarding and shutdown timeout, unchanged), then exits with
the worst status of its workers (worst_status) and prints the report of the rank that failed first: its one line, or
its traceback. Its workers leave their reports to it (report_failure, run_worker) in the error file torchrun gives
each of them, so an error every rank hits is shown once.

A stop signal (SIGTERM, SIGUSR1) that comes before torchrun can pass it on, or before a worker can note it, is held
until then (components/run/stop_signals.py): the launcher blocks both first thing, its workers start with them blocked,
and it unblocks them once torchrun's handler is installed and the workers have started.

At the end of a launch that trained or stopped after a checkpoint, it draws the run: <dump_folder>/metrics.png
(components/metrics/plot.py).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path
from unittest import mock

from components.run.exit_codes import (
    EXIT_BAD_INPUT,
    EXIT_DISK_FULL,
    EXIT_HUNG,
    EXIT_PREEMPTED,
    EXIT_STOPPED,
    exit_process,
)
from components.run.stop_signals import hold_stop_signals, release_stop_signals, stop_signal_pending

KNOWN = (0, EXIT_PREEMPTED, EXIT_HUNG, EXIT_DISK_FULL, EXIT_BAD_INPUT, EXIT_STOPPED)
"""The statuses a worker chooses, least severe first; any other one is a crash, more severe than all of them."""
LAUNCHED = "INGOT_LAUNCHER"
"""Set in the environment of this launcher's workers, which leave their failure reports to it."""
FAILURE_GRACE_SECONDS = 5
"""How long the other workers get to end, once one has ended with a hang, a crash or any status but 0 and 75, before
they are killed. torchrun waits 30 s there (TORCH_ELASTIC_SHUTDOWN_TIMEOUT is for a stop signal, where the workers
save a checkpoint), but with a peer gone no collective of theirs can complete, and a frozen rank, which a SIGTERM does
not stop, would hold the job that long."""


def worst_status(statuses: Iterable[int]) -> int:
    """The status that speaks for several processes: a crash (1, 128+N after signal N, any other) over 3 (step guard)
    over 2 (bad input) over 74 (no space for a checkpoint) over 4 (hang) over 75 (preempted, checkpoint saved) over
    0; of several crashes, the highest number (a signal says more than 1). A crash must not hide behind a stop that
    explains itself, a run that a person must change (3, 2, 74) behind one that may run again (4 after a look at the
    ranks it names, 75 as it is), and nothing behind 0."""
    return max(statuses, key=lambda s: (0, KNOWN.index(s)) if s in KNOWN else (1, s), default=0)


def _error_file() -> str | None:
    """Where a worker of this launcher writes its failure report; None for any other process."""
    return os.environ.get("TORCHELASTIC_ERROR_FILE") if os.environ.get(LAUNCHED) else None


def _write_report(message: str | dict) -> None:
    """A report into this worker's error file, in the format torchrun parses, whole or not at all: torchrun reads
    the error file of every worker that ended with a failure and fails itself on one it cannot parse, and a worker
    writing its report when torchrun's SIGTERM comes (sent to the other workers once one has failed; train.main
    has given the signal's default back by then) dies mid-write. So written beside it and renamed into place."""
    path = Path(_error_file())
    partial = path.with_name(f"{path.name}.partial")
    partial.write_text(json.dumps({"message": message, "timestamp": str(int(time.time()))}))
    os.replace(partial, path)


def report_failure(message: str) -> None:
    """A worker's one-line failure report: for this launcher, which shows the first failing rank's, or on stderr."""
    if _error_file():
        _write_report(message)
    else:
        print(message, file=sys.stderr)


def run_worker(main: Callable[[], int]) -> int:
    """main()'s status. For this launcher an uncaught exception goes with its traceback into the error file (in
    the form of torch's ErrorHandler.record_exception) instead of onto stderr, and the status is 1."""
    if not _error_file():
        return main()
    try:
        return main()
    except Exception as e:
        _write_report({"message": f"{type(e).__name__}: {e}",
                       "extraInfo": {"py_callstack": traceback.format_exc(), "timestamp": str(int(time.time()))}})
        return 1


class Workers:
    """What the launcher learns of the workers by watching torchrun stop them (PContext.close, which it calls once all
    have ended, as soon as one has failed, and when it got a signal)."""

    def __init__(self):
        self.context = None
        self.consequences: set[int] = set()
        """Local ranks still running when torchrun began stopping them after another one ended: their status is a
        consequence of that one's (torchrun's SIGTERM, then SIGKILL, or a broken collective)."""

    def watch(self, close: Callable) -> Callable:
        def watched(context, death_sig=None, timeout=30):
            if context is not self.context:  # the first close of these workers (a restart brings new ones)
                codes = {r: h.proc.poll() for r, h in context.subprocess_handlers.items()}
                running = {r for r, code in codes.items() if code is None}
                self.context = context
                self.consequences = running if len(running) < len(codes) else set()
                if running and any(code not in (None, 0, EXIT_PREEMPTED) for code in codes.values()):
                    timeout = min(timeout, FAILURE_GRACE_SECONDS)
            close(context, death_sig, timeout)
        return watched

    def outcome(self) -> tuple[int | None, list[str]]:
        """The worst status of the ranks that ended on their own (or of all, stopped by a signal to the launcher;
        None before any worker started), and what to print: the first report written, after a line on the rank
        behind the status when that rank wrote none (killed by a signal, say)."""
        if self.context is None:
            return None, []
        codes, reports = {}, []  # global rank -> return code (-N after signal N); (written at, rank, message)
        for local, handler in self.context.subprocess_handlers.items():
            code = handler.proc.poll()
            if code is None or local in self.consequences:
                continue
            rank = int(self.context.envs[local]["RANK"])
            codes[rank] = code
            if code and (report := _read_report(self.context.error_files[local])):
                reports.append((report[0], rank, report[1]))
        statuses = {rank: 128 - code if code < 0 else code for rank, code in codes.items()}
        status, lines = worst_status(statuses.values()), []
        if status not in (0, EXIT_PREEMPTED) and all(statuses[rank] != status for _, rank, _ in reports):
            rank = min(rank for rank, s in statuses.items() if s == status)
            cause = f"was killed by {signal.Signals(-codes[rank]).name}" if codes[rank] < 0 else "exited"
            lines.append(f"rank {rank} {cause} (exit status {status})")
        if reports:
            _, rank, message = min(reports)
            lines.append(message if isinstance(message, str) else
                         f"rank {rank} crashed (exit status {statuses[rank]}):\n{message['extraInfo']['py_callstack']}")
        return status, [line.rstrip() for line in lines]


def _read_report(path: str) -> tuple[int, str | dict] | None:
    """When a worker wrote its error file, and its message: a line (report_failure) or torch's record of an exception
    (run_worker); None without a readable one."""
    try:
        return os.stat(path).st_mtime_ns, json.loads(Path(path).read_text())["message"]
    except (OSError, ValueError, KeyError):
        return None


def _not_replaced(record: logging.LogRecord) -> bool:
    """False for torchrun's log lines that the launcher's report or the workers' own lines replace: the first
    failure it noticed, each worker it then stops, and a stop signal it passes on (the workers say what they do)."""
    return not str(record.msg).startswith(("failed (exitcode", "Sending process", "Received %s death signal"))


def restarts_allowed(argv: list[str]) -> int:
    """job.max_restarts of the training run torchrun's arguments start: read from the arguments that follow the
    script (a config file and overrides), 0 where they do not load (the workers will say why)."""
    from torch.distributed import run as torchrun

    from components.config import ConfigError, read_key

    try:
        return read_key(list(torchrun.parse_args(argv).training_script_args), "job.max_restarts")
    except (ConfigError, OSError, ValueError):
        return 0


def launch_once(argv: list[str]) -> tuple[int, list[str], bool]:
    """torchrun once: the workers' status, what to print, and whether the launcher itself got a signal."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.agent.server.api import SimpleElasticAgent
    from torch.distributed.elastic.multiprocessing.api import PContext, SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    args = torchrun.parse_args(argv)
    if "OMP_NUM_THREADS" not in os.environ and torchrun.determine_local_world_size(args.nproc_per_node) > 1:
        os.environ["OMP_NUM_THREADS"] = "1"  # torchrun's own choice for several workers, which it prints in 4 lines
    own_log_dir = args.log_dir is None  # else torchrun leaves a torchelastic_* folder in TMPDIR at every launch
    if own_log_dir:
        args.log_dir = tempfile.mkdtemp(prefix="torchelastic_")
    workers, signalled = Workers(), None
    with (mock.patch.object(PContext, "close", workers.watch(PContext.close)),
          mock.patch.object(SimpleElasticAgent, "_initialize_workers", _then_release(SimpleElasticAgent))):
        try:
            torchrun.run(args)
        except ChildFailedError:
            pass  # torchrun's summary of the failure: the workers' own statuses and reports are read below
        except SignalException as e:  # torchrun passed the signal on and waited for the workers
            signalled = 128 + e.sigval
        finally:
            hold_stop_signals()  # again: between attempts, and until the launcher exits
    status, lines = workers.outcome()  # reads the workers' error files, in the log folder
    if own_log_dir:
        shutil.rmtree(args.log_dir, ignore_errors=True)
    return (status if status is not None else signalled or 0), lines, signalled is not None


def _then_release(agent_class) -> Callable:
    """torchrun's agent's _initialize_workers (rendezvous, then start the workers with the stop signals still
    blocked), then the signals unblocked: one that came since the launch reaches torchrun's handler now, which
    passes it on to the workers (SignalException, with the workers' context in place to close)."""
    initialize = agent_class._initialize_workers

    def initialize_then_release(agent, worker_group):
        initialize(agent, worker_group)
        release_stop_signals()
    return initialize_then_release


def with_process_count(argv: list[str]) -> list[str]:
    """torchrun's arguments, with one process per CUDA GPU (or one without CUDA) where they name no count."""
    if "PET_NPROC_PER_NODE" in os.environ or any(arg.startswith(("--nproc_per_node", "--nproc-per-node"))
                                                 for arg in argv):
        return argv
    import torch

    return ["--nproc_per_node", str(max(torch.cuda.device_count(), 1)), *argv]


def run_folder(argv: list[str]) -> Path | None:
    """The dump folder of the run torchrun's arguments start (a replica group's own, under fault tolerance); None
    where the arguments do not say (the workers will)."""
    from torch.distributed import run as torchrun

    from components.config import ConfigError, read_key

    try:
        args = list(torchrun.parse_args(argv).training_script_args)
        folder = Path(read_key(args, "job.dump_folder"))
        if read_key(args, "fault_tolerance.enable"):
            folder = folder / f"replica_{read_key(args, 'fault_tolerance.replica_id')}"
    except (ConfigError, OSError, ValueError):
        return None
    return folder


def logged(folder: Path | None) -> tuple[int, int] | None:
    """The size and modification time of the run's metrics.jsonl, None without one: what a launch that logged a step
    changes."""
    try:
        stat = (folder / "metrics.jsonl").stat()
    except (OSError, TypeError):
        return None
    return stat.st_size, stat.st_mtime_ns


def picture_of_the_run(folder: Path) -> None:
    """<folder>/metrics.png (components/metrics/plot.py), said in one line; a drawing that fails costs one line."""
    from components.metrics.plot import plot_runs

    try:
        if plot_runs([folder], folder / "metrics.png"):
            print(f"plot of the run: {folder / 'metrics.png'}", file=sys.stderr, flush=True)
    except Exception as e:  # noqa: BLE001 -- the run is done: its status stands whatever the drawing meets
        print(f"no plot of the run: {type(e).__name__}: {e}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    """torchrun (launch_with_restarts), then a picture of the run where this launch logged steps and the run trained
    to its end (0) or stopped after a checkpoint (75)."""
    hold_stop_signals()  # until torchrun can pass them on to the workers (launch_once): not lost, not fatal
    argv = with_process_count(sys.argv[1:] if argv is None else argv)
    folder = run_folder(argv)
    before = logged(folder)
    status = launch_with_restarts(argv)
    if status in (0, EXIT_PREEMPTED) and logged(folder) not in (None, before):
        picture_of_the_run(folder)
    return status


def launch_with_restarts(argv: list[str]) -> int:
    """torchrun, and again after a crash or a hang as many times as job.max_restarts allows: each attempt resumes
    the run's last checkpoint. Never after bad input (2), the step guard (3), a full disk (74), a preemption (75) or
    a signal to the launcher: those a person or the scheduler decides on."""
    os.environ[LAUNCHED] = "1"
    for name in ("torch.distributed.elastic.multiprocessing.api", "torch.distributed.elastic.agent.server.api"):
        logging.getLogger(name).addFilter(_not_replaced)
    restarts = restarts_allowed(argv)
    for attempt in range(restarts + 1):
        status, lines, signalled = launch_once(argv)
        for line in lines:
            print(line, file=sys.stderr, flush=True)
        stopped = signalled or stop_signal_pending()  # a stop signal after the workers ended: no restart
        if stopped or status in (0, EXIT_PREEMPTED, EXIT_BAD_INPUT, EXIT_STOPPED, EXIT_DISK_FULL) or \
                attempt == restarts:
            return status
        cause = lines[0] if lines else f"exit status {status}"
        print(f"restart {attempt + 1} of {restarts} (job.max_restarts) after: {cause}", file=sys.stderr, flush=True)
    return status


if __name__ == "__main__":
    exit_process(main())
