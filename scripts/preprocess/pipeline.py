"""One preprocessing run: the inputs read in order, tokenized by the workers, each document sent to its
split's shards, and the manifest written last. docs/data.md describes the design and its guarantees."""

from __future__ import annotations

import os
import time
from collections import Counter
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path

from components.data.packed_format import token_dtype, tokenizer_fingerprint, write_manifest
from components.durable import fsync_path
from components.tokenizer import Tokenizer, build_tokenizer
from scripts.preprocess.errors import EXIT_FAILED, EXIT_OK, ReadError, UsageError
from scripts.preprocess.inputs import check_sources, expand_inputs, read_tasks
from scripts.preprocess.output import SplitWriters, prepare_output
from scripts.preprocess.progress import Progress, log, si
from scripts.preprocess.split import validation_mask
from scripts.preprocess.workers import REASONS, ordered_results

MAX_LINE_RECORDS = 1000
"""How many skipped lines the manifest names (the counts are always complete)."""
DEFAULT_BATCH_BYTES = 1 << 20
DEFAULT_SHARD_TOKENS = 1 << 30


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
    """The CPUs this process may use."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _check_options(workers: int, val_fraction: float, max_bad_fraction: float, shard_tokens: int, batch_bytes: int,
                   inputs: list[str]) -> None:
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


def _load_tokenizer(path: str) -> Tokenizer:
    try:
        return build_tokenizer(path, setting="--tokenizer")
    except FileNotFoundError as e:  # its message names --tokenizer and the path
        raise UsageError(str(e)) from e
    except (OSError, ValueError) as e:
        raise UsageError(f"--tokenizer {path}: {e}") from e


def preprocess(inputs: list[str], output: str, tokenizer: str, workers: int | None = None, text_field: str = "text",
               val_fraction: float = 0.01, max_bad_fraction: float = 0.001, shard_tokens: int = DEFAULT_SHARD_TOKENS,
               seed: int = 0, batch_bytes: int = DEFAULT_BATCH_BYTES, progress: bool = True) -> Result:
    """Tokenize `inputs` into the packed folder `output`. Raises UsageError (before writing anything)
    for bad arguments or inputs; returns a Result otherwise."""
    workers = default_workers() if workers is None else workers
    _check_options(workers, val_fraction, max_bad_fraction, shard_tokens, batch_bytes, inputs)
    sources = expand_inputs(inputs)
    check_sources(sources, text_field)
    tok = _load_tokenizer(tokenizer)
    dtype = token_dtype(tok.vocab_size)
    folder = Path(output)
    replaced = prepare_output(folder)

    log(f"{len(sources)} input{'s' * (len(sources) != 1)} -> {folder}{' (replacing the earlier output)' * replaced}; "
        f"tokenizer {tokenizer} (vocab {tok.vocab_size:,}, {dtype.name}); "
        f"{workers} worker{'s' * (workers != 1)}; validation fraction {val_fraction}")
    writers = SplitWriters(folder, dtype, shard_tokens)
    counts = {"lines": 0, "documents": 0, "tokens": 0}
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

    results = ordered_results(counted(read_tasks(sources, text_field, batch_bytes)), workers, tokenizer, text_field)
    not_a_dataset = f"{folder} has no manifest.json and is not a dataset"
    try:
        for tokens, lengths, bad, lines, cpu in results:
            worker_cpu += cpu
            counts["lines"] += lines
            for source, line, reason in bad:
                reasons[reason] += 1
                if len(records) < MAX_LINE_RECORDS:
                    records.append({"file": sources[source].path, "line": line, "reason": reason})
            writers.write(tokens, lengths, validation_mask(seed, counts["documents"], len(lengths), val_fraction))
            counts["documents"] += len(lengths)
            counts["tokens"] += int(lengths.sum())
            meter.update(counts["documents"], counts["tokens"], sum(reasons.values()))
    except BrokenProcessPool as e:
        meter.end()
        return Result(EXIT_FAILED, message=f"a worker process died ({e}); out of memory? {not_a_dataset}")
    except ReadError as e:
        meter.end()
        return Result(EXIT_FAILED, message=f"{e}; {not_a_dataset}")
    finally:
        results.close()
    meter.update(counts["documents"], counts["tokens"], sum(reasons.values()), force=True)
    meter.end()

    splits = writers.close()
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
    log(f"done: {counts['documents']:,} documents ({splits['train']['documents']:,} train, "
        f"{splits['validation']['documents']:,} validation), {counts['tokens']:,} tokens, "
        f"{skipped:,} of {counts['lines']:,} lines skipped, {seconds:.1f} s, "
        f"{si(result.tokens_per_second)} tokens/s ({si(per_worker)} per worker), "
        f"{input_bytes / 1e6 / max(seconds, 1e-9):.1f} MB/s -> {folder}")
    if skipped:
        detail = ", ".join(f"{REASONS.get(r, r)} {n:,}" for r, n in sorted(reasons.items()))
        first = records[0]
        log(f"skipped lines: {detail}; first: {first['file']}:{first['line']} "
            f"({REASONS.get(first['reason'], first['reason'])}); "
            f"manifest.json counts.skipped lists {len(records):,} of them")
    if counts["lines"] and skipped > max_bad_fraction * counts["lines"]:
        result.exit_code = EXIT_FAILED
        result.message = (f"{skipped:,} of {counts['lines']:,} lines ({skipped / counts['lines']:.2%}) were skipped, "
                          f"more than --max-bad-fraction {max_bad_fraction:g} allows; the output in {folder} is "
                          f"complete without them (see counts.skipped in its manifest.json)")
    elif counts["documents"] == 0:
        result.exit_code = EXIT_FAILED
        result.message = f"the inputs hold no documents; {folder} holds an empty dataset"
    elif val_fraction > 0 and splits["validation"]["documents"] == 0:
        log(f"warning: no document fell into the validation split (--val-fraction {val_fraction} of "
            f"{counts['documents']:,} documents); raise --val-fraction for one")
    return result
