"""A scheduler's stop signal (SIGTERM, SIGUSR1) at any moment from the launch on: never a worker killed by the
signal's default action. Before the first step the job exits 75 with the dump folder as it was; from the first step
on it saves a checkpoint and exits 75 (tests/test_reliability.py covers the later steps and the exact resume)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, TINY, losses
from fault_injection import kill_tree

RUN = [*TINY, "--training.steps", "6", "--metrics.log_freq", "1", "--checkpoint.enable", "true"]
ENV = dict(os.environ, OMP_NUM_THREADS="1", PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           # As run_train.sh sets them: on a loaded machine, workers stopped while importing take more than 30 s.
           PET_SIGNALS_TO_HANDLE="SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1", TORCH_ELASTIC_SHUTDOWN_TIMEOUT="300")


def launch(nproc: int, dump: Path, stop_signal: str) -> subprocess.CompletedProcess:
    """tests/fault_injection.py under the launcher (what run_train.sh starts), rank 0 sending the stop signal that
    INGOT_STOP_SIGNAL names (<signal>:<point>:<target>) at that point of its start-up."""
    command = [sys.executable, "-m", "components.run.launch", "--standalone", "--nproc_per_node", str(nproc),
               "tests/fault_injection.py", *RUN, "--job.dump_folder", str(dump)]
    proc = subprocess.Popen(command, cwd=REPO, env=ENV | {"INGOT_STOP_SIGNAL": stop_signal}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        return subprocess.CompletedProcess(command, proc.wait(timeout=300), proc.communicate()[0], "")
    finally:
        kill_tree(proc.pid)


def snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    """Every file under `folder` with its size and modification time, but the lock file (each job writes its own
    details into it: components/run/lock.py)."""
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != ".lock"}


def assert_stopped_before_the_first_step(result: subprocess.CompletedProcess, name: str) -> None:
    assert result.returncode == 75, result.stdout[-3000:]
    assert f"{name} during start-up: stopping before the first step, nothing trained" in result.stdout
    assert "killed by" not in result.stdout and "Traceback" not in result.stdout, result.stdout[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("stop_signal, nproc", [("SIGTERM:imports:every", 2), ("SIGUSR1:process-group:launcher", 1)])
def test_a_stop_signal_during_start_up_exits_75_and_leaves_no_folder_behind(stop_signal, nproc, tmp_path):
    dump = tmp_path / "outputs" / "run"
    result = launch(nproc, dump, stop_signal)
    assert_stopped_before_the_first_step(result, stop_signal.split(":")[0])
    assert not (tmp_path / "outputs").exists()  # the folders the run created, its lock file in them, are gone


@pytest.mark.slow
def test_a_stop_signal_in_the_first_step_saves_it_and_one_while_loading_that_checkpoint_leaves_it_as_it_was(tmp_path):
    first = launch(1, tmp_path, "SIGTERM:first-step:launcher")
    assert first.returncode == 75, first.stdout[-3000:]
    record = json.loads((tmp_path / "preempted.json").read_text())
    assert record["signal"] == "SIGTERM" and record["step"] >= 1
    assert (tmp_path / "checkpoint" / f"step-{record['step']}" / "integrity.json").is_file()
    before = snapshot(tmp_path)

    resumed = launch(1, tmp_path, "SIGUSR1:checkpoint:every")
    assert_stopped_before_the_first_step(resumed, "SIGUSR1")
    assert snapshot(tmp_path) == before  # preempted.json included: it still names the newest checkpoint
    assert sorted(losses(tmp_path)) == list(range(1, record["step"] + 1))


def stop_signals_blocked(pid: int) -> bool:
    """Whether the main thread of `pid` blocks SIGTERM and SIGUSR1 (/proc's SigBlk mask)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    mask = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigBlk:")), 16)
    return all(mask >> (signum - 1) & 1 for signum in (signal.SIGTERM, signal.SIGUSR1))


@pytest.mark.slow
def test_a_stop_signal_to_the_launcher_before_it_started_torchrun_stops_the_job_with_75(tmp_path):
    dump = tmp_path / "run"
    proc = subprocess.Popen(["./run_train.sh", *RUN, "--job.dump_folder", str(dump)], cwd=REPO, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not stop_signals_blocked(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.005)
        os.kill(proc.pid, signal.SIGTERM)  # while the launcher imports torch
        assert proc.wait(timeout=300) == 75, proc.communicate()[0][-3000:]
        assert_stopped_before_the_first_step(subprocess.CompletedProcess([], 75, proc.communicate()[0]), "SIGTERM")
    finally:
        kill_tree(proc.pid)
    assert not dump.exists()
