"""Tokenize a corpus once into the packed token format (packed_format.py) that training memory-maps.

    python -m components.data.preprocess INPUT... --output DIR --tokenizer PATH [--workers N]
        [--text-field text] [--val-fraction 0.01] [--max-bad-fraction 0.001]
        [--shard-tokens N] [--seed S] [--batch-bytes N]

Inputs, read in the order given (directories expanded to their supported files, sorted by path;
globs expanded and sorted):

- JSON lines (`.jsonl`, `.json`, `.ndjson`): one object per line, the document in `--text-field`;
- plain text (`.txt`, `.text`): the whole file is one document;
- either of those compressed (`.gz`, `.bz2`, `.xz`, and `.zst` when the `zstandard` module is installed);
- Parquet (`.parquet`), the document in the column `--text-field`;
- a folder written by `datasets` `save_to_disk` (a Dataset, or a DatasetDict: its splits in order).

Design
------
One reader, N tokenizer processes, one writer. The main process reads the inputs in order and cuts
them into tasks of about `--batch-bytes` of input (JSON lines are shipped as raw bytes: the workers
parse as well as tokenize, so the main process does almost no per-document work). A pool of N worker
processes, each building the tokenizer once, turns a task into one token array plus the documents'
lengths and the task's bad lines. The main process takes the results back *in submission order*
(a queue of futures popped from the front) and appends them to the shard writers. At most
2N + 1 tasks are in flight, so memory stays bounded whatever the corpus size; no file is read
whole, except a plain-text file, which is one document.

Why order-preserving: the output is the corpus in input order, so a document's place in the packed
stream (and in the train/validation split) does not depend on which worker happened to finish
first. Why deterministic: the same inputs and options give a byte-identical folder (every .bin, .idx
and manifest.json) whatever the number of workers or the machine's speed, so a dataset can be
rebuilt and checked against its manifest's checksums, and a training run that names a folder means
exactly one token stream. For that, the manifest holds no timestamps, absolute temporary paths or
worker counts, and the split is a pure function of the document's number and `--seed`: document g
(counting kept documents from 0 over all inputs) goes to validation when a 64-bit mix of (seed, g),
read as a number in [0, 1), is below `--val-fraction` (see `validation_mask`).

Bad input never stalls or truncates the output: an empty line, a line that is not JSON or not a JSON
object, one without the text field, a text that is not a string or is empty (whitespace only), bytes
that are not UTF-8, or a text the tokenizer rejects is skipped, counted by reason and recorded with
its file and line (row, for Parquet and `datasets` folders); the manifest lists the first 1000 such
lines and always the complete counts. When more than `--max-bad-fraction` of all lines were skipped
the output is still written completely, and the command exits with status 1 and says so.

Exit status: 0 success; 1 too many bad lines, no documents at all, or a worker died; 2 bad usage
(a missing or unsupported input, a missing text column, an unreadable tokenizer, an output folder
holding other files), in which case nothing is written.

The output folder is written in place: an existing manifest.json there is removed first and written
again last (atomically), so a run that crashes or is interrupted never leaves a manifest and a reader
never takes the half-written folder for a dataset. Re-running over an earlier output replaces it; a
folder that holds files this tool did not write is refused.

Progress goes to stderr: a line updated every second on a terminal (every 10 seconds otherwise)
with documents, documents/s and tokens/s, and a summary at the end.
"""

from __future__ import annotations

import argparse
import bz2
import glob
import gzip
import importlib.util
import io
import json
import lzma
import multiprocessing
import os
import re
import signal
import sys
import time
from collections import Counter, deque
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from components.data.packed_format import ShardWriter, token_dtype, tokenizer_fingerprint, write_manifest
from components.durable import fsync_path

JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
TEXT_SUFFIXES = (".txt", ".text")
PARQUET_SUFFIXES = (".parquet",)
COMPRESSION_SUFFIXES = (".gz", ".bz2", ".xz", ".zst")
HF_MARKERS = ("state.json", "dataset_info.json", "dataset_dict.json")

