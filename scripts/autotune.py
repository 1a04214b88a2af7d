"""Find the fastest settings that fit a memory budget by running short trainings.

Candidates (local batch size x activation checkpointing x compile, x float8 where the GPU has it) are
first checked against the budget with the memory estimator, so that only those that may fit are run;
the least recomputation that fits is kept per batch size. docs/ablations.md describes the search,
the pruning and how throughput is measured.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from components.config import REPO_ROOT, Config, ConfigError, Training, load_config
from components.data.batch_plan import BatchPlan, batch_plan
from components.distributed.mesh import ParallelDims
from components.metrics.reporting import read_metrics
from models.families import model_config_class
from scripts.ac_modes import ac_flags
from scripts.memory_estimate import cpu_baseline_bytes, estimate

AC_MODES = ("none", "op", "full")


# --- Candidates -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Candidate:
    local_batch: int
    ac: str
    """none, op (selective by op), full, or N (selective: every N-th block)."""
    compile: bool = False
    float8: bool = False
    global_batch: int = -1
    """The pinned training.global_batch_size, or -1 (local x dp)."""

    def overrides(self) -> list[str]:
        out = ["--training.local_batch_size", str(self.local_batch),
               "--training.global_batch_size", str(self.global_batch), *ac_flags(self.ac)]
        out += ["--compile.enable", str(self.compile).lower()]
        if self.float8:
            out += ["--float8.enable", "true"]
        return out

    @property
    def name(self) -> str:
        """A folder name for the run."""
        name = f"b{self.local_batch}_ac-{self.ac}_compile-{'on' if self.compile else 'off'}"
        return name + ("_float8" if self.float8 else "")

    def describe(self, dp: int) -> str:
        ac = {"none": "AC none", "op": "AC op", "full": "AC full"}.get(self.ac, f"AC every {self.ac}")
        text = f"batch {self.local_batch}, {ac}, compile {'on' if self.compile else 'off'}"
        if self.float8:
            text += ", float8"
        batch = batch_of(self.local_batch, self.global_batch, dp)
        if self.global_batch == -1:
            text += f" (global {batch.global_batch}: changes the optimization)"
        else:
            text += f" (accumulation {batch.grad_accum_steps})"
        return text


def batch_of(local_batch: int, global_batch: int, dp: int) -> BatchPlan:
    """train.py's batch plan of a local and a global batch size (-1: local x dp) on `dp` ranks; a
    ConfigError where the global batch is not a multiple of local x dp. seq_len plays no part here."""
    return batch_plan(Training(local_batch_size=local_batch, global_batch_size=global_batch), dp)


@dataclass
class SearchSpace:
    batch_sizes: list[int]
    ac_modes: list[str]
    compile: list[bool]
    float8: list[bool]
    global_batch: int
    """The configured global batch in sequences (pinned where a candidate's local batch divides it)."""
    dp: int

    def candidate(self, batch: int, ac: str, compile_: bool, float8: bool) -> Candidate:
        """Pinned to the configured global batch where it is a multiple of batch x dp, else -1."""
        try:
            batch_of(batch, self.global_batch, self.dp)
            pinned = self.global_batch
        except ConfigError:
            pinned = -1
        return Candidate(batch, ac, compile_, float8, pinned)

    def all(self) -> list[Candidate]:
        return [self.candidate(b, a, c, f)
                for f in self.float8 for c in self.compile for a in self.ac_modes for b in self.batch_sizes]


def powers_of_two(limit: int) -> list[int]:
    out, b = [], 1
    while b <= limit:
        out.append(b)
        b *= 2
    return out


def gpu_has_float8() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


def _parse_bools(text: str) -> list[bool]:
    values = {"off": False, "false": False, "0": False, "on": True, "true": True, "1": True}
    out = []
    for item in text.split(","):
        if item.strip().lower() not in values:
            raise ConfigError(f"expected a list of on/off, got {text!r}")
        out.append(values[item.strip().lower()])
    return list(dict.fromkeys(out))


def _on_off(values: list[bool]) -> str:
    return ",".join("on" if v else "off" for v in values)


def _parse_modes(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    for m in modes:
        if m not in AC_MODES and not (m.isdigit() and int(m) > 0):
            raise ConfigError(f"activation checkpointing modes are none, op, full or a positive integer N; got {m!r}")
    return modes


# --- Results of runs ------------------------------------------------------------------------------


@dataclass
class Result:
    candidate: Candidate
    status: str = "not run"
    """ok | skipped (estimate) | pruned | over budget | failed ...; only "ok" results are ranked."""
    estimate_gib: float | None = None
    tokens_per_second: float | None = None
    peak_gib: float | None = None
    measured_steps: int = 0
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def summarize(records: list[dict], warmup: int) -> tuple[float | None, float | None, int]:
    """(median tokens/s over the steps after the first `warmup`, peak memory_gib of all steps,
    number of steps the median is over). With no step past the warm-up, the last step counts."""
    if not records:
        return None, None, 0
    records = sorted(records, key=lambda r: r["step"])
    measured = [r for r in records if r["step"] > warmup] or records[-1:]
    peak = max(r["memory_gib"] for r in records)
    return statistics.median(r["tokens_per_second"] for r in measured), peak, len(measured)


def rank(results: list[Result]) -> list[Result]:
    """Successful runs by tokens/s (fastest first), then the rest in the order they were tried."""
    done = sorted((r for r in results if r.ok), key=lambda r: -r.tokens_per_second)
    return done + [r for r in results if not r.ok]


# --- The search -----------------------------------------------------------------------------------


def search(space: SearchSpace, budget_gib: float, estimate_fn: Callable[[Candidate], float],
           run_fn: Callable[[Candidate], Result], exhaustive: bool = False,
           log: Callable[[str], None] = print) -> list[Result]:
    """Try the candidates of `space`: one runs only if its estimate fits the budget, and counts only if
    it then runs within it. The order and the pruning (docs/ablations.md, Autotune) rest on more
    recomputation never being faster at the same batch size and compile setting.
    estimate_fn(candidate) -> GiB; run_fn(candidate) -> Result with status ok/failed..., its
    tokens_per_second and peak_gib. Returns every candidate considered, in the order tried."""
    results: list[Result] = []
    estimates: dict[Candidate, float] = {}

    def estimated(c: Candidate) -> float:
        if c not in estimates:
            estimates[c] = estimate_fn(c)
        return estimates[c]

    def attempt(c: Candidate) -> Result:
        """Estimate, then run if the estimate fits; the result says whether it fit."""
        est = estimated(c)
        if est > budget_gib:
            result = Result(c, f"skipped: estimate {est:.2f} GiB > budget", est)
            log(f"  {c.name}: {result.status}")
        else:
            log(f"  {c.name}: estimate {est:.2f} GiB, running...")
            result = run_fn(c)
            result.estimate_gib = est
            if result.ok and result.peak_gib is not None and result.peak_gib > budget_gib:
                result.status = f"over budget: measured {result.peak_gib:.2f} GiB"
            measured = ""
            if result.tokens_per_second is not None:
                measured = f", {result.tokens_per_second:,.0f} tokens/s, peak {result.peak_gib:.2f} GiB"
            log(f"  {c.name}: {result.status}{measured}")
        results.append(result)
        return result

    batches = sorted(space.batch_sizes)
    for f8 in space.float8:
        for comp in space.compile:
            if exhaustive:
                for ac in space.ac_modes:
                    for i, b in enumerate(batches):
                        if not attempt(space.candidate(b, ac, comp, f8)).ok:
                            results.extend(Result(space.candidate(bb, ac, comp, f8), f"pruned: batch {b} did not fit")
                                           for bb in batches[i + 1:])
                            break
                continue
            first_mode = 0
            for i, b in enumerate(batches):
                fitted = False
                for m in range(first_mode, len(space.ac_modes)):
                    if attempt(space.candidate(b, space.ac_modes[m], comp, f8)).ok:
                        first_mode, fitted = m, True
                        break
                if not fitted:
                    results.extend(Result(space.candidate(bb, ac, comp, f8), f"pruned: no mode fit batch {b}")
                                   for bb in batches[i + 1:] for ac in space.ac_modes[first_mode:])
                    break
    # What the order rules out without a try: more recomputation than a mode that already fit the same
    # batch (never faster), or less than a mode that did not fit a smaller batch (cannot fit).
    tried = {r.candidate for r in results}
    results.extend(Result(c, "pruned: ruled out by a tried setting") for c in space.all() if c not in tried)
    return results


# --- Running a candidate --------------------------------------------------------------------------


def world_size_of(config: Config, world_size: int | None = None) -> int:
    """Processes a run needs: the product of the degrees; data_parallel_shard_degree = -1 takes the
    local GPUs (one process without CUDA) unless world_size is given."""
    p = config.parallelism
    others = (p.data_parallel_replicate_degree * p.context_parallel_degree * p.tensor_parallel_degree
              * p.pipeline_parallel_degree)
    if p.data_parallel_shard_degree != -1:
        return others * p.data_parallel_shard_degree
    if world_size is not None:
        return world_size
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 1
    return others * max(1, gpus // others)


def train_command(base_args: list[str], candidate: Candidate, steps: int, dump_folder: Path,
                  world_size: int) -> list[str]:
    """train.py (under torchrun for several ranks) with the user's arguments, the candidate's and the
    short-run settings."""
    launcher = [sys.executable]
    if world_size > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world_size)]
    return [
        *launcher, str(REPO_ROOT / "train.py"), *base_args, *candidate.overrides(),
        "--training.steps", str(steps), "--checkpoint.enable", "false", "--validation.enable", "false",
        "--metrics.log_freq", "1", "--job.dump_folder", str(dump_folder),
    ]


def run_candidate(base_args: list[str], candidate: Candidate, *, steps: int, runs_folder: Path, world_size: int,
                  warmup: int | None = None, timeout: float = 900) -> Result:
    """Train `candidate` for `steps` steps in a fresh process and read its metrics.jsonl."""
    dump = runs_folder / candidate.name
    dump.mkdir(parents=True, exist_ok=True)
    (dump / "metrics.jsonl").unlink(missing_ok=True)  # from an earlier autotune into the same --output
    command = train_command(base_args, candidate, steps, dump, world_size)
    start = time.perf_counter()
    with open(dump / "run.log", "w") as log:
        log.write(shlex.join(command) + "\n")
        log.flush()
        try:
            rc = subprocess.run(command, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
                                timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = None
    seconds = time.perf_counter() - start
    warmup = (3 if candidate.compile else 2) if warmup is None else warmup
    train, _ = read_metrics(dump / "metrics.jsonl")
    tps, peak, measured = summarize(train, warmup)
    result = Result(candidate, "ok", tokens_per_second=tps, peak_gib=peak, measured_steps=measured, seconds=seconds)
    if rc != 0 or tps is None:
        text = (dump / "run.log").read_text(errors="replace")
        if rc is None:
            result.status = f"failed: timed out after {timeout:.0f} s"
        elif "out of memory" in text.lower() or "OutOfMemoryError" in text or rc in (-9, 137):
            result.status = "failed: out of memory" + (" (killed)" if rc in (-9, 137) else "")
        else:
            errors = [line for line in text.splitlines() if "error" in line.lower()]
            reason = errors[-1].strip()[:120] if errors else f"see {dump / 'run.log'}"
            result.status = f"failed (exit {rc}): {reason}"
    return result


# --- Report ---------------------------------------------------------------------------------------


def table(results: list[Result], dp: int) -> str:
    lines = ["| rank | candidate | tokens/s | peak GiB | estimate GiB | status |",
             "| ---: | --- | ---: | ---: | ---: | --- |"]
    for i, r in enumerate(rank(results), 1):
        tps = f"{r.tokens_per_second:,.0f}" if r.tokens_per_second is not None else "-"
        peak = f"{r.peak_gib:.2f}" if r.peak_gib is not None else "-"
        est = f"{r.estimate_gib:.2f}" if r.estimate_gib is not None else "-"
        lines.append(f"| {i if r.ok else ''} | {r.candidate.describe(dp)} | {tps} | {peak} | {est} | {r.status} |")
    return "\n".join(lines)


def winner_command(base_args: list[str], winner: Candidate, world_size: int) -> str:
    """The winner as a ./run_train.sh command line (the config file and overrides given here, then
    the winning settings)."""
    args = list(base_args)
    config_file = None
    if "--job.config_file" in args:
        i = args.index("--job.config_file")
        config_file = args[i + 1]
        del args[i : i + 2]
    prefix = f"NGPU={world_size} " if world_size > 1 else ""
    config_part = ["--job.config_file", config_file] if config_file else []
    return prefix + shlex.join(["./run_train.sh", *config_part, *args, *winner.overrides()])


# --- Command line ---------------------------------------------------------------------------------


EPILOG = """Any other --section.key value argument is a config override passed to every run.

AC: activation checkpointing (activation_checkpoint.mode): none keeps every activation, op recomputes
the cheap ops of each block (selective by op), full recomputes whole blocks.

Example: the fastest batch size, AC and compile setting of the debug model under 2 GiB per rank:
  python -m scripts.autotune --job.config_file debug_model.toml --memory-budget-gib 2 --steps 6 \\
      --output outputs/autotune"""


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        prog="python -m scripts.autotune", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG)
    parser.add_argument("--memory-budget-gib", type=float, required=True,
                        help="peak memory per rank allowed (required)")
    parser.add_argument("--steps", type=int, default=8, help="training steps per run (default 8)")
    parser.add_argument("--warmup", type=int, default=None,
                        help="steps left out of the median (default 2, 3 with compile)")
    parser.add_argument("--batch-sizes", type=str, default=None,
                        help="comma-separated local batch sizes (default: powers of two)")
    parser.add_argument("--max-batch", type=int, default=None,
                        help="largest power of two tried (default: the configured local batch)")
    parser.add_argument("--ac-modes", type=str, default="none,op,full",
                        help="activation checkpointing (AC) modes to try, from least to most recomputation "
                             "(default none,op,full)")
    parser.add_argument("--compile", type=str, default="off,on", help="compile settings to try (default off,on)")
    parser.add_argument("--float8", type=str, default=None,
                        help="float8 settings (default off,on on GPUs with float8, else off)")
    parser.add_argument("--world-size", type=int, default=None,
                        help="processes per run when data_parallel_shard_degree is -1 (default: the local GPUs, "
                             "or 1 without CUDA)")
    parser.add_argument("--output", type=str, default=None,
                        help="folder for autotune.md and the runs (default: none: the table on stdout only, the runs "
                             "in a temporary folder)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds allowed per run (default 900)")
    parser.add_argument("--exhaustive", action="store_true",
                        help="run every candidate, not only the least recomputation that fits")
    parser.add_argument("--dry-run", action="store_true", help="print the candidates and their estimates, run nothing")
    parser.add_argument("--predict", action="store_true",
                        help="rank layouts (TP, PP x AC x batch) by preflight's predicted tokens/s, run nothing")
    parser.add_argument("--pp-degrees", default="1", help="with --predict: pipeline degrees to try (default 1)")
    parser.add_argument("--cluster", default="h100",
                        help="with --predict: h100, h200 or a TOML file (preflight's; default h100)")
    return parser.parse_known_args(argv)


def build_space(config: Config, opts: argparse.Namespace, world_size: int) -> SearchSpace:
    dims = ParallelDims.from_config(config.parallelism, world_size)
    if opts.batch_sizes:
        try:
            batches = sorted({int(b) for b in opts.batch_sizes.split(",") if b.strip()})
        except ValueError:
            raise ConfigError(f"--batch-sizes must be integers, got {opts.batch_sizes!r}") from None
    else:
        batches = powers_of_two(opts.max_batch or config.training.local_batch_size)
    if not batches or batches[0] < 1:
        raise ConfigError("batch sizes must be >= 1")
    if dims.pp > 1:  # each local batch must split into pipeline micro-batches
        mb = config.parallelism.pipeline_parallel_microbatch_size
        batches = [b for b in batches if b % mb == 0]
    float8 = _parse_bools(opts.float8) if opts.float8 else ([False, True] if gpu_has_float8() else [False])
    configured_global = batch_plan(config.training, dims.dp).global_batch
    return SearchSpace(batches, _parse_modes(opts.ac_modes), _parse_bools(opts.compile), float8, configured_global,
                       dims.dp)


def predict_main(opts: argparse.Namespace, base_args: list[str], world_size: int, space: SearchSpace) -> int:
    from scripts.preflight.layouts import predict_layouts, table
    from scripts.preflight.predict import load_cluster

    cluster = load_cluster(opts.cluster)
    print(f"autotune --predict: {world_size} GPUs of {cluster.name}, budget {opts.memory_budget_gib} GiB per GPU")
    try:
        pp_degrees = sorted({int(d) for d in opts.pp_degrees.split(",")})
    except ValueError:
        raise ConfigError(f"--pp-degrees must be integers, got {opts.pp_degrees!r}") from None
    layouts = predict_layouts(base_args, world_size, opts.memory_budget_gib, cluster, space.ac_modes,
                              space.batch_sizes, pp_degrees)
    print("\n" + table(layouts))
    return 0 if layouts and layouts[0].prediction else 1


def main(argv: list[str] | None = None) -> int:
    opts, base_args = parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        config = load_config(base_args, model_config_class)
        target = "cuda" if torch.cuda.is_available() else "cpu"
        # Measured now, before anything is built: this process is then what a trainer is before training.
        baseline = cpu_baseline_bytes(config) if target == "cpu" else None
        world_size = world_size_of(config, opts.world_size)
        space = build_space(config, opts, world_size)
        if opts.predict:
            return predict_main(opts, base_args, world_size, space)
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    def estimate_fn(c: Candidate) -> float:
        try:
            config = load_config(base_args + c.overrides(), model_config_class)
            return estimate(config, world_size, target, baseline).total_gib
        except (ConfigError, ValueError) as e:
            print(f"  {c.name}: no estimate ({e})")
            return float("inf")

    float8 = f" x float8 {_on_off(space.float8)}" if space.float8 != [False] else ""
    print(f"autotune: {len(space.all())} candidates (batch {','.join(map(str, space.batch_sizes))} "
          f"x AC {','.join(space.ac_modes)} x compile {_on_off(space.compile)}{float8}), "
          f"budget {opts.memory_budget_gib} GiB per rank, {world_size} process(es), global batch {space.global_batch}")
    if opts.dry_run:
        results = []
        for c in space.all():
            estimate_gib = estimate_fn(c)
            fits = estimate_gib <= opts.memory_budget_gib
            results.append(Result(c, "would run" if fits else "skipped: estimate over budget", estimate_gib))
        print(table(results, space.dp))
        return 0

    output = Path(opts.output) if opts.output else None
    tmp = None if output else tempfile.TemporaryDirectory(prefix="autotune-")
    runs_folder = output / "runs" if output else Path(tmp.name)
    try:
        results = search(
            space, opts.memory_budget_gib, estimate_fn,
            lambda c: run_candidate(base_args, c, steps=opts.steps, runs_folder=runs_folder, world_size=world_size,
                                    warmup=opts.warmup, timeout=opts.timeout),
            exhaustive=opts.exhaustive,
        )
    finally:
        if tmp is not None:
            tmp.cleanup()
    report = [table(results, space.dp), ""]
    ranked = rank(results)
    if ranked and ranked[0].ok:
        best = ranked[0]
        report += [f"winner: {best.candidate.describe(space.dp)}: {best.tokens_per_second:,.0f} tokens/s, "
                   f"peak {best.peak_gib:.2f} GiB",
                   "", "    " + winner_command(base_args, best.candidate, world_size)]
        code = 0
    else:
        report += [f"no candidate fit the budget of {opts.memory_budget_gib} GiB"]
        code = 1
    text = "\n".join(report)
    print("\n" + text)
    if output:
        output.mkdir(parents=True, exist_ok=True)
        command = shlex.join(sys.argv[1:] if argv is None else argv)
        header = (f"# Autotune\n\n`python -m scripts.autotune {command}`\n\n"
                  f"Budget {opts.memory_budget_gib} GiB per rank, {opts.steps} steps per run, "
                  "tokens/s per device: median after warm-up.\n\n")
        (output / "autotune.md").write_text(header + text + "\n")
        print(f"\nwritten to {output / 'autotune.md'}")
    return code


if __name__ == "__main__":
    sys.exit(main())
