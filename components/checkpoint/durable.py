"""Files that a crash or a full disk leaves whole or not at all: fsync, write-then-rename, and appended lines
that are all there or not at all."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
"""The errors of a write that found no room: the file system is full, or the user's quota is used up."""


def append_whole(fd: int, text: str) -> None:
    """Append `text` to the file open (O_APPEND) as `fd`, whole or not at all: a write that fails part-way (no space
    left) is undone before its error propagates, so that no reader ever meets half a line."""
    data, size = text.encode(), os.fstat(fd).st_size
    try:
        while data:
            data = data[os.write(fd, data):]
    except OSError:
        os.ftruncate(fd, size)
        raise


def fsync_path(path: Path) -> None:
    """Flush a file's (or a folder's entries') data to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_atomically(path: Path, obj) -> None:
    """Write `obj` as JSON to path + ".tmp", fsync it, then rename it into place: a reader sees the
    whole file or none."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
