"""One job per dump folder, and workers that die with their launcher.

A job's rank 0 holds an exclusive lock on `<dump_folder>/.lock` for the job's whole life; a second
job started on the same folder finds it held and stops before writing anything, naming the holder.
The lock is the kernel's (fcntl.lockf, a POSIX record lock): it goes away with the process that holds
it, however that process ends (kill -9 included), so a dead job never blocks a restart. On NFS the
lock goes through the server's lock manager (NLM for NFSv3, built into NFSv4) and holds across hosts;
Lustre honours it across clients only when mounted with `-o flock` (with `-o localflock` it holds on one
host only). Where the filesystem cannot lock at all, the job says so and runs unguarded. A job that wrote nothing
into its folder (refused, or stopped by a signal, before its first step) leaves it as it was: a folder it created goes
again, and so does a lock file it created in a folder that was there; a folder it created also goes when the run
failed before its first step after writing its start-up files (a bad data line is found by the first step's read).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import logging
import os
import shutil
import signal
import socket
import sys
import time
from pathlib import Path

logger = logging.getLogger(__name__)

LOCK_FILE = ".lock"


class FolderInUse(RuntimeError):
    """Another live job holds the dump folder."""


_held: dict[Path, tuple[object, Path | None, set[str] | None]] = {}
"""The open lock files (a lock lasts as long as its file stays open), each with the outermost folder its job
created (None where the folder was there before) and, where the job created the lock file in a folder that was
there, the names the folder held before."""
_failed_before_first_step: set[Path] = set()


def lock_dump_folder(folder: Path) -> None:
    """Hold the folder's lock until this process ends (or go on unguarded where the filesystem cannot
    lock). Raises FolderInUse when another job holds it."""
    folder = folder.resolve()
    if folder in _held:  # POSIX locks are per process: taking it again, or closing a second handle, would drop it
        return
    created = next((f for f in reversed([folder, *folder.parents]) if not f.exists()), None)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK_FILE
    before = {p.name for p in folder.iterdir()} if created is None and not path.exists() else None
    handle = open(path, "a+")
    try:
        fcntl.lockf(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in (errno.EACCES, errno.EAGAIN):
            handle.seek(0)
            holder = handle.read().strip() or "a process that wrote no details yet"
            handle.close()
            raise FolderInUse(
                f"{folder} is in use by another job ({holder}; lock file {path}): wait for it to end or stop it, "
                f"or give this run another --job.dump_folder"
            ) from None
        logger.warning(f"cannot lock {path} ({e.strerror}): a second job on this folder would not be noticed")
        handle.close()
        return
    handle.seek(0)
    handle.truncate()
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime())
    handle.write(f"host {socket.gethostname()}, pid {os.getpid()}, started {started}\n")
    handle.flush()
    _held[folder] = handle, created, before


def failed_before_first_step(folder: Path) -> None:
    """The run ended by an error before its first step: at release, a folder this job created goes whole, what its
    start-up wrote included (config.toml, an empty metrics.jsonl, tb/)."""
    _failed_before_first_step.add(folder.resolve())


def release_dump_folders() -> None:
    """Drop this process's folder locks (at a run's end: in a test, a run ends inside a longer-lived process). A
    folder the job created and left holding only its lock file, or that it wrote into before failing ahead of its
    first step, goes, with the empty folders created above it; a lock file the job created in a folder whose names
    it left as they were goes too."""
    for folder, (handle, created, before) in _held.items():
        handle.close()
        if created is not None and folder in _failed_before_first_step:
            shutil.rmtree(created, ignore_errors=True)
        elif before is not None and {p.name for p in folder.iterdir()} == before | {LOCK_FILE}:
            (folder / LOCK_FILE).unlink()
        elif created is not None and [p.name for p in folder.iterdir()] == [LOCK_FILE]:
            (folder / LOCK_FILE).unlink()
            with contextlib.suppress(OSError):  # a folder something else wrote into meanwhile stays
                for empty in [folder, *folder.parents]:
                    empty.rmdir()
                    if empty == created:
                        break
    _held.clear()
    _failed_before_first_step.clear()


def die_with_launcher() -> None:
    """Under torchrun, have the kernel kill this worker when its launcher (the elastic agent, our parent)
    dies: torchrun starts each worker in a session of its own, so killing the launcher's process
    group would otherwise leave the workers training. Linux only (prctl's parent-death signal);
    checkpoints are written atomically, so being killed mid-save leaves the last good one in place."""
    if not sys.platform.startswith("linux") or "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() == 1:  # the launcher died before the request took effect: init adopted us
        os.kill(os.getpid(), signal.SIGKILL)
