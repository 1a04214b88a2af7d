"""Training data streamed with Hugging Face `datasets` and packed on the fly (`training.dataset = "hf"`).

Sources. Each entry of training.dataset_path is a file, a glob, a folder of JSON-lines / text / Parquet
files, a local dataset repository (the layout the hub serves: shards under data/, the split named in
the file names; the `train` split is read), a `datasets.save_to_disk` folder, or, only when the machine
is online, a hub dataset id `owner/name` or `owner/name:config`. Every source is read as a `datasets`
IterableDataset: nothing is converted or cached, so a corpus of any size starts at once and takes no
local disk. An entry may end in `:weight` to blend sources (see below).

Shares. Each data-parallel rank reads only its share of every source, as
`datasets.distributed.split_dataset_by_node` deals it: whole shards (files) when the source's shard count
is a multiple of the data-parallel degree (rank r takes shards r, r + dp, ...), otherwise every dp-th
document of all shards. Inside a rank,
the loader's worker processes (training.dataloader_workers) split the rank's shards between them again,
so there are at most as many workers as the rank has shards of its smallest source; each worker reads,
tokenizes and packs its documents, and the training process receives finished batches.

Packing. A worker's documents, each as BOS + tokens + EOS, are cut into windows of seq_len + 1 tokens
(inputs and labels shifted by one); the tokens left over wait for the next document. When a source's share
is exhausted it starts again (a new epoch of that source).

Blends. Sources with weights are mixed by tokens: the next document comes from the source furthest below
its share (weight / total weight) of the tokens read so far, so the proportions hold to within a
document at every point, with no randomness to store. The tokens each source contributed to the batches
handed out are counted; train.py logs them as data_tokens/<source>.

Resume. The position (each source's place in its shards, its epoch, the leftover tokens, per worker) is
saved per data-parallel rank and restored exactly: the same layout resumes bitwise. A share depends on
the data-parallel degree and the worker count, so a resume that changes either is refused at start-up
(components/resume.py); `checkpoint.exclude_from_loading dataloader` starts the data from the beginning
instead.

Validation reads its sources whole on every rank, in order, once; windows are dealt round-robin to the
ranks, and only whole rows of windows are kept, so every rank gets the same number of batches.
"""

from __future__ import annotations

import copy
import glob
import json
import logging
import os
import pickle
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch.utils.data import IterableDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from components.data.packed import parse_path, stop_workers

if TYPE_CHECKING:
    from components.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

BUILDERS = {".json": "json", ".jsonl": "json", ".txt": "text", ".text": "text", ".parquet": "parquet"}
HUB_ID = re.compile(r"[\w][\w.-]*/[\w][\w.-]*")


class DataError(ValueError):
    """Data that cannot be read: a one-line message naming the setting and the file."""


def _builder(path: Path) -> str | None:
    suffixes = [s for s in path.suffixes if s not in (".gz", ".bz2", ".xz", ".zst")]
    return BUILDERS.get(suffixes[-1]) if suffixes else None


@dataclass
class Source:
    """One entry of a dataset path: the documents of all its shards, not yet split between ranks."""

    name: str
    weight: float
    dataset: object  # datasets.IterableDataset
    files: list[str] = field(default_factory=list)  # its shards in order; [] for a hub dataset

    @property
    def num_shards(self) -> int:
        return self.dataset.num_shards


def _files(path: str, setting: str) -> list[Path]:
    p = Path(path)
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and _builder(f))
    elif p.is_file():
        files = [p]
    else:
        files = sorted(Path(f) for f in glob.glob(path) if Path(f).is_file())
    if not files:
        return []
    kinds = {_builder(f) for f in files}
    if None in kinds or len(kinds) > 1:
        shown = ", ".join(sorted(str(f) for f in files[:5]))
        raise DataError(f"{setting} {path!r}: mixes or has unknown formats ({shown})")
    return files


