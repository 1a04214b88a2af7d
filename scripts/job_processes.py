"""A training job's processes as /proc shows them, for the fault soak (scripts/soak.py) and tests/fault_injection.py:
one launch of the job, its ranks and their data loaders' workers, its whole process tree. No torch imported."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TRAINER = REPO / "tests" / "fault_injection.py"
"""train.py with a fault armed by the environment (INGOT_FAULT), else train.py itself."""
LAUNCHER = {"PET_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "300",
            "OMP_NUM_THREADS": "1"}
"""What run_train.sh sets for the launcher."""
STEP_LINE = re.compile(r"\] \S+ step +(\d+) +loss")


class Launch:
    """One launch of the job (components/run/launch.py, as run_train.sh starts it), its output read as it comes."""

    def __init__(self, nproc: int, args: list[str], log: Path, env: dict[str, str]):
        self.log, self.lines, self.start = log, [], time.perf_counter()
        command = [sys.executable, "-m", "components.run.launch", "--standalone", "--nproc_per_node", str(nproc),
                   str(TRAINER), *args]
        self.proc = subprocess.Popen(command, cwd=REPO, env=dict(os.environ, **LAUNCHER, **env), text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        with open(self.log, "w", buffering=1) as out:
            for line in self.proc.stdout:
                self.lines.append(line)
                out.write(line)

    def last_step(self) -> int:
        steps = [int(m[1]) for line in list(self.lines) if (m := STEP_LINE.search(line))]
        return max(steps, default=0)

    def wait_until(self, condition, timeout: float = 300) -> bool:
        """Whether `condition()` came true while the job ran."""
        end = time.perf_counter() + timeout
        while time.perf_counter() < end:
            if condition():
                return True
            if self.proc.poll() is not None:
                self.reader.join()
                return condition()
            time.sleep(0.02)
        return False

    def said(self, text: str) -> bool:
        return any(text in line for line in list(self.lines))

    def ranks(self) -> dict[int, int]:
        """{rank: pid} of the job's workers."""
        found = {}
        for pid in descendants(self.proc.pid):
            environment = read_environment(pid)
            if environment.get("RANK") is not None and parent(pid) == self.proc.pid:
                found[int(environment["RANK"])] = pid
        return found

    def loader_workers(self, rank: int) -> list[int]:
        pid = self.ranks().get(rank)
        return [child for child in descendants(pid) if parent(child) == pid and
                "fault_injection" in command_line(child)] if pid else []

    def end(self, timeout: float = 600) -> tuple[int, float]:
        try:
            status = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            for pid in [self.proc.pid, *descendants(self.proc.pid)]:
                signal_quietly(pid, signal.SIGKILL)
            status = self.proc.wait()
        self.reader.join()
        return status, time.perf_counter() - self.start


def proc_read(pid: int, name: str) -> bytes:
    try:
        return Path(f"/proc/{pid}/{name}").read_bytes()
    except OSError:
        return b""


def parent(pid: int) -> int:
    stat = proc_read(pid, "stat").decode(errors="replace")
    return int(stat.rsplit(") ", 1)[1].split()[1]) if ") " in stat else -1


def command_line(pid: int) -> str:
    return proc_read(pid, "cmdline").replace(b"\0", b" ").decode(errors="replace")


def read_environment(pid: int) -> dict[str, str]:
    pairs = (item.split(b"=", 1) for item in proc_read(pid, "environ").split(b"\0") if b"=" in item)
    return {key.decode(errors="replace"): value.decode(errors="replace") for key, value in pairs}


def descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            children.setdefault(parent(int(entry.name)), []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def signal_quietly(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
