"""The train/validation split of the documents: a pure function of (seed, file, document number in the file),
so that the worker count, the batch sizes, the machine's speed and how the files are dealt out to the ranks
of a multi-process run never change which split a document is in."""

from __future__ import annotations

import numpy as np

MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def validation_mask(seed: int, file: int, first: int, count: int, val_fraction: float) -> np.ndarray:
    """Whether documents first .. first + count - 1 of input file `file` (both numbered from 0: the file in
    the ordered list of inputs, the documents kept from that file) go to validation: splitmix64 of (a key
    mixed from seed and file + document number), its top 53 bits as a number in [0, 1), below val_fraction."""
    if val_fraction <= 0 or count == 0:
        return np.zeros(count, dtype=bool)
    key = _splitmix64((_splitmix64(seed & MASK64) + file) & MASK64)
    x = np.arange(first, first + count, dtype=np.uint64) + np.uint64(key)
    x = x + np.uint64(0x9E3779B97F4A7C15)  # uint64 arrays wrap around silently
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    x = x ^ (x >> np.uint64(31))
    return (x >> np.uint64(11)).astype(np.float64) * 2.0**-53 < val_fraction
