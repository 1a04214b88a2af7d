"""What the streaming hf loader costs each data-parallel rank (components/data/streaming.py): CPU, memory and
bytes read, for 1, 2 and 4 ranks reading the same global batches.

    python -m scripts.benchmark.stream_cost [--data PATH] [--steps 40] [--global-batch 16] [--seq-len 2048]
        [--workers 2] [--ranks 1 2 4] [--make-jsonl-gb 1]

Each rank is a process of its own (started together, as torchrun starts them) that builds its loader and takes
`steps` global batches' worth of its batches; it reports, from after its imports to the end, its wall seconds,
CPU seconds (its own and its loader workers'), the memory the loader added (proportional set sizes: a page
shared by the forked workers counts once in all), and the bytes it and its workers read (/proc/<pid>/io rchar:
files, whether from the disk or the page cache). `--make-jsonl-gb N` first writes a
JSON-lines file of about N GB (the shipped corpus repeated) and measures that. Linux only (/proc).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CORPUS = REPO / "tests" / "assets" / "shakespeare" / "train.jsonl"
TOKENIZER = REPO / "tests" / "assets" / "tokenizers" / "shakespeare_bpe_4k.model"


def proc_stat(pid: int) -> tuple[int, int]:
    """(rchar, proportional resident bytes: shared pages divided among the processes sharing them) of a live
    process."""
    io = dict(line.split(": ") for line in Path(f"/proc/{pid}/io").read_text().splitlines())
    rollup = Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()
    pss = next(int(line.split()[1]) * 1024 for line in rollup if line.startswith("Pss:"))
    return int(io["rchar"]), pss


def cpu_seconds(pid: int) -> float:
    """User + system seconds of a live process."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def one_rank(args: argparse.Namespace) -> None:
    """Run as a rank: build the loader, take the batches, print the figures as one JSON line."""
    from components.data.streaming import build_streaming_dataloader
    from components.data.tokenizer import build_tokenizer

    start, cpu_before = time.perf_counter(), cpu_seconds(os.getpid())
    rchar_before, memory_before = proc_stat(os.getpid())
    local = args.global_batch // args.ranks
    loader = build_streaming_dataloader([args.data], "text", build_tokenizer(str(TOKENIZER)), args.seq_len, local,
                                        args.global_batch, args.rank, args.ranks, args.workers, seed=0)
    batches = iter(loader)
    for _ in range(args.steps):
        next(batches)
    workers = children(os.getpid())
    stats = [proc_stat(pid) for pid in [os.getpid(), *workers]]
    cpu = sum(cpu_seconds(pid) for pid in [os.getpid(), *workers]) - cpu_before
    print(json.dumps({"rank": args.rank, "seconds": time.perf_counter() - start, "cpu_seconds": cpu,
                      "memory_mib": (sum(pss for _, pss in stats) - memory_before) / 2**20,
                      "read_mib": (sum(r for r, _ in stats) - rchar_before) / 2**20, "workers": len(workers)}))
    loader.close()


def write_jsonl(path: Path, gigabytes: float) -> None:
    text = CORPUS.read_bytes()
    with open(path, "wb") as f:
        for _ in range(max(1, int(gigabytes * 2**30 / len(text)))):
            f.write(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default=str(CORPUS))
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--make-jsonl-gb", type=float, default=0)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank is not None:
        args.ranks = args.ranks[0]
        one_rank(args)
        return 0
    with tempfile.TemporaryDirectory() as folder:
        if args.make_jsonl_gb:
            args.data = str(Path(folder) / "big.jsonl")
            write_jsonl(Path(args.data), args.make_jsonl_gb)
        size = os.path.getsize(args.data) / 2**20
        tokens = args.steps * args.global_batch * (args.seq_len + 1)
        print(f"{args.data} ({size:,.0f} MiB): {args.steps} global batches of {args.global_batch} x "
              f"{args.seq_len + 1} tokens ({tokens:,} tokens), {args.workers} loader workers per rank")
        print("| ranks | seconds per rank | CPU seconds per rank | memory per rank (MiB) | read per rank (MiB) |")
        print("| ---: | ---: | ---: | ---: | ---: |")
        for ranks in args.ranks:
            command = [sys.executable, "-m", "scripts.benchmark.stream_cost", "--data", args.data, "--steps",
                       str(args.steps), "--global-batch", str(args.global_batch), "--seq-len", str(args.seq_len),
                       "--workers", str(args.workers), "--ranks", str(ranks)]
            processes = [subprocess.Popen([*command, "--rank", str(rank)], cwd=REPO, stdout=subprocess.PIPE, text=True,
                                          env=dict(os.environ, OMP_NUM_THREADS="1")) for rank in range(ranks)]
            rows = [json.loads(p.communicate()[0].strip().splitlines()[-1]) for p in processes]
            mean = {key: sum(r[key] for r in rows) / len(rows) for key in ("seconds", "cpu_seconds", "memory_mib",
                                                                         "read_mib")}
            print(f"| {ranks} | {mean['seconds']:.1f} | {mean['cpu_seconds']:.1f} | {mean['memory_mib']:,.0f} | "
                  f"{mean['read_mib']:,.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
