"""Tokens/s of ingot's trainer against a bare PyTorch loop on the same model and batch.

    python -m scripts.benchmark.framework_overhead [--steps 40] [extra train.py flags]

Both run the debug model (train_configs/debug_model.toml) for the same number of steps in this
process on one rank; the first `--warmup` steps are left out of both rates. The bare loop is what
ingot does minus everything around the math: random token batches prepared up front, AdamW
(the configured implementation, fused by default), a constant lr, gradient clipping, no data loading,
logging, metrics or checkpoints.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import train
from components.config import load_config
from components.data.tokenizer import build_tokenizer
from components.metrics.reporting import read_metrics
from models.families import model_config_class
from models.llama3 import Transformer, build_model_args


def ingot_tokens_per_second(steps: int, warmup: int, extra: list[str]) -> float:
    with tempfile.TemporaryDirectory() as dump:
        argv = ["--job.config_file", "debug_model.toml", "--training.steps", str(steps), "--checkpoint.enable",
                "false", "--metrics.log_freq", "1", "--job.dump_folder", dump, *extra]
        if train.main(argv) != 0:
            raise SystemExit("the ingot run failed")
        rates = [record["tokens_per_second"] for record in read_metrics(Path(dump) / "metrics.jsonl")[0]]
    # Each logged rate covers one step; the harmonic mean of per-step rates is total tokens / total time.
    return statistics.harmonic_mean(rates[warmup:])


def bare_tokens_per_second(steps: int, warmup: int, extra: list[str]) -> float:
    config = load_config(["--job.config_file", "debug_model.toml", *extra], model_config_class)
    training = config.training
    args = build_model_args(config, build_tokenizer(config.model.tokenizer_path).vocab_size)
    torch.manual_seed(training.seed)
    model = Transformer(args)
    model.init_weights()
    opt = config.optimizer
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=opt.lr, betas=(opt.beta1, opt.beta2), weight_decay=opt.weight_decay,
        fused=opt.implementation == "fused", foreach=opt.implementation == "foreach",
    )
    batches = torch.randint(0, args.vocab_size, (steps, training.local_batch_size, training.seq_len + 1))
    times = []
    for batch in batches:
        start = time.perf_counter()
        optimizer.zero_grad()
        loss = F.cross_entropy(model(batch[:, :-1]).flatten(0, 1).float(), batch[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), training.max_norm, foreach=True)
        optimizer.step()
        loss.item()
        times.append(time.perf_counter() - start)
    return training.local_batch_size * training.seq_len * (steps - warmup) / sum(times[warmup:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=2,
                        help="alternate the two this many times; report the best of each")
    known, extra = parser.parse_known_args()
    ingot, bare = [], []
    for _ in range(known.repeats):
        ingot.append(ingot_tokens_per_second(known.steps, known.warmup, extra))
        bare.append(bare_tokens_per_second(known.steps, known.warmup, extra))
    print(f"threads: {torch.get_num_threads()}  steps: {known.steps} (first {known.warmup} left out)  "
          f"repeats: {known.repeats}")
    print(f"ingot train.py : {max(ingot):9,.0f} tokens/s   (runs: {', '.join(f'{x:,.0f}' for x in ingot)})")
    print(f"bare loop      : {max(bare):9,.0f} tokens/s   (runs: {', '.join(f'{x:,.0f}' for x in bare)})")
    print(f"ratio          : {max(ingot) / max(bare):.3f}")


if __name__ == "__main__":
    main()
