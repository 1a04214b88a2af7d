"""Running one case: train.py in a process of its own (torchrun for several), read back from its
metrics.jsonl; and what the header says about this machine."""

from __future__ import annotations

import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from components.config import REPO_ROOT, Config, ConfigError, load_config
from components.data.batch_plan import batch_plan
from components.distributed.mesh import ParallelDims
from components.metrics.reporting import read_metrics
from models.families import model_config_class
from scripts.benchmark.cases import Case
from scripts.sweep.launch import ERROR_LINE, error_summary

# After the user's flags, so that they always hold: a metrics record every step, nothing else written.
RUN_FLAGS = ("--checkpoint.enable", "false", "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false",
             "--validation.enable", "false")
TRACED_STEPS = 2
"""With a trace: the profiler warms up for one more step and records the next; both are left out of the figures."""


@dataclass
class Result:
    case: str
    status: str = "ok"
    """ok, "failed: <the error line>" or "skipped: <why>"."""
    tokens_per_second: float | None = None
    """Per device, over the steps after the warm-up: total tokens / total time."""
    mfu: float | None = None
    """Percent; None where the peak FLOP/s of the device is unknown (CPUs, unknown GPUs)."""
    peak_memory_gib: float | None = None
    step_seconds: float | None = None
    processes: int = 1
    wall_seconds: float | None = None
    """The whole run, start-up and compilation included."""
    command: list[str] = field(default_factory=list)
    torchtitan: dict | None = None
    """With --torchtitan: the same figures of torchtitan's run, or its status."""
    trace: str | None = None
    """With --traces: the chrome trace of one step after the measured ones."""


def device_name() -> str:
    if torch.cuda.is_available():
        return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name()}"
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            model = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), model)
    except OSError:
        pass
    threads = torch.get_num_threads()
    return f"{model} ({threads} thread{'s' if threads > 1 else ''})"


def cpu_load() -> str | None:
    """On a CPU, the load average over the last minute against the cores: other processes slow CPU
    runs down, several threads per process most (they wait for each other at every operation)."""
    if torch.cuda.is_available() or not hasattr(os, "getloadavg"):
        return None
    return f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"


def git_commit() -> str:
    """The short hash of HEAD, with +dirty where the tree has changes; "unknown" outside a git checkout."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, check=True).stdout.strip()

    try:
        return git("rev-parse", "--short", "HEAD") + ("+dirty" if git("status", "--porcelain") else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def process_count(case: Case) -> int:
    if not case.all_devices:
        return 1
    return torch.cuda.device_count() if torch.cuda.is_available() else 2


def skip_reason(case: Case, config: Config) -> str | None:
    """Why `case` measures nothing on this machine, or None."""
    if config.float8.enable:
        if not torch.cuda.is_available():
            return "float8 on a CPU is torchao's emulation in high precision: its speed measures nothing"
        if torch.cuda.get_device_capability() < (8, 9):
            major, minor = torch.cuda.get_device_capability()
            return f"float8 matmuls need SM 8.9 or newer; this GPU is SM {major}.{minor}"
    if case.all_devices and process_count(case) < 2:
        return f"spreading over the local GPUs needs 2 or more; {process_count(case)} visible"
    return None


def launch_command(processes: int, script: list[str]) -> list[str]:
    """`python SCRIPT...`, or under torchrun with one process per device."""
    if processes == 1:
        return [sys.executable, *script]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(processes), *script]


def run_logged(command: list[str], log: Path, timeout: float, env: dict[str, str] | None = None) -> int | None:
    """Run `command` in the repository root with its output in `log`; its exit status, None on a timeout
    (the command and every process it started are then killed)."""
    with open(log, "w") as out:
        proc = subprocess.Popen(command, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, start_new_session=True)  # a process group of its own: torchrun's workers too
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return None


def failure(rc: int | None, log: Path, timeout: float) -> str:
    """"failed: " and the last error line of a failed run's output (train.py's `error: ...`, or a
    traceback's last line, not torchrun's report of it), cut to 200 characters."""
    if rc is None:
        return f"failed: timed out after {timeout:.0f} s"
    text = log.read_text(errors="replace")
    lines = [line.strip() for line in text.splitlines()]
    errors = [line for line in lines if ERROR_LINE.match(line) and "ChildFailedError" not in line]
    line = errors[-1] if errors else error_summary(text) or f"exit status {rc}"
    return f"failed: {line if len(line) <= 200 else line[:199] + '…'}"


def harmonic_mean(values: list[float]) -> float:
    """Of per-step rates over steps of equal size: total size / total time."""
    return statistics.harmonic_mean(values)


def train_argv(case: Case, extra: list[str], steps: int, dump: Path) -> list[str]:
    """train.py's arguments for `case`: its flags, then the extra ones, then the benchmark's."""
    return [*case.flags, *extra, "--training.steps", str(steps), *RUN_FLAGS, "--job.dump_folder", str(dump)]


def profiling_flags(last_step: int) -> list[str]:
    """torch.profiler on for the last TRACED_STEPS steps of a run of `last_step` steps."""
    return ["--profiling.enable_profiling", "true", "--profiling.profile_freq", str(last_step),
            "--profiling.profiler_warmup", str(TRACED_STEPS - 1), "--profiling.profiler_active", "1"]


def run_case(case: Case, extra: list[str], steps: int, warmup: int, timeout: float, dump: Path,
             trace: Path | None = None) -> Result:
    """Train `case` for `steps` steps in a fresh process and summarize the steps after the first `warmup`;
    with `trace`, TRACED_STEPS more steps under the profiler, whose chrome trace (rank 0's) is copied to `trace`."""
    processes = process_count(case)
    last_step = steps + (TRACED_STEPS if trace is not None else 0)
    argv = train_argv(case, [*extra, *(profiling_flags(last_step) if trace is not None else [])], last_step, dump)
    result = Result(case.name, processes=processes, command=launch_command(processes, ["train.py", *argv]))
    try:
        config = load_config(argv, model_config_class)
        plan = batch_plan(config.training, ParallelDims.from_config(config.parallelism, processes).dp)
    except ConfigError as e:
        result.status = f"failed: config error: {e}"
        return result
    if reason := skip_reason(case, config):
        result.status = f"skipped: {reason}"
        return result
    dump.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    rc = run_logged(result.command, dump / "run.log", timeout)
    result.wall_seconds = time.perf_counter() - start
    records, _ = read_metrics(dump / "metrics.jsonl")
    kept = [r for r in records if warmup < r["step"] <= steps]
    written = dump / config.profiling.save_traces_folder / f"step-{last_step}" / "rank0_trace.json"
    if trace is not None and written.exists():
        shutil.copyfile(written, trace)
        result.trace = str(trace)
    if rc != 0:
        result.status = failure(rc, dump / "run.log", timeout)
    elif not kept:
        result.status = f"failed: no step logged after the first {warmup} (warm-up)"
    else:
        result.tokens_per_second = harmonic_mean([r["tokens_per_second"] for r in kept])
        if all(r["mfu"] is not None for r in kept):
            result.mfu = harmonic_mean([r["mfu"] for r in kept])
        result.peak_memory_gib = max(r["memory_gib"] for r in records)
        result.step_seconds = plan.tokens_per_step / (result.tokens_per_second * processes)
    return result
