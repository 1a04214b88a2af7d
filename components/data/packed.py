"""The training loader for packed folders (written by `python -m scripts.preprocess`, format in
packed_format.py): fixed windows of a memory-mapped token stream, globally shuffled, blendable.

Samples. A split of a folder is one token stream (PackedSplit). Its windows are seq_len + 1 tokens
long (inputs and labels shifted by one) and overlap by one token, so every token is trained on:
window i is tokens [i * seq_len, i * seq_len + seq_len + 1), and there are
N = (num_tokens - 1) // seq_len of them.

Global samples. The whole run reads one sequence of global samples g = 0, 1, 2, ... over all epochs.
A micro-step consumes the next local_batch_size * dp_size of them; in each row of dp_size samples,
data-parallel rank r takes the r-th. An optimizer step therefore trains on the same samples whatever
the data-parallel layout, and the loader's whole state is one integer, the number of global samples
consumed, identical on every rank: a checkpoint resumes exactly, also under another dp_size or
local_batch_size. Reading sample g takes O(1) work and memory, never a replay of samples 0..g-1.

Shuffling. For one folder, sample j lies in epoch e = j // N and is window perm_e(j % N), where
perm_e is a pseudo-random permutation of range(N) keyed by (seed, folder, e): a new order every
epoch, every window once per epoch. A permutation stored as an array would cost O(N) memory per
process and a shuffle at every epoch (billions of windows in real runs); a Feistel network computes
perm_e(i) from i alone. It is a bijection on range(2^b), 2^b the smallest power of two >= N (at
least 4), whatever its round function (here a 64-bit integer hash of the key, the round and the
half); values >= N are mapped again ("cycle walking") until one lands below N, which keeps it a
bijection on range(N) and, as 2^b < 2N for N >= 3, takes fewer than two passes on average.
shuffle=False reads windows in order (validation).

Blends. Folders given as "path:weight" are mixed in proportion to their (normalized) weights.
Global samples are cut into blocks of BLEND_BLOCK. Each folder gets a fixed count c_d of every
block's slots (weight * BLEND_BLOCK, rounded by largest remainder so the counts sum to the block),
and a permutation of the block keyed by (seed, block) deals out the slots: slot s goes to the folder
whose range [C_d, C_d + c_d) of the cumulative counts holds p = perm(s), as that folder's sample
j = block * c_d + p - C_d. Each folder thus sees its own samples j = 0, 1, 2, ... (in a shuffled
order inside a block) and walks through its own epochs at its own pace; the proportions are exact
at every block boundary. With shuffle=False the folders are read one after another, weights unused.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import math

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler
from torchdata.stateful_dataloader import StatefulDataLoader

from components.data.packed_format import PackedSplit, check_tokenizer, read_manifest
from components.run.stopping import leave_signals_to_the_trainer

logger = logging.getLogger(__name__)

BLEND_BLOCK = 1000
"""Global samples per blend block: the proportions of a blend are exact every this many samples."""
FEISTEL_ROUNDS = 6
_MASK64 = (1 << 64) - 1
_FOLDER, _BLEND = 1, 2  # key tags, so folder and blend permutations never share a key


def _mix64(x: int) -> int:
    """SplitMix64's finalizer: a bijective 64-bit hash in which every input bit affects every output bit."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _hash(*values: int) -> int:
    """A 64-bit hash of a tuple of integers (negative ones as two's complement)."""
    h = 0
    for value in values:
        h = _mix64(h ^ (value & _MASK64))
    return h


