"""run_train.sh (components/run/launch.py: torchrun, then the workers' status) exits with what its workers exited
with, and shows a failure once: a config error's line, a step-guard stop, a preemption, a crash's traceback."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, TINY

from components.run.launch import worst_status

RUN = [*TINY, "--metrics.log_freq", "1", "--training.dataloader_workers", "0"]


def start(command: list[str], nproc: int, dump: Path, **env: str) -> subprocess.Popen:
    """`command` in the repository root with this interpreter first on PATH (run_train.sh calls `python`), stdout
    and stderr together."""
    env = dict(os.environ, OMP_NUM_THREADS="1", NGPU=str(nproc),
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}", **env)
    return subprocess.Popen([*command, "--job.dump_folder", str(dump)], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)


def run_train(nproc: int, args: list[str], dump: Path) -> tuple[int, str]:
    proc = start([str(REPO / "run_train.sh"), *args], nproc, dump)
    out, _ = proc.communicate(timeout=300)
    return proc.returncode, out


def test_the_worst_status_is_a_crash_then_the_step_guard_then_bad_input_then_a_hang_then_a_preemption():
    assert worst_status([0, 75, 2, 3, 1]) == 1
    assert worst_status([0, 75, 2, 3]) == 3
    assert worst_status([75, 2, 0, 4]) == 2
    assert worst_status([75, 4, 0]) == 4
    assert worst_status([0, 75]) == 75 and worst_status([0, 0]) == 0 and worst_status([]) == 0
    assert worst_status([1, 128 + signal.SIGKILL, 75]) == 137  # of crashes, a signal's says more than 1
    assert worst_status([75, 143]) == 143


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_a_config_error_exits_2_with_its_line_once_and_the_launcher_prints_and_leaves_nothing_of_its_own(
        nproc, tmp_path):
    """As a user launches: OMP_NUM_THREADS unset (torchrun would print four lines on setting it for 2 workers), and
    no torchelastic_* folder left in TMPDIR (torchrun's log folder, holding the workers' error files)."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"} | {
        "NGPU": str(nproc), "TMPDIR": str(scratch), "PATH": path}
    command = [str(REPO / "run_train.sh"), "--training.stepz", "3", "--job.dump_folder", str(tmp_path / "o")]
    proc = subprocess.run(command, cwd=REPO, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          timeout=300)
    assert proc.returncode == 2, proc.stdout
    assert proc.stdout == "config error: unknown config key 'training.stepz' (did you mean training.steps?)\n"
    assert not list(scratch.glob("torchelastic_*"))


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_a_non_finite_loss_exits_3_with_its_line_once(nproc, tmp_path):
    """An lr of 1e30 makes the loss of step 2 non-finite, on every rank alike."""
    status, out = run_train(nproc, [*RUN, "--training.steps", "6", "--optimizer.lr", "1e30"], tmp_path)
    assert status == 3, out
    assert out.count("training stopped: non-finite loss or gradient norm at step ") == 1, out
    assert "Traceback" not in out and "ChildFailedError" not in out


def test_a_worker_s_report_is_in_its_error_file_whole_or_not_at_all(tmp_path, monkeypatch):
    """torchrun parses the error file of every worker that failed and fails itself on a partial one: in CI rank 0,
    reporting the collective that rank 1's crash broke, got torchrun's SIGTERM mid-write and the launcher died of
    a JSONDecodeError instead of restarting the job. A write cut short now leaves no file; a whole one parses."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from components.run.launch import report_failure, run_worker

    error_file = tmp_path / "error.json"
    monkeypatch.setenv("INGOT_LAUNCHER", "1")
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))

    class Killed(BaseException):
        """What a signal's default action does to a process, as far as its files are concerned."""

    write_text = Path.write_text

    def killed_mid_write(path, text):
        write_text(path, text[:10])
        raise Killed

    with monkeypatch.context() as patched, pytest.raises(Killed):
        patched.setattr(Path, "write_text", killed_mid_write)
        report_failure("error: a one-line report")
    def torchrun_reads(exitcode):  # what torchrun does with the error file of a worker that failed
        return ProcessFailure(local_rank=0, pid=1, exitcode=exitcode, error_file=str(error_file)).message

    assert not error_file.exists() and torchrun_reads(-15) == "Signal 15 (SIGTERM) received by PID 1"
    report_failure("error: a one-line report")
    assert torchrun_reads(2) == "error: a one-line report"

    def crash():
        raise RuntimeError("fault injected")

    assert run_worker(crash) == 1
    crashed = torchrun_reads(1)
    assert crashed["message"] == "RuntimeError: fault injected"
    assert 'raise RuntimeError("fault injected")' in crashed["extraInfo"]["py_callstack"]
    assert [f.name for f in tmp_path.iterdir()] == ["error.json"]


