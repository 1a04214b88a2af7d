"""python -m scripts.memory_estimate --job.config_file CONFIG [--world-size N] [--target cpu|cuda]
[--section.key value ...]: prints the peak memory breakdown of the most loaded rank."""

from __future__ import annotations

import argparse
import sys

from components.config import ConfigError, load_config
from models.families import model_config_class
from scripts.memory_estimate import cpu_baseline_bytes, default_target, estimate


def positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return int(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m scripts.memory_estimate", allow_abbrev=False,
        description="Peak memory per rank of a training config, without the target hardware "
                    "(docs/memory_estimate.md). Every other argument is a train.py config argument: "
                    "--job.config_file CONFIG, --section.key value.",
    )
    parser.add_argument("--world-size", type=positive_int, help="processes (default: the product of the "
                        "[parallelism] degrees, data_parallel_shard_degree -1 counting as 1)")
    parser.add_argument("--target", choices=("cpu", "cuda"), help="what to estimate for (default: cuda when this "
                        "machine has it or the config computes in half precision, else cpu)")
    args, config_args = parser.parse_known_args(argv)
    try:
        config = load_config(config_args, model_config_class)
        # Before anything else is built: this process is then what the trainer is before training.
        baseline = cpu_baseline_bytes(config) if (args.target or default_target(config)) == "cpu" else None
        result = estimate(config, args.world_size, args.target, baseline)
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(result.format())
    return 0


if __name__ == "__main__":
    sys.exit(main())
