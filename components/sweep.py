"""Hyperparameter sweeps and run comparisons: launch a grid of training runs, then tabulate and plot them.

    python -m components.sweep SWEEP.toml [--output DIR] [--parallel K] [--dry-run]
    python -m components.sweep compare DUMP [DUMP ...] [--output DIR]

A sweep file names a base config, overrides for every run, and the runs: the Cartesian product of a
[grid] table and/or explicit [[runs]] tables (see train_configs/sweeps/ and docs/ablations.md):

    base_config = "train_configs/debug_model.toml"
    nproc_per_run = 1                  # optional: processes (GPUs) per run, NGPU for run_train.sh
    [overrides]                        # applied to every run
    "training.steps" = 200
    [grid]                             # every combination of these values is one run
    "optimizer.lr" = [1e-3, 3e-3]
    "training.seed" = [1, 2]
    [[runs]]                           # and/or explicit override sets (an optional name = "...")
    "model.n_layers" = 4

The design, in three rules:

- One process tree per run, launched exactly as a person would: `run_train.sh --job.config_file BASE
  --job.dump_folder DIR/<run> --key value ...` in the repository root, with NGPU (and on CUDA a
  disjoint CUDA_VISIBLE_DEVICES per concurrent run; on CPU an even share of OMP_NUM_THREADS). The
  sweep never imports the trainer, so a crash, an out-of-memory or a NaN in one run stays in that run.
- All state lives in files under DIR: each run's folder holds what train.py writes (config.toml with
  the git commit, metrics.jsonl, checkpoints) plus sweep_run.json (command, overrides, status, exit
  code, error, start and end times of every attempt), command.txt (the command line, ready to paste)
  and its full stdout.log / stderr.log. The report (results.csv, results.md, loss_curves.png) is
  rebuilt from those files every time, and `compare` builds the same report from any dump folders.
- Hence re-running the same command is safe: a run whose sweep_run.json says done and whose
  metrics.jsonl reaches training.steps is skipped; any other run is launched again, and train.py
  resumes it from the newest checkpoint in its folder (an interrupted or failed run continues where
  its last checkpoint left it). Every config is validated before anything is launched, so a typo in a
  key fails the sweep at once. A lock file keeps two sweeps out of the same DIR.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import itertools
import json
import math
import os
import re
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from components.config import REPO_ROOT, Config, ConfigError, git_commit, load_config, resolve_config_file

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

RUN_TRAIN = REPO_ROOT / "run_train.sh"
SWEEP_KEYS = ("base_config", "nproc_per_run", "overrides", "grid", "runs")
STATE_FILE = "sweep_run.json"
SEED_KEY = "training.seed"
FINAL_WINDOW = 5  # "final loss": mean of at most this many logged losses ...
FINAL_FRACTION = 0.1  # ... from the last 10% of the run's steps
STDERR_TAIL = 30  # lines of a failed run's stderr (before torchrun's report) kept in sweep_run.json
# Keys that do not change what a run computes; compare ignores them when it looks for differences.
NOT_A_SETTING = ("job.", "metrics.", "profiling.", "comm.", "checkpoint.enable", "checkpoint.folder", "checkpoint.interval",
                 "checkpoint.async_mode", "checkpoint.keep_latest_k", "validation.freq")


class SweepError(Exception):
    """A sweep that cannot start (a bad sweep file, an unknown key, too few GPUs); the message says why."""


# --- The sweep file: base config, overrides, and the runs they expand into ---------------------------


@dataclass
class Run:
    name: str
    overrides: dict[str, object]
    """What sets this run apart (its grid point and/or [[runs]] entry), in sweep-file order."""
    all_overrides: dict[str, object]
    """The sweep's common [overrides], then this run's."""
    dump: Path
    config: Config
    command: list[str]


@dataclass
class Sweep:
    path: Path
    base_config: Path
    nproc_per_run: int
    overrides: dict[str, object]
    runs: list[Run]
    output: Path


def _flatten(table: dict, prefix: str = "") -> dict[str, object]:
    """{"optimizer": {"lr": 1}} and {"optimizer.lr": 1} both become {"optimizer.lr": 1} (unquoted
    dotted keys in TOML make nested tables)."""
    flat = {}
    for key, value in table.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def cli_value(value) -> str:
    """A TOML value of the sweep file as train.py's command line takes it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else str(value)
    if isinstance(value, (int, str)):
        return str(value)
    if isinstance(value, list):  # list-typed keys parse a TOML array on the command line
        return "[" + ", ".join(json.dumps(v) if isinstance(v, str) else cli_value(v) for v in value) + "]"
    raise SweepError(f"unsupported value {value!r} ({type(value).__name__}): use a string, number, boolean or list")


def cli_args(overrides: dict[str, object]) -> list[str]:
    args = []
    for key, value in overrides.items():
        text = cli_value(value)
        # train.py reads `--key --x` as a bare flag followed by another key; `--key=--x` is unambiguous.
        args += [f"--{key}={text}"] if text.startswith("--") else [f"--{key}", text]
    return args


