"""One benchmark matrix for every device: short trainings of train.py, each switching one technique on
against the same baseline, summarized in one table (docs/benchmarks.md).

    python -m scripts.benchmark --preset {tiny,cpu,h100} [--json PATH] [--torchtitan] [train.py flags...]

Each case is its own process (torchrun for FSDP over the local devices) with checkpointing off and a
metrics record every step. Figures leave out the first --warmup steps (compilation, allocator
warm-up): tokens/s per device is total tokens / total time over the steps kept, MFU is null where
the device's peak FLOP/s is unknown (CPUs), peak memory is the run's highest. A case that fails is
reported with its error line and the others still run; the exit status is 1 if any case failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import re
import shlex
import sys
import tempfile
from pathlib import Path

import torch

from components.config import ConfigError, load_config
from models.families import model_config_class
from scripts.benchmark.cases import PRESETS, Case
from scripts.benchmark.run import Result, cpu_load, device_name, git_commit, run_case, train_argv
from scripts.benchmark.torchtitan_run import run_torchtitan
from scripts.benchmark.trace_summary import summarize

EXIT_FAILED, EXIT_USAGE = 1, 2


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)  # progress; stdout holds only the report


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        prog="python -m scripts.benchmark", description=__doc__.split("\n\n")[0], allow_abbrev=False,
        epilog="Any other --section.key value argument is a train.py flag applied to every case.",
    )
    parser.add_argument("--preset", choices=sorted(PRESETS), required=True,
                        help="tiny: what CI runs; cpu: the debug model; h100: Llama 3 1B and 8B on one GPU")
    parser.add_argument("--json", type=Path, help="also write the results to this JSON file")
    parser.add_argument("--torchtitan", action="store_true",
                        help="run each case through TorchTitan too and print the tokens/s ratios")
    parser.add_argument("--steps", type=int, help="training steps per case (default: the preset's)")
    parser.add_argument("--warmup", type=int, help="first steps left out of the figures (default: the preset's)")
    parser.add_argument("--cases", help="comma-separated case names to run (default: all of the preset's)")
    parser.add_argument("--case-flags", action="append", default=[], metavar="CASE=FLAGS",
                        help="more train.py flags for one case, e.g. 'debug default=--training.seq_len 128'")
    parser.add_argument("--timeout", type=float, default=600, help="seconds allowed per run (default 600)")
    parser.add_argument("--traces", type=Path, metavar="DIR",
                        help="2 more steps per case under torch.profiler (left out of the figures): each case's "
                             "chrome trace in DIR, and where each step's time goes in DIR/summary.md")
    return parser.parse_known_args(argv)


def selected_cases(cases: tuple[Case, ...], names: str | None) -> list[Case]:
    if names is None:
        return list(cases)
    by_name = {case.name: case for case in cases}
    wanted = [name.strip() for name in names.split(",") if name.strip()]
    unknown = [name for name in wanted if name not in by_name]
    if unknown:
        raise ConfigError(f"no case {', '.join(unknown)} in this preset; its cases: {', '.join(by_name)}")
    return [by_name[name] for name in wanted]


def flags_by_case(items: list[str], cases: list[Case]) -> dict[str, list[str]]:
    flags: dict[str, list[str]] = {}
    for item in items:
        name, _, text = item.partition("=")
        if name not in {case.name for case in cases}:
            raise ConfigError(f"--case-flags {item!r}: no case {name!r} is run")
        flags.setdefault(name, []).extend(shlex.split(text))
    return flags


def progress(status: str, tokens_per_second: float | None) -> str:
    return f"{tokens_per_second:,.0f} tokens/s per device" if status == "ok" else status


def number(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def cell(text: str) -> str:
    return text.replace("|", "\\|")


def case_label(result: Result) -> str:
    return result.case + (f" ({result.processes} processes)" if result.processes > 1 else "")


def table(results: list[Result]) -> str:
    lines = ["| case | tokens/s per device | MFU | peak GiB | step s | status |",
             "| --- | ---: | ---: | ---: | ---: | --- |"]
    for r in results:
        mfu = "-" if r.mfu is None else f"{r.mfu:.2f}%"
        lines.append(f"| {case_label(r)} | {number(r.tokens_per_second, ',.0f')} | {mfu} | "
                     f"{number(r.peak_memory_gib, '.2f')} | {number(r.step_seconds, '.3f')} | {cell(r.status)} |")
    return "\n".join(lines)


def torchtitan_table(results: list[Result]) -> str:
    lines = ["| case | ingot tokens/s | torchtitan tokens/s | ingot / torchtitan | torchtitan MFU "
             "| torchtitan peak GiB | torchtitan status |", "| --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in results:
        titan = r.torchtitan or {"status": "not run"}
        theirs = titan.get("tokens_per_second")
        ratio = f"{r.tokens_per_second / theirs:.2f}" if r.tokens_per_second and theirs else "-"
        mfu = "-" if titan.get("mfu") is None else f"{titan['mfu']:.2f}%"
        lines.append(f"| {case_label(r)} | {number(r.tokens_per_second, ',.0f')} | {number(theirs, ',.0f')} | {ratio} "
                     f"| {mfu} | {number(titan.get('peak_memory_gib'), '.2f')} | {cell(titan['status'])} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    opts, extra = parse_args(list(sys.argv[1:] if argv is None else argv))
    preset = PRESETS[opts.preset]
    try:
        if preset.needs_gpu and not torch.cuda.is_available():
            raise ConfigError(f"the {opts.preset} preset needs a CUDA GPU; on a CPU run --preset cpu")
        if opts.torchtitan and importlib.util.find_spec("torchtitan") is None:
            raise ConfigError("--torchtitan needs TorchTitan, which is not installed here: pip install "
                              "torchtitan==0.3.0 (it trains on CUDA GPUs only)")
        load_config(extra, model_config_class)  # a misspelt flag stops here, not once per case
        cases = selected_cases(preset.cases, opts.cases)
        case_flags = flags_by_case(opts.case_flags, cases)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    steps = opts.steps or preset.steps
    warmup = preset.warmup if opts.warmup is None else opts.warmup
    report = {"device": device_name(), "torch": torch.__version__, "commit": git_commit(), "preset": opts.preset,
              "steps": steps, "warmup": warmup, "extra_flags": extra, "cpu_load": cpu_load()}
    results = []
    if opts.traces:
        opts.traces.mkdir(parents=True, exist_ok=True)
        (opts.traces / "summary.md").write_text(f"# Where a step's time goes: {report['device']}, torch "
                                                f"{report['torch']}, commit {report['commit']}\n\n")
    with tempfile.TemporaryDirectory(prefix="ingot-benchmark-") as tmp:
        for i, case in enumerate(cases, 1):
            say(f"[{i}/{len(cases)}] {case.name}")
            flags, dump = extra + case_flags.get(case.name, []), Path(tmp) / f"case-{i}"
            trace = opts.traces / (re.sub(r"[^A-Za-z0-9.-]+", "_", case.name) + ".json") if opts.traces else None
            result = run_case(case, flags, steps, warmup, opts.timeout, dump, trace)
            say(f"  {progress(result.status, result.tokens_per_second)}"
                + (f" ({result.wall_seconds:.0f} s)" if result.wall_seconds is not None else ""))
            if result.trace:
                with open(opts.traces / "summary.md", "a") as summary:
                    summary.write(summarize(json.loads(trace.read_text()), case.name) + "\n")
            if opts.torchtitan and result.wall_seconds is not None:  # the ingot case ran
                titan = run_torchtitan(train_argv(case, flags, steps, dump), result.processes, warmup, opts.timeout,
                                       Path(tmp) / f"torchtitan-{i}")
                say(f"  torchtitan: {progress(titan['status'], titan.get('tokens_per_second'))}")
                result.torchtitan = titan
            results.append(result)
            if opts.json:  # after every case: a benchmark cut short keeps what it measured
                report["cases"] = [dataclasses.asdict(r) for r in results]
                opts.json.write_text(json.dumps(report, indent=2) + "\n")
    print(f"ingot benchmark, preset {opts.preset}: {report['device']} | torch {report['torch']} | commit "
          f"{report['commit']} | {steps} steps per case, the first {warmup} left out"
          + (f" | {report['cpu_load']} at the start" if report["cpu_load"] else ""))
    print(table(results))
    if opts.torchtitan:
        print("\n" + torchtitan_table(results))
    statuses = [r.status for r in results] + [r.torchtitan["status"] for r in results if r.torchtitan]
    return EXIT_FAILED if any(status.startswith("failed") for status in statuses) else 0


if __name__ == "__main__":
    sys.exit(main())
