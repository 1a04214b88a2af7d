"""The output folder: made ready (an earlier output removed, its manifest first), filled with the shards
of both splits, then flushed to disk before the manifest is written last. Until then the folder has no
manifest.json, so an interrupted run never leaves something a reader takes for a dataset."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import numpy as np

from components.checkpoint.durable import fsync_path
from components.data.packed_format import SPLITS, ShardWriter
from scripts.preprocess.distributed import EXCHANGE_FILE, FOLDER_PREFIX
from scripts.preprocess.errors import UsageError

OUTPUT_FILE = re.compile(r"(train|validation)(-r\d{5,})?-\d{5,}\.(bin|idx)|manifest\.json(\.tmp)?")


def prepare_output(folder: Path, keep: Path | None = None) -> bool:
    """Make `folder` ready to write; True when an earlier output there was removed. Its manifest goes
    first, so from here on the folder is not a dataset until the new manifest is written. `keep`: the
    coordination folder of this run's ranks, left alone (one an earlier run left is removed with its output)."""
    if folder.exists() and not folder.is_dir():
        raise UsageError(f"--output {folder}: exists and is not a folder")
    if not folder.exists():
        folder.mkdir(parents=True)
        return False
    entries = [p for p in folder.iterdir() if p != keep]
    ranks = [p for p in entries if p.is_dir() and p.name.startswith(FOLDER_PREFIX)
             and all(EXCHANGE_FILE.fullmatch(name) for name in os.listdir(p))]
    foreign = sorted(p.name for p in entries
                     if not ((p.is_file() and OUTPUT_FILE.fullmatch(p.name)) or p in ranks))
    if foreign:
        raise UsageError(
            f"--output {folder}: holds files this tool did not write ({', '.join(foreign[:5])}"
            f"{', ...' if len(foreign) > 5 else ''}); name a new or empty folder or an earlier output"
        )
    manifest = folder / "manifest.json"
    if manifest.exists():
        manifest.unlink()
    for path in entries:
        if path in ranks:
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
    return bool(entries)


class SplitWriters:
    """The shard writers of the train and validation splits, with the documents and tokens of each
    (`rank`: a multi-process run's, named in the shards)."""

    def __init__(self, folder: Path, dtype: np.dtype, shard_tokens: int, rank: int | None = None):
        self.folder = folder
        self.writers = {split: ShardWriter(folder, split, dtype, shard_tokens, rank) for split in SPLITS}
        self.counts = {split: {"documents": 0, "tokens": 0} for split in self.writers}

    def write(self, tokens: np.ndarray, lengths: np.ndarray, is_validation: np.ndarray) -> None:
        """Documents back to back in `tokens`, of these `lengths`, each to the split `is_validation` says."""
        ends = np.cumsum(lengths)
        for begin, end, validation in zip((ends - lengths).tolist(), ends.tolist(), is_validation.tolist()):
            split = "validation" if validation else "train"
            self.writers[split].write(tokens[begin:end])
            self.counts[split]["documents"] += 1
            self.counts[split]["tokens"] += end - begin

    def close(self) -> dict:
        """Finish both splits and flush their files to disk; -> the manifest's "splits" entry."""
        splits = {}
        for split, writer in self.writers.items():
            shards = writer.close()
            splits[split] = {**self.counts[split], "shards": shards}
            for shard in shards:
                for ext in ("bin", "idx"):
                    fsync_path(self.folder / f"{shard['name']}.{ext}")
        return splits
