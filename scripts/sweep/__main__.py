"""The sweep command line: `python -m scripts.sweep SWEEP.toml ...` runs a sweep and
`python -m scripts.sweep compare DUMP ...` reports on finished runs (or ingot-sweep)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from components.config import REPO_ROOT
from scripts.sweep import launch
from scripts.sweep.plan import Sweep, SweepError, read_sweep
from scripts.sweep.report import dump_results, overrides_text, sweep_results, write_report
from scripts.sweep.state import next_action

EXIT_OK, EXIT_NOT_DONE, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


def print_plan(sweep: Sweep, slots: list[dict[str, str]], parallel: int) -> None:
    print(f"sweep {sweep.path}: {len(sweep.runs)} run(s), {parallel} at a time, under {sweep.output}")
    print(f"base config {sweep.base_config}; common overrides: {overrides_text(sweep.overrides) or 'none'}")
    rows = [("run", "overrides", "state")]
    for run in sweep.runs:
        action, why = next_action(run)
        state = {"skip": "done (skip)", "resume": f"resume {why}"}.get(action, "new" if not why else why)
        rows.append((run.name, overrides_text(run.overrides) or "-", state))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    for row in rows:
        print("  " + "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
    print("commands (the first slot's environment):")
    for run in sweep.runs:
        print(f"  {run.name}: {launch.shell_line(run, slots[0])}")


def run_sweep(args: argparse.Namespace) -> int:
    sweep = read_sweep(args.sweep, args.output)
    gpus = launch.visible_gpus()
    slots = launch.slot_environments(args.parallel, sweep.nproc_per_run, gpus, launch.cpu_cores())
    if args.dry_run:
        print_plan(sweep, slots, args.parallel)
        return EXIT_OK
    sweep.output.mkdir(parents=True, exist_ok=True)
    lock = launch.lock_output(sweep.output)
    (sweep.output / "sweep.toml").write_text(sweep.path.read_text())
    device = f"GPUs {','.join(gpus)}" if gpus else f"CPU, OMP_NUM_THREADS={slots[0]['OMP_NUM_THREADS']} per process"
    launch.say(f"sweep {sweep.path.name}: {len(sweep.runs)} run(s), {args.parallel} at a time, "
               f"NGPU={sweep.nproc_per_run} each ({device}) -> {sweep.output}")
    try:
        with launch.stop_signals_interrupt():
            failed = launch.execute(sweep, args.parallel, slots)
    except KeyboardInterrupt:
        failed = None
    results = sweep_results(sweep)
    base, common = os.path.relpath(sweep.base_config, REPO_ROOT), overrides_text(sweep.overrides) or "none"
    preamble = [f"Sweep `{sweep.path}`: base config `{base}`, common overrides `{common}`, "
                f"{sweep.nproc_per_run} process(es) per run.", ""]
    write_report(results, sweep.output, f"Sweep {sweep.path.stem}", preamble, log=launch.say)
    lock.close()
    if failed is None:
        return EXIT_INTERRUPTED
    not_done = [r.name for r in results if r.status != "done"]
    if failed or not_done:
        print(f"{len(not_done)} of {len(results)} run(s) not done: {', '.join(not_done)}", file=sys.stderr)
        return EXIT_NOT_DONE
    return EXIT_OK


def run_folders(given: list[str]) -> list[Path]:
    """The run folders named on the command line; a sweep's output folder stands for its runs."""
    dumps = []
    for text in given:
        path = Path(text)
        if not path.is_dir():
            raise SweepError(f"not a folder: {path}")
        if (path / "config.toml").is_file():
            dumps.append(path)
        else:
            runs = sorted(p for p in path.iterdir() if (p / "config.toml").is_file())
            if not runs:
                raise SweepError(f"{path} holds no config.toml, nor run folders that do")
            dumps += runs
    return dumps


def run_compare(args: argparse.Namespace) -> int:
    dumps = run_folders(args.dumps)
    preamble = ["Runs: " + ", ".join(f"`{d}`" for d in dumps), ""]
    write_report(dump_results(dumps), Path(args.output), "Run comparison", preamble, log=launch.say)
    return EXIT_OK


def compare_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m scripts.sweep compare",
                                     description="Table and loss curves of finished runs (seeds grouped).")
    parser.add_argument("dumps", nargs="+", metavar="DUMP",
                        help="a run's dump folder (config.toml, metrics.jsonl), or a sweep's output folder")
    parser.add_argument("--output", default="compare_report",
                        help="where results.csv, results.md, loss_curves.png go (default: %(default)s)")
    return parser


def sweep_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m scripts.sweep",
        description="Run a sweep of training runs (a grid and/or a list of override sets); "
                    "`python -m scripts.sweep compare DUMP ...` compares finished runs.",
    )
    parser.add_argument("sweep", metavar="SWEEP.toml", help="the sweep file (see train_configs/sweeps/)")
    parser.add_argument("--output",
                        help="the sweep's folder, one subfolder per run (default: outputs/sweeps/<sweep file name>)")
    parser.add_argument("--parallel", type=int, default=1, metavar="K", help="runs at a time (default: 1)")
    parser.add_argument("--dry-run", action="store_true", help="print the runs and their commands, launch nothing")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["compare"]:
        command, args = run_compare, compare_parser().parse_args(argv[1:])
    else:
        parser = sweep_parser()
        args, extra = parser.parse_known_args(argv)
        if not args.sweep.endswith(".toml"):
            parser.error(f"the first argument is `compare` or a sweep file (.toml), got {args.sweep!r}")
        if extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        command = run_sweep
    try:
        return command(args)
    except SweepError as e:
        print(f"sweep error: {e}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
