"""Checkpoints that appear only when complete, and a check that a checkpoint is intact.

A save writes into `step-N.partial/`. DCP gathers every rank's write results to the coordinator
(rank 0) before it writes `.metadata`, so the coordinator's `finish` is the one moment at which all
ranks' files are known to be written, for blocking and asynchronous saves alike. `CommittingWriter`
uses it to add `integrity.json` (size and CRC32 of every file) and then rename the folder to
`step-N`. A save interrupted at any point leaves at most a `.partial` folder, which is never read.

Each rank checksums the files it wrote (in parallel, while they are in the page cache) and leaves
the figures in a small `__<rank>_integrity.json`; the coordinator merges those into `integrity.json`.
"""

from __future__ import annotations

import json
import pickle
import shutil
import zlib
from pathlib import Path

from torch.distributed.checkpoint import FileSystemWriter

from components.checkpoint.durable import fsync_path, write_json_atomically

INTEGRITY_FILE = "integrity.json"
PARTIAL_SUFFIX = ".partial"
_CHUNK = 16 * 2**20


def file_crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def unused_name(path: Path, suffix: str) -> Path:
    """path + suffix, or path + suffix + "-2", "-3"... if taken."""
    candidate, n = path.with_name(path.name + suffix), 1
    while candidate.exists():
        n += 1
        candidate = path.with_name(f"{path.name}{suffix}-{n}")
    return candidate


class CommittingWriter(FileSystemWriter):
    """A DCP FileSystemWriter into `<final>.partial` that, once the save is complete on every rank,
    writes `extra_files` (name -> text), records integrity.json and renames the folder to `final`."""

    def __init__(self, final: Path, checksums: bool, extra_files: dict[str, str] | None = None):
        self.final, self.checksums, self.extra_files = Path(final), checksums, extra_files or {}
        super().__init__(str(self.final) + PARTIAL_SUFFIX)

    def write_data(self, plan, planner):
        future = super().write_data(plan, planner)
        files = sorted({result.storage_data.relative_path for result in future.wait()})
        record = {name: self._describe(Path(self.path) / name) for name in files}
        # plan.storage_data.prefix is this rank's file prefix, "__<rank>_"
        write_json_atomically(Path(self.path) / f"{plan.storage_data.prefix}{INTEGRITY_FILE}", record)
        return future

    def _describe(self, path: Path) -> dict:
        entry = {"size": path.stat().st_size}
        if self.checksums:
            entry["crc32"] = file_crc32(path)
        return entry

    def finish(self, metadata, results) -> None:
        super().finish(metadata, results)
        folder = Path(self.path)
        files = {}
        for part in sorted(folder.glob(f"__*_{INTEGRITY_FILE}")):
            files.update(json.loads(part.read_text()))
            part.unlink()
        for name, text in self.extra_files.items():
            (folder / name).write_text(text)
        for name in [".metadata", *self.extra_files]:
            files[name] = self._describe(folder / name)
        write_json_atomically(folder / INTEGRITY_FILE, {"format": 1, "files": files})
        replaced = None
        if self.final.exists():  # e.g. a seed checkpoint written again: the old one stays until the new one is in
            replaced = self.final.rename(unused_name(self.final, ".replaced"))
        folder.rename(self.final)
        fsync_path(self.final.parent)
        if replaced is not None:
            shutil.rmtree(replaced, ignore_errors=True)


def check_checkpoint(path: Path, verify_checksums: bool, files_to_checksum=None) -> str | None:
    """What is wrong with the checkpoint at `path`, or None if it is intact.

    Sizes of every file integrity.json lists are checked, and that .metadata can be read and refers
    only to listed files. CRC32s are verified for the files in `files_to_checksum` (all when None),
    so that ranks can share the reading. A checkpoint written before integrity records existed (or
    by another tool) has no integrity.json: its .metadata's entries are checked against file sizes.
    """
    record_path = path / INTEGRITY_FILE
    try:
        with open(path / ".metadata", "rb") as f:
            metadata = pickle.load(f)
    except FileNotFoundError:
        return "no .metadata file"
    except Exception as e:  # noqa: BLE001 - any unpickling failure means a damaged file
        return f".metadata cannot be read ({type(e).__name__}: {e})"
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    if not record_path.is_file():
        for name, end in sorted(needed.items()):
            size = (path / name).stat().st_size if (path / name).is_file() else None
            if size is None or size < end:
                found = "missing" if size is None else f"{size} bytes, shorter than the {end} its metadata needs"
                return f"{name} is {found}"
        return None
    try:
        files = json.loads(record_path.read_text())["files"]
    except (ValueError, KeyError) as e:
        return f"{INTEGRITY_FILE} cannot be read ({e})"
    unlisted = sorted(set(needed) - set(files))
    if unlisted:
        return f"{unlisted[0]} is used by .metadata but not in {INTEGRITY_FILE}"
    for name, entry in sorted(files.items()):
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        size = file.stat().st_size
        if size != entry["size"]:
            return f"{name} is {size} bytes, {entry['size']} were written"
        if verify_checksums and "crc32" in entry and (files_to_checksum is None or name in files_to_checksum):
            if file_crc32(file) != entry["crc32"]:
                return f"{name} does not match its CRC32"
    return None


def listed_files(path: Path) -> list[str]:
    """The files a checkpoint's integrity record lists (empty without one)."""
    try:
        return sorted(json.loads((path / INTEGRITY_FILE).read_text())["files"])
    except (OSError, ValueError, KeyError):
        return []
