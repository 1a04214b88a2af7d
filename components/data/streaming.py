"""Training data streamed from files and packed on the fly (`training.dataset = "hf"`), in an order that
belongs to the run, not to its layout.

Streams. The run reads S streams, S the global batch size (sequences per optimizer step): the sequence
number v of every global batch is the next window of stream v. Stream v reads share v of S of every source
(sources.py: a range of its bytes or rows), and packs its documents, each as BOS + tokens + EOS, into windows
of seq_len + 1 tokens (inputs and labels shifted by one), the tokens left over going to its next window. So
the token ids of every global batch are a function of the data, the seed and the global batch size alone:
the same on 1 process and on any number, whatever the data-, tensor-, pipeline-, context- or expert-parallel
layout and the gradient accumulation.

Ranks. Data-parallel rank r of dp reads the streams v = j * dp + r, j = 0 .. S/dp - 1, in that order: row i
of its micro-batch m of a step is stream (m * local_batch_size + i) * dp + r (the packed loader deals its
samples the same way). It reads 1/dp of the bytes of a splittable source. Its loader's worker processes
(training.dataloader_workers, as many as divide S/dp) take every W-th of its streams; each reads, tokenizes
and packs them, and the training process receives windows in turn from each worker, which is the order above.

Epochs. A stream reads its share of a source in blocks (1 MiB of JSON lines, a Parquet row group, 1024 rows
of a saved dataset, a text file). Its first pass goes in file order; every later pass takes the blocks in an
order drawn from (training.seed, source, stream, epoch) and the documents of each block in an order drawn the
same way: data read again is reshuffled, and the same under any layout.

Blends. Sources with weights are mixed by tokens within each stream: the next document comes from the source
furthest below its share (weight / total weight) of the tokens the stream has read so far, so the proportions
hold to within a document at every point, with no randomness to store. The tokens each source contributed to
the windows handed out are counted; train.py logs them as data_tokens/<source>.

Resume. A stream's state is where it stands in each source (epoch, block, document), the tokens it read of
each, and how far into its last document its windows reached: a few numbers, saved under a key of its own
(`stream_<v>`). A resume on any number of processes loads the states of the streams each rank now reads and
continues exactly; one with another global batch size (other streams) is refused at start-up
(components/checkpoint/resume.py) unless `checkpoint.exclude_from_loading dataloader` starts the data again.

Validation reads its sources whole on every rank, in order, once; windows are dealt round-robin to the
ranks, and only whole rows of windows are kept, so every rank gets the same number of batches.
"""

from __future__ import annotations

import copy
import logging
import pickle
import random
from collections.abc import Iterator

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from components.data.packed import _hash, stop_iterator
from components.data.sources import DataError, Source, open_source
from components.data.tokenizer import Tokenizer
from components.run.stopping import leave_signals_to_the_trainer

logger = logging.getLogger(__name__)

BLOCK_BYTES = 1 << 20
"""JSON-lines blocks: a stream reads its share this many bytes at a time."""
BLOCK_ROWS = 1024
"""Saved-dataset blocks, in rows."""
_ORDER, _DOCUMENTS = 11, 12  # tags of the shuffles' seeds


