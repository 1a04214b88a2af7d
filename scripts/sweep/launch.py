"""Running a sweep's runs, K at a time. Each run is its own process tree, launched as a person would
launch it (run_train.sh in the repository root, in a session of its own), so that a crash, an
out-of-memory or a NaN stays in that run; a run's devices come from its slot's environment."""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import IO

import torch

from components.config import REPO_ROOT, git_commit
from components.metrics.reporting import read_metrics
from scripts.sweep.plan import Run, Sweep, SweepError
from scripts.sweep.state import next_action, read_state, write_state

STDERR_TAIL = 30  # lines of a failed run's stderr (before any report of plain torchrun) kept in sweep_run.json
LOCK_FILE = ".sweep.lock"


def say(message: str) -> None:
    print(message, flush=True)  # flushed: a sweep's output is often a pipe or a log file


def visible_gpus() -> list[str]:
    """CUDA device ids this process may hand out (honours CUDA_VISIBLE_DEVICES); [] without CUDA."""
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
        return [{"NGPU": str(nproc), "CUDA_VISIBLE_DEVICES": ",".join(gpus[i * nproc:(i + 1) * nproc])}
                for i in range(parallel)]
    threads = max(1, cores // (parallel * nproc))
    return [{"NGPU": str(nproc), "OMP_NUM_THREADS": str(threads)} for _ in range(parallel)]


def shell_line(run: Run, env: dict[str, str]) -> str:
    """The command as one line to paste in a shell."""
    assignments = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
    return f"cd {shlex.quote(str(REPO_ROOT))} && {assignments} {shlex.join(run.command)}"


def lock_output(output: Path) -> IO:
    """Hold the lock that keeps a second sweep out of `output` (until the returned file is closed)."""
    import fcntl

    handle = open(output / LOCK_FILE, "w")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        raise SweepError(f"another sweep is running in {output}") from None
    return handle


@contextmanager
def stop_signals_interrupt() -> Iterator[None]:
    """SIGTERM and SIGHUP (a closed terminal) stop the runs as Ctrl-C does (KeyboardInterrupt): the
    runs are in sessions of their own, so nothing else would stop them."""
    previous = {sig: signal.signal(sig, signal.default_int_handler) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _now() -> str:
    return datetime.now().astimezone().isoformat(timespec="seconds")


def _trainer_lines(stderr: str) -> list[str]:
    """A failed run's stderr up to plain torchrun's own traceback of the failure, if any: run_train.sh's launcher
    (components/run/launch.py) prints none, but scripts.benchmark runs plain torchrun. Its warnings can come before the
    failed worker's last lines, so they are kept."""
    lines = stderr.splitlines()
    end = next((i for i, line in enumerate(lines) if "ChildFailedError" in line), len(lines))
    return lines[:end]


ERROR_LINE = re.compile(
    r"^(\[rank\d+\]:?\s*)?(\d\d:\d\d:\d\d\s+)?((config )?error: |[\w.]*(Error|Exception): |KeyboardInterrupt)"
)


def error_summary(stderr: str) -> str:
    """The line of a failed run's stderr that says what went wrong: train.py's `error: ...`, or the last line of a
    Python traceback (before plain torchrun's report; else that report's exit code line); else the last line, such
    as the launcher's `rank N was killed by SIGKILL (exit status 137)`."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    end = len([line for line in _trainer_lines(stderr) if line.strip()])
    for line in reversed(lines[:end]):
        if ERROR_LINE.match(line):
            return line
    exit_lines = [line for line in lines if "exitcode" in line or "Signal" in line]
    return exit_lines[-1] if exit_lines else (lines[-1] if lines else "")


@dataclass
class Active:
    """A launched run."""
    run: Run
    proc: subprocess.Popen
    start: float
    stderr_offset: int
    """Where this attempt's part of stderr.log begins."""
    logs: list[IO]


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
        name=run.name, overrides=run.overrides, all_overrides=run.all_overrides,
        base_config=str(run.config.job.config_file), command=run.command, command_line=line, env=slot_env,
        nproc=int(slot_env["NGPU"]), git_commit=commit, status="running", action=action, exit_code=None, error=None,
        stderr_tail=None, start_time=start_time, end_time=None, wall_time_s=None, host=socket.gethostname(), pid=None,
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
                    train, _ = read_metrics(act.run.dump / "metrics.jsonl")
                    loss = f"  loss {train[-1]['loss']:.4f} at step {train[-1]['step']}" if train else ""
                    log(f"done    {act.run.name}  {state['wall_time_s']:.0f}s{loss}")
                else:
                    failed += 1
                    log(f"FAILED  {act.run.name} (exit code {code}): {state['error']}  "
                        f"[{act.run.dump / 'stderr.log'}]")
    except KeyboardInterrupt:
        log(f"interrupted: stopping {len(active)} running run(s); run the same command again to resume")
        for act in active.values():
            _stop(act)
            code = act.proc.returncode if act.proc.returncode is not None else -signal.SIGTERM
            _finish(act, code, status="interrupted")
        raise
    return failed