def _repository_files(folder: Path, split: str, setting: str) -> list[Path]:
    """The `split` shards of a local dataset repository, found by the hub's file-name conventions."""
    import datasets

    try:
        data_files = datasets.load_dataset_builder(str(folder)).config.data_files or {}
    except Exception as e:  # noqa: BLE001 - datasets raises many kinds; the message is what matters
        raise DataError(f"{setting} {str(folder)!r}: not a readable dataset repository ({e})") from e
    if split not in data_files:
        raise DataError(f"{setting} {str(folder)!r}: the repository has no {split!r} split "
                        f"(splits: {', '.join(data_files) or 'none'})")
    return [Path(f) for f in data_files[split]]


def _first_bad_json_line(files: list[str]) -> str | None:
    """Where a JSON-lines read failed, name the file and line, which datasets' own error does not."""
    import gzip

    for file in files:
        opener = gzip.open if file.endswith(".gz") else open
        with opener(file, "rt", encoding="utf-8", errors="replace") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    json.loads(line)
                except json.JSONDecodeError as e:
                    return f"{file}:{number}: invalid JSON ({e.msg})"
    return None


def _columns(file: Path, builder: str, setting: str) -> list[str]:
    """The columns of one shard, read from its head (a Parquet footer, a first JSON line): a shard that
    cannot be read is named now, not in a loader worker hours into the run."""
    try:
        if builder == "parquet":
            import pyarrow.parquet as pq

            return pq.ParquetFile(file).schema_arrow.names
        if builder == "json":
            import gzip

            with (gzip.open if file.suffix == ".gz" else open)(file, "rt", encoding="utf-8") as f:
                line = next((line for line in f if line.strip()), None)
            if line is None:
                return []
            try:
                return list(json.loads(line))
            except json.JSONDecodeError as e:
                raise DataError(f"{setting}: cannot read {file}: its first line is not JSON ({e.msg})") from e
        return ["text"]
    except (OSError, UnicodeDecodeError, ValueError) as e:
        if isinstance(e, DataError):
            raise
        raise DataError(f"{setting}: cannot read {file}: {e}") from e


def _check_field(columns: list[str], text_field: str, where: str, setting: str) -> None:
    if columns and text_field not in columns:
        raise DataError(f"{setting} {where!r} has no field {text_field!r} (columns: {', '.join(columns)}); "
                        "set training.dataset_text_field")


