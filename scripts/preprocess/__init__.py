"""Preprocessing: tokenize a corpus once into the packed token folder that `training.dataset = "packed"`
memory-maps (format: components/data/packed_format.py). `python -m scripts.preprocess --help`; docs/data.md
describes the inputs, the ordering and determinism guarantees and how bad input is handled.

    inputs.py       what the inputs name, read in order and cut into tasks
    workers.py      tokenizing the tasks in worker processes, results kept in task order
    split.py        the train/validation split, a pure function of (seed, file, document number in the file)
    distributed.py  several ranks under torchrun: the files shared out, rank 0 writes the manifest
    output.py       the output folder and its shard writers
    pipeline.py     one run, from the inputs to the manifest
    progress.py     the progress line and messages on stderr
    errors.py       usage and read errors, exit statuses
"""

from scripts.preprocess.errors import UsageError
from scripts.preprocess.pipeline import Result, default_workers, preprocess

__all__ = ["Result", "UsageError", "default_workers", "main", "preprocess"]


def __getattr__(name: str):
    # `main` is imported on first use: importing __main__ here would make `python -m scripts.preprocess`
    # run a module already in sys.modules, which runpy warns about.
    if name == "main":
        from scripts.preprocess.__main__ import main

        return main
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
