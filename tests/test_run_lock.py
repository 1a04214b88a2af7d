"""One job per dump folder, and workers that die with their launcher (components/run/lock.py)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, TINY, losses

from components.run.lock import FolderInUse, lock_dump_folder, release_dump_folders

pytestmark = pytest.mark.slow

LONG = [*TINY, "--training.steps", "400", "--metrics.log_freq", "1"]


def launch(nproc: int, args: list[str], log: Path) -> subprocess.Popen:
    """torchrun in a session of its own, as a batch system or a terminal starts it."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
               str(REPO / "train.py"), *args]
    return subprocess.Popen(command, cwd=REPO, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def wait_for_steps(dump: Path, steps: int, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (dump / "metrics.jsonl").exists() and len(losses(dump)) >= steps:
            return
        assert proc.poll() is None, f"the run ended early with status {proc.returncode}"
        time.sleep(0.2)
    raise AssertionError(f"no {steps} steps logged in {timeout} s")


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry.name))
    return found


def alive(pid: int) -> bool:
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_a_second_job_on_a_live_folder_is_refused_and_the_first_goes_on_undisturbed(tmp_path, train_in_process,
                                                                                     capsys):
    dump = tmp_path / "run"
    steps = ["--training.steps", "40"]
    first = launch(1, [*LONG, *steps, "--job.dump_folder", str(dump)], tmp_path / "first.log")
    try:
        wait_for_steps(dump, 2, first)
        config_before = (dump / "config.toml").read_bytes()
        assert train_in_process([*TINY, "--job.dump_folder", str(dump)]) == 2
        error = capsys.readouterr().err
        worker = children(first.pid)[0]
        assert f"{dump.resolve()} is in use by another job (host " in error
        assert f"pid {worker}, started " in error and "another --job.dump_folder" in error
        assert (dump / "config.toml").read_bytes() == config_before
    finally:
        assert first.wait(timeout=600) == 0, (tmp_path / "first.log").read_text()[-3000:]
    alone = launch(1, [*LONG, *steps, "--job.dump_folder", str(tmp_path / "alone")], tmp_path / "alone.log")
    assert alone.wait(timeout=600) == 0
    assert losses(dump) == losses(tmp_path / "alone")


def test_a_job_killed_with_sigkill_leaves_no_lock_behind(tmp_path, train_in_process):
    dump = tmp_path / "run"
    job = launch(1, [*LONG, "--job.dump_folder", str(dump)], tmp_path / "job.log")
    wait_for_steps(dump, 2, job)
    for worker in children(job.pid):
        os.kill(worker, signal.SIGKILL)
    job.wait(timeout=60)
    assert train_in_process([*TINY, "--training.steps", "2", "--job.dump_folder", str(dump)]) == 0


def test_killing_the_launcher_kills_its_workers_within_seconds(tmp_path):
    """kill -9 of torchrun's process group: the workers are in sessions of their own, and only the
    parent-death signal they asked for stops them."""
    dump = tmp_path / "run"
    launcher = launch(2, [*LONG, "--job.dump_folder", str(dump)], tmp_path / "job.log")
    wait_for_steps(dump, 2, launcher)
    workers = children(launcher.pid)
    assert len(workers) == 2
    os.killpg(launcher.pid, signal.SIGKILL)
    launcher.wait()
    deadline = time.monotonic() + 30
    while any(alive(w) for w in workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(alive(w) for w in workers), "workers outlived their launcher"


def test_the_lock_is_taken_once_per_process_and_released(tmp_path):
    lock_dump_folder(tmp_path)
    lock_dump_folder(tmp_path)  # again from the same process: still held, not dropped
    probe = [sys.executable, "-c", "import sys; from pathlib import Path; from components.run.lock import "
             "lock_dump_folder; lock_dump_folder(Path(sys.argv[1]))", str(tmp_path)]
    held = subprocess.run(probe, cwd=REPO, capture_output=True, text=True)
    assert held.returncode == 1 and FolderInUse.__name__ in held.stderr and f"pid {os.getpid()}" in held.stderr
    release_dump_folders()
    assert subprocess.run(probe, cwd=REPO, capture_output=True, text=True).returncode == 0


def test_a_run_refused_for_its_data_leaves_a_new_folder_absent_and_an_existing_one_as_it_was(tmp_path,
                                                                                              train_in_process):
    """The lock is taken before the data is read (a second job must stop before writing anything): a refusal after
    it takes back what the lock made, the folders above the dump folder included."""
    missing = ["--job.config_file", "train_configs/debug_model.toml", "--training.dataset_path", str(tmp_path / "no")]
    assert train_in_process([*missing, "--job.dump_folder", str(tmp_path / "new" / "run")]) == 2
    assert not (tmp_path / "new").exists()
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "notes.txt").write_text("mine")
    assert train_in_process([*missing, "--job.dump_folder", str(existing)]) == 2
    assert [p.name for p in existing.iterdir()] == ["notes.txt"]


def test_a_run_refused_at_its_first_read_for_a_bad_data_line_leaves_no_new_folder(tmp_path):
    """The data's line 51 is not JSON: the streaming loader's workers (the default config's) meet it in the first
    step, after start-up wrote config.toml, metrics.jsonl and tb/ into the new folder; the launch, as run_train.sh
    starts it, takes the folder back."""
    lines = (REPO / "tests/assets/shakespeare/train.jsonl").read_text().splitlines()
    data = tmp_path / "bad.jsonl"
    data.write_text("\n".join([*lines[:50], '{"text": "cut', *lines[50:55]]) + "\n")
    env = dict(os.environ, NGPU="1", PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    result = subprocess.run([str(REPO / "run_train.sh"), "--training.dataset_path", str(data), "--training.steps", "2",
                             "--job.dump_folder", str(tmp_path / "new" / "run")], cwd=REPO, env=env, text=True,
                            capture_output=True, timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.strip().endswith(f"error: training.dataset_path: {data}:51: invalid JSON (Invalid control "
                                          "character at)")  # the line break, read as part of the string
    assert not (tmp_path / "new").exists()
