"""Samples/s and tokens/s of the packed-data loader (components/data/packed.py).

    python -m scripts.benchmark.packed_loader_throughput [--tokens 50000000] [--seconds 5]

Writes a packed folder of random uint16 token ids in a temporary directory (freshly written, so it
is read from the page cache: this measures the loader, not the disk), then reads shuffled batches
for the debug config (seq_len 2048, local batch 8) and the 8B config (seq_len 8192, local batch 1)
with 0 and 2 worker processes. The first batches (worker start-up) are left out of the rates.
Tokens/s counts the seq_len trained tokens of every sample.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from components.data.packed import build_packed_dataloader
from components.data.packed_format import ShardWriter, tokenizer_fingerprint, write_manifest

REPO = Path(__file__).resolve().parents[2]
TOKENIZER = REPO / "tests" / "assets" / "tokenizers" / "shakespeare_bpe_4k.model"
CONFIGS = {"debug (seq 2048, batch 8)": (2048, 8), "8B (seq 8192, batch 1)": (8192, 1)}


def write_random_folder(folder: Path, tokens: int) -> None:
    """`tokens` random ids in documents of 1 to 4,000 tokens, shards of 16M tokens."""
    rng = np.random.default_rng(0)
    writer = ShardWriter(folder, "train", np.uint16, shard_tokens=1 << 24)
    documents, written = 0, 0
    while written < tokens:
        ids = rng.integers(3, 4096, size=1 << 20, dtype=np.uint16)
        cuts = np.cumsum(rng.integers(1, 4000, size=1000))
        for document in np.split(ids, cuts[cuts < len(ids)]):
            writer.write(document)
            documents += 1
        written += len(ids)
    shards = writer.close()
    tokenizer = {"path": str(TOKENIZER), "fingerprint": tokenizer_fingerprint(TOKENIZER), "vocab_size": 4096,
                 "bos_id": 1, "eos_id": 2}
    split = {"documents": documents, "tokens": written, "shards": shards}
    write_manifest(folder, {"dtype": "uint16", "tokenizer": tokenizer, "splits": {"train": split}})


def measure(folder: Path, seq_len: int, local_batch_size: int, num_workers: int, seconds: float) -> float:
    """Samples per second, after 5 warm-up batches."""
    loader = build_packed_dataloader([str(folder)], "train", str(TOKENIZER), seq_len, local_batch_size, 0, 1, 0,
                                     num_workers)
    batches = iter(loader)
    for _ in range(5):
        next(batches)
    start, samples = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        samples += len(next(batches))
    return samples / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=50_000_000)
    parser.add_argument("--seconds", type=float, default=5.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "packed"
        folder.mkdir()
        start = time.perf_counter()
        write_random_folder(folder, args.tokens)
        print(f"wrote {args.tokens / 1e6:.0f}M random tokens in {time.perf_counter() - start:.1f}s")
        print(f"{'config':<28}{'workers':>8}{'samples/s':>12}{'tokens/s':>14}")
        for name, (seq_len, batch) in CONFIGS.items():
            for workers in (0, 2):
                rate = measure(folder, seq_len, batch, workers, args.seconds)
                print(f"{name:<28}{workers:>8}{rate:>12,.0f}{rate * seq_len:>14,.0f}")


if __name__ == "__main__":
    main()
