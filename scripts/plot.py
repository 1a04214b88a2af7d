"""Draw runs from their metrics.jsonl: loss (validation loss dashed), learning rate, gradient norm and tokens/s
over steps, each run a colour, into one PNG (components/metrics/plot.py).

    python -m scripts.plot outputs/lr_1e-3 outputs/wide --output compare.png
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from components.metrics.plot import plot_runs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.plot", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="Example:\n" + __doc__.split("\n\n")[1])
    parser.add_argument("folders", nargs="+", type=Path, help="dump folders (job.dump_folder) of the runs")
    parser.add_argument("--output", type=Path, help="the PNG to write (default: metrics.png in the one folder given; "
                                                    "required for several)")
    args = parser.parse_args(argv)
    if args.output is None and len(args.folders) > 1:
        parser.error("several runs need --output FILE.png")
    output = args.output or args.folders[0] / "metrics.png"
    drawn = plot_runs(args.folders, output)
    missing = [str(folder) for folder in args.folders if folder not in drawn]
    if missing:
        print(f"no step logged in {', '.join(missing)} (no metrics.jsonl, or an empty one)", file=sys.stderr)
    if not drawn:
        return 2
    print(f"plot of {len(drawn)} run(s): {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