MAX_LINE_RECORDS = 1000
"""How many skipped lines the manifest names (the counts are always complete)."""
ROWS_PER_READ = 1000
"""Rows read at a time from Parquet files and `datasets` folders."""
DEFAULT_BATCH_BYTES = 1 << 20
DEFAULT_SHARD_TOKENS = 1 << 30

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2

REASONS = {
    "empty_line": "empty line",
    "invalid_json": "not valid JSON",
    "invalid_utf8": "not valid UTF-8",
    "not_an_object": "JSON value is not an object",
    "missing_field": "no text field",
    "null_text": "text is null",
    "not_a_string": "text is not a string",
    "empty_text": "text is empty",
    "encode_error": "the tokenizer failed on the text",
}


class UsageError(Exception):
    """A problem with the command line or its inputs, found before anything is written (exit 2)."""


# ---------------------------------------------------------------------------------------------
# Inputs


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
        elif source.kind == "parquet":
            columns = _parquet_file(source).schema_arrow.names
            if text_field not in columns:
                raise UsageError(f"{source.path}: no column {text_field!r} (columns: {', '.join(columns)}); set --text-field")
        elif source.kind == "hf":
            columns = _hf_dataset(source).column_names
            if text_field not in columns:
                raise UsageError(f"{source.path}: no column {text_field!r} (columns: {', '.join(columns)}); set --text-field")


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


class ReadError(Exception):
    """An input that failed while being read (a damaged compressed file, an I/O error)."""


def _tasks(sources: list[Source], text_field: str, batch_bytes: int):
    """Tasks (lists of parts) of about `batch_bytes` of input or ROWS_PER_READ rows each, in input order."""
    parts, size, rows = [], 0, 0
    for index, source in enumerate(sources):
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


# ---------------------------------------------------------------------------------------------
# Workers


class Encoder:
    """What a worker does with a task: texts out of the parts, checked, tokenized as BOS + ids + EOS."""

    def __init__(self, tokenizer_path: str, text_field: str):
        from components.tokenizer import build_tokenizer

        self.tokenizer = build_tokenizer(tokenizer_path)
        self.text_field = text_field
        self.dtype = token_dtype(self.tokenizer.vocab_size)

    def _json_text(self, line: bytes):
        if not line.strip():
            return None, "empty_line"
        try:
            record = json.loads(line)
        except UnicodeDecodeError:
            return None, "invalid_utf8"
        except ValueError:
            return None, "invalid_json"
        if not isinstance(record, dict):
            return None, "not_an_object"
        if self.text_field not in record:
            return None, "missing_field"
        return record[self.text_field], None

    def __call__(self, parts: list) -> tuple[np.ndarray, np.ndarray, list, int, float]:
        """-> (tokens of the kept documents back to back, their lengths, [(source index, line,
        reason)] of the skipped ones, lines read, CPU seconds spent)."""
        cpu = time.process_time()
        encode, bos, eos = self.tokenizer.encode, self.tokenizer.bos_id, self.tokenizer.eos_id
        flat: list[int] = []
        lengths: list[int] = []
        bad: list[tuple[int, int, str]] = []
        lines = 0
        for kind, source, first, count, payload, _ in parts:
            lines += count
            if kind == "lines":
                items = payload.split(b"\n")
                if len(items) > count:  # the block ends with a newline: no line after it
                    items.pop()
            elif kind == "file":
                items = [payload]
            else:
                items = payload
            for offset, item in enumerate(items):
                reason = None
                if kind == "lines":
                    text, reason = self._json_text(item)
                elif kind == "file":
                    try:
                        text = item.decode("utf-8-sig")
                    except UnicodeDecodeError:
                        text, reason = None, "invalid_utf8"
                else:
                    text = item
                if reason is None:
                    if text is None:
                        reason = "null_text"
                    elif not isinstance(text, str):
                        reason = "not_a_string"
                    elif not text.strip():
                        reason = "empty_text"
                if reason is None:
                    try:
                        ids = encode(text)  # no BOS/EOS: added here, the same as encode(bos=True, eos=True)
                    except Exception:  # noqa: BLE001 - a text the tokenizer cannot take is one bad line
                        reason = "encode_error"
                if reason is not None:
                    bad.append((source, first + offset, reason))
                    continue
                flat.append(bos)
                flat.extend(ids)
                flat.append(eos)
                lengths.append(len(ids) + 2)
        tokens = np.array(flat, dtype=self.dtype)
        return tokens, np.array(lengths, dtype=np.int64), bad, lines, time.process_time() - cpu


