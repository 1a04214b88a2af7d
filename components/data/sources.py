"""The documents of an hf data source, addressable by position, so that any reader can read any part of it.

A source is one entry of training.dataset_path: a file, a glob, a folder of JSON-lines / text / Parquet files,
a local dataset repository (the layout the hub serves: shards under data/, the split named in the file names;
the `train` split is read), a `datasets.save_to_disk` folder, or, only when the machine is online, a hub
dataset id `owner/name` or `owner/name:config` (its data files, read over the network). Nothing is converted
or copied: a corpus of any size starts at once and takes no local disk.

Units. Its files, in order, make one space of units: bytes for JSON lines (a document per line) and text
files (a document per file), rows for Parquet and saved datasets. A range of units [start, end) holds the
documents that begin in it, so consecutive ranges split the documents without overlap, and reading a range
reads about its own bytes: a JSON-lines range starts at the first line that begins in it (one seek), a
Parquet range reads the row groups it overlaps. Compressed files cannot be read from the middle: a source with
any is `splittable = False`, and every range of it reads the whole source (streaming.py then takes every N-th
document).

`read_range` returns the texts of the documents in a range, in order; a document whose text is missing, not a
string or blank is skipped, as the preprocessor skips it.
"""

from __future__ import annotations

import bisect
import glob
import gzip
import json
import os
import re
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

BUILDERS = {".json": "json", ".jsonl": "json", ".txt": "text", ".text": "text", ".parquet": "parquet"}
COMPRESSED = (".gz", ".bz2", ".xz", ".zst")
HUB_ID = re.compile(r"[\w][\w.-]*/[\w][\w.-]*")


class DataError(ValueError):
    """Data that cannot be read: a one-line message naming the setting and the file."""


def _builder(path: str) -> str | None:
    suffixes = [s for s in Path(path).suffixes if s not in COMPRESSED]
    return BUILDERS.get(suffixes[-1]) if suffixes else None


def _compressed(path: str) -> bool:
    return Path(path).suffix in COMPRESSED


@dataclass
class Source:
    """One entry of a dataset path, not yet split between readers."""

    name: str
    weight: float
    kind: str
    """json (a document per line, units are bytes), text (a document per file, bytes), parquet or saved (rows)."""
    files: list[str]
    """Its files in order (a saved dataset: its folder)."""
    sizes: list[int]
    """Units per file."""
    text_field: str
    setting: str
    """The config key that named it, for messages."""
    splittable: bool = True
    row_groups: list[list[int]] = field(default_factory=list)
    """Parquet: the rows of each row group, per file."""

    def __post_init__(self):
        self.starts = [0]
        for size in self.sizes:
            self.starts.append(self.starts[-1] + size)

    @property
    def units(self) -> int:
        return self.starts[-1]

    def share(self, index: int, count: int) -> tuple[int, int]:
        """The units of reader `index` of `count` (the whole source where it cannot be split)."""
        if not self.splittable:
            return 0, self.units
        return index * self.units // count, (index + 1) * self.units // count

    def blocks(self, start: int, end: int, block_units: int) -> list[tuple[int, int]]:
        """[start, end) cut at file boundaries (Parquet: row-group boundaries) and, where a file can be read from
        the middle, every block_units."""
        cuts = {start, end}
        for i, file_start in enumerate(self.starts[:-1]):
            if self.kind == "parquet":
                offsets = [file_start]
                for rows in self.row_groups[i]:
                    offsets.append(offsets[-1] + rows)
                cuts.update(o for o in offsets if start < o < end)
            elif start < file_start < end:
                cuts.add(file_start)
        if self.kind == "saved" or self.kind == "json" and self.splittable:
            cuts.update(range(start - start % block_units + block_units, end, block_units))
        edges = sorted(cuts)
        return list(zip(edges, edges[1:]))

    def read_range(self, start: int, end: int) -> list[str]:
        """The texts of the documents that begin in units [start, end)."""
        if start >= end:
            return []
        texts = []
        first = bisect.bisect_right(self.starts, start) - 1
        for i in range(first, len(self.files)):
            file_start = self.starts[i]
            if file_start >= end:
                break
            lo, hi = max(start - file_start, 0), min(end - file_start, self.sizes[i])
            if lo < hi or self.kind == "text" and file_start >= start:  # a text file's document: at its start
                texts += self._read_file_range(i, lo, hi)
        return [t for t in texts if isinstance(t, str) and t.strip()]

    def _read_file_range(self, i: int, lo: int, hi: int) -> list:
        path = self.files[i]
        try:
            if self.kind == "text":
                return [_read_text(path)] if lo == 0 else []
            if self.kind == "json":
                return [row.get(self.text_field) if isinstance(row, dict) else None
                        for row in _json_rows(path, lo, hi, self.setting)]
            if self.kind == "parquet":
                return _parquet_rows(path, lo, hi, self.text_field)
            return _saved(path, os.getpid())[lo:hi][self.text_field]
        except (OSError, UnicodeDecodeError, ValueError) as e:
            if isinstance(e, DataError):
                raise
            raise DataError(f"{self.setting}: cannot read {path}: {e}") from e


