"""Peak memory of a Gated DeltaNet layer per rank under context parallelism (Qwen3.5's linear layer,
models/qwen3_5/model.py), on CPU over gloo:

    python -m scripts.benchmark.cp_delta_net_memory [--seq 16384] [--degrees 1 2 4] [--dim 512] [--key-heads 4]
        [--value-heads 8] [--head-dim 64] [--documents MEAN]

For each CP degree, that many processes (gloo, one thread each) hold their zigzag shares (by documents with
`--documents`) of a random input of `seq` tokens and run one forward and backward of the same layer, its
convolution and delta rule carried over the ranks as training does, by each parallelism.context_parallel_mixers
method (parallelisms/sequence_mixers.py: pass_state, the state passed between the ranks in sequence order; alltoall,
whole sequences of a share of the heads); each reports the growth of its resident memory over them (as
scripts/benchmark/cp_attention_memory.py measures it) and its seconds. The table shows the largest rank's memory and
the slowest rank's seconds. Linux only (/proc).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from scripts.benchmark.cp_attention_memory import document_ids, measure


def delta_net(shape: dict) -> torch.nn.Module:
    """The layer, its weights the same on every rank (seeded)."""
    from models.qwen3_5.model import GatedDeltaNet, ModelArgs

    args = ModelArgs(dim=shape["dim"], linear_n_key_heads=shape["key_heads"], linear_n_value_heads=shape["value_heads"],
                     linear_key_head_dim=shape["head_dim"], linear_value_head_dim=shape["head_dim"])
    torch.manual_seed(0)
    layer = GatedDeltaNet(args)
    layer.init_weights(0.02, 0.02)
    return layer


def run_layer(layer: torch.nn.Module, x: torch.Tensor, ids: torch.Tensor | None) -> tuple[int, float]:
    def forward(x, _k, _v):
        return layer(x, document_ids=ids)

    return measure(forward, x, x, x)


def _worker(rank: int, cp: int, store: str, shape: dict, results: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from parallelisms.context_parallel import shard_sequence
    from parallelisms.sequence_mixers import MIXER_METHODS, carry_over_context

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, cp), rank=rank, world_size=cp)
    mesh = init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",))
    ids = document_ids(shape)
    x = torch.randn(shape["batch"], shape["seq"], shape["dim"], generator=torch.Generator().manual_seed(1))
    share = shard_sequence(x, mesh, dim=1, document_ids=ids)
    lines = []
    for method in MIXER_METHODS:
        layer = delta_net(shape)
        carry_over_context(layer, mesh, method=method)
        dist.barrier()
        peak, seconds = run_layer(layer, share, ids)
        lines.append(f"{method} {peak} {seconds}")
        del layer
    Path(results, f"rank{rank}").write_text("\n".join(lines))
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def one_process(shape: dict) -> tuple[int, float]:
    torch.set_num_threads(1)
    x = torch.randn(shape["batch"], shape["seq"], shape["dim"], generator=torch.Generator().manual_seed(1))
    return run_layer(delta_net(shape), x, document_ids(shape))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=16384)
    parser.add_argument("--degrees", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--key-heads", type=int, default=4)
    parser.add_argument("--value-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--documents", type=int, default=0, metavar="MEAN",
                        help="document masking, documents of MEAN tokens on average (default: one sequence)")
    args = parser.parse_args(argv)
    shape = {"seq": args.seq, "dim": args.dim, "key_heads": args.key_heads, "value_heads": args.value_heads,
             "head_dim": args.head_dim, "batch": args.batch, "documents": args.documents}
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # freed tensors leave the resident set at once
    masking = f", documents of {args.documents} tokens on average" if args.documents else ""
    print(f"Gated DeltaNet layer of {args.batch} x {args.seq} tokens, dim {args.dim}, {args.key_heads} key and "
          f"{args.value_heads} value heads of {args.head_dim}{masking}, float32, forward and backward; "
          f"torch {torch.__version__}")
    print("| CP degree | method | peak MiB (largest rank) | of CP 1 | seconds |")
    print("| ---: | --- | ---: | ---: | ---: |")
    baseline = None
    for cp in args.degrees:
        if cp == 1:
            peak, seconds = mp.get_context("spawn").Pool(1).apply(one_process, (shape,))
            baseline = peak
            print(f"| 1 | (one process) | {peak / 2**20:,.0f} | 1.00 | {seconds:.1f} |", flush=True)
            continue
        with tempfile.TemporaryDirectory() as folder:
            mp.spawn(_worker, args=(cp, str(Path(folder, "store")), shape, folder), nprocs=cp)
            rows = [line.split() for rank in range(cp) for line in Path(folder, f"rank{rank}").read_text().split("\n")]
        for method in dict.fromkeys(row[0] for row in rows):
            peak = max(int(row[1]) for row in rows if row[0] == method)
            seconds = max(float(row[2]) for row in rows if row[0] == method)
            share = f"{peak / baseline:.2f}" if baseline else ""
            print(f"| {cp} | {method} | {peak / 2**20:,.0f} | {share} | {seconds:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