class ShareReader:
    """Stream `stream` of `streams`'s share of one source: its documents, pass after pass. A position is
    (epoch, block in that epoch's order, document in that block)."""

    def __init__(self, source: Source, index: int, stream: int, streams: int, seed: int):
        self.source, self.index, self.stream, self.streams, self.seed = source, index, stream, streams, seed
        start, end = source.share(stream, streams)
        self.blocks = source.blocks(start, end, BLOCK_BYTES if source.kind == "json" else BLOCK_ROWS)
        self._cached: tuple[tuple[int, int], list[str]] | None = None

    def _order(self, epoch: int) -> list[int]:
        order = list(range(len(self.blocks)))
        if epoch > 0:
            random.Random(_hash(self.seed, _ORDER, self.index, self.stream, epoch)).shuffle(order)
        return order

    def block(self, epoch: int, position: int) -> list[str]:
        """The documents of the `position`-th block of pass `epoch`, in that pass's order."""
        if self._cached and self._cached[0] == (epoch, position):
            return self._cached[1]
        block = self._order(epoch)[position]
        texts = self.source.read_range(*self.blocks[block])
        if not self.source.splittable:  # every stream reads the whole source: keep every streams-th document
            texts = texts[(self.stream - block) % self.streams::self.streams]
        if epoch > 0:
            random.Random(_hash(self.seed, _DOCUMENTS, self.index, self.stream, epoch, block)).shuffle(texts)
        self._cached = ((epoch, position), texts)
        return texts

    def documents(self, position: tuple[int, int, int], endless: bool = True) -> Iterator[tuple[tuple, str]]:
        """(position after it, text) of every document from `position` on; one pass when not endless."""
        epoch, block, document = position
        while True:
            whole_pass, found = block == document == 0, False
            while block < len(self.blocks):
                texts = self.block(epoch, block)
                found = found or bool(texts)
                while document < len(texts):
                    document += 1
                    yield (epoch, block, document), texts[document - 1]
                block, document = block + 1, 0
            if not endless:
                return
            if whole_pass and not found:
                raise DataError(f"{self.source.setting}: {self.source.name} is too small for {self.streams} streams "
                                f"(one per sequence of the global batch, docs/data.md): stream {self.stream}'s share "
                                "holds no document; use a smaller training.global_batch_size or more data")
            epoch, block, document = epoch + 1, 0, 0
            if self.stream == 0:
                logger.info(f"data: {self.source.name}: epoch {epoch + 1} (a new order of its documents)")


def fresh_state(sources: int) -> dict:
    """A stream's state before it read anything: see the module docstring."""
    return {"next": [(0, 0, 0)] * sources, "read": [0] * sources, "given": [0] * sources, "partial": None}


class StreamPacker:
    """One stream's windows, blended by tokens: yields (window, tokens per source in it, state after it)."""

    def __init__(self, readers: list[ShareReader], weights: list[float], tokenizer: Tokenizer, seq_len: int,
                 state: dict | None = None, endless: bool = True):
        self.readers, self.tokenizer, self.window, self.endless = readers, tokenizer, seq_len + 1, endless
        self.shares = [w / sum(weights) for w in weights]
        self.state = copy.deepcopy(state) if state else fresh_state(len(readers))

    def _tokens(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, bos=True, eos=True)

    def __iter__(self):
        state = copy.deepcopy(self.state)
        documents = [reader.documents(position, self.endless) for reader, position in zip(self.readers, state["next"])]
        buffer, owners = [], []  # tokens not yet in a window and their sources: all but the last document's used
        current = None  # the last document read: (source, position after it, its length in tokens)
        if state["partial"] is not None:  # the rest of the document the last window ended in
            source, position, offset = state["partial"]
            epoch, block, document = position
            tokens = self._tokens(self.readers[source].block(epoch, block)[document - 1])
            buffer, current = tokens[offset:], (source, position, len(tokens))
            owners = [source] * len(buffer)
        while True:
            while len(buffer) < self.window:
                total = sum(state["read"]) + 1
                source = max(range(len(self.readers)), key=lambda s: self.shares[s] * total - state["read"][s])
                document = next(documents[source], None)
                if document is None:  # a finite (validation) pass is over
                    return
                position, text = document
                tokens = self._tokens(text)
                state["next"][source] = position
                state["read"][source] += len(tokens)
                buffer += tokens
                owners += [source] * len(tokens)
                current = (source, position, len(tokens))
            window, buffer = buffer[:self.window], buffer[self.window:]
            counts = [0] * len(self.readers)
            for owner in owners[:self.window]:
                counts[owner] += 1
            owners = owners[self.window:]
            for source, n in enumerate(counts):
                state["given"][source] += n
            # What is left is the end of the last document read: it starts the next window.
            state["partial"] = (current[0], current[1], current[2] - len(buffer)) if buffer else None
            yield window, counts, copy.deepcopy(state)