def _open(path: str, mode: str = "rb"):
    if "://" in path:
        import fsspec

        return fsspec.open(path, mode, compression="infer").open()
    if _compressed(path):
        import fsspec

        return fsspec.open(path, mode, compression="infer").open()
    return open(path, mode)


def _file_size(path: str) -> int:
    if "://" in path:
        import fsspec

        fs, _, (resolved,) = fsspec.get_fs_token_paths(path)
        return fs.size(resolved)
    return os.path.getsize(path)


def _read_text(path: str) -> str:
    with _open(path) as f:
        return f.read().decode("utf-8")


def _json_rows(path: str, lo: int, hi: int, setting: str) -> list:
    """The JSON objects of the lines of a JSON-lines file that begin at a byte in [lo, hi); a compressed file is
    read whole (lo, hi then count its uncompressed bytes: hi is the file's units, all of it)."""
    rows = []
    with _open(path) as f:
        if lo > 0:
            f.seek(lo - 1)
            f.readline()  # the line that began before lo ends here (or, if lo - 1 is a newline, nothing more)
        position = f.tell()
        while position < hi or _compressed(path):
            line = f.readline()
            if not line:
                break
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise DataError(f"{setting}: {path}:{_line_number(path, position)}: invalid JSON ({e.msg})") from e
            position += len(line)
    return rows


def _line_number(path: str, offset: int) -> int:
    """The number (from 1) of the line that begins at byte `offset`: read only to name a bad line."""
    with _open(path) as f:
        return f.read(offset).count(b"\n") + 1


def _parquet_file(path: str):
    return _parquet_file_of_process(path, os.getpid())


@lru_cache(maxsize=4)
def _parquet_file_of_process(path: str, pid: int):
    """Each process opens its own (a loader worker does not share its parent's file handles)."""
    import pyarrow.parquet as pq

    return pq.ParquetFile(_open(path) if "://" in path else path)


def _parquet_rows(path: str, lo: int, hi: int, text_field: str) -> list:
    """Rows [lo, hi) of one row group of a Parquet file (Source.blocks never crosses one)."""
    file = _parquet_file(path)
    offset = 0
    for group in range(file.num_row_groups):
        rows = file.metadata.row_group(group).num_rows
        if lo < offset + rows:
            column = file.read_row_group(group, columns=[text_field]).column(text_field)
            return column.slice(lo - offset, hi - lo).to_pylist()
        offset += rows
    return []


@lru_cache(maxsize=2)
def _saved(folder: str, pid: int):
    """A save_to_disk folder, memory-mapped once per process."""
    import datasets

    return datasets.load_from_disk(folder)


def _files(path: str, setting: str) -> list[str]:
    p = Path(path)
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and _builder(str(f)))
    elif p.is_file():
        files = [p]
    else:
        files = sorted(Path(f) for f in glob.glob(path) if Path(f).is_file())
    kinds = {_builder(str(f)) for f in files}
    if None in kinds or len(kinds) > 1:
        shown = ", ".join(sorted(str(f) for f in files[:5]))
        raise DataError(f"{setting} {path!r}: mixes or has unknown formats ({shown})")
    return [str(f) for f in files]


def _repository_files(folder: Path, split: str, setting: str) -> list[str]:
    """The `split` shards of a local dataset repository, found by the hub's file-name conventions."""
    import datasets

    try:
        data_files = datasets.load_dataset_builder(str(folder)).config.data_files or {}
    except Exception as e:  # noqa: BLE001 - datasets raises many kinds; the message is what matters
        raise DataError(f"{setting} {str(folder)!r}: not a readable dataset repository ({e})") from e
    if split not in data_files:
        raise DataError(f"{setting} {str(folder)!r}: the repository has no {split!r} split "
                        f"(splits: {', '.join(data_files) or 'none'})")
    return [str(f) for f in data_files[split]]