_ENCODER: Encoder | None = None


def _init_worker(tokenizer_path: str, text_field: str) -> None:
    global _ENCODER
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is handled by the main process alone
    _ENCODER = Encoder(tokenizer_path, text_field)


def _encode_task(parts: list):
    return _ENCODER(parts)


def _ordered_results(tasks, workers: int, tokenizer_path: str, text_field: str):
    """The results of the tasks in task order, tokenized by `workers` processes (0: in this
    process), with at most 2 * workers + 1 tasks in flight."""
    if workers == 0:
        encoder = Encoder(tokenizer_path, text_field)
        for task in tasks:
            yield encoder(task)
        return
    # fork starts workers fastest and needs no re-import; elsewhere spawn is the safe choice.
    context = multiprocessing.get_context("fork" if sys.platform == "linux" else "spawn")
    executor = ProcessPoolExecutor(workers, mp_context=context, initializer=_init_worker, initargs=(tokenizer_path, text_field))
    pending: deque = deque()
    try:
        for task in tasks:
            pending.append(executor.submit(_encode_task, task))
            if len(pending) > 2 * workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        executor.shutdown(wait=True, cancel_futures=True)


# ---------------------------------------------------------------------------------------------
# Split


MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def validation_mask(seed: int, first: int, count: int, val_fraction: float) -> np.ndarray:
    """Whether documents first .. first + count - 1 (numbered from 0 over the whole corpus) go to
    validation: splitmix64 of (mixed seed + document number), its top 53 bits as a number in [0, 1),
    below val_fraction. A pure function of (seed, number): the same whatever the workers or batches."""
    if val_fraction <= 0 or count == 0:
        return np.zeros(count, dtype=bool)
    x = np.arange(first, first + count, dtype=np.uint64) + np.uint64(_splitmix64(seed & MASK64))
    x = x + np.uint64(0x9E3779B97F4A7C15)  # uint64 arrays wrap around silently
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    x = x ^ (x >> np.uint64(31))
    return (x >> np.uint64(11)).astype(np.float64) * 2.0**-53 < val_fraction


# ---------------------------------------------------------------------------------------------
# Output folder


OUTPUT_FILE = re.compile(r"(train|validation)-\d{5,}\.(bin|idx)|manifest\.json(\.tmp)?")


def _prepare_output(folder: Path) -> bool:
    """Make `folder` ready to write; True when an earlier output there was removed. Its manifest goes
    first, so from here on the folder is not a dataset until the new manifest is written."""
    if folder.exists() and not folder.is_dir():
        raise UsageError(f"--output {folder}: exists and is not a folder")
    if not folder.exists():
        folder.mkdir(parents=True)
        return False
    entries = list(folder.iterdir())
    foreign = sorted(p.name for p in entries if not (p.is_file() and OUTPUT_FILE.fullmatch(p.name)))
    if foreign:
        raise UsageError(
            f"--output {folder}: holds files this tool did not write ({', '.join(foreign[:5])}"
            f"{', ...' if len(foreign) > 5 else ''}); name a new or empty folder or an earlier output"
        )
    manifest = folder / "manifest.json"
    if manifest.exists():
        manifest.unlink()
    for path in entries:
        if path.exists():
            path.unlink()
    return bool(entries)