def test_a_process_exits_with_its_status_after_its_logs_and_streams_are_flushed():
    """exit_process, the trainer's and the launcher's last call, skips the interpreter's teardown (where a gloo
    thread freeing a collective's tensors aborted a run with status 134: 1 exit in 7-20 of a refused start-up on a
    loaded machine) but loses none of what was written."""
    script = ("import logging, sys; from components.run.exit_codes import exit_process; logging.basicConfig(); "
              "logging.warning('a log line'); sys.stdout.write('no newline'); sys.stderr.write('unflushed'); "
              "exit_process(3)")
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert (proc.returncode, proc.stdout, proc.stderr) == (3, "no newline", "WARNING:root:a log line\nunflushed")


@pytest.mark.slow
def test_a_crash_exits_1_and_shows_the_first_failing_ranks_traceback_once(tmp_path):
    """Rank 1 raises during step 3; rank 0, stopped by torchrun or by the broken collective, stays silent. Started
    as on a node of a multi-node job (--nnodes, --rdzv-*), which run_train.sh's --standalone stands for."""
    command = [sys.executable, "-m", "components.run.launch", "--nnodes", "1", "--nproc_per_node", "2",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0", "--rdzv-id", "crash",
               "tests/fault_injection.py", *RUN, "--training.steps", "6"]
    proc = start(command, 2, tmp_path, INGOT_FAULT="raise-step:3:1")
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 1, out
    assert "rank 1 crashed (exit status 1):\nTraceback (most recent call last):" in out, out
    assert out.count("Traceback") == 1 and out.count("RuntimeError: fault injected at step 3") == 1, out
    assert "ChildFailedError" not in out


@pytest.mark.slow
def test_a_crash_restarts_the_job_which_resumes_its_checkpoint_and_ends_as_an_uninterrupted_run(tmp_path):
    """job.max_restarts 1: rank 1 raises during step 5 of the first attempt; the launcher names the crash, starts
    the job again, which resumes step 4's checkpoint, and exits 0 with the losses of a run that never crashed.
    Bad input is never retried."""
    from conftest import losses

    run = [*RUN, "--training.steps", "8", "--checkpoint.enable", "true", "--checkpoint.interval", "2",
           "--job.max_restarts", "1"]
    command = [sys.executable, "-m", "components.run.launch", "--standalone", "--nproc_per_node", "2",
               "tests/fault_injection.py", *run]
    proc = start(command, 2, tmp_path / "restarted", INGOT_FAULT="raise-step:5:1",
                 INGOT_FAULT_ONCE=str(tmp_path / "fired"))
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    assert out.count("restart 1 of 1 (job.max_restarts) after: rank 1 crashed (exit status 1):") == 1, out
    assert "resuming" in out.lower() or "checkpoint/step-4" in out, out
    status, clean = run_train(2, run, tmp_path / "clean")
    assert status == 0, clean
    assert losses(tmp_path / "restarted") == losses(tmp_path / "clean")
    # The picture of the run, once it ended having trained: all 8 steps, the resumed ones once.
    assert out.rstrip().endswith(f"plot of the run: {tmp_path / 'restarted' / 'metrics.png'}")
    assert (tmp_path / "restarted" / "metrics.png").read_bytes().startswith(b"\x89PNG")
    status, refused = run_train(1, [*run, "--training.stepz", "3"], tmp_path / "bad")
    assert status == 2 and "restart" not in refused, refused
