"""Peak memory of attention per rank under context parallelism, for each parallelism.context_parallel_method
(parallelisms/context_parallel.py) on CPU over gloo:

    python -m scripts.benchmark.cp_attention_memory [--seq 16384] [--degrees 1 2 4] [--heads 8] [--kv-heads 2]
        [--head-dim 64] [--batch 1] [--documents MEAN] [--window W] [--learned-sinks]

For each CP degree, that many processes (gloo, one thread each) hold their zigzag shares of random q, k, v of a
`seq`-token sequence and run one forward and backward of the method's attention; each reports the growth of its
resident memory over them (Linux's peak resident set, reset just before, minus what it held then: the attention's
working memory, communication buffers, saved tensors and the gradients of q, k and v) and its seconds. The table
shows the largest rank's memory and the slowest rank's seconds (the ranks wait for each other). Degree 1 is
plain causal attention (the fused kernel). With `--documents MEAN`, under document masking: each row packed
with documents of random lengths, MEAN tokens on average (seeded), the shares by documents; degree 1 is then
the model's masked attention of the whole sequence. With `--window W`, every query sees only the last W keys
(the sliding window a model declares, components/model/attention.py), with or without documents. With
`--learned-sinks`, the attention has a learned sink logit per head (gpt-oss's; zeros here), applied through each
kernel's log-sum-exp. Linux only (/proc).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

METHODS = ("allgather", "ring", "alltoall")


def resident_bytes(field: str) -> int:
    """VmRSS (now) or VmHWM (the peak since the last reset) of this process."""
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith(field))
    return int(line.split()[1]) * 1024


def measure(attention, q, k, v) -> tuple[int, float]:
    """(bytes the forward and backward of `attention` added at their peak, seconds)."""
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident set
    before, start = resident_bytes("VmRSS"), time.perf_counter()
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    attention(q, k, v).sum().backward()
    seconds = time.perf_counter() - start
    peak = resident_bytes("VmHWM") - before
    del q, k, v
    return peak, seconds


def document_ids(shape: dict) -> torch.Tensor | None:
    """(batch, seq): rows packed with documents of `shape["documents"]` tokens on average, or None."""
    if not shape["documents"]:
        return None
    generator = torch.Generator().manual_seed(0)
    return (torch.rand(shape["batch"], shape["seq"], generator=generator) < 1 / shape["documents"]).long().cumsum(1)


def _worker(rank: int, cp: int, store: str, shape: dict, results: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, cp), rank=rank, world_size=cp)
    lines = _measure_methods(rank, cp, init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",)), shape)
    Path(results, f"rank{rank}").write_text("\n".join(lines))
    # The tensors (and the collectives' work they hold) freed while gloo still runs: freed at interpreter exit
    # instead, they sometimes abort the process (1 run in 10).
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def _measure_methods(rank: int, cp: int, mesh, shape: dict) -> list[str]:
    """`method rank peak seconds` of each method on this rank."""
    from components.model.attention import AttentionMask, causal_attention, document_mask
    from parallelisms.context_parallel import (
        allgather_kv_attention,
        alltoall_attention,
        shard_sequence,
        zigzag_masks,
    )
    from parallelisms.context_parallel_documents import allgather_documents, alltoall_documents, ring_documents
    from parallelisms.ring_attention import ring_attention

    seq, batch, head_dim = shape["seq"], shape["batch"], shape["head_dim"]
    ids = document_ids(shape)
    generator = torch.Generator().manual_seed(0)
    q, k, v = (shard_sequence(torch.randn(batch, heads, seq, head_dim, generator=generator), mesh, dim=2,
                              document_ids=ids) for heads in (shape["heads"], shape["kv_heads"], shape["kv_heads"]))
    methods = {"allgather": partial(allgather_kv_attention, cp_mesh=mesh, masks=zigzag_masks(seq, cp, rank)),
               "ring": partial(ring_attention, cp_mesh=mesh),
               "alltoall": partial(alltoall_attention, cp_mesh=mesh, attend=causal_attention)}
    masks = {"allgather": partial(allgather_documents, cp_size=cp, cp_rank=rank),
             "ring": partial(ring_documents, cp_size=cp, cp_rank=rank),
             "alltoall": partial(alltoall_documents, cp_size=cp, whole_mask=document_mask)}
    spec = AttentionMask(window=shape["window"])
    sinks = learned_sinks(shape)
    lines = []
    for method in METHODS:
        dist.barrier()
        mask = None if ids is None else masks[method](ids, spec)  # what the model builds once per forward
        peak, seconds = measure(lambda q, k, v: methods[method](q, k, v, mask, spec, **sinks), q, k, v)
        lines.append(f"{method} {rank} {peak} {seconds}")
    return lines


def learned_sinks(shape: dict) -> dict:
    """The attention's keyword for learned sink logits, if the shape has them."""
    return {"sink_logits": torch.zeros(shape["heads"])} if shape["learned_sinks"] else {}