# ---------------------------------------------------------------------------------------------
# Progress


def _si(x: float) -> str:
    for limit, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "K")):
        if abs(x) >= limit:
            return f"{x / limit:.2f}{suffix}"
    return f"{x:.0f}"


class Progress:
    """A line on stderr: rewritten in place every second on a terminal, printed every 10 s otherwise."""

    def __init__(self, stream=None, enabled: bool = True):
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty() if hasattr(self.stream, "isatty") else False
        self.enabled = enabled
        self.start = self.last = time.monotonic()
        self.interval = 1.0 if self.tty else 10.0
        self.shown = False

    def update(self, documents: int, tokens: int, skipped: int, force: bool = False) -> None:
        now = time.monotonic()
        if not self.enabled or (now - self.last < self.interval and not force):
            return
        self.last = now
        seconds = max(now - self.start, 1e-9)
        line = (f"preprocess: {documents:,} documents  {_si(documents / seconds)} docs/s  {_si(tokens)} tokens  "
                f"{_si(tokens / seconds)} tokens/s  {skipped:,} skipped  {seconds:.0f} s")
        if self.tty:
            self.stream.write("\r" + line + "\x1b[K")
            self.shown = True
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def end(self) -> None:
        if self.shown:
            self.stream.write("\n")
            self.stream.flush()
            self.shown = False