def _offline() -> bool:
    return any(os.environ.get(name, "").lower() in ("1", "true", "yes", "on")
               for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"))


def _hub_source(entry: str, path: str, weight: float, text_field: str, split: str, setting: str) -> Source:
    import datasets

    repo, _, config = path.partition(":")
    if _offline():
        raise DataError(f"{setting} {path!r} is not a local path; as a hub dataset it needs the network, and this "
                        "machine is offline (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE); give local files or a local "
                        "dataset repository instead")
    try:
        dataset = datasets.load_dataset(repo, config or None, split=split, streaming=True)
    except Exception as e:  # noqa: BLE001 - network and hub errors come in many types
        raise DataError(f"{setting} {path!r}: cannot open the hub dataset {repo!r} (is this machine offline?): "
                        f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from e
    features = getattr(dataset, "features", None)
    _check_field(list(features) if features else [], text_field, path, setting)
    return Source(path, weight, dataset.select_columns([text_field]))


def open_source(entry: str, text_field: str, setting: str = "training.dataset_path", split: str = "train") -> Source:
    """The documents of one dataset path entry (see the module docstring), checked: every shard's head
    is readable and has `text_field`. Raises DataError (or FileNotFoundError) with a one-line message."""
    import datasets

    datasets.disable_progress_bars()  # one bar per file would flood the training log
    path, weight = parse_path(entry)
    p = Path(path)
    if p.is_dir() and ((p / "dataset_info.json").exists() or (p / "state.json").exists()):
        saved = datasets.load_from_disk(str(p))
        _check_field(saved.column_names, text_field, path, setting)
        if len(saved) == 0:
            raise DataError(f"{setting} {path!r} holds no documents")
        shards = max(1, min(len(saved.cache_files), len(saved)))
        dataset = saved.select_columns([text_field]).to_iterable_dataset(num_shards=shards)
        return Source(p.name, weight, dataset, [f["filename"] for f in saved.cache_files])
    if p.is_dir() and ((p / "data").is_dir() or (p / "README.md").exists()):
        files = _repository_files(p, split, setting)
    else:
        files = _files(path, setting)
    if not files:
        if not p.exists() and HUB_ID.fullmatch(path.partition(":")[0]) and not _builder(p):
            return _hub_source(entry, path, weight, text_field, split, setting)
        raise FileNotFoundError(f"{setting}: no data files at {path!r} (JSON/JSONL, text or Parquet files, a dataset "
                                "repository or save_to_disk folder, or a hub id owner/name when online)")
    builder = _builder(files[0])
    for file in files:
        _check_field(_columns(file, builder, setting), text_field, str(file), setting)
    kwargs = {"sample_by": "document"} if builder == "text" else {}
    dataset = datasets.load_dataset(builder, data_files=[str(f) for f in files], split="train", streaming=True,
                                    **kwargs)
    name = p.stem if p.is_file() else p.name or path
    return Source(name, weight, dataset.select_columns([text_field]), [str(f) for f in files])


def rank_share(source: Source, dp_rank: int, dp_size: int) -> tuple[object, str, int]:
    """This rank's share of `source` (split_dataset_by_node), a description of it, and its shard count."""
    from datasets.distributed import split_dataset_by_node

    n = source.num_shards
    share = split_dataset_by_node(source.dataset, rank=dp_rank, world_size=dp_size)
    if dp_size == 1:
        return share, f"all {n} shard{'s' * (n != 1)}", n
    if n % dp_size == 0:
        mine = list(range(dp_rank, n, dp_size))
        named = f" ({', '.join(Path(source.files[i]).name for i in mine[:3])}{', ...' * (len(mine) > 3)})" \
            if source.files else ""
        shown = ", ".join(str(i + 1) for i in mine[:4]) + (", ..." if len(mine) > 4 else "")
        return share, f"shards {shown} of {n}{named}", len(mine)
    return share, f"every {dp_size}th document (from document {dp_rank + 1}) of its {n} shard{'s' * (n != 1)}", n


class StreamingWindows(IterableDataset):
    """Packed windows of one reader's documents (a data-parallel rank's share, split again between the
    loader's workers by `datasets`), blended by tokens. Each item is (window, tokens per source in it)."""

    def __init__(self, sources: list[object], names: list[str], weights: list[float], text_field: str,
                 tokenizer: Tokenizer, seq_len: int, setting: str, files: list[list[str]], endless: bool = True):
        self.sources, self.names, self.text_field, self.tokenizer = sources, names, text_field, tokenizer
        self.shares = [w / sum(weights) for w in weights]
        self.window, self.setting, self.files, self.endless = seq_len + 1, setting, files, endless
        self.fresh = [copy.deepcopy(s.state_dict()) for s in sources]
        self.state = {"positions": copy.deepcopy(self.fresh), "epochs": [0] * len(sources),
                      "tokens": [0] * len(sources), "buffer": [], "buffer_sources": []}
        self._live = None

    def _documents(self, i: int):
        """Source i's texts, pass after pass (one pass when not endless)."""
        source = self.sources[i]
        while True:
            read = 0
            examples = iter(source)
            while True:
                try:
                    example = next(examples)
                except StopIteration:
                    break
                except Exception as e:  # noqa: BLE001 - a shard that fails mid-stream: name the file
                    where = _first_bad_json_line(self.files[i]) if any(".json" in f for f in self.files[i]) else None
                    raise DataError(f"{self.setting}: cannot read {self.names[i]}: {where or e}") from e
                read += 1
                yield example[self.text_field]
            if not self.endless:
                return
            if read == 0 and self._live["empty_pass"][i]:
                raise DataError(f"{self.setting}: {self.names[i]} gives this reader no documents")
            self._live["empty_pass"][i] = read == 0
            self._live["epochs"][i] += 1
            source.load_state_dict(self.fresh[i])  # else the next pass would start at a loaded position again
            logger.info(f"data: {self.names[i]}: finished a pass over this reader's share, epoch "
                        f"{self._live['epochs'][i]}")

    def _next_source(self, tokens: list[int]) -> int:
        """The source furthest below its share of the tokens read so far."""
        total = sum(tokens) + 1
        return max(range(len(tokens)), key=lambda i: self.shares[i] * total - tokens[i])

    def __iter__(self):
        live = self._live = copy.deepcopy(self.state) | {"empty_pass": [False] * len(self.sources)}
        for source, position in zip(self.sources, live["positions"]):
            source.load_state_dict(copy.deepcopy(position))
        documents = [self._documents(i) for i in range(len(self.sources))]
        buffer, owners = live["buffer"], live["buffer_sources"]
        while True:
            while len(buffer) < self.window:
                i = self._next_source(live["tokens"])
                text = next(documents[i], None)
                if text is None:  # a finite (validation) read is over
                    return
                live["positions"][i] = self.sources[i].state_dict()
                tokens = self.tokenizer.encode(text, bos=True, eos=True)
                buffer.extend(tokens)
                owners.extend([i] * len(tokens))
                live["tokens"][i] += len(tokens)
            window, counts = buffer[:self.window], torch.bincount(torch.tensor(owners[:self.window]),
                                                                  minlength=len(self.sources))
            del buffer[:self.window], owners[:self.window]
            yield torch.tensor(window, dtype=torch.long), counts

    def state_dict(self) -> dict:
        """The position after the last window handed out (a loader worker calls this after each batch)."""
        if self._live is None:
            return copy.deepcopy(self.state)
        return copy.deepcopy({k: v for k, v in self._live.items() if k != "empty_pass"})

    def load_state_dict(self, state: dict) -> None:
        self.state, self._live = copy.deepcopy(state), None


class StreamingDataLoader:
    """Batches (local_batch_size, seq_len + 1) of int64 for one data-parallel rank, packed by the loader's
    workers. `tokens_by_source`: the tokens of each source in the batches handed out on this rank.

    Its state is this rank's position, under a key of its own (`dp_rank_<r>`): the ranks' positions
    differ, and a distributed checkpoint keeps one copy of a key that several ranks share."""

    def __init__(self, dataset: StreamingWindows, local_batch_size: int, num_workers: int, dp_rank: int,
                 dp_size: int, paths: list[str]):
        self.names, self.key, self.paths = dataset.names, f"dp_rank_{dp_rank}", list(paths)
        self.layout = {"dp": dp_size, "workers": num_workers}
        self.tokens_by_source = dict.fromkeys(self.names, 0)
        self._loader = StatefulDataLoader(
            dataset, batch_size=local_batch_size, num_workers=num_workers, persistent_workers=num_workers > 0,
            prefetch_factor=4 if num_workers > 0 else None, pin_memory=torch.cuda.is_available(),
        )

    def __iter__(self):
        batches = iter(self._loader)
        while True:
            try:
                windows, counts = next(batches)
            except StopIteration:
                return
            except DataError as e:  # raised in a worker: keep its own line, not the worker's traceback
                raise DataError(str(e).strip().splitlines()[-1].removeprefix("components.data.streaming.")
                                .removeprefix("DataError: ")) from None
            for name, n in zip(self.names, counts.sum(dim=0).tolist()):
                self.tokens_by_source[name] += n
            yield windows

    def state_dict(self) -> dict:
        state = {"layout": self.layout, "paths": self.paths, "loader": self._loader.state_dict(),
                 "tokens": self.tokens_by_source}
        return {self.key: pickle.dumps(state)}

    def close(self) -> None:
        stop_workers(self._loader)

    def load_state_dict(self, state: dict) -> None:
        saved = pickle.loads(state[self.key])
        if saved["layout"] != self.layout:  # components/resume.py refuses this at start-up already
            raise DataError(f"the checkpoint's hf data position was saved with {saved['layout']}, this run has "
                            f"{self.layout}; resume with the saved layout or --checkpoint.exclude_from_loading "
                            "dataloader")
        if saved["paths"] != self.paths:  # a position in other sources means nothing in these
            logger.warning(f"data: the hf sources changed since the checkpoint ({','.join(saved['paths'])} → "
                           f"{','.join(self.paths)}): reading the new ones from their beginning")
            return
        self._loader.load_state_dict(saved["loader"])
        self.tokens_by_source = saved["tokens"]


def _unique_names(sources: list[Source]) -> list[str]:
    names = [s.name for s in sources]
    return [f"{name}{names[:i].count(name) + 1}" if names.count(name) > 1 else name for i, name in enumerate(names)]


def build_streaming_dataloader(paths: list[str], text_field: str, tokenizer: Tokenizer, seq_len: int,
                               local_batch_size: int, dp_rank: int, dp_size: int, num_workers: int,
                               setting: str = "training.dataset_path") -> StreamingDataLoader:
    """This data-parallel rank's endless training batches of the sources `paths` (see the module docstring)."""
    if not paths:
        raise DataError(f"{setting}: no data given")
    sources = [open_source(p, text_field, setting) for p in paths]
    names = _unique_names(sources)
    shares = [rank_share(s, dp_rank, dp_size) for s in sources]
    weights = [s.weight for s in sources]
    for source, name, weight in zip(sources, names, weights):
        ranks = "; ".join(f"rank {r}: {rank_share(source, r, dp_size)[1]}" for r in range(min(dp_size, 4)))
        more = f"; ... (rank r of {dp_size} alike)" if dp_size > 4 else ""
        blend = f", weight {weight / sum(weights):.3f}" if len(sources) > 1 else ""
        logger.info(f"data: {name} ({source.num_shards} shard{'s' * (source.num_shards != 1)}{blend}) streamed in "
                    f"data-parallel shares: {ranks}{more}")
    workers = min([num_workers] + [k for _, _, k in shares])
    if workers < num_workers:
        logger.info(f"data: {workers} loader worker{'s' * (workers != 1)} per rank, not training.dataloader_workers "
                    f"{num_workers}: a worker reads whole shards, and a rank's share has {min(k for *_, k in shares)}")
    dataset = StreamingWindows([share for share, _, _ in shares], names, weights, text_field, tokenizer, seq_len,
                               setting, [s.files for s in sources])
    return StreamingDataLoader(dataset, local_batch_size, workers, dp_rank, dp_size, paths)


def build_streaming_validation_dataloader(path: str, text_field: str, tokenizer: Tokenizer, seq_len: int,
                                          local_batch_size: int, dp_rank: int, dp_size: int,
                                          setting: str = "validation.dataset_path"):
    """This rank's validation batches of `path`, one pass from its start: every rank reads the whole source
    and takes every dp-th window; only whole rows of dp windows and whole batches are kept, so that every
    rank yields the same number of batches."""
    source = open_source(path, text_field, setting)
    windows = StreamingWindows([source.dataset], [source.name], [1.0], text_field, tokenizer, seq_len, setting,
                               [source.files], endless=False)

    def batches():
        row, batch = [], []
        for window, _ in windows:
            row.append(window)
            if len(row) < dp_size:
                continue
            batch.append(row[dp_rank])
            row = []
            if len(batch) == local_batch_size:
                yield torch.stack(batch)
                batch = []

    return batches()
