"""Training data read from local files with Hugging Face `datasets` and packed on the fly (`training.dataset = "hf"`).

The files are JSON lines, text or Parquet (or a `datasets` save_to_disk folder); nothing is prepared
ahead, which suits small data. The corpus is read as one global stream: every document, in order, as
BOS + tokens + EOS, cut into windows of seq_len + 1 tokens (inputs and labels shifted by one). Window g
goes to data-parallel rank g % dp_size, so one optimizer step always consumes the next
global_batch_size windows of the stream, whatever the layout. The loader's position is stored as a
point in that global stream (document, token offset, windows consumed), identical on every rank: a
checkpoint resumes exactly, also under a different data-parallel degree. Every rank tokenizes the whole
stream, which is cheap at the sizes this on-the-fly path is for.
"""

from __future__ import annotations

import glob
import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch.utils.data import IterableDataset
from torchdata.stateful_dataloader import StatefulDataLoader

if TYPE_CHECKING:
    from components.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

BUILDERS = {".json": "json", ".jsonl": "json", ".txt": "text", ".text": "text", ".parquet": "parquet"}


def _builder(path: Path) -> str | None:
    suffixes = [s for s in path.suffixes if s not in (".gz", ".bz2", ".xz", ".zst")]
    return BUILDERS.get(suffixes[-1]) if suffixes else None


def _data_files(path: str, setting: str) -> list[Path]:
    p = Path(path)
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and _builder(f))
    elif p.is_file():
        files = [p]
    else:
        files = sorted(Path(f) for f in glob.glob(path) if Path(f).is_file())
    if not files:
        raise FileNotFoundError(f"{setting}: no data files at {path!r} (JSON/JSONL, text or Parquet)")
    kinds = {_builder(f) for f in files}
    if None in kinds or len(kinds) > 1:
        shown = ", ".join(sorted(str(f) for f in files[:5]))
        raise ValueError(f"{setting} {path!r}: mixes or has unknown formats ({shown})")
    return files


def _first_bad_json_line(files: list[Path]) -> str | None:
    """Where a JSON-lines read failed, name the file and line, which datasets' own error does not."""
    import gzip

    for file in files:
        opener = gzip.open if file.suffix == ".gz" else open
        with opener(file, "rt", encoding="utf-8", errors="replace") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    json.loads(line)
                except json.JSONDecodeError as e:
                    return f"{file}:{number}: invalid JSON ({e.msg})"
    return None


def load_documents(paths: list[str], text_field: str, setting: str = "training.dataset_path"):
    """A map-style Hugging Face dataset of the documents (a `text_field` column) of all `paths`, in order.

    Each path is a directory written by `datasets.save_to_disk`, a file, a glob or a directory of
    JSON/JSONL (one object per line), text (one document per file) or Parquet files. `setting` names
    the option that gave the paths, in errors."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # local files only: never reach for the hub
    import datasets

    datasets.disable_progress_bars()  # one bar per file and step would flood the training log
    parts = []
    for path in paths:
        if Path(path).is_dir() and (Path(path) / "dataset_info.json").exists():
            docs = datasets.load_from_disk(path)
        else:
            files = _data_files(path, setting)
            builder = _builder(files[0])
            kwargs = {"sample_by": "document"} if builder == "text" else {}
            try:
                docs = datasets.load_dataset(builder, data_files=[str(f) for f in files], split="train", **kwargs)
            except Exception as e:
                where = _first_bad_json_line(files) if builder == "json" else None
                raise ValueError(f"{setting}: cannot read {path!r}: {where or e}") from e
        if text_field not in docs.column_names:
            columns = ", ".join(docs.column_names)
            raise ValueError(f"{setting} {path!r} has no field {text_field!r} (columns: {columns}); "
                             "set training.dataset_text_field")
        if len(docs) == 0:
            raise ValueError(f"{setting} {path!r} holds no documents")
        parts.append(docs.select_columns([text_field]))
    return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)


class PackedDocuments(IterableDataset):
    """This rank's windows of the packed global token stream (see the module docstring)."""

    def __init__(self, docs, text_field: str, tokenizer: Tokenizer, seq_len: int, dp_rank: int, dp_size: int):
        self.docs, self.text_field, self.tokenizer = docs, text_field, tokenizer
        self.window, self.dp_rank, self.dp_size = seq_len + 1, dp_rank, dp_size
        # Position of the next unread row of dp_size windows in the global stream.
        self.position = {"epoch": 0, "document": 0, "offset": 0, "windows": 0}

    def _tokens(self, index: int) -> list[int]:
        return self.tokenizer.encode(self.docs[index][self.text_field], bos=True, eos=True)

    def __iter__(self):
        epoch, document, offset, windows = (self.position[k] for k in ("epoch", "document", "offset", "windows"))
        row = self.window * self.dp_size
        buffer, last = [], []
        while True:
            while len(buffer) < row:
                if document == len(self.docs):
                    epoch, document = epoch + 1, 0
                    logger.info(f"data: finished a pass over {len(self.docs)} documents, starting epoch {epoch}")
                last = self._tokens(document)
                buffer.extend(last[offset:])
                document, offset = document + 1, 0
            mine = buffer[self.dp_rank * self.window : (self.dp_rank + 1) * self.window]
            buffer = buffer[row:]
            windows += self.dp_size
            # The leftover tokens all come from the document read last, so the row ends inside it.
            at = (document - 1, len(last) - len(buffer)) if buffer else (document, 0)
            self.position = {"epoch": epoch, "document": at[0], "offset": at[1], "windows": windows}
            yield torch.tensor(mine, dtype=torch.long)

    def state_dict(self) -> dict:
        return dict(self.position)

    def load_state_dict(self, state: dict) -> None:
        self.position = {k: int(state[k]) for k in ("epoch", "document", "offset", "windows")}


def build_local_files_dataloader(paths: list[str], text_field: str, tokenizer: Tokenizer, seq_len: int,
                                 local_batch_size: int, dp_rank: int, dp_size: int,
                                 setting: str = "training.dataset_path") -> StatefulDataLoader:
    """Batches of shape (local_batch_size, seq_len + 1); `state_dict()` goes into checkpoints."""
    docs = load_documents(paths, text_field, setting)
    dataset = PackedDocuments(docs, text_field, tokenizer, seq_len, dp_rank, dp_size)
    return StatefulDataLoader(dataset, batch_size=local_batch_size, num_workers=0)
