"""One preprocessing run: the inputs read in order, tokenized by the workers, each document sent to its
split's shards, and the manifest written last. docs/data.md describes the design and its guarantees."""

from __future__ import annotations

import os
import time
import traceback
from collections import Counter
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from components.checkpoint.durable import fsync_path
from components.data.packed_format import SPLITS, token_dtype, tokenizer_fingerprint, write_manifest
from components.data.tokenizer import Tokenizer, build_tokenizer
from scripts.preprocess.distributed import World, assign_files
from scripts.preprocess.errors import EXIT_FAILED, EXIT_OK, ReadError, UsageError
from scripts.preprocess.inputs import Source, check_sources, expand_inputs, read_tasks, source_bytes
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
    """The CPUs this process may use, shared out among the processes torchrun started on this machine."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:
        cpus = os.cpu_count() or 1
    return max(1, cpus // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


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
               seed: int = 0, batch_bytes: int = DEFAULT_BATCH_BYTES, progress: bool = True,
               world: World | None = None) -> Result:
    """Tokenize `inputs` into the packed folder `output`, as one rank of `world` (default: the only one),
    which tokenizes its share of the files; rank 0 writes the manifest. Raises UsageError (before writing
    anything, on every rank) for bad arguments or inputs; returns a Result otherwise, with the same exit
    status on every rank. Only rank 0 logs, but for a rank's own failure."""
    world = world or World()
    workers = default_workers() if workers is None else workers
    folder = Path(output)
    world.start(folder)  # several ranks exchange through a folder in the output; main() closes the world

    def check_inputs() -> tuple[list[Source], list[range]]:
        _check_options(workers, val_fraction, max_bad_fraction, shard_tokens, batch_bytes, inputs)
        sources = expand_inputs(inputs)
        if not world.distributed:
            return sources, [range(len(sources))]
        return sources, assign_files([source_bytes(source) for source in sources], world.size)

    sources, shares = world.on_rank0(check_inputs)
    share = shares[world.rank]

    def check_share() -> Tokenizer:
        check_sources([sources[i] for i in share], text_field)
        return _load_tokenizer(tokenizer)

    tok = world.on_every_rank(check_share)
    # the other ranks wait: none writes before this
    replaced = world.on_rank0(lambda: prepare_output(folder, keep=world.folder))
    dtype = token_dtype(tok.vocab_size)

    if world.rank == 0:
        ranks = (f" on {world.size} ranks (files per rank: {', '.join(str(len(s)) for s in shares)})"
                 if world.distributed else "")
        replacing = " (replacing the earlier output)" * replaced
        log(f"{len(sources)} input{'s' * (len(sources) != 1)} -> {folder}{replacing}; "
            f"tokenizer {tokenizer} (vocab {tok.vocab_size:,}, {dtype.name}); "
            f"{workers} worker{'s' * (workers != 1)}{' per rank' * world.distributed}{ranks}; "
            f"validation fraction {val_fraction}")
    start = time.monotonic()
    part = _tokenize(world, sources, share, folder, dtype, tokenizer, workers, text_field, val_fraction, shard_tokens,
                     seed, batch_bytes, progress)
    parts = world.all_gather(part)  # every rank has finished (its shards on disk) or failed

    failed = [(rank, p["error"]) for rank, p in enumerate(parts) if p["error"] is not None]
    if failed:
        errors = "; ".join(f"rank {rank}: {error}" if world.distributed else error for rank, error in failed)
        return Result(EXIT_FAILED, message=f"{errors}; {folder} has no manifest.json and is not a dataset")

    splits = {split: {"documents": sum(p["splits"][split]["documents"] for p in parts),
                      "tokens": sum(p["splits"][split]["tokens"] for p in parts),
                      "shards": [shard for p in parts for shard in p["splits"][split]["shards"]]}
              for split in SPLITS}
    counts = {key: sum(p["counts"][key] for p in parts) for key in ("lines", "documents", "tokens")}
    reasons = sum((p["reasons"] for p in parts), Counter())
    records = [record for p in parts for record in p["records"]][:MAX_LINE_RECORDS]
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
    if world.rank == 0:
        write_manifest(folder, manifest)
        fsync_path(folder)
    seconds = time.monotonic() - start

    result = Result(EXIT_OK, manifest, seconds, sum(p["input_bytes"] for p in parts), workers,
                    sum(p["worker_cpu"] for p in parts))
    if world.rank == 0:
        per_worker = result.tokens_per_second / (max(workers, 1) * world.size)
        log(f"done: {counts['documents']:,} documents ({splits['train']['documents']:,} train, "
            f"{splits['validation']['documents']:,} validation), {counts['tokens']:,} tokens, "
            f"{skipped:,} of {counts['lines']:,} lines skipped, {seconds:.1f} s, "
            f"{si(result.tokens_per_second)} tokens/s ({si(per_worker)} per worker), "
            f"{result.input_bytes / 1e6 / max(seconds, 1e-9):.1f} MB/s -> {folder}")
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
    elif val_fraction > 0 and splits["validation"]["documents"] == 0 and world.rank == 0:
        log(f"warning: no document fell into the validation split (--val-fraction {val_fraction} of "
            f"{counts['documents']:,} documents); raise --val-fraction for one")
    return result


