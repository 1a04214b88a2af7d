"""Score a saved checkpoint on multiple-choice tasks, as the training loop's evaluation does.

    python -m scripts.eval --checkpoint DUMP/checkpoint/step-N [--tasks FILE|name=FILE ...] [--limit N]
    torchrun --standalone --nproc_per_node 4 -m scripts.eval --checkpoint DUMP/checkpoint/step-N

The checkpoint may have been saved under any layout (DCP reassembles it) or be a Hugging Face folder;
its run's config.toml gives the model, tokenizer, sequence length and (without --tasks) the tasks of
its [evaluation] section. Every process holds the whole model and scores its share of the examples
(docs/evaluation.md). Any other `--section.key value` overrides that config.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from components.config import ConfigError
from components.evaluation.scoring import evaluate_task, prepare_task
from components.evaluation.tasks import read_task
from components.run.exit_codes import exit_process
from components.training.loss import sequence_loglikelihoods
from scripts.checkpoint_model import model_from_checkpoint


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="python -m scripts.eval", description=__doc__.split("\n\n")[0],
                                     allow_abbrev=False,
                                     epilog="Any other --section.key value argument overrides the run's config.")
    parser.add_argument("--checkpoint", type=Path, required=True, help="a step-N checkpoint folder or an HF folder")
    parser.add_argument("--tasks", nargs="+", help="task files, each FILE or name=FILE (default: the run's)")
    parser.add_argument("--limit", type=int, default=0, help="first examples of each task (default 0: all)")
    parser.add_argument("--batch-size", type=int, default=8,
                        help="rows of training.seq_len tokens per forward (default 8); shorter rows come in "
                             "larger batches of as many tokens")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", type=Path, help="also write the results to this JSON file")
    return parser.parse_known_args(argv)


def evaluate(options: argparse.Namespace, overrides: list[str]) -> dict[str, dict[str, float]]:
    distributed = dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    device = torch.device(options.device)
    if device.type == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
    model, config, tokenizer = model_from_checkpoint(options.checkpoint, overrides, device)
    specs = options.tasks or config.evaluation.tasks
    if not specs:
        raise ConfigError("no tasks: pass --tasks (the run's evaluation.tasks is empty)")
    seq_len = config.training.seq_len

    @torch.no_grad()
    def score(windows: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        windows, labels = windows.to(device), labels.to(device)
        return sequence_loglikelihoods(model(windows[:, :-1]), labels)

    def reduce_sum(totals: torch.Tensor) -> torch.Tensor:
        if distributed:
            dist.all_reduce(totals)
        return totals

    results = {}
    for spec in specs:
        prepared = prepare_task(read_task(spec, options.limit), tokenizer, seq_len)
        results[prepared.task.name] = evaluate_task(prepared, score, reduce_sum, rank, world, options.batch_size,
                                                    seq_len, 64, False, device)
    return results


def table(results: dict[str, dict[str, float]]) -> str:
    lines = ["| task | examples | acc | acc_norm |", "|---|---:|---:|---:|"]
    lines += [f"| {name} | {r['examples']} | {r['acc']:.4f} | {r['acc_norm']:.4f} |" for name, r in results.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    options, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    if "RANK" in os.environ:  # under torchrun: each process scores its share
        dist.init_process_group("nccl" if options.device.startswith("cuda") else "gloo")
    try:
        results = evaluate(options, overrides)
    except (ConfigError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if int(os.environ.get("RANK", 0)) == 0:
        print(table(results))
        if options.json:
            options.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    exit_process(main())
