"""The Hugging Face converter: DCP checkpoints to HF safetensors folders (export) and back (import).

    python -m scripts.hf export --job.config_file CFG --checkpoint DUMP/checkpoint/step-N --output HFDIR \\
        [--dtype float32|bfloat16|float16] [--max-shard-gb 5]
    python -m scripts.hf import --job.config_file CFG --hf HFDIR --output DCPDIR

Any other `--section.key value` is a config override, as for train.py: the config must describe the
model of the checkpoint. docs/hf.md explains both directions.

The export itself is components/hf/export.py, which training runs use too (checkpoint.last_save_in_hf).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from components.checkpoint.dcp import one_process
from components.config import DTYPES, Config, ConfigError, load_config
from components.hf.export import export, model_and_args
from components.hf.load import check_hf_config, read_hf_config, read_hf_weights
from models.families import check_family_reads, import_model_package, model_config_class

logger = logging.getLogger(__name__)


# --- Import ---------------------------------------------------------------------------------------


def import_hf(config: Config, hf: Path, output: Path) -> None:
    """Write the weights of an HF folder as a model-only DCP checkpoint, for
    --checkpoint.initial_load_path (kept in the dtype of the HF files; loading casts them)."""
    package = import_model_package(config.model.name)
    args, _ = model_and_args(config, package)
    hf_config = read_hf_config(hf)
    check_family_reads(config.model.name, hf_config, hf)
    check_hf_config(package, args, hf_config, hf)
    weights = package.from_hf(read_hf_weights(hf), args)
    with torch.device("meta"):
        expected = package.Transformer(args).state_dict()
    if set(weights) != set(expected):
        missing, extra = sorted(set(expected) - set(weights)), sorted(set(weights) - set(expected))
        raise ConfigError(f"{hf} does not hold the model's weights: missing {missing[:5]}, unexpected {extra[:5]}")
    with one_process():
        dcp.save({"model": weights}, checkpoint_id=str(output), no_dist=True)
    logger.info(f"imported {hf} to {output}; train from it with --checkpoint.initial_load_path {output}")


# --- Command line ---------------------------------------------------------------------------------


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, Config]:
    description = __doc__.split("\n\n")[0]
    parser = argparse.ArgumentParser(prog="python -m scripts.hf", description=description, allow_abbrev=False)
    commands = parser.add_subparsers(dest="command", required=True)
    config_note = ("Every other argument, --job.config_file CFG and --section.key value overrides, sets the config "
                   "of the model as for train.py.")
    export_parser = commands.add_parser(
        "export", help="DCP checkpoint -> HF folder", epilog=config_note, allow_abbrev=False
    )
    export_parser.add_argument("--checkpoint", type=Path, required=True, help="a step-N checkpoint folder")
    export_parser.add_argument("--output", type=Path, required=True, help="the HF folder to write")
    export_parser.add_argument("--dtype", choices=list(DTYPES), default="float32")
    export_parser.add_argument("--max-shard-gb", type=float, default=5.0, help="largest safetensors file (GiB)")
    import_parser = commands.add_parser(
        "import", help="HF folder -> DCP checkpoint", epilog=config_note, allow_abbrev=False
    )
    import_parser.add_argument("--hf", type=Path, required=True, help="the HF folder (config.json, *.safetensors)")
    import_parser.add_argument("--output", type=Path, required=True, help="the DCP checkpoint folder to write")
    options, rest = parser.parse_known_args(argv)
    return options, load_config(rest, model_config_class)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    try:
        options, config = parse_args(sys.argv[1:] if argv is None else argv)
        if options.command == "export":
            package = import_model_package(config.model.name)
            export(config, package, options.checkpoint, options.output, options.dtype, options.max_shard_gb)
        else:
            import_hf(config, options.hf, options.output)
    except (ConfigError, FileNotFoundError, ValueError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
