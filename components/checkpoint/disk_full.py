"""A checkpoint save that ran out of space: how to tell (out_of_space) and what a run that cannot go on without it
raises (DiskFull). components/checkpoint/dcp.py's CheckpointManager decides what follows (checkpoint.on_disk_full)."""

from __future__ import annotations

import shutil
from pathlib import Path

from torch.distributed.checkpoint.api import CheckpointException

from components.checkpoint.durable import NO_SPACE


class DiskFull(Exception):
    """A checkpoint the run needs could not be written for lack of space: with checkpoint.on_disk_full "stop", or the
    last step's or a preemption's save, after which no later save would make up for it (EXIT_DISK_FULL)."""


FULL_BELOW = 0.01
"""A save that failed while its file system had less than this share of its size free ran out of space: torch's
writer of pickled entries reports a failed write only as `unexpected pos N vs M` (inline_container.cc), without
the OSError."""


def out_of_space(folder: Path, error: BaseException) -> str | None:
    """How full the file system of `folder` is ("0.00 GiB free of 0.12 GiB"), where the failed save `error` ran out of
    space: an OSError ENOSPC or EDQUOT among its causes (DCP's per-rank failures included), or less than FULL_BELOW
    of the file system free now, with the failed save's files still there. None otherwise."""
    usage = shutil.disk_usage(folder)
    figures = f"{usage.free / 2**30:.2f} GiB free of {usage.total / 2**30:.2f} GiB"
    if any(isinstance(e, OSError) and e.errno in NO_SPACE for e in causes(error)):
        return figures
    return figures if usage.free < FULL_BELOW * usage.total else None


def causes(error: BaseException) -> list[BaseException]:
    """`error` and what caused it: its causes and contexts, and DCP's per-rank failures."""
    seen, todo, found = set(), [error], []
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        found.append(e)
        if isinstance(e, CheckpointException):
            todo += [failure for failure, _ in e.failures.values()]
        todo += [e.__cause__, e.__context__]
    return found