def one_process(shape: dict) -> tuple[int, float]:
    from components.model.attention import AttentionMask, causal_attention, document_mask

    torch.set_num_threads(1)
    q, k, v = (torch.randn(shape["batch"], heads, shape["seq"], shape["head_dim"])
               for heads in (shape["heads"], shape["kv_heads"], shape["kv_heads"]))
    ids = document_ids(shape)
    spec = AttentionMask(window=shape["window"])
    mask = None if ids is None else document_mask(ids, spec)
    return measure(partial(causal_attention, mask=mask, spec=spec, **learned_sinks(shape)), q, k, v)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=16384)
    parser.add_argument("--degrees", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--documents", type=int, default=0, metavar="MEAN",
                        help="document masking, documents of MEAN tokens on average (default: one causal sequence)")
    parser.add_argument("--window", type=int, default=None, metavar="W",
                        help="a sliding window: each query sees the last W keys only (default: all before it)")
    parser.add_argument("--learned-sinks", action="store_true", help="a learned sink logit per head (gpt-oss's)")
    args = parser.parse_args(argv)
    shape = {"seq": args.seq, "heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim,
             "batch": args.batch, "documents": args.documents, "window": args.window,
             "learned_sinks": args.learned_sinks}
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # freed tensors leave the resident set at once
    masking = f", documents of {args.documents} tokens on average" if args.documents else ", causal"
    masking += f", a window of {args.window} keys" if args.window else ""
    masking += ", learned sinks" if args.learned_sinks else ""
    print(f"attention of {args.batch} x {args.seq} tokens, {args.heads} query and {args.kv_heads} key/value heads "
          f"of {args.head_dim}{masking}, float32, forward and backward; torch {torch.__version__}")
    print("| method | CP degree | peak MiB (largest rank) | of CP 1 | seconds |")
    print("| --- | ---: | ---: | ---: | ---: |")
    baseline = None
    for cp in args.degrees:
        if cp == 1:
            peak, seconds = mp.get_context("spawn").Pool(1).apply(one_process, (shape,))
            baseline = peak
            print(f"| (one process) | 1 | {peak / 2**20:,.0f} | 1.00 | {seconds:.1f} |", flush=True)
            continue
        with tempfile.TemporaryDirectory() as folder:
            mp.spawn(_worker, args=(cp, str(Path(folder, "store")), shape, folder), nprocs=cp)
            rows = [line.split() for rank in range(cp) for line in Path(folder, f"rank{rank}").read_text().split("\n")]
        for method in METHODS:
            peak = max(int(row[2]) for row in rows if row[0] == method)
            seconds = max(float(row[3]) for row in rows if row[0] == method)
            share = f"{peak / baseline:.2f}" if baseline else ""
            print(f"| {method} | {cp} | {peak / 2**20:,.0f} | {share} | {seconds:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
