"""Reading the inputs: the files a path, folder or glob names, and their documents cut into tasks.

This runs in the main process, which does no per-document work: JSON lines go to the workers as raw
bytes and are parsed there, so that reading keeps up with many workers. No file is read whole except a
plain-text file, which is one document.
"""

from __future__ import annotations

import bz2
import glob
import gzip
import importlib.util
import io
import json
import lzma
import os
from dataclasses import dataclass
from pathlib import Path

from scripts.preprocess.errors import ReadError, UsageError

JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
TEXT_SUFFIXES = (".txt", ".text")
PARQUET_SUFFIXES = (".parquet",)
COMPRESSION_SUFFIXES = (".gz", ".bz2", ".xz", ".zst")
HF_MARKERS = ("state.json", "dataset_info.json", "dataset_dict.json")

ROWS_PER_READ = 1000
"""Rows read at a time from Parquet files and `datasets` folders."""


@dataclass(frozen=True)
class Source:
    """One input to read: `path` as typed or expanded (what messages and the manifest show)."""

    path: str
    kind: str  # "jsonl", "text", "parquet" or "hf"
    compression: str | None = None


def _file_kind(path: Path) -> tuple[str, str | None] | None:
    """(kind, compression) of a data file from its name, None when it is not one this tool reads."""
    suffixes = [s.lower() for s in path.suffixes]
    compression = suffixes.pop() if suffixes and suffixes[-1] in COMPRESSION_SUFFIXES else None
    if not suffixes:
        return None
    if suffixes[-1] in JSONL_SUFFIXES:
        return "jsonl", compression
    if suffixes[-1] in TEXT_SUFFIXES:
        return "text", compression
    if suffixes[-1] in PARQUET_SUFFIXES and compression is None:
        return "parquet", None
    return None


def _is_hf_folder(path: Path) -> bool:
    return path.is_dir() and any((path / marker).is_file() for marker in HF_MARKERS)


def _is_packed_output(path: Path) -> bool:
    """A folder this tool wrote (its manifest.json is no input)."""
    return (path / "manifest.json").is_file() and any(path.glob("*-00000.idx"))


def _hf_sources(path: Path, shown: str) -> list[Source]:
    """A save_to_disk folder: a Dataset, or a DatasetDict whose splits are read in its order."""
    dict_file = path / "dataset_dict.json"
    if dict_file.is_file():
        try:
            splits = json.loads(dict_file.read_text())["splits"]
        except (ValueError, KeyError, TypeError) as e:
            raise UsageError(f"{dict_file}: not a datasets DatasetDict description ({e})") from e
        return [Source(os.path.join(shown, split), "hf") for split in splits]
    return [Source(shown, "hf")]


def _folder_sources(folder: Path, shown: str) -> list[Source]:
    """The supported files under `folder`, sorted by path; save_to_disk folders count as one input
    each (their .arrow and .json files are not read as files); hidden files and folders and earlier
    outputs of this tool are left out."""
    found: list[tuple[str, list[Source]]] = []
    for root, dirs, files in os.walk(folder):
        rel_root = os.path.relpath(root, folder)
        shown_root = shown if rel_root == "." else os.path.join(shown, rel_root)
        keep = []
        for d in sorted(dirs):
            if d.startswith(".") or _is_packed_output(Path(root) / d):
                continue
            if _is_hf_folder(Path(root) / d):
                found.append((os.path.join(shown_root, d), _hf_sources(Path(root) / d, os.path.join(shown_root, d))))
            else:
                keep.append(d)
        dirs[:] = keep
        for name in files:
            kind = None if name.startswith(".") else _file_kind(Path(name))
            if kind:
                path = os.path.join(shown_root, name)
                found.append((path, [Source(path, *kind)]))
    found.sort(key=lambda item: item[0])
    return [source for _, sources in found for source in sources]


def _path_sources(path: Path, shown: str, explicit: bool) -> list[Source]:
    if _is_hf_folder(path):
        return _hf_sources(path, shown)
    if _is_packed_output(path):
        if explicit:
            raise UsageError(f"{shown}: a packed output folder of this tool, not an input")
        return []
    if path.is_dir():
        return _folder_sources(path, shown)
    kind = _file_kind(path)
    if kind is None:
        if explicit:
            raise UsageError(
                f"{shown}: not a file type this tool reads (JSON lines {', '.join(JSONL_SUFFIXES)}, text "
                f"{', '.join(TEXT_SUFFIXES)}, optionally compressed {', '.join(COMPRESSION_SUFFIXES)}; Parquet; "
                f"a datasets save_to_disk folder)"
            )
        return []
    return [Source(shown, *kind)]


def expand_inputs(inputs: list[str]) -> list[Source]:
    """The inputs as a list of files (and save_to_disk folders) to read, in order. Raises UsageError
    for a missing path, a glob that matches nothing, a folder without data files or an unsupported file."""
    sources: list[Source] = []
    for given in inputs:
        path = Path(given)
        if path.exists():
            found = _path_sources(path, given, explicit=True)
        elif glob.has_magic(given):
            matches = sorted(glob.glob(given, recursive=True))
            if not matches:
                raise UsageError(f"{given}: no file matches this pattern")
            found = [s for m in matches for s in _path_sources(Path(m), m, explicit=False)]
        else:
            raise UsageError(f"{given}: no such file or directory")
        if not found:
            raise UsageError(f"{given}: holds no JSON-lines, text or Parquet files")
        sources.extend(found)
    return sources