def _tokenize(world: World, sources: list[Source], share: range, folder: Path, dtype: np.dtype, tokenizer: str,
              workers: int, text_field: str, val_fraction: float, shard_tokens: int, seed: int, batch_bytes: int,
              progress: bool) -> dict:
    """This rank's share of the inputs tokenized into its own shards. -> what it did, for rank 0's
    manifest: splits (with their shards), counts, skipped lines (reasons, the first records), input
    bytes and worker CPU seconds, or the error that stopped it."""
    writers = SplitWriters(folder, dtype, shard_tokens, world.rank if world.distributed else None)
    counts = {"lines": 0, "documents": 0, "tokens": 0}
    kept_in_file: Counter = Counter()  # documents kept so far per input file, which the split numbers
    reasons: Counter = Counter()
    records: list[dict] = []
    input_bytes, worker_cpu = 0, 0.0
    meter = Progress(enabled=progress and world.rank == 0,
                     label=f"rank 0 of {world.size}: " if world.distributed else "")

    def counted(tasks):
        nonlocal input_bytes
        for task in tasks:
            input_bytes += sum(part[5] for part in task)
            yield task

    tasks = counted(read_tasks(sources, text_field, batch_bytes, share))
    results = ordered_results(tasks, workers, tokenizer, text_field)
    reading = f" while reading {_files(sources, share)}" if world.distributed else ""
    error = None
    try:
        for tokens, lengths, kept, bad, lines, cpu in results:
            worker_cpu += cpu
            counts["lines"] += lines
            for source, line, reason in bad:
                reasons[reason] += 1
                if len(records) < MAX_LINE_RECORDS:
                    records.append({"file": sources[source].path, "line": line, "reason": reason})
            masks = []
            for source, documents in kept:
                masks.append(validation_mask(seed, source, kept_in_file[source], documents, val_fraction))
                kept_in_file[source] += documents
            writers.write(tokens, lengths, np.concatenate(masks))
            counts["documents"] += len(lengths)
            counts["tokens"] += int(lengths.sum())
            meter.update(counts["documents"], counts["tokens"], sum(reasons.values()))
        splits = writers.close()
    except BrokenProcessPool as e:
        error = f"a worker process died{reading} (out of memory? {e})"
    except ReadError as e:  # names the file
        error = str(e)
    except Exception as e:
        if not world.distributed:
            raise
        # This rank still takes part in the gather, or the others would wait for it until the timeout.
        traceback.print_exc()
        error = f"{type(e).__name__}{reading}: {e}"
    finally:
        results.close()
    if error is not None:
        meter.end()
        if world.distributed:
            log(f"rank {world.rank}: error: {error}; the job fails once every rank is done")
        return {"error": error}
    meter.update(counts["documents"], counts["tokens"], sum(reasons.values()), force=True)
    meter.end()
    return {"splits": splits, "counts": counts, "reasons": reasons, "records": records,
            "input_bytes": input_bytes, "worker_cpu": worker_cpu, "error": None}


def _files(sources: list[Source], share: range) -> str:
    """A rank's files, for messages."""
    if len(share) <= 1:
        return sources[share[0]].path if share else "no files"
    return f"{sources[share[0]].path} to {sources[share[-1]].path} ({len(share)} files)"
