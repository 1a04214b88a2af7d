"""The ladder command line: `python -m scripts.ladder LADDER.toml --output DIR` (or ingot-ladder) trains
every rung x budget through the sweep runner, fits L(N, D) = E + A / N^alpha + B / D^beta to their final
losses and predicts the ladder's target; docs/scaling.md."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from components.config import REPO_ROOT
from scripts.ladder.plan import (
    LadderRun,
    held_out,
    memory_over_budget,
    plan_runs,
    short_count,
    short_flops,
    sweep_file_text,
    target_size,
)
from scripts.ladder.plot import plot_loss_vs_compute
from scripts.ladder.results import collect, fit_rows, summary_lines, write_csv
from scripts.ladder.spec import LadderError, read_ladder
from scripts.sweep.__main__ import main as sweep_main
from scripts.sweep.launch import say
from scripts.sweep.plan import SweepError, read_sweep
from scripts.sweep.report import sweep_results

EXIT_OK, EXIT_NOT_DONE, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


def print_plan(runs: list[LadderRun], holdout: set[str], estimates: dict[str, float],
               target: tuple[float, float] | None) -> None:
    table = [("run", "N", "D", "steps", "C (FLOPs)") + (("memory GiB",) if estimates else ()) + ("",)]
    for run in runs:
        memory = (f"{estimates[run.rung]:.2f}",) if estimates else ()
        table.append((run.name, short_count(run.n_params), short_count(run.tokens), str(run.steps),
                      short_flops(run.flops), *memory, "held out" if run.name in holdout else ""))
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    for row in table:
        say("  " + "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
    if target:
        say(f"  target: N {short_count(target[0])}, D {short_count(target[1])}, "
            f"C {short_flops(6 * target[0] * target[1])}")


def run_ladder(args: argparse.Namespace) -> int:
    ladder = read_ladder(args.ladder)
    runs = plan_runs(ladder)
    holdout = held_out(runs, args.holdout or ladder.holdout)
    target = target_size(ladder)
    estimates = {}
    if ladder.memory_budget_gib is not None and not args.fit_only:
        estimates, over = memory_over_budget(ladder, runs)
        if over:
            raise LadderError(f"{len(over)} rung(s) over memory_budget_gib = {ladder.memory_budget_gib:g}: "
                              + ", ".join(f"{rung} ({estimates[rung]:.2f} GiB estimated)" for rung in over)
                              + "; nothing was run")
    output = Path(args.output or REPO_ROOT / "outputs" / "ladders" / ladder.path.stem).resolve()
    say(f"ladder {ladder.path.name}: {len(runs)} run(s) of {len(ladder.rungs)} rung(s), fitting the final "
        f"{ladder.loss} loss; N: non-embedding parameters -> {output}")
    print_plan(runs, holdout, estimates, target)
    if args.dry_run:
        return EXIT_OK
    output.mkdir(parents=True, exist_ok=True)
    sweep_file = output / "sweep.toml"
    sweep_file.write_text(sweep_file_text(ladder, runs))
    code = EXIT_OK
    if args.fit_only:
        if not (output / "runs").is_dir():
            raise LadderError(f"--fit-only: {output / 'runs'} does not exist: run the ladder first")
    else:
        code = sweep_main([str(sweep_file), "--output", str(output / "runs"), "--parallel", str(args.parallel)])
        if code in (EXIT_USAGE, EXIT_INTERRUPTED):
            return code
    try:
        sweep = read_sweep(sweep_file, output / "runs")
    except SweepError as e:
        raise LadderError(str(e)) from None
    rows = collect(runs, sweep_results(sweep), ladder.loss, holdout)
    fitted = fit_rows(rows, ladder.loss, ladder.bootstrap, target, say)
    write_csv(rows, output / "results.csv")
    written = [output / "results.csv"]
    for stale in ("fit.json", "loss_vs_compute.png"):
        (output / stale).unlink(missing_ok=True)  # never leave an old fit beside new results
    if fitted is None:
        say(f"wrote {written[0]}")
        return EXIT_NOT_DONE
    summary, law = fitted
    (output / "fit.json").write_text(json.dumps(summary, indent=2) + "\n")
    written.append(output / "fit.json")
    plot_loss_vs_compute(rows, law, summary, output / "loss_vs_compute.png", f"Ladder {ladder.path.stem}")
    written.append(output / "loss_vs_compute.png")
    for line in summary_lines(summary):
        say(line)
    say("wrote " + ", ".join(str(p) for p in written))
    return code


def ladder_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m scripts.ladder", allow_abbrev=False,
        description="Train a ladder of model sizes and token budgets (through the sweep runner), fit "
                    "L(N, D) = E + A / N^alpha + B / D^beta to their final losses, predict a larger model.",
    )
    parser.add_argument("ladder", metavar="LADDER.toml", help="the ladder file (see train_configs/ladders/)")
    parser.add_argument("--output", help="where sweep.toml, runs/, results.csv, fit.json and loss_vs_compute.png "
                                         "go (default: outputs/ladders/<ladder file name>)")
    parser.add_argument("--parallel", type=int, default=1, metavar="K", help="runs at a time (default: 1)")
    parser.add_argument("--fit-only", action="store_true", help="run nothing: refit the runs already in DIR/runs")
    parser.add_argument("--holdout", action="append", metavar="NAME",
                        help="leave this rung (or run) out of the fit and compare its loss with the prediction; "
                             "repeat for several; replaces the ladder file's holdout")
    parser.add_argument("--dry-run", action="store_true", help="print the runs (and memory estimates), run nothing")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = ladder_parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return run_ladder(args)
    except LadderError as e:
        print(f"ladder error: {e}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