def _name_value(value) -> str:
    if isinstance(value, list):
        return ",".join(_name_value(v) for v in value)
    return cli_value(value)


def _sanitize(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._,+=-]+", "-", text).strip("-.")


def run_names(override_sets: list[dict[str, object]], explicit: list[str | None]) -> list[str]:
    """Readable, unique folder names: `lr=0.001_seed=1` from the last part of each key (the whole key
    where two keys share their last part), or an explicit name from a [[runs]] table."""
    keys = list(dict.fromkeys(k for overrides in override_sets for k in overrides))
    last_parts = [k.rsplit(".", 1)[-1] for k in keys]
    short = {k: (p if last_parts.count(p) == 1 else k) for k, p in zip(keys, last_parts)}
    names, seen = [], set()
    for overrides, given in zip(override_sets, explicit):
        name = _sanitize(given) if given else "_".join(_sanitize(f"{short[k]}={_name_value(v)}") for k, v in overrides.items())
        name = name or "base"
        if len(name) > 120:  # keep paths sane; the overrides are in sweep_run.json anyway
            import hashlib

            name = f"{name[:100]}-{hashlib.sha1(name.encode()).hexdigest()[:8]}"
        unique, n = name, 2
        while unique in seen:
            unique, n = f"{name}-{n}", n + 1
        seen.add(unique)
        names.append(unique)
    return names


def _resolve_base(value: str, sweep_path: Path) -> Path:
    for candidate in (Path(value), REPO_ROOT / value, sweep_path.parent / value):
        if candidate.is_file():
            return candidate.resolve()
    try:
        return resolve_config_file(value).resolve()
    except ConfigError as e:
        raise SweepError(f"{sweep_path}: base_config: {e}") from None


def expand(data: dict, where: str = "sweep file") -> tuple[dict, list[tuple[dict, str | None]]]:
    """The common overrides and each run's own overrides (with its explicit name or None): the grid's
    Cartesian product (in file order, the first key varying slowest), then the [[runs]] tables."""
    from difflib import get_close_matches

    for key in data:
        if key not in SWEEP_KEYS:
            close = get_close_matches(key, SWEEP_KEYS, n=1)
            raise SweepError(f"{where}: unknown key '{key}'" + (f" (did you mean {close[0]}?)" if close else "")
                             + f"; a sweep file has {', '.join(SWEEP_KEYS)}")
    common = _flatten(data.get("overrides", {}))
    grid = _flatten(data.get("grid", {}))
    for key, values in grid.items():
        if not isinstance(values, list) or not values:
            raise SweepError(f"{where}: grid key '{key}' needs a non-empty list of values, got {values!r}")
    runs = data.get("runs", [])
    if not isinstance(runs, list) or not all(isinstance(r, dict) for r in runs):
        raise SweepError(f"{where}: runs must be [[runs]] tables")
    sets: list[tuple[dict, str | None]] = []
    if grid:
        sets += [(dict(zip(grid, combo)), None) for combo in itertools.product(*grid.values())]
    for table in runs:
        table = _flatten(table)
        name = table.pop("name", None)
        if name is not None and not isinstance(name, str):
            raise SweepError(f"{where}: a [[runs]] name must be a string, got {name!r}")
        sets.append((table, name))
    if not sets:
        sets = [({}, None)]  # just the base config with the common overrides
    for overrides, _ in sets:
        for key in [*common, *overrides]:
            if key in ("job.dump_folder", "job.config_file"):
                raise SweepError(f"{where}: {key} is set by the sweep (base_config, and DIR/<run>); do not override it")
            if "." not in key:
                raise SweepError(f"{where}: '{key}' is not a config key: write \"section.key\" (quoted), e.g. \"optimizer.lr\"")
    # The same override set twice (say a [[runs]] table repeating a grid point) is one run.
    unique, seen = [], set()
    for overrides, name in sets:
        signature = json.dumps({k: cli_value(v) for k, v in sorted(overrides.items())})
        if signature in seen:
            print(f"note: the override set {overrides} appears twice in {where}; running it once")
            continue
        seen.add(signature)
        unique.append((overrides, name))
    return common, unique


def plan(sweep_path: str | Path, output: str | Path | None = None) -> Sweep:
    """Read a sweep file and resolve and validate every run's config; launches nothing, writes nothing."""
    sweep_path = Path(sweep_path)
    try:
        data = tomllib.loads(sweep_path.read_text())
    except FileNotFoundError:
        raise SweepError(f"sweep file not found: {sweep_path}") from None
    except tomllib.TOMLDecodeError as e:
        raise SweepError(f"cannot parse {sweep_path}: {e}") from None
    if "base_config" not in data or not isinstance(data["base_config"], str):
        raise SweepError(f"{sweep_path}: base_config = \"path/to/config.toml\" is required")
    base = _resolve_base(data["base_config"], sweep_path)
    nproc = data.get("nproc_per_run", 1)
    if not isinstance(nproc, int) or isinstance(nproc, bool) or nproc < 1:
        raise SweepError(f"{sweep_path}: nproc_per_run must be a positive integer, got {nproc!r}")
    common, sets = expand(data, str(sweep_path))
    output = Path(output if output is not None else REPO_ROOT / "outputs" / "sweeps" / sweep_path.stem).resolve()
    names = run_names([o for o, _ in sets], [n for _, n in sets])
    runs = []
    for (overrides, _), name in zip(sets, names):
        dump = output / name
        merged = common | overrides
        args = ["--job.config_file", str(base), "--job.dump_folder", str(dump), *cli_args(merged)]
        try:
            config = load_config(args)
        except ConfigError as e:
            raise SweepError(f"{sweep_path}: run {name}: {e}") from None
        runs.append(Run(name, overrides, merged, dump, config, [str(RUN_TRAIN), *args]))
    return Sweep(sweep_path, base, nproc, common, runs, output)


