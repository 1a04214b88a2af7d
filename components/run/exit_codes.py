"""The exit statuses a training run chooses (docs/reliability.md; components/run/stopping.py maps what ended a run to
them), and the way its processes exit with one. Nothing of torch imported here, so that the launcher
(components/run/launch.py) reads them without importing torch's checkpointing."""

import logging
import os
import sys

EXIT_BAD_INPUT, EXIT_STOPPED, EXIT_HUNG = 2, 3, 4
"""A config or input that cannot be used; a run stopped by its step guard (non-finite values, too many skipped
steps); a run whose collective timed out because a rank stopped making progress (components/run/heartbeat.py)."""
EXIT_DISK_FULL = 74
"""Exit status of a run that could not save a checkpoint it needed for lack of space (EX_IOERR of sysexits.h): the
older checkpoints are intact, the failed save's folder removed (components/checkpoint/dcp.py, DiskFull)."""
EXIT_PREEMPTED = 75
"""Exit status of a run stopped by a signal after saving its checkpoint (EX_TEMPFAIL of sysexits.h:
"try again later")."""


def exit_process(status: int) -> None:
    """End this process with `status` once its logs and standard streams are flushed, skipping the interpreter's
    teardown; the last call of the trainer's and the launcher's processes, after they closed what they opened.

    torch's C++ threads take the GIL to free the Python tensors of a collective they finished (gloo's worker
    threads, after the last collective of a run or of a failed start-up); one that does so while the interpreter
    tears down aborts the process ("terminate called without an active exception", status 134 instead of the
    run's: pytorch/pytorch#38228), now and then on a loaded machine. Without the teardown there is none, and
    no last collection over every object of torch's modules either (0.6 s per process on this project's CI)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(status)