class FeistelPermutation:
    """A pseudo-random permutation of range(n) keyed by integers, computed one index at a time in
    O(1) memory: an unbalanced Feistel network on the smallest power of two >= n (at least 4), with
    cycle walking to stay below n."""

    def __init__(self, n: int, *key: int):
        if n < 1:
            raise ValueError(f"a permutation needs n >= 1, got {n}")
        self.n = n
        bits = max(2, (n - 1).bit_length())
        self.widths = (bits // 2, bits - bits // 2)  # of the left (high) and right (low) halves
        base = _hash(*key)
        self.round_keys = [_hash(base, r) for r in range(FEISTEL_ROUNDS)]

    def __call__(self, index: int) -> int:
        if not 0 <= index < self.n:
            raise IndexError(f"{index} outside range({self.n})")
        x = self._encrypt(index)
        while x >= self.n:
            x = self._encrypt(x)
        return x

    def _encrypt(self, x: int) -> int:
        left_bits, right_bits = self.widths
        left, right = x >> right_bits, x & ((1 << right_bits) - 1)
        for key in self.round_keys:
            # (L, R) -> (R, L ^ F(R)): invertible whatever F is; the halves swap widths each round.
            left, right = right, left ^ (_mix64(key ^ right) & ((1 << left_bits) - 1))
            left_bits, right_bits = right_bits, left_bits
        return (left << right_bits) | right


def largest_remainder(weights: list[float], total: int) -> list[int]:
    """Integer counts proportional to `weights` that sum to `total`."""
    exact = [w * total / sum(weights) for w in weights]
    counts = [math.floor(x) for x in exact]
    by_remainder = sorted(range(len(weights)), key=lambda d: counts[d] - exact[d])
    for d in by_remainder[: total - sum(counts)]:
        counts[d] += 1
    return counts


class Blend:
    """Global sample g -> (folder d, that folder's sample j), in seeded blocks (module docstring)."""

    def __init__(self, weights: list[float], seed: int):
        self.counts = largest_remainder(weights, BLEND_BLOCK)
        if 0 in self.counts:
            raise ValueError(f"training.dataset_path: blend weights {weights} give a folder less than "
                             f"1/{BLEND_BLOCK} of the samples")
        self.starts = [0, *itertools.accumulate(self.counts)][:-1]
        self.seed = seed

    def locate(self, g: int) -> tuple[int, int]:
        block, slot = divmod(g, BLEND_BLOCK)
        p = FeistelPermutation(BLEND_BLOCK, self.seed, _BLEND, block)(slot)
        d = bisect.bisect_right(self.starts, p) - 1
        return d, block * self.counts[d] + p - self.starts[d]


class Concatenation:
    """Global sample g -> (folder d, j): the folders' samples one after another; the last goes on."""

    def __init__(self, sizes: list[int]):
        self.starts = [0, *itertools.accumulate(sizes)][:-1]

    def locate(self, g: int) -> tuple[int, int]:
        d = bisect.bisect_right(self.starts, g) - 1
        return d, g - self.starts[d]


class PackedWindows(Dataset):
    """Global sample g -> its window of seq_len + 1 tokens as an int64 tensor. The memory maps are
    opened on first use in each process (a worker opens its own), never pickled."""

    def __init__(self, folders: list[str], manifests: list[dict], num_windows: list[int], split: str, seq_len: int,
                 weights: list[float], seed: int, shuffle: bool):
        self.folders, self.manifests, self.num_windows = folders, manifests, num_windows
        self.split, self.seq_len, self.seed, self.shuffle = split, seq_len, seed, shuffle
        self.order = Blend(weights, seed) if shuffle and len(folders) > 1 else Concatenation(self.num_windows)
        self._splits: list[PackedSplit] | None = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_splits": None}

    def window(self, d: int, j: int) -> int:
        """The window of folder d's sample j."""
        if not self.shuffle:
            return j
        epoch, i = divmod(j, self.num_windows[d])
        return FeistelPermutation(self.num_windows[d], self.seed, _FOLDER, d, epoch)(i)

    def __getitem__(self, g: int) -> torch.Tensor:
        if self._splits is None:
            self._splits = [PackedSplit(f, self.split, m) for f, m in zip(self.folders, self.manifests)]
        d, j = self.order.locate(g)
        tokens = self._splits[d].read(self.window(d, j) * self.seq_len, self.seq_len + 1)
        return torch.from_numpy(tokens.astype(np.int64))


class RankSampler(Sampler[int]):
    """This rank's global samples from `start` on: row i holds samples start + i * dp_size + [0, dp_size),
    of which this rank takes start + i * dp_size + dp_rank. Endless, or with `end`, the whole
    micro-steps (local_batch_size rows) that fit before sample `end`."""

    def __init__(self, dp_rank: int, dp_size: int, local_batch_size: int, end: int | None):
        self.dp_rank, self.dp_size, self.local_batch_size, self.end = dp_rank, dp_size, local_batch_size, end
        self.start = 0

    def __iter__(self):
        if self.end is None:
            rows = itertools.count()
        else:
            rows = range((self.end - self.start) // (self.local_batch_size * self.dp_size) * self.local_batch_size)
        for i in rows:
            yield self.start + i * self.dp_size + self.dp_rank


def stop_workers(loader: StatefulDataLoader) -> None:
    """Stop the worker processes of `loader`'s persistent iterator (see stop_iterator)."""
    iterator, loader._iterator = loader._iterator, None
    stop_iterator(iterator)


def stop_iterator(iterator) -> None:
    """Stop a DataLoader iterator's worker processes and its queue threads now rather than at garbage collection,
    which an exception's traceback can put off indefinitely: a process that goes on and forks again (train.main
    called from a notebook or the test suite) can crash the new child if it forks while those threads run, and
    one that exits would wait for workers that ignore the SIGTERM it stops them with (they leave the stop signals
    to the trainer, components/run/stopping.py): those still alive after the DataLoader's own shutdown (a private
    method, stable since torch 1.x) are killed. An iterator without workers has none."""
    if not hasattr(iterator, "_shutdown_workers"):
        return
    workers = list(getattr(iterator, "_workers", []))
    iterator._shutdown_workers()
    for worker in workers:
        if worker.is_alive():
            worker.kill()
            worker.join()


class PackedDataLoader:
    """Batches (local_batch_size, seq_len + 1) of int64 for one data-parallel rank, read by a
    StatefulDataLoader's workers. The state is the global samples consumed by the batches handed to
    the caller (prefetched ones do not count): {"samples_consumed": int}, the same on every rank.

    Endless when shuffled: every iter() continues where the last batch handed out left off. With
    shuffle=False it is finite: every iter() is one pass from the loaded start (0 unless
    load_state_dict set one) to the last whole micro-step of the data."""

    def __init__(self, dataset: PackedWindows, sampler: RankSampler, num_workers: int):
        self.sampler = sampler
        self._samples_per_batch = sampler.local_batch_size * sampler.dp_size
        self._start = self._consumed = 0
        self._loader = StatefulDataLoader(
            dataset, batch_size=sampler.local_batch_size, sampler=sampler, num_workers=num_workers,
            persistent_workers=num_workers > 0, prefetch_factor=4 if num_workers > 0 else None,
            pin_memory=torch.cuda.is_available(), worker_init_fn=leave_signals_to_the_trainer,
            snapshot_every_n_steps=None,  # our own counter is the state; torchdata's snapshots would go unused
            # Each iterator draws its workers' base seed: from the global RNG, whose state checkpoints carry, that
            # draw would leave a resumed run one draw ahead of the uninterrupted one.
            generator=torch.Generator(),
        )

    def __iter__(self):
        if self.sampler.end is not None:
            self._consumed = self._start
        self.sampler.start = self._consumed
        for batch in self._loader:
            self._consumed += self._samples_per_batch
            yield batch

    def state_dict(self) -> dict:
        return {"samples_consumed": self._consumed}

    def close(self) -> None:
        stop_workers(self._loader)

    def load_state_dict(self, state: dict) -> None:
        self._start = self._consumed = int(state["samples_consumed"])


def parse_path(entry: str) -> tuple[str, float]:
    """"path:weight" -> (path, weight); a path without a weight (or whose last ':' is not followed by a
    number) weighs 1. The blend notation of both loaders (packed folders and hf sources)."""
    folder, colon, weight = entry.rpartition(":")
    try:
        value = float(weight) if colon else None
    except ValueError:
        value = None
    if value is None:
        return entry, 1.0
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"training.dataset_path {entry!r}: a blend weight must be a positive number")
    return folder, value


def config_key(split: str) -> str:
    """The setting that named the folders, for error messages."""
    return "training.dataset_path" if split == "train" else "validation.dataset_path"


def _open_folder(folder: str, split: str, tokenizer_path: str, seq_len: int) -> tuple[dict, int]:
    """The manifest of `folder` and its number of windows, checked: readable, same tokenizer, intact
    split, at least one window."""
    try:
        manifest = read_manifest(folder)
        check_tokenizer(folder, manifest, tokenizer_path)
        tokens = PackedSplit(folder, split, manifest).num_tokens
    except KeyError as e:
        raise ValueError(f"{config_key(split)}: {folder}/manifest.json has no key {e}; the dataset is damaged") from e
    except (OSError, ValueError) as e:  # their messages name the folder
        kind = FileNotFoundError if isinstance(e, FileNotFoundError) else ValueError
        raise kind(f"{config_key(split)}: {e}") from e
    if (tokens - 1) // seq_len == 0:
        raise ValueError(f"{config_key(split)}: {folder}: the {split} split holds {tokens} tokens, "
                         f"too few for one window of seq_len + 1 = {seq_len + 1}")
    return manifest, (tokens - 1) // seq_len


def build_packed_dataloader(paths: list[str], split: str, tokenizer_path: str, seq_len: int, local_batch_size: int,
                            dp_rank: int, dp_size: int, seed: int, num_workers: int = 2, shuffle: bool = True,
                            ) -> PackedDataLoader:
    """This data-parallel rank's batches of `split` of the packed folders `paths` ("folder" or
    "folder:weight"), shuffled and blended (endless) or in order (one pass); see the module docstring."""
    if not paths:
        raise ValueError("training.dataset_path: no packed folder given")
    folders, weights = map(list, zip(*(parse_path(p) for p in paths)))
    manifests, num_windows = map(list, zip(*(_open_folder(f, split, tokenizer_path, seq_len) for f in folders)))
    dataset = PackedWindows(folders, manifests, num_windows, split, seq_len, weights, seed, shuffle)
    for folder, weight, n in zip(folders, weights, num_windows):
        share = weight / sum(weights)
        logger.info(f"data: {folder} ({split}): {n:,} windows of {seq_len + 1} tokens, weight {share:.3f}")
    end = None if shuffle else sum(num_windows)
    if end is not None and end < local_batch_size * dp_size:
        raise ValueError(f"{config_key(split)}: the {split} split holds {end} windows of {seq_len + 1} tokens, "
                         f"fewer than one batch over all data-parallel ranks ({local_batch_size} x {dp_size})")
    return PackedDataLoader(dataset, RankSampler(dp_rank, dp_size, local_batch_size, end), num_workers)