# --- A run's state on disk ----------------------------------------------------------------------------


def read_state(dump: Path) -> dict:
    try:
        return json.loads((dump / STATE_FILE).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def write_state(dump: Path, state: dict) -> None:
    tmp = dump / f".{STATE_FILE}.tmp"
    tmp.write_text(json.dumps(state, indent=2) + "\n")
    os.replace(tmp, dump / STATE_FILE)  # atomic: a killed sweep never leaves half a file


def read_metrics(dump: Path) -> tuple[list[dict], list[dict]]:
    """Train and validation records by step. A resumed run appends to metrics.jsonl, possibly
    repeating steps logged after its last checkpoint: the later record of a step wins."""
    train, val = {}, {}
    path = dump / "metrics.jsonl"
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by a killed run
            if "loss" in record:
                train[record["step"]] = record
            elif "val_loss" in record:
                val[record["step"]] = record
    return [train[s] for s in sorted(train)], [val[s] for s in sorted(val)]


def last_logged_step(steps: int, log_freq: int) -> int:
    """The last step train.py logs: step 1 and every log_freq-th step."""
    log_freq = max(log_freq, 1)
    return max(1, steps - steps % log_freq) if steps >= 1 else 0


def newest_checkpoint(dump: Path, folder: str = "checkpoint") -> int | None:
    """The step of the newest complete checkpoint (the rule of components.checkpoint.step_folders:
    DCP writes .metadata last), without importing torch."""
    steps = [int(p.name[5:]) for p in (dump / folder).glob("step-*") if p.name[5:].isdigit() and (p / ".metadata").is_file()]
    return max(steps) if steps else None


def is_complete(run: Run) -> bool:
    """Done by the sweep's record and by the metrics: both, so that neither a stale status nor
    metrics copied from elsewhere is trusted alone."""
    if read_state(run.dump).get("status") != "done":
        return False
    train, _ = read_metrics(run.dump)
    training = run.config.training
    return bool(train) and train[-1]["step"] >= last_logged_step(training.steps, run.config.metrics.log_freq)


def next_action(run: Run) -> tuple[str, str]:
    """skip (complete), resume (from a checkpoint) or start, with a few words for the log."""
    if is_complete(run):
        return "skip", "done"
    step = newest_checkpoint(run.dump, run.config.checkpoint.folder)
    if step is not None:
        return "resume", f"from checkpoint step-{step}"
    status = read_state(run.dump).get("status")
    return "start", (f"again, from scratch (was {status}, no checkpoint)" if status else "")


# --- Launching: K runs at a time, each on its own devices ----------------------------------------------


def visible_gpus() -> list[str]:
    """CUDA device ids this process may hand out (honours CUDA_VISIBLE_DEVICES); [] without CUDA."""
    import torch  # only here: the rest of the sweep does not need it

    count = torch.cuda.device_count()
    if count == 0:
        return []
    given = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return given[:count] if given else [str(i) for i in range(count)]


def cpu_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def slot_environments(parallel: int, nproc: int, gpus: list[str], cores: int) -> list[dict[str, str]]:
    """The extra environment of each of the `parallel` concurrent slots: on CUDA a disjoint set of
    nproc devices each; on CPU every slot shares the cores evenly between its processes."""
    if parallel < 1:
        raise SweepError(f"--parallel must be at least 1, got {parallel}")
    if gpus:
        need = parallel * nproc
        if need > len(gpus):
            raise SweepError(
                f"--parallel {parallel} x nproc_per_run {nproc} needs {need} GPUs, but {len(gpus)} are visible "
                f"({','.join(gpus)}): lower --parallel"
            )
        return [{"NGPU": str(nproc), "CUDA_VISIBLE_DEVICES": ",".join(gpus[i * nproc:(i + 1) * nproc])} for i in range(parallel)]
    threads = max(1, cores // (parallel * nproc))
    return [{"NGPU": str(nproc), "OMP_NUM_THREADS": str(threads)} for _ in range(parallel)]


def shell_line(run: Run, env: dict[str, str]) -> str:
    """The command as one line to paste in a shell."""
    assignments = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
    return f"cd {shlex.quote(str(REPO_ROOT))} && {assignments} {shlex.join(run.command)}"


def say(message: str) -> None:
    print(message, flush=True)  # flushed: a sweep's output is often a pipe or a log file


def _now() -> str:
    return datetime.now().astimezone().isoformat(timespec="seconds")


def _trainer_lines(stderr: str) -> list[str]:
    """A failed run's stderr up to torchrun's own report of the failure (its traceback and summary)."""
    lines = stderr.splitlines()
    end = next((i for i, l in enumerate(lines) if "ChildFailedError" in l or "elastic/multiprocessing" in l), len(lines))
    return lines[:end]


def error_summary(stderr: str) -> str:
    """The line of a failed run's stderr that says what went wrong: train.py's `error: ...`, or the
    last line of a Python traceback, before torchrun's report; else that report's exit code line."""
    lines = [l.strip() for l in stderr.splitlines() if l.strip()]
    end = len([l for l in _trainer_lines(stderr) if l.strip()])
    pattern = re.compile(r"^(\[rank\d+\]:?\s*)?(\d\d:\d\d:\d\d\s+)?((config )?error: |[\w.]*(Error|Exception): |KeyboardInterrupt)")
    for line in reversed(lines[:end]):
        if pattern.match(line):
            return line
    exit_lines = [l for l in lines if "exitcode" in l or "Signal" in l]
    return exit_lines[-1] if exit_lines else (lines[-1] if lines else "")


@dataclass
class Active:
    run: Run
    proc: subprocess.Popen
    start: float
    stderr_offset: int
    logs: list


def _launch(run: Run, slot_env: dict[str, str], action: str, commit: str) -> Active:
    run.dump.mkdir(parents=True, exist_ok=True)
    state = read_state(run.dump)
    if action == "start" and (run.dump / "metrics.jsonl").is_file():
        # No checkpoint to resume from: train.py starts at step 1, so the old records go aside.
        os.replace(run.dump / "metrics.jsonl", run.dump / "metrics.previous.jsonl")
    line = shell_line(run, slot_env)
    (run.dump / "command.txt").write_text(line + "\n")
    start_time = _now()
    state.update(
        name=run.name, overrides=run.overrides, all_overrides=run.all_overrides, base_config=str(run.config.job.config_file),
        command=run.command, command_line=line, env=slot_env, nproc=int(slot_env["NGPU"]), git_commit=commit,
        status="running", action=action, exit_code=None, error=None, stderr_tail=None, start_time=start_time, end_time=None,
        wall_time_s=None, host=socket.gethostname(), pid=None,
    )
    state.setdefault("attempts", [])
    write_state(run.dump, state)
    stdout = open(run.dump / "stdout.log", "a")
    stderr = open(run.dump / "stderr.log", "a")
    for log in (stdout, stderr):
        log.write(f"=== {start_time} {action}: {line}\n")
        log.flush()
    env = dict(os.environ, **slot_env)
    # run_train.sh calls torchrun and python from PATH: make them this interpreter's.
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    proc = subprocess.Popen(run.command, cwd=REPO_ROOT, env=env, stdout=stdout, stderr=stderr, stdin=subprocess.DEVNULL,
                            start_new_session=True)  # its own process group: we can stop torchrun and its workers
    write_state(run.dump, state | {"pid": proc.pid})
    return Active(run, proc, time.time(), stderr.tell(), [stdout, stderr])


def _finish(active: Active, exit_code: int, status: str | None = None) -> dict:
    for log in active.logs:
        log.close()
    run, end = active.run, time.time()
    state = read_state(run.dump)
    state["exit_code"] = exit_code
    state["status"] = status or ("done" if exit_code == 0 else "failed")
    state["end_time"] = _now()
    state["wall_time_s"] = round(end - active.start, 2)
    state["attempts"] = state.get("attempts", []) + [
        {"start_time": state["start_time"], "end_time": state["end_time"], "action": state.get("action"),
         "exit_code": exit_code, "wall_time_s": state["wall_time_s"]}
    ]
    if state["status"] != "done":
        with open(run.dump / "stderr.log", errors="replace") as f:
            f.seek(active.stderr_offset)
            tail = f.read()
        state["stderr_tail"] = "\n".join(_trainer_lines(tail)[-STDERR_TAIL:])
        state["error"] = error_summary(tail) if state["status"] == "failed" else "interrupted by the sweep"
    write_state(run.dump, state)
    return state


def still_running(run: Run) -> int | None:
    """The pid of this run's launch by an earlier sweep that is still alive on this host (that sweep
    was killed without a chance to stop it), else None."""
    state = read_state(run.dump)
    pid = state.get("pid")
    if state.get("status") != "running" or not pid or state.get("host") != socket.gethostname():
        return None
    try:
        os.killpg(pid, 0)  # the run's process group: run_train.sh/torchrun and its workers
    except (ProcessLookupError, PermissionError):
        return None
    return pid


def _stop(active: Active) -> None:
    """SIGTERM to the run's process group (torchrun forwards it to its workers), SIGKILL if it lingers."""
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(active.proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            active.proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def execute(sweep: Sweep, parallel: int, slots: list[dict[str, str]], log=say) -> int:
    """Run every incomplete run, `parallel` at a time; return the number of runs that failed."""
    alive = [f"{run.name} (process group {pid})" for run in sweep.runs if (pid := still_running(run))]
    if alive:
        raise SweepError(f"runs of an earlier sweep are still running: {', '.join(alive)}; wait for them or stop them "
                         "(kill -- -PID), then run the sweep again")
    commit = git_commit()
    queue = []
    for run in sweep.runs:
        action, why = next_action(run)
        if action == "skip":
            log(f"skip    {run.name} ({why})")
        else:
            queue.append((run, action, why))
    active: dict[int, Active] = {}
    failed = 0
    total = len(queue)
    try:
        while queue or active:
            for slot in range(parallel):
                if slot not in active and queue:
                    run, action, why = queue.pop(0)
                    active[slot] = _launch(run, slots[slot], action, commit)
                    where = slots[slot].get("CUDA_VISIBLE_DEVICES")
                    log(f"{action:<7} {run.name} {why}".rstrip() + (f" [GPUs {where}]" if where else "")
                        + f"  ({total - len(queue)}/{total})")
            time.sleep(0.2)
            for slot, act in list(active.items()):
                code = act.proc.poll()
                if code is None:
                    continue
                del active[slot]
                state = _finish(act, code)
                if state["status"] == "done":
                    train, _ = read_metrics(act.run.dump)
                    loss = f"  loss {train[-1]['loss']:.4f} at step {train[-1]['step']}" if train else ""
                    log(f"done    {act.run.name}  {state['wall_time_s']:.0f}s{loss}")
                else:
                    failed += 1
                    log(f"FAILED  {act.run.name} (exit code {code}): {state['error']}  [{act.run.dump / 'stderr.log'}]")
    except KeyboardInterrupt:
        log(f"interrupted: stopping {len(active)} running run(s); run the same command again to resume")
        for act in active.values():
            _stop(act)
            _finish(act, act.proc.returncode if act.proc.returncode is not None else -signal.SIGTERM, status="interrupted")
        raise
    return failed


# --- Results: a table per run, a table per setting (seeds grouped), loss curves -------------------------


@dataclass
class Result:
    name: str
    overrides: dict[str, object]
    status: str
    steps: int
    tokens_per_step: int | None
    train: list[dict]
    val: list[dict]
    exit_code: int | None = None
    error: str | None = None
    wall_time_s: float | None = None
    summary: dict = field(default_factory=dict)

    def __post_init__(self):
        self.summary = summarize(self.train, self.val) | {"wall_time_s": self.wall_time_s}


def summarize(train: list[dict], val: list[dict]) -> dict:
    """final_loss: mean of the last few logged losses (at most FINAL_WINDOW, from the last 10% of the
    steps); best_loss; final_val_loss; tokens_per_second and mfu: medians over the logged steps after
    the first (which includes start-up); peak_memory_gib; last_step."""
    out = dict.fromkeys(("last_step", "final_loss", "best_loss", "final_val_loss", "tokens_per_second", "mfu", "peak_memory_gib"))
    if train:
        last = train[-1]["step"]
        tail = [r for r in train if r["step"] >= last * (1 - FINAL_FRACTION)][-FINAL_WINDOW:]
        steady = train[1:] or train
        out.update(
            last_step=last,
            final_loss=statistics.fmean(r["loss"] for r in tail),
            best_loss=min(r["loss"] for r in train),
            tokens_per_second=statistics.median(r["tokens_per_second"] for r in steady),
            mfu=statistics.median(r["mfu"] for r in steady),
            peak_memory_gib=max(r["memory_gib"] for r in train),
        )
    if val:
        out["final_val_loss"] = val[-1]["val_loss"]
    return out


def flat_config(config: Config | dict) -> dict[str, object]:
    return _flatten(dataclasses.asdict(config) if isinstance(config, Config) else config)


def tokens_per_step(cfg: dict[str, object], world_size: int) -> int:
    """Tokens of one optimizer step: global batch x seq_len, the global batch as train.py derives it."""
    global_batch = int(cfg.get("training.global_batch_size", -1))
    if global_batch == -1:
        replicate = int(cfg.get("parallelism.data_parallel_replicate_degree", 1))
        shard = int(cfg.get("parallelism.data_parallel_shard_degree", -1))
        if shard == -1:
            others = 1
            for key in ("tensor_parallel_degree", "pipeline_parallel_degree", "context_parallel_degree"):
                others *= int(cfg.get(f"parallelism.{key}", 1))
            dp = max(world_size // others, 1)
        else:
            dp = replicate * shard
        global_batch = int(cfg.get("training.local_batch_size", 8)) * dp
    return global_batch * int(cfg.get("training.seq_len", 2048))


def sweep_results(sweep: Sweep) -> list[Result]:
    results = []
    for run in sweep.runs:
        state = read_state(run.dump)
        train, val = read_metrics(run.dump)
        attempts = state.get("attempts", [])
        wall = sum(a.get("wall_time_s") or 0 for a in attempts) if attempts else None
        results.append(Result(
            run.name, run.overrides, state.get("status", "not run"), run.config.training.steps,
            tokens_per_step(flat_config(run.config), sweep.nproc_per_run), train, val,
            state.get("exit_code"), state.get("error"), wall,
        ))
    return results


def _world_size_of(dump: Path, state: dict, checkpoint_folder: str) -> int:
    """Processes of a finished run: from sweep_run.json, else from the ranks of its newest checkpoint
    (DCP writes __<rank>_<n>.distcp), else 1."""
    if state.get("nproc"):
        return int(state["nproc"])
    step = newest_checkpoint(dump, checkpoint_folder)
    if step is not None:
        ranks = {p.name.split("_")[2] for p in (dump / checkpoint_folder / f"step-{step}").glob("__*_*.distcp")}
        if ranks:
            return len(ranks)
    return 1


def dump_results(dumps: list[Path]) -> list[Result]:
    """Results of any finished (or unfinished) run folders, for `compare`. A run's overrides are the
    keys of its config.toml that differ between the folders (leaving out job.*, metrics.* and other
    keys that do not change what is computed)."""
    configs = {}
    for dump in dumps:
        path = dump / "config.toml"
        if not path.is_file():
            raise SweepError(f"{dump} has no config.toml: not a run's dump folder")
        try:
            configs[dump] = flat_config(tomllib.loads(path.read_text()))
        except tomllib.TOMLDecodeError as e:
            raise SweepError(f"cannot parse {path}: {e}") from None
    keys = list(dict.fromkeys(k for cfg in configs.values() for k in cfg))
    differing = [k for k in keys if not k.startswith(NOT_A_SETTING) and len({json.dumps(cfg.get(k)) for cfg in configs.values()}) > 1]
    names = [d.name for d in dumps]
    results = []
    for dump, cfg in configs.items():
        name = dump.name if names.count(dump.name) == 1 else f"{dump.parent.name}/{dump.name}"
        state = read_state(dump)
        train, val = read_metrics(dump)
        steps = int(cfg.get("training.steps", 0))
        status = state.get("status") or (
            "done" if train and train[-1]["step"] >= last_logged_step(steps, int(cfg.get("metrics.log_freq", 10))) else "incomplete"
        )
        attempts = state.get("attempts", [])
        results.append(Result(
            name, {k: cfg.get(k) for k in differing}, status, steps, tokens_per_step(cfg, _world_size_of(dump, state, str(cfg.get("checkpoint.folder", "checkpoint")))), train, val,
            state.get("exit_code"), state.get("error"), sum(a.get("wall_time_s") or 0 for a in attempts) if attempts else None,
        ))
    return results


def short_label(overrides: dict[str, object]) -> str:
    """`lr=0.001, seed=1` for a legend or a table."""
    if not overrides:
        return "base"
    keys = list(overrides)
    parts = [k.rsplit(".", 1)[-1] for k in keys]
    return ", ".join(f"{p if parts.count(p) == 1 else k}={_name_value(overrides[k]) if overrides[k] is not None else 'unset'}"
                     for k, p in zip(keys, parts))


@dataclass
class Group:
    """Runs that differ only in training.seed."""
    label: str
    results: list[Result]

    def curve(self, which: str = "train") -> tuple[list[int], list[float], list[float], list[float]]:
        """Steps logged by every member, and the mean, min and max of the loss at each."""
        members = [{r["step"]: r["loss"] for r in res.train} for res in self.results if res.train]
        if not members:
            return [], [], [], []
        steps = sorted(set.intersection(*(set(m) for m in members))) or sorted(members[0])
        values = [[m[s] for m in members if s in m] for s in steps]
        return steps, [statistics.fmean(v) for v in values], [min(v) for v in values], [max(v) for v in values]

    def stat(self, key: str) -> list[float]:
        return [r.summary[key] for r in self.results if r.summary.get(key) is not None]


def group_by_setting(results: list[Result]) -> list[Group]:
    groups: dict[str, Group] = {}
    for res in results:
        setting = {k: v for k, v in res.overrides.items() if k != SEED_KEY}
        signature = json.dumps(setting, sort_keys=True, default=str)
        groups.setdefault(signature, Group(short_label(setting), []))
        groups[signature].results.append(res)
    return list(groups.values())


def _fmt(value, digits: int = 4) -> str:
    if value is None:
        return ""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return f"{value:.{digits}f}"


def _fmt_time(seconds: float | None) -> str:
    if seconds is None:
        return ""
    seconds = round(seconds)
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


def _overrides_text(overrides: dict[str, object], sep: str = " ") -> str:
    return sep.join(f"{k}={_name_value(v) if v is not None else 'unset'}" for k, v in overrides.items())


CSV_COLUMNS = ("run", "overrides", "status", "exit_code", "last_step", "steps", "final_loss", "best_loss", "final_val_loss",
               "tokens_per_second", "mfu", "peak_memory_gib", "wall_time_s", "error")


def write_csv(results: list[Result], path: Path) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(CSV_COLUMNS)
        for r in results:
            s = r.summary
            writer.writerow([r.name, _overrides_text(r.overrides, "; "), r.status, "" if r.exit_code is None else r.exit_code,
                             s["last_step"] or "", r.steps, *("" if s[k] is None else s[k] for k in CSV_COLUMNS[6:13]),
                             r.error or ""])


def markdown(results: list[Result], title: str, preamble: list[str] = (), plot: str | None = None) -> str:
    lines = [f"# {title}", "", *preamble]
    lines += [
        "| run | overrides | status | steps | final loss | best loss | final val loss | tokens/s | MFU % | peak memory GiB | wall time |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        s = r.summary
        tps = f"{s['tokens_per_second']:,.0f}" if s["tokens_per_second"] is not None else ""
        lines.append(
            f"| {r.name} | {_overrides_text(r.overrides)} | {r.status} | {s['last_step'] or 0}/{r.steps} | {_fmt(s['final_loss'])} | "
            f"{_fmt(s['best_loss'])} | {_fmt(s['final_val_loss'])} | {tps} | {_fmt(s['mfu'], 2)} | "
            f"{_fmt(s['peak_memory_gib'], 2)} | {_fmt_time(s.get('wall_time_s'))} |"
        )
    lines += ["", f"final loss: mean of the last {FINAL_WINDOW} logged training losses (within the last "
                  f"{FINAL_FRACTION:.0%} of the steps); tokens/s and MFU: medians over the logged steps after the first "
                  "(per device); wall time: all attempts."]
    groups = group_by_setting(results)
    if any(len(g.results) > 1 for g in groups):
        lines += [
            "", "## By setting (seeds grouped)", "",
            "| setting | runs | final loss mean ± std | final loss min – max | best loss mean | final val loss mean | tokens/s mean |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
        for g in groups:
            final, best, val, tps = g.stat("final_loss"), g.stat("best_loss"), g.stat("final_val_loss"), g.stat("tokens_per_second")
            std = statistics.stdev(final) if len(final) > 1 else 0.0
            lines.append(
                f"| {g.label} | {len(g.results)} | {_fmt(statistics.fmean(final)) + ' ± ' + _fmt(std) if final else ''} | "
                f"{_fmt(min(final)) + ' – ' + _fmt(max(final)) if final else ''} | {_fmt(statistics.fmean(best)) if best else ''} | "
                f"{_fmt(statistics.fmean(val)) if val else ''} | {f'{statistics.fmean(tps):,.0f}' if tps else ''} |"
            )
    failures = [r for r in results if r.status == "failed"]
    if failures:
        lines += ["", "## Failed runs", ""]
        lines += [f"- {r.name} (exit code {r.exit_code}): `{(r.error or '').replace('`', chr(39))}` — see {r.name}/stderr.log"
                  for r in failures]
    if plot:
        lines += ["", f"![loss curves]({plot})"]
    return "\n".join(lines) + "\n"


def plot_curves(results: list[Result], path: Path, title: str) -> bool:
    """Train loss against steps and against tokens, one line per setting; a setting with several seeds
    is drawn as their mean with a min-max band. False (and nothing written) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import EngFormatter
    except ImportError:
        return False
    fig, (by_step, by_tokens) = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    drawn = 0
    for i, group in enumerate(group_by_setting(results)):
        steps, mean, low, high = group.curve()
        if not steps:
            continue
        color = colors[i % len(colors)]
        n = sum(1 for r in group.results if r.train)
        label = group.label + (f" ({n} seeds)" if n > 1 else "")
        per_step = next(r.tokens_per_step for r in group.results if r.train)
        for ax, xs in ((by_step, steps), (by_tokens, [s * per_step for s in steps] if per_step else None)):
            if xs is None:
                continue
            ax.plot(xs, mean, color=color, label=label, linewidth=1.5)
            if n > 1:
                ax.fill_between(xs, low, high, color=color, alpha=0.2, linewidth=0)
        drawn += 1
    if not drawn:
        plt.close(fig)
        return False
    by_step.set_xlabel("step")
    by_step.set_ylabel("train loss")
    by_tokens.set_xlabel("tokens (step × global batch × seq_len)")
    by_tokens.xaxis.set_major_formatter(EngFormatter())
    for ax in (by_step, by_tokens):
        ax.grid(alpha=0.3)
    by_step.legend(fontsize="small")
    fig.suptitle(title + " — mean over seeds, band: min–max")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


PLOTS_NOTE = "note: matplotlib is not installed, so there is no loss_curves.png: pip install 'ingot[plots]' for the plot"


def write_report(results: list[Result], output: Path, title: str, preamble: list[str] = (), echo: bool = False, log=say) -> str:
    """results.csv, results.md and (with matplotlib) loss_curves.png in `output`; returns the markdown
    (and prints it first with echo)."""
    output.mkdir(parents=True, exist_ok=True)
    write_csv(results, output / "results.csv")
    plotted = plot_curves(results, output / "loss_curves.png", title)
    if not plotted:
        (output / "loss_curves.png").unlink(missing_ok=True)  # never leave a stale plot beside a new table
    text = markdown(results, title, preamble, "loss_curves.png" if plotted else None)
    (output / "results.md").write_text(text)
    if echo:
        log(text.rstrip("\n"))
    files = ["results.md", "results.csv"] + (["loss_curves.png"] if plotted else [])
    log(f"report: {', '.join(str(output / f) for f in files)}")
    if not plotted and any(r.train for r in results):
        log(PLOTS_NOTE)
    return text


# --- The command line ----------------------------------------------------------------------------------


def _print_plan(sweep: Sweep, slots: list[dict[str, str]], parallel: int) -> None:
    print(f"sweep {sweep.path}: {len(sweep.runs)} run(s), {parallel} at a time, under {sweep.output}")
    print(f"base config {sweep.base_config}; common overrides: {_overrides_text(sweep.overrides) or 'none'}")
    rows = [("run", "overrides", "state")]
    for run in sweep.runs:
        action, why = next_action(run)
        rows.append((run.name, _overrides_text(run.overrides) or "-", {"skip": "done (skip)", "resume": f"resume {why}"}.get(action, "new" if not why else why)))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    for row in rows:
        print("  " + "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
    print("commands (the first slot's environment):")
    for run in sweep.runs:
        print(f"  {run.name}: {shell_line(run, slots[0])}")


def _lock(output: Path):
    import fcntl

    handle = open(output / ".sweep.lock", "w")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        raise SweepError(f"another sweep is running in {output}") from None
    return handle


def run_sweep(args) -> int:
    sweep = plan(args.sweep, args.output)
    gpus = visible_gpus()
    slots = slot_environments(args.parallel, sweep.nproc_per_run, gpus, cpu_cores())
    if args.dry_run:
        _print_plan(sweep, slots, args.parallel)
        return 0
    sweep.output.mkdir(parents=True, exist_ok=True)
    lock = _lock(sweep.output)
    (sweep.output / "sweep.toml").write_text(sweep.path.read_text())
    device = f"GPUs {','.join(gpus)}" if gpus else f"CPU, OMP_NUM_THREADS={slots[0]['OMP_NUM_THREADS']} per process"
    say(f"sweep {sweep.path.name}: {len(sweep.runs)} run(s), {args.parallel} at a time, NGPU={sweep.nproc_per_run} each "
        f"({device}) -> {sweep.output}")
    # SIGTERM and SIGHUP (a closed terminal) stop the runs as Ctrl-C does; the runs are in sessions of
    # their own, so nothing else would stop them.
    previous = {sig: signal.signal(sig, signal.default_int_handler) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        failed = execute(sweep, args.parallel, slots)
    except KeyboardInterrupt:
        failed = None
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    results = sweep_results(sweep)
    preamble = [f"Sweep `{sweep.path}`: base config `{os.path.relpath(sweep.base_config, REPO_ROOT)}`, common overrides "
                f"`{_overrides_text(sweep.overrides) or 'none'}`, {sweep.nproc_per_run} process(es) per run.", ""]
    write_report(results, sweep.output, f"Sweep {sweep.path.stem}", preamble, echo=True)
    lock.close()
    if failed is None:
        return 130
    not_done = [r.name for r in results if r.status != "done"]
    if failed or not_done:
        print(f"{len(not_done)} of {len(results)} run(s) not done: {', '.join(not_done)}", file=sys.stderr)
        return 1
    return 0


def run_compare(args) -> int:
    dumps = []
    for given in args.dumps:
        path = Path(given)
        if not path.is_dir():
            raise SweepError(f"not a folder: {path}")
        if (path / "config.toml").is_file():
            dumps.append(path)
        else:  # a sweep's output folder: take its runs
            runs = sorted(p for p in path.iterdir() if (p / "config.toml").is_file())
            if not runs:
                raise SweepError(f"{path} holds no config.toml, nor run folders that do")
            dumps += runs
    results = dump_results(dumps)
    output = Path(args.output)
    preamble = ["Runs: " + ", ".join(f"`{d}`" for d in dumps), ""]
    write_report(results, output, "Run comparison", preamble, echo=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["compare"]:
        parser = argparse.ArgumentParser(prog="python -m components.sweep compare",
                                         description="Table and loss curves of finished runs (seeds grouped).")
        parser.add_argument("dumps", nargs="+", metavar="DUMP", help="a run's dump folder (config.toml, metrics.jsonl), or a sweep's output folder")
        parser.add_argument("--output", default="compare_report", help="where results.csv, results.md, loss_curves.png go (default: %(default)s)")
        command, args = run_compare, parser.parse_args(argv[1:])
    else:
        parser = argparse.ArgumentParser(
            prog="python -m components.sweep",
            description="Run a sweep of training runs (a grid and/or a list of override sets); "
                        "`python -m components.sweep compare DUMP ...` compares finished runs.",
        )
        parser.add_argument("sweep", metavar="SWEEP.toml", help="the sweep file (see train_configs/sweeps/)")
        parser.add_argument("--output", help="the sweep's folder, one subfolder per run (default: outputs/sweeps/<sweep file name>)")
        parser.add_argument("--parallel", type=int, default=1, metavar="K", help="runs at a time (default: 1)")
        parser.add_argument("--dry-run", action="store_true", help="print the runs and their commands, launch nothing")
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
        return 2


if __name__ == "__main__":
    sys.exit(main())