def check_sources(sources: list[Source], text_field: str) -> None:
    """What can be checked before writing anything: files readable, compressions available, the text
    column present in Parquet files and datasets folders."""
    for source in sources:
        if source.compression == ".zst" and importlib.util.find_spec("zstandard") is None:
            raise UsageError(f"{source.path}: reading .zst files needs the zstandard module (pip install zstandard)")
        if source.kind in ("jsonl", "text"):
            try:
                with open(source.path, "rb"):
                    pass
            except OSError as e:
                raise UsageError(f"{source.path}: cannot be read ({e.strerror or e})") from e
        else:
            if source.kind == "parquet":
                columns = _parquet_file(source).schema_arrow.names
            else:
                columns = _hf_dataset(source).column_names
            if text_field not in columns:
                raise UsageError(
                    f"{source.path}: no column {text_field!r} (columns: {', '.join(columns)}); set --text-field"
                )


def source_bytes(source: Source) -> int:
    """The size of an input on disk (a save_to_disk folder: all its files), to deal out the inputs by."""
    path = Path(source.path)
    if path.is_dir():
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    return path.stat().st_size


def _parquet_file(source: Source):
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(source.path)
    except Exception as e:  # pyarrow raises several kinds for a damaged or foreign file
        raise UsageError(f"{source.path}: cannot be read as Parquet ({e})") from e


def _hf_dataset(source: Source):
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # local folders only: never reach for the hub
    import datasets

    try:
        dataset = datasets.load_from_disk(source.path)
    except Exception as e:  # datasets raises several kinds for a damaged folder
        raise UsageError(f"{source.path}: cannot be read as a datasets save_to_disk folder ({e})") from e
    if not isinstance(dataset, datasets.Dataset):
        raise UsageError(f"{source.path}: a datasets folder holding {type(dataset).__name__}; name one of its splits")
    return dataset


def _open_binary(source: Source):
    if source.compression == ".gz":
        return gzip.open(source.path, "rb")
    if source.compression == ".bz2":
        return bz2.open(source.path, "rb")
    if source.compression == ".xz":
        return lzma.open(source.path, "rb")
    if source.compression == ".zst":
        import zstandard

        raw = open(source.path, "rb")
        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw, closefd=True))
    return open(source.path, "rb")


# A part is one source's contribution to a task: (kind, source index, first line, lines, payload, bytes).
#   "lines":  payload is bytes holding `lines` JSON lines, split on b"\n"
#   "values": payload is a list of the text column's values, one per row
#   "file":   payload is the bytes of a whole text file (one document)


def _read_jsonl(source: Source, index: int, block_bytes: int):
    """Blocks of about `block_bytes` of whole lines; a longer line makes its block longer."""
    line = 1
    with _open_binary(source) as f:
        pending: list[bytes] = []  # the start of a line that has not ended yet
        while True:
            chunk = f.read(block_bytes)
            if not chunk:
                break
            cut = chunk.rfind(b"\n") + 1
            if cut == 0:
                pending.append(chunk)
                continue
            block = b"".join(pending) + chunk[:cut] if pending else chunk[:cut]
            pending = [chunk[cut:]] if cut < len(chunk) else []
            count = block.count(b"\n")
            yield ("lines", index, line, count, block, len(block))
            line += count
        if pending:
            block = b"".join(pending)
            yield ("lines", index, line, 1, block, len(block))


def _read_text(source: Source, index: int):
    with _open_binary(source) as f:
        data = f.read()
    yield ("file", index, 1, 1, data, len(data))


def _read_rows(batches, index: int):
    row = 1
    for values in batches:
        size = sum(len(v) for v in values if isinstance(v, str))
        yield ("values", index, row, len(values), values, size)
        row += len(values)


def _read_source(source: Source, index: int, text_field: str, block_bytes: int):
    if source.kind == "jsonl":
        return _read_jsonl(source, index, block_bytes)
    if source.kind == "text":
        return _read_text(source, index)
    if source.kind == "parquet":
        batches = _parquet_file(source).iter_batches(batch_size=ROWS_PER_READ, columns=[text_field])
        return _read_rows((batch.column(0).to_pylist() for batch in batches), index)
    dataset = _hf_dataset(source).select_columns([text_field])
    return _read_rows((batch[text_field] for batch in dataset.iter(batch_size=ROWS_PER_READ)), index)


def read_tasks(sources: list[Source], text_field: str, batch_bytes: int, share: range | None = None):
    """Tasks (lists of parts) of about `batch_bytes` of input or ROWS_PER_READ rows each, in input order,
    of the sources whose indices are in `share` (default: all); parts name a source by its index in `sources`."""
    parts, size, rows = [], 0, 0
    for index in range(len(sources)) if share is None else share:
        source = sources[index]
        try:
            for part in _read_source(source, index, text_field, batch_bytes):
                parts.append(part)
                size, rows = size + part[5], rows + part[3]
                if size >= batch_bytes or (part[0] != "lines" and rows >= ROWS_PER_READ):
                    yield parts
                    parts, size, rows = [], 0, 0
        except (OSError, EOFError, ValueError) as e:  # gzip, bz2, lzma, zstandard and pyarrow errors
            raise ReadError(f"{source.path}: reading failed ({type(e).__name__}: {e})") from e
    if parts:
        yield parts
