"""Files that a crash leaves whole or not at all: fsync, and write-then-rename."""

from __future__ import annotations

import json
import os
from pathlib import Path


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
