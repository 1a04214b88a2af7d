"""The preprocessing command line: `python -m scripts.preprocess INPUT... --output DIR` (or ingot-preprocess)."""

from __future__ import annotations

import argparse
import sys

from scripts.preprocess.distributed import World
from scripts.preprocess.errors import EXIT_OK, EXIT_USAGE, UsageError
from scripts.preprocess.pipeline import DEFAULT_BATCH_BYTES, DEFAULT_SHARD_TOKENS, Result, preprocess
from scripts.preprocess.progress import log


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m scripts.preprocess",
        description="Tokenize JSON-lines, text or Parquet files, or datasets save_to_disk folders, into a packed "
                    "token folder for training.dataset = \"packed\".",
        epilog="Under torchrun (torchrun --nnodes N --nproc_per_node M -m scripts.preprocess ...) the ranks share "
               "out the input files and rank 0 writes the manifest. "
               "Exit status: 0 done; 1 too many bad lines (the output is still complete), no documents, or a "
               "worker died; 2 bad arguments or inputs (nothing written).",
    )
    parser.add_argument("inputs", nargs="+", metavar="INPUT",
                        help="files, folders, globs or save_to_disk folders, read in this order")
    parser.add_argument("--output", "-o", required=True, metavar="DIR",
                        help="the folder to write (created; an earlier output there is replaced)")
    parser.add_argument("--tokenizer", default="tests/assets/tokenizers/shakespeare_bpe_4k.model", metavar="PATH",
                        help="sentencepiece model or tiktoken BPE-ranks file (default: %(default)s)")
    parser.add_argument("--workers", type=int, default=None, metavar="N",
                        help="tokenizer processes, per rank under torchrun (default: the CPUs this process may use, "
                             "divided among torchrun's processes on the machine; 0: tokenize in the main process)")
    parser.add_argument("--text-field", default="text",
                        help="the field or column holding the text (default: %(default)s)")
    parser.add_argument("--val-fraction", type=float, default=0.01,
                        help="fraction of documents put in the validation split, 0 for none (default: %(default)s)")
    parser.add_argument("--max-bad-fraction", type=float, default=0.001,
                        help="exit with status 1 when more than this fraction of lines were skipped "
                             "(default: %(default)s)")
    parser.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS, metavar="N",
                        help="start a new shard file after this many tokens (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the train/validation split (default: %(default)s)")
    parser.add_argument("--batch-bytes", type=int, default=DEFAULT_BATCH_BYTES, metavar="N",
                        help="input bytes per task sent to a worker (default: %(default)s)")
    parser.add_argument("--quiet", action="store_true", help="no progress line")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    world = World.from_env()  # several ranks under torchrun; every rank gets the same exit status
    try:
        try:
            result = preprocess(args.inputs, args.output, args.tokenizer, workers=args.workers,
                                text_field=args.text_field, val_fraction=args.val_fraction,
                                max_bad_fraction=args.max_bad_fraction, shard_tokens=args.shard_tokens, seed=args.seed,
                                batch_bytes=args.batch_bytes, progress=not args.quiet, world=world)
        except UsageError as e:
            result = Result(EXIT_USAGE, message=str(e))
        if result.exit_code != EXIT_OK and world.rank == 0:
            log(f"error: {result.message}")
    except KeyboardInterrupt:
        print(file=sys.stderr)
        log(f"interrupted; {args.output} has no manifest.json and is not a dataset")
        return 130
    finally:
        world.close()  # after rank 0's report: the other ranks leave once rank 0 has closed
    return result.exit_code


if __name__ == "__main__":
    sys.exit(main())