class StreamWindows(IterableDataset):
    """The windows of one rank's streams (`streams`: their numbers v, in the rank's order j), as the loader's
    workers make them: worker k of W packs the streams j = k, k + W, ... and yields, for each in turn, its next
    window as (j, window, tokens per source, stream state after it)."""

    def __init__(self, sources: list[Source], tokenizer: Tokenizer, seq_len: int, seed: int, streams: list[int],
                 count: int, states: dict[int, dict]):
        self.sources, self.tokenizer, self.seq_len, self.seed = sources, tokenizer, seq_len, seed
        self.streams, self.count, self.states = streams, count, states

    def packer(self, v: int) -> StreamPacker:
        readers = [ShareReader(source, i, v, self.count, self.seed) for i, source in enumerate(self.sources)]
        return StreamPacker(readers, [s.weight for s in self.sources], self.tokenizer, self.seq_len,
                            self.states.get(v))

    def __iter__(self):
        worker = get_worker_info()
        k, workers = (worker.id, worker.num_workers) if worker else (0, 1)
        mine = [(j, iter(self.packer(v))) for j, v in enumerate(self.streams) if j % workers == k]
        while True:
            for j, windows in mine:
                window, counts, state = next(windows)
                yield j, torch.tensor(window, dtype=torch.long), torch.tensor(counts), state


class StreamingDataLoader:
    """Batches (local_batch_size, seq_len + 1) of int64 for one data-parallel rank. `tokens_by_source`: the
    tokens of each source in the windows this rank handed out."""

    def __init__(self, dataset: StreamWindows, local_batch_size: int, workers: int, paths: list[str]):
        self.dataset, self.local_batch_size, self.workers, self.paths = dataset, local_batch_size, workers, list(paths)
        self.names = [source.name for source in dataset.sources]
        self.states = {j: dataset.states.get(v) for j, v in enumerate(dataset.streams)}
        self._items = None  # the iterator of the torch DataLoader, which owns the worker processes

    @property
    def tokens_by_source(self) -> dict[str, int]:
        given = [state["given"] for state in self.states.values() if state]
        return {name: sum(g[i] for g in given) for i, name in enumerate(self.names)}

    def __iter__(self):
        """Batches from where the last batch handed out left off."""
        self.close()
        self.dataset.states = {self.dataset.streams[j]: state for j, state in self.states.items() if state}
        per_worker = len(self.dataset.streams) // max(self.workers, 1)
        # generator: each iterator draws its workers' base seed, not from the global RNG (PackedDataLoader says why).
        loader = DataLoader(self.dataset, batch_size=None, num_workers=self.workers,
                            prefetch_factor=2 * per_worker if self.workers else None,
                            pin_memory=torch.cuda.is_available(), worker_init_fn=leave_signals_to_the_trainer,
                            generator=torch.Generator())
        items = self._items = iter(loader)
        while True:
            rows = []
            for _ in range(self.local_batch_size):
                try:
                    j, window, _, state = next(items)
                except DataError as e:  # raised in a worker: keep its own line, not the worker's traceback
                    raise DataError(str(e).strip().splitlines()[-1].removeprefix("components.data.sources.")
                                    .removeprefix("DataError: ")) from None
                self.states[j] = state
                rows.append(window)
            yield torch.stack(rows)

    def state_dict(self) -> dict:
        """One entry per stream this rank reads, `stream_<v>`: any rank that reads stream v later loads it."""
        return {f"stream_{v}": pickle.dumps({"paths": self.paths, "state": self.states[j]})
                for j, v in enumerate(self.dataset.streams)}

    def load_state_dict(self, state: dict) -> None:
        saved = {key: pickle.loads(value) for key, value in state.items()}
        if any(entry["paths"] != self.paths for entry in saved.values()):  # positions in other sources mean nothing
            old = next(entry["paths"] for entry in saved.values() if entry["paths"] != self.paths)
            logger.warning(f"data: the hf sources changed since the checkpoint ({','.join(old)} → "
                           f"{','.join(self.paths)}): reading the new ones from their beginning")
            return
        for j, v in enumerate(self.dataset.streams):
            self.states[j] = saved[f"stream_{v}"]["state"]

    def close(self) -> None:
        stop_iterator(self._items)
        self._items = None


