"""The training and validation loaders train.py asks for, by `training.dataset`."""

from __future__ import annotations

from pathlib import Path

from components.config import Config, ConfigError
from components.data.batch_plan import batch_plan
from components.data.packed import build_packed_dataloader
from components.data.packed_format import is_packed_folder
from components.data.streaming import build_streaming_dataloader, build_streaming_validation_dataloader
from components.data.tokenizer import Tokenizer


def build_dataloader(config: Config, tokenizer: Tokenizer, dp_rank: int, dp_size: int):
    """The training batches of this data-parallel rank: under every layout of the same global batch size the
    ranks' batches of a step make the same global batch (docs/data.md)."""
    t = config.training
    if t.dataset == "packed":
        return build_packed_dataloader(
            t.dataset_path, "train", config.model.tokenizer_path, t.seq_len, t.local_batch_size, dp_rank, dp_size,
            t.seed, t.dataloader_workers,
        )
    global_batch = batch_plan(t, dp_size).global_batch
    return build_streaming_dataloader(t.dataset_path, t.dataset_text_field, tokenizer, t.seq_len, t.local_batch_size,
                                      global_batch, dp_rank, dp_size, t.dataloader_workers, t.seed)


def validation_sources(paths: list[str]) -> dict[str | None, str]:
    """The named sources of validation.dataset_path ({None: path} for one unnamed source)."""
    named = [entry.split("=", 1) if "=" in entry else (None, entry) for entry in paths]
    if len(named) == 1 and named[0][0] is None:
        return {None: named[0][1]}
    sources = {}
    for name, path in named:
        name = name or Path(path.rstrip("/")).stem
        if name in sources:
            raise ConfigError(f"validation.dataset_path names two sources {name!r}; name them as name=path")
        sources[name] = path
    return sources


def build_validation_dataloader(config: Config, tokenizer: Tokenizer, dp_rank: int, dp_size: int, path: str):
    """Validation batches of this rank, from the start of `path` (a validation.dataset_path source):
    the validation split of a packed folder, in order, or an hf source (streaming.py), in order."""
    t = config.training
    if is_packed_folder(path):
        return build_packed_dataloader(
            [path], "validation", config.model.tokenizer_path, t.seq_len, t.local_batch_size, dp_rank, dp_size,
            t.seed, num_workers=0, shuffle=False,
        )
    return build_streaming_validation_dataloader(path, t.dataset_text_field, tokenizer, t.seq_len, t.local_batch_size,
                                                 dp_rank, dp_size)

