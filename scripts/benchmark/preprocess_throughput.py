"""Throughput of preprocessing (scripts/preprocess) on a synthetic corpus.

Builds a JSON-lines corpus of at least --mb megabytes (default 50) in a temporary folder from the
shipped Shakespeare corpus (tests/assets/shakespeare/train.jsonl): copy r of each document has its
lines rotated by a different amount and a header naming the copy, so no two documents are the same.
Then packs it with 1 worker and with every CPU this process may use (and any --workers given), and
prints, per run: seconds, tokens/s in total and per worker, tokens per worker-CPU-second (what one
core does, unaffected by other load on the machine) and input MB/s.

With --nproc N it also packs the corpus cut into 4 files with the command line, once as one process and
once under `torchrun --standalone --nproc_per_node N`, each process with the first --workers count (1 by
default), and prints the wall time and the CPU seconds of all processes (user + sys, torchrun and the
tokenizer workers included) of both, their ratio, and whether both wrote the same token streams
(--repeat times, alternating; the ranks exchange through files, so only torchrun imports torch).

Run from the repository root:

    python -m scripts.benchmark.preprocess_throughput                  # 50 MB, default sentencepiece tokenizer
    python -m scripts.benchmark.preprocess_throughput --mb 200 --workers 1 4 8
    python -m scripts.benchmark.preprocess_throughput --tokenizer tests/assets/tokenizers/gpt2.tiktoken
    python -m scripts.benchmark.preprocess_throughput --mb 58 --workers 1 --nproc 2 --repeat 3

Target: at least 500K tokens/s per core with the default sentencepiece tokenizer.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from components.data.packed_format import SPLITS, PackedSplit, read_manifest
from scripts.preprocess import default_workers, preprocess

REPO = Path(__file__).resolve().parents[2]
SOURCE = REPO / "tests/assets/shakespeare/train.jsonl"
DEFAULT_TOKENIZER = REPO / "tests/assets/tokenizers/shakespeare_bpe_4k.model"


def build_corpus(path: Path, megabytes: float) -> tuple[int, int]:
    """Write at least `megabytes` MB of JSON lines to `path`; -> (bytes, documents)."""
    texts = [json.loads(line)["text"] for line in SOURCE.open()]
    size, documents, copy = 0, 0, 0
    with path.open("w") as f:
        while size < megabytes * 1e6:
            for text in texts:
                lines = text.split("\n")
                shift = (copy * 7) % len(lines)
                varied = f"Copy {copy} of a play\n" + "\n".join(lines[shift:] + lines[:shift])
                line = json.dumps({"text": varied}) + "\n"
                f.write(line)
                size += len(line.encode())
                documents += 1
            copy += 1
    return size, documents


def split_corpus(corpus: Path, parts: int) -> list[Path]:
    """`corpus` cut into `parts` files of whole lines, about equal in size."""
    lines = corpus.read_bytes().splitlines(keepends=True)
    paths = [corpus.with_name(f"part-{i}.jsonl") for i in range(parts)]
    for i, path in enumerate(paths):
        path.write_bytes(b"".join(lines[i * len(lines) // parts : (i + 1) * len(lines) // parts]))
    return paths


def measured(command: list[str]) -> tuple[float, float]:
    """Run `command`; -> (wall seconds, CPU seconds of it and all its descendants)."""
    before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.monotonic()
    subprocess.run(command, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"), check=True)
    wall, after = time.monotonic() - start, resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime


def streams(folder: Path) -> list:
    manifest = read_manifest(folder)
    return [PackedSplit(folder, split, manifest).read(0, manifest["splits"][split]["tokens"]).tobytes()
            if manifest["splits"][split]["shards"] else b"" for split in SPLITS]


def compare_nproc(corpus: Path, nproc: int, workers: int, tokenizer: str, repeat: int = 1) -> None:
    """One process against torchrun with `nproc` processes, on `corpus` cut into 4 files, `repeat` times."""
    inputs = [str(p) for p in split_corpus(corpus, 4)]
    tail = ["--tokenizer", tokenizer, "--workers", str(workers), "--quiet"]
    one, many = corpus.parent / "out-one", corpus.parent / f"out-nproc{nproc}"
    print(f"\n4 files, {workers} worker{'s' * (workers != 1)} per process{'wall s':>15} {'CPU s':>7}")
    for _ in range(repeat):
        one_wall, one_cpu = measured([sys.executable, "-m", "scripts.preprocess", *inputs, "--output", str(one),
                                      *tail])
        many_wall, many_cpu = measured([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                        "--nproc_per_node", str(nproc), "-m", "scripts.preprocess", *inputs,
                                        "--output", str(many), *tail])
        print(f"{'python -m scripts.preprocess':<36}{one_wall:>7.1f} {one_cpu:>7.1f}")
        print(f"{f'torchrun --nproc_per_node {nproc}':<36}{many_wall:>7.1f} {many_cpu:>7.1f}")
        print(f"CPU ratio {many_cpu / one_cpu:.2f}, wall ratio {many_wall / one_wall:.2f}; "
              f"token streams {'identical' if streams(one) == streams(many) else 'DIFFERENT'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=50, help="corpus size in MB (default: %(default)s)")
    parser.add_argument("--workers", type=int, nargs="+", default=None,
                        help="worker counts to run (default: 1 and all CPUs)")
    parser.add_argument("--tokenizer", default=str(DEFAULT_TOKENIZER))
    parser.add_argument("--nproc", type=int, default=None, metavar="N",
                        help="also compare one process with torchrun --nproc_per_node N (CPU seconds, streams)")
    parser.add_argument("--repeat", type=int, default=1, metavar="R",
                        help="run that comparison R times (default: %(default)s)")
    args = parser.parse_args()
    counts = args.workers or sorted({1, default_workers()})

    with tempfile.TemporaryDirectory(prefix="preprocess-bench-") as tmp:
        corpus = Path(tmp) / "corpus.jsonl"
        start = time.monotonic()
        size, documents = build_corpus(corpus, args.mb)
        print(f"corpus: {size / 1e6:.1f} MB, {documents:,} documents, built in {time.monotonic() - start:.1f} s; "
              f"tokenizer {Path(args.tokenizer).name}; {default_workers()} CPUs available")
        rows = []
        for workers in counts:
            result = preprocess([str(corpus)], str(Path(tmp) / f"out-{workers}"), args.tokenizer, workers=workers,
                                progress=False)
            assert result.exit_code == 0, result.message
            tokens, seconds = result.tokens, result.seconds
            rows.append((workers, seconds, tokens, tokens / seconds, tokens / seconds / max(workers, 1),
                         tokens / result.worker_cpu_seconds, size / 1e6 / seconds))
        print()
        print(f"{'workers':>7} {'seconds':>8} {'tokens':>12} {'tokens/s':>12} {'per worker':>12} "
              f"{'per CPU-s':>12} {'MB/s':>7}")
        for workers, seconds, tokens, total, per_worker, per_cpu, mbs in rows:
            print(f"{workers:>7} {seconds:>8.1f} {tokens:>12,} {total:>12,.0f} {per_worker:>12,.0f} "
                  f"{per_cpu:>12,.0f} {mbs:>7.1f}")
        if args.nproc:
            compare_nproc(corpus, args.nproc, (args.workers or [1])[0], args.tokenizer, args.repeat)


if __name__ == "__main__":
    main()