def _unique_names(sources: list[Source]) -> None:
    names = [s.name for s in sources]
    for i, source in enumerate(sources):
        if names.count(source.name) > 1:
            source.name = f"{source.name}{names[:i].count(source.name) + 1}"


def _divisor_at_most(n: int, most: int) -> int:
    return max(d for d in range(1, min(n, max(most, 1)) + 1) if n % d == 0)


def build_streaming_dataloader(paths: list[str], text_field: str, tokenizer: Tokenizer, seq_len: int,
                               local_batch_size: int, global_batch_size: int, dp_rank: int, dp_size: int,
                               num_workers: int, seed: int, setting: str = "training.dataset_path",
                               ) -> StreamingDataLoader:
    """This data-parallel rank's endless training batches of the sources `paths`: its streams of the
    global_batch_size streams of the run (see the module docstring)."""
    if not paths:
        raise DataError(f"{setting}: no data given")
    sources = [open_source(p, text_field, setting) for p in paths]
    _unique_names(sources)
    weights = [s.weight for s in sources]
    streams = list(range(dp_rank, global_batch_size, dp_size))
    for source, weight in zip(sources, weights):
        blend = f", weight {weight / sum(weights):.3f}" if len(sources) > 1 else ""
        unit = "rows" if source.kind in ("parquet", "saved") else "bytes"
        how = (f"in {global_batch_size} shares of about {source.units // global_batch_size:,} {unit}, one per stream"
               if source.splittable else f"whole by every stream (compressed: it cannot be read from the middle), "
               f"each taking every {global_batch_size}th document")
        logger.info(f"data: {source.name} ({len(source.files)} file{'s' * (len(source.files) != 1)}, "
                    f"{source.units:,} {unit}{blend}) read {how}; this rank reads {len(streams)} streams")
    workers = _divisor_at_most(len(streams), num_workers) if num_workers else 0
    if workers != num_workers:
        logger.info(f"data: {workers} loader workers per rank, not training.dataloader_workers {num_workers}: the "
                    f"rank's {len(streams)} streams are dealt evenly to its workers")
    dataset = StreamWindows(sources, tokenizer, seq_len, seed, streams, global_batch_size, {})
    return StreamingDataLoader(dataset, local_batch_size, workers, paths)


def build_streaming_validation_dataloader(path: str, text_field: str, tokenizer: Tokenizer, seq_len: int,
                                          local_batch_size: int, dp_rank: int, dp_size: int,
                                          setting: str = "validation.dataset_path"):
    """This rank's validation batches of `path`, one pass from its start: every rank reads the whole source
    and takes every dp-th window; only whole rows of dp windows and whole batches are kept, so that every
    rank yields the same number of batches."""
    source = open_source(path, text_field, setting)
    windows = StreamPacker([ShareReader(source, 0, 0, 1, seed=0)], [1.0], tokenizer, seq_len, endless=False)

    def batches():
        row, batch = [], []
        for window, _, _ in windows:
            row.append(torch.tensor(window, dtype=torch.long))
            if len(row) < dp_size:
                continue
            batch.append(row[dp_rank])
            row = []
            if len(batch) == local_batch_size:
                yield torch.stack(batch)
                batch = []

    return batches()