def _log(message: str) -> None:
    print(f"preprocess: {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# The run


@dataclass
class Result:
    """What a run did; `exit_code` is what the command exits with."""

    exit_code: int
    manifest: dict = field(default_factory=dict)
    seconds: float = 0.0
    input_bytes: int = 0
    workers: int = 0
    worker_cpu_seconds: float = 0.0
    message: str = ""

    @property
    def tokens(self) -> int:
        return self.manifest.get("counts", {}).get("tokens", 0)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def default_workers() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def preprocess(inputs: list[str], output: str, tokenizer: str, workers: int | None = None, text_field: str = "text",
               val_fraction: float = 0.01, max_bad_fraction: float = 0.001, shard_tokens: int = DEFAULT_SHARD_TOKENS,
               seed: int = 0, batch_bytes: int = DEFAULT_BATCH_BYTES, progress: bool = True) -> Result:
    """Tokenize `inputs` into the packed folder `output` (see the module docstring). Raises UsageError
    (before writing anything) for bad arguments or inputs; returns a Result otherwise."""
    workers = default_workers() if workers is None else workers
    if workers < 0:
        raise UsageError(f"--workers {workers}: must be 0 (tokenize in the main process) or more")
    if not 0 <= val_fraction < 1:
        raise UsageError(f"--val-fraction {val_fraction}: must be in [0, 1)")
    if not 0 <= max_bad_fraction <= 1:
        raise UsageError(f"--max-bad-fraction {max_bad_fraction}: must be in [0, 1]")
    if shard_tokens < 1 or batch_bytes < 1:
        raise UsageError("--shard-tokens and --batch-bytes must be positive")
    if not inputs:
        raise UsageError("no inputs given")

    sources = expand_inputs(inputs)
    check_sources(sources, text_field)
    from components.tokenizer import build_tokenizer

    try:
        tok = build_tokenizer(tokenizer, setting="--tokenizer")
    except FileNotFoundError as e:  # its message names --tokenizer and the path
        raise UsageError(str(e)) from e
    except (OSError, ValueError) as e:
        raise UsageError(f"--tokenizer {tokenizer}: {e}") from e
    dtype = token_dtype(tok.vocab_size)
    folder = Path(output)
    replaced = _prepare_output(folder)

    _log(f"{len(sources)} input{'s' * (len(sources) != 1)} -> {folder}{' (replacing the earlier output)' * replaced}; "
         f"tokenizer {tokenizer} (vocab {tok.vocab_size:,}, {dtype.name}); "
         f"{workers} worker{'s' * (workers != 1)}; validation fraction {val_fraction}")
    writers = {"train": ShardWriter(folder, "train", dtype, shard_tokens),
               "validation": ShardWriter(folder, "validation", dtype, shard_tokens)}
    counts = {"lines": 0, "documents": 0, "tokens": 0}
    split_counts = {split: {"documents": 0, "tokens": 0} for split in writers}
    reasons: Counter = Counter()
    records: list[dict] = []
    input_bytes, worker_cpu = 0, 0.0
    meter = Progress(enabled=progress)
    start = time.monotonic()

    def counted(tasks):
        nonlocal input_bytes
        for task in tasks:
            input_bytes += sum(part[5] for part in task)
            yield task

    results = _ordered_results(counted(_tasks(sources, text_field, batch_bytes)), workers, tokenizer, text_field)
    try:
        for tokens, lengths, bad, lines, cpu in results:
            worker_cpu += cpu
            counts["lines"] += lines
            for source, line, reason in bad:
                reasons[reason] += 1
                if len(records) < MAX_LINE_RECORDS:
                    records.append({"file": sources[source].path, "line": line, "reason": reason})
            is_val = validation_mask(seed, counts["documents"], len(lengths), val_fraction)
            ends = np.cumsum(lengths)
            for begin, end, val in zip((ends - lengths).tolist(), ends.tolist(), is_val.tolist()):
                split = "validation" if val else "train"
                writers[split].write(tokens[begin:end])
                split_counts[split]["documents"] += 1
                split_counts[split]["tokens"] += end - begin
            counts["documents"] += len(lengths)
            counts["tokens"] += int(ends[-1]) if len(ends) else 0
            meter.update(counts["documents"], counts["tokens"], sum(reasons.values()))
    except BrokenProcessPool as e:
        meter.end()
        return Result(EXIT_FAILED, message=f"a worker process died ({e}); out of memory? {folder} has no manifest.json and is not a dataset")
    except ReadError as e:
        meter.end()
        return Result(EXIT_FAILED, message=f"{e}; {folder} has no manifest.json and is not a dataset")
    finally:
        results.close()
    meter.update(counts["documents"], counts["tokens"], sum(reasons.values()), force=True)
    meter.end()

    splits = {}
    for split, writer in writers.items():
        shards = writer.close()
        splits[split] = {**split_counts[split], "shards": shards}
        for shard in shards:
            for ext in ("bin", "idx"):
                fsync_path(folder / f"{shard['name']}.{ext}")
    skipped = sum(reasons.values())
    manifest = {
        "dtype": dtype.name,
        "tokenizer": {"path": tokenizer, "fingerprint": tokenizer_fingerprint(tokenizer), "vocab_size": tok.vocab_size,
                      "bos_id": tok.bos_id, "eos_id": tok.eos_id},
        "splits": splits,
        "inputs": list(inputs),
        "files": [source.path for source in sources],
        "text_field": text_field,
        "val_fraction": val_fraction,
        "seed": seed,
        "shard_tokens": shard_tokens,
        "counts": {
            **counts,
            "skipped": {
                "total": skipped,
                "reasons": dict(sorted(reasons.items())),
                "lines": records,
                "lines_not_listed": skipped - len(records),
            },
        },
    }
    write_manifest(folder, manifest)
    fsync_path(folder)
    seconds = time.monotonic() - start

    result = Result(EXIT_OK, manifest, seconds, input_bytes, workers, worker_cpu)
    per_worker = result.tokens_per_second / max(workers, 1)
    _log(f"done: {counts['documents']:,} documents ({splits['train']['documents']:,} train, "
         f"{splits['validation']['documents']:,} validation), {counts['tokens']:,} tokens, "
         f"{skipped:,} of {counts['lines']:,} lines skipped, {seconds:.1f} s, "
         f"{_si(result.tokens_per_second)} tokens/s ({_si(per_worker)} per worker), "
         f"{input_bytes / 1e6 / max(seconds, 1e-9):.1f} MB/s -> {folder}")
    if skipped:
        detail = ", ".join(f"{REASONS.get(r, r)} {n:,}" for r, n in sorted(reasons.items()))
        first = records[0]
        _log(f"skipped lines: {detail}; first: {first['file']}:{first['line']} ({REASONS.get(first['reason'], first['reason'])}); "
             f"manifest.json counts.skipped lists {len(records):,} of them")
    if counts["lines"] and skipped > max_bad_fraction * counts["lines"]:
        result.exit_code = EXIT_FAILED
        result.message = (f"{skipped:,} of {counts['lines']:,} lines ({skipped / counts['lines']:.2%}) were skipped, "
                          f"more than --max-bad-fraction {max_bad_fraction:g} allows; the output in {folder} is complete "
                          f"without them (see counts.skipped in its manifest.json)")
    elif counts["documents"] == 0:
        result.exit_code = EXIT_FAILED
        result.message = f"the inputs hold no documents; {folder} holds an empty dataset"
    elif val_fraction > 0 and splits["validation"]["documents"] == 0:
        _log(f"warning: no document fell into the validation split (--val-fraction {val_fraction} of "
             f"{counts['documents']:,} documents); raise --val-fraction for one")
    return result


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m components.data.preprocess",
        description="Tokenize JSON-lines, text or Parquet files, or datasets save_to_disk folders, into a packed "
                    "token folder for training.dataset = \"packed\".",
        epilog="Exit status: 0 done; 1 too many bad lines (the output is still complete), no documents, or a "
               "worker died; 2 bad arguments or inputs (nothing written).",
    )
    parser.add_argument("inputs", nargs="+", metavar="INPUT", help="files, folders, globs or save_to_disk folders, read in this order")
    parser.add_argument("--output", "-o", required=True, metavar="DIR", help="the folder to write (created; an earlier output there is replaced)")
    parser.add_argument("--tokenizer", default="tests/assets/tokenizers/shakespeare_bpe_4k.model", metavar="PATH",
                        help="sentencepiece model or tiktoken BPE-ranks file (default: %(default)s)")
    parser.add_argument("--workers", type=int, default=None, metavar="N",
                        help="tokenizer processes (default: the CPUs this process may use; 0: tokenize in the main process)")
    parser.add_argument("--text-field", default="text", help="the field or column holding the text (default: %(default)s)")
    parser.add_argument("--val-fraction", type=float, default=0.01,
                        help="fraction of documents put in the validation split, 0 for none (default: %(default)s)")
    parser.add_argument("--max-bad-fraction", type=float, default=0.001,
                        help="exit with status 1 when more than this fraction of lines were skipped (default: %(default)s)")
    parser.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS, metavar="N",
                        help="start a new shard file after this many tokens (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the train/validation split (default: %(default)s)")
    parser.add_argument("--batch-bytes", type=int, default=DEFAULT_BATCH_BYTES, metavar="N",
                        help="input bytes per task sent to a worker (default: %(default)s)")
    parser.add_argument("--quiet", action="store_true", help="no progress line")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        result = preprocess(args.inputs, args.output, args.tokenizer, workers=args.workers, text_field=args.text_field,
                            val_fraction=args.val_fraction, max_bad_fraction=args.max_bad_fraction,
                            shard_tokens=args.shard_tokens, seed=args.seed, batch_bytes=args.batch_bytes,
                            progress=not args.quiet)
    except UsageError as e:
        _log(f"error: {e}")
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(file=sys.stderr)
        _log(f"interrupted; {args.output} has no manifest.json and is not a dataset")
        return 130
    if result.exit_code != EXIT_OK:
        _log(f"error: {result.message}")
    return result.exit_code


if __name__ == "__main__":
    sys.exit(main())