def _offline() -> bool:
    return any(os.environ.get(name, "").lower() in ("1", "true", "yes", "on")
               for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"))


def _hub_files(path: str, split: str, setting: str) -> list[str]:
    import datasets

    repo, _, config = path.partition(":")
    if _offline():
        raise DataError(f"{setting} {path!r} is not a local path; as a hub dataset it needs the network, and this "
                        "machine is offline (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE); give local files or a local "
                        "dataset repository instead")
    try:
        data_files = datasets.load_dataset_builder(repo, config or None).config.data_files or {}
    except Exception as e:  # noqa: BLE001 - network and hub errors come in many types
        raise DataError(f"{setting} {path!r}: cannot open the hub dataset {repo!r} (is this machine offline?): "
                        f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from e
    if split not in data_files:
        raise DataError(f"{setting} {path!r}: the hub dataset has no {split!r} split")
    return [str(f) for f in data_files[split]]


def _columns(path: str, builder: str, setting: str) -> list[str]:
    """The columns of one file, read from its head (a Parquet footer, a first JSON line): a file that cannot be
    read is named now, not in a loader worker hours into the run."""
    try:
        if builder == "parquet":
            return _parquet_file(path).schema_arrow.names
        if builder == "json":
            with _open(path) as f:
                line = next((line for line in f if line.strip()), None)
            if line is None:
                return []
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{setting}: cannot read {path}: its first line is not JSON ({e.msg})") from e
            return list(row) if isinstance(row, dict) else []
        return ["text"]
    except (OSError, UnicodeDecodeError, ValueError, EOFError, gzip.BadGzipFile) as e:
        if isinstance(e, DataError):
            raise
        raise DataError(f"{setting}: cannot read {path}: {e}") from e


def _check_field(columns: list[str], text_field: str, where: str, setting: str) -> None:
    if columns and text_field not in columns:
        raise DataError(f"{setting} {where!r} has no field {text_field!r} (columns: {', '.join(columns)}); "
                        "set training.dataset_text_field")


def _units(path: str, builder: str) -> tuple[int, list[int]]:
    """(units, Parquet row groups) of one file: rows of a Parquet file, else bytes (of a compressed file: after
    decompression, which reads it once)."""
    if builder == "parquet":
        metadata = _parquet_file(path).metadata
        groups = [metadata.row_group(i).num_rows for i in range(metadata.num_row_groups)]
        return sum(groups), groups
    if _compressed(path):
        with _open(path) as f:
            return sum(len(chunk) for chunk in iter(lambda: f.read(1 << 24), b"")), []
    return _file_size(path), []


def _where(path: str) -> str:
    """How a dataset path is found: "saved" (a save_to_disk folder), "repository" (a local dataset repository),
    "hub" (an id owner/name[:config] that names nothing here) or "files" (files, a glob or a folder of files)."""
    p = Path(path)
    if p.is_dir() and ((p / "dataset_info.json").exists() or (p / "state.json").exists()):
        return "saved"
    if p.is_dir() and ((p / "data").is_dir() or (p / "README.md").exists()):
        return "repository"
    if not p.exists() and HUB_ID.fullmatch(path.partition(":")[0]) and not _builder(path) and not glob.glob(path):
        return "hub"
    return "files"


def reader_libraries(entry: str, setting: str = "training.dataset_path") -> list[str]:
    """The modules reading a dataset path entry imports: Hugging Face datasets for a saved folder, a dataset
    repository or a hub id, pyarrow for Parquet files, none for JSON lines and text. The memory estimator imports
    them to measure what a trainer process holds."""
    from components.data.packed import parse_path

    path, _ = parse_path(entry)
    if _where(path) != "files":
        return ["datasets"]
    files = _files(path, setting)  # of one format
    return ["pyarrow.parquet"] if files and _builder(files[0]) == "parquet" else []


def open_source(entry: str, text_field: str, setting: str = "training.dataset_path", split: str = "train") -> Source:
    """One dataset path entry ("path" or "path:weight"; see the module docstring), checked: every file's head is
    readable and has `text_field`, and there is something to read. Raises DataError (or FileNotFoundError) with a
    one-line message."""
    from components.data.packed import parse_path

    path, weight = parse_path(entry)
    p, where = Path(path), _where(path)
    if where == "saved":
        try:
            saved = _saved(str(p), os.getpid())
        except Exception as e:  # noqa: BLE001 - datasets raises many kinds
            raise DataError(f"{setting} {path!r}: not a readable save_to_disk folder ({e})") from e
        _check_field(saved.column_names, text_field, path, setting)
        if len(saved) == 0:
            raise DataError(f"{setting} {path!r} holds no documents")
        return Source(p.name, weight, "saved", [str(p)], [len(saved)], text_field, setting)
    if where == "repository":
        files = _repository_files(p, split, setting)
    elif where == "hub":
        files = _hub_files(path, split, setting)
    else:
        files = _files(path, setting)
    if not files:
        raise FileNotFoundError(f"{setting}: no data files at {path!r} (JSON/JSONL, text or Parquet files, a "
                                "dataset repository or save_to_disk folder, or a hub id owner/name when online)")
    builder = _builder(files[0])
    sizes, groups = [], []
    for file in files:
        _check_field(_columns(file, builder, setting), text_field, file, setting)
        units, row_groups = _units(file, builder)
        sizes.append(units)
        groups.append(row_groups)
    if sum(sizes) == 0:
        raise DataError(f"{setting} {path!r} holds no documents (its {len(files)} file(s) are empty)")
    name = p.stem if p.is_file() else p.name or path
    return Source(name, weight, builder, files, sizes, text_field, setting,
                  splittable=not any(_compressed(f) for f in files), row_groups=groups)
