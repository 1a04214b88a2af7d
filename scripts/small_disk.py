"""A small file system of its own for a command: a tmpfs mounted in a private mount namespace (unshare(1)), so that
a full disk is a real one (writes fail with ENOSPC, as on a full volume) and nothing outside the command sees it or
has to unmount it: it goes when the command ends. Root mounts it in a mount namespace of its own; another user first
maps itself to root in a user namespace of its own, where the kernel allows that.

    python -m scripts.small_disk MOUNT_POINT MEGABYTES COMMAND...

For tests/test_checkpoint_disk.py and the fault soak (scripts/soak.py)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

MOUNT_THEN_RUN = 'mount -t tmpfs -o size="$1"m tmpfs "$2" && shift 2 && exec "$@"'


def in_small_file_system(mount_point: Path, megabytes: int, command: list[str]) -> list[str]:
    """`command` as run with a tmpfs of `megabytes` mounted at `mount_point` (a folder that exists)."""
    unshare = ["unshare", "--mount", "--propagation", "private"] if os.geteuid() == 0 else \
        ["unshare", "--user", "--map-root-user", "--mount"]
    return [*unshare, "sh", "-c", MOUNT_THEN_RUN, "sh", str(megabytes), str(mount_point), *command]


def why_no_small_file_system(folder: Path) -> str | None:
    """Why this machine cannot give a command a small file system (no unshare, no permission), or None."""
    try:
        result = subprocess.run(in_small_file_system(folder, 1, ["true"]), capture_output=True, text=True)
    except FileNotFoundError:
        return "unshare(1) is not installed"
    return None if result.returncode == 0 else f"unshare and mount refused: {result.stderr.strip()}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.small_disk", description=__doc__.split("\n\n")[0])
    parser.add_argument("mount_point", type=Path, help="where the file system appears (created if absent)")
    parser.add_argument("megabytes", type=int, help="its size")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command, and its arguments")
    args = parser.parse_args(argv)
    args.mount_point.mkdir(parents=True, exist_ok=True)
    return subprocess.run(in_small_file_system(args.mount_point, args.megabytes, args.command)).returncode


if __name__ == "__main__":
    sys.exit(main())
