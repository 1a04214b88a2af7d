"""Throughput of preprocessing (scripts/preprocess) on a synthetic corpus.

Builds a JSON-lines corpus of at least --mb megabytes (default 50) in a temporary folder from the
shipped Shakespeare corpus (tests/assets/shakespeare/train.jsonl): copy r of each document has its
lines rotated by a different amount and a header naming the copy, so no two documents are the same.
Then packs it with 1 worker and with every CPU this process may use (and any --workers given), and
prints, per run: seconds, tokens/s in total and per worker, tokens per worker-CPU-second (what one
core does, unaffected by other load on the machine) and input MB/s.

Run from the repository root:

    python -m scripts.benchmark.preprocess_throughput                  # 50 MB, default sentencepiece tokenizer
    python -m scripts.benchmark.preprocess_throughput --mb 200 --workers 1 4 8
    python -m scripts.benchmark.preprocess_throughput --tokenizer tests/assets/tokenizers/gpt2.tiktoken

Target: at least 500K tokens/s per core with the default sentencepiece tokenizer.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=50, help="corpus size in MB (default: %(default)s)")
    parser.add_argument("--workers", type=int, nargs="+", default=None,
                        help="worker counts to run (default: 1 and all CPUs)")
    parser.add_argument("--tokenizer", default=str(DEFAULT_TOKENIZER))
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


if __name__ == "__main__":
    main()
