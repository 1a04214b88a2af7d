"""Every command of README.md and docs/*.md runs as documented and as typed, in order, in one scratch clone of
the repository; tests/docs_commands.py states the rules. The slowest work of the suite, in two lanes that share it,
one on each pytest-xdist worker (this file and tests/test_docs_run_in_order_lane_2.py): most of its time is the
commands' processes' start-up, and the README's quick start (200 steps); a lane's report (kept when it fails) gives
each of its commands' CPU seconds."""

import os
import re
import subprocess
from pathlib import Path

import docs_commands
import pytest
import torch
from conftest import REPO, metric_lines
from docs_commands import (
    TIMED_OUT,
    join_lanes,
    leave_lanes,
    read_commands,
    report,
    run,
    run_commands,
    run_share,
    shared_folders,
)


def describe(outcome) -> str:
    tail = "\n".join(outcome.output.splitlines()[-30:])
    return f"{outcome.command.where}: {outcome.ran}\n{outcome.problem}; the last 30 lines:\n{tail}"


def shared_scratch(tmp_path_factory) -> Path:
    """The folder this session's lanes share: under pytest-xdist, beside the workers' own temporary folders."""
    base = tmp_path_factory.getbasetemp()
    return (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "documented_commands"


def run_a_lane(tmp_path_factory, tmp_path) -> None:
    """Run documents in the session's shared clone until none is left (docs_commands.run_share), and check what this
    lane ran; the lane that ran the README checks its quick start as README.md and getting_started.md describe it."""
    scratch = shared_scratch(tmp_path_factory)
    lane, clean = join_lanes(scratch), False
    try:
        outcomes = run_share(REPO, scratch)
        (tmp_path / "report.md").write_text(report(outcomes))
        failed = [o for o in outcomes if o.problem]
        assert not failed, f"{len(failed)} command(s) not as documented (report: {tmp_path / 'report.md'}):\n\n" + (
            "\n\n".join(describe(o) for o in failed))
        quick_start = next((o for o in outcomes if o.command.document == "README.md" and o.ran == "./run_train.sh"),
                           None)
        if quick_start is not None:
            check_the_quick_start(quick_start, scratch / "clone" / "outputs" / "debug_model")
        clean = True
    finally:
        leave_lanes(lane, clean)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_the_documented_commands_run_in_order(tmp_path_factory, tmp_path):
    """A lane of two (the other: tests/test_docs_run_in_order_lane_2.py), one on each pytest-xdist worker."""
    run_a_lane(tmp_path_factory, tmp_path)


def check_the_quick_start(quick_start, run: Path) -> None:
    losses = [float(loss) for loss in re.findall(r"step +\d+ +loss +([\d.]+)", quick_start.output)]
    assert len(losses) == 200 and round(losses[0], 1) == 8.8, losses[:3]  # "from 8.8 to about 5.5 (the mean of
    assert sum(losses[-10:]) / 10 == pytest.approx(5.5, abs=0.15), losses[-10:]  # the last 10 steps)"
    assert "no MFU on cpu" in quick_start.output and " mfu " not in quick_start.output  # "a CPU run logs none"
    metrics = metric_lines(run)
    assert [m["step"] for m in metrics] == list(range(1, 201)) and all(m["mfu"] is None for m in metrics)
    # getting_started.md's list of what metrics.jsonl holds is what the code writes, and the step line quoted in
    # README.md and getting_started.md is the quick start's own, times and throughput excepted.
    getting_started = (REPO / "docs/getting_started.md").read_text()
    listed = re.search(r"one JSON object per logged step: `([^`]+)`", getting_started)
    assert listed[1].split(", ") == list(metrics[0])
    logged = step_line_fields(next(line for line in quick_start.output.splitlines() if "step     10 " in line))
    memory, quoted_memory = logged.pop("memory"), set()
    for document in ("README.md", "docs/getting_started.md"):
        quoted = step_line_fields(next(line for line in (REPO / document).read_text().splitlines()
                                       if line.startswith("[rank0]") and "step     10 " in line))
        quoted_memory.add(quoted.pop("memory"))
        assert quoted == logged
    # The peak resident set counts the libraries loaded: the line quotes the README's install (PyPI's CUDA build of
    # torch); getting_started.md gives the CPU-only build's figure too.
    cpu_only = float(re.search(r"([\d.]+) GiB with the CPU-only build", getting_started)[1])
    (readme_install,) = quoted_memory
    assert memory == pytest.approx(readme_install if torch.version.cuda else cpu_only, abs=0.05)
    assert list((run / "tb").glob("events.out.tfevents.*")) and (run / "config.toml").read_text().startswith("# git")
    assert sorted(p.name for p in (run / "checkpoint").iterdir()) == ["step-100", "step-200"]
    assert quick_start.output.rstrip().endswith("plot of the run: outputs/debug_model/metrics.png")
    assert (run / "metrics.png").read_bytes().startswith(b"\x89PNG")


def step_line_fields(line: str) -> dict:
    """A step line's figures by name, but its time and tokens/s (the machine's); memory as a number (the peak resident
    set on a CPU varies a little from machine to machine and with the torch build)."""
    fields = dict(re.findall(r"(step|loss|grad_norm|lr|memory) +(\S+)", line))
    fields["memory"] = float(fields["memory"].removesuffix("GiB"))
    return fields | {"tokens/s": "tokens/s" in line}


def test_the_documents_run_in_one_clone_after_the_readme_and_a_command_that_trains_nothing_must_say_so(tmp_path):
    repo = tmp_path / "repo"
    finished = "echo '[rank0] nothing trained: the checkpoint in outputs/x is at step 2 = training.steps'"
    documents = {"README.md": "echo > from_readme\npip install -e . && echo > installed",
                 "docs/getting_started.md": "test -e from_readme && test -e installed",
                 "docs/a.md": "echo > from_a\ntest -e from_readme\ntest -e from_a", "docs/b.md": "false  # exits 1",
                 "docs/c.md": f"{finished}  # trains nothing: the run is finished\n{finished}",
                 "docs/d.md": "true  # exits 1"}
    for name, commands in documents.items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text(f"```bash\n{commands}\n```\n")
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run(["git", "add", "."], cwd=repo, check=True)

    outcomes = run_commands(repo, tmp_path / "scratch")

    assert [(o.command.where, o.ran, o.status) for o in outcomes] == [
        ("README.md:2", "echo > from_readme", 0), ("README.md:3", "echo > installed", 0),
        ("docs/getting_started.md:2", "test -e from_readme && test -e installed", 0),
        ("docs/a.md:2", "echo > from_a", 0), ("docs/a.md:3", "test -e from_readme", 0),
        ("docs/a.md:4", "test -e from_a", 0),
        ("docs/b.md:2", "false", 1), ("docs/c.md:2", finished, 0), ("docs/c.md:3", finished, 0),
        ("docs/d.md:2", "true", 0)]
    problems = {o.command.where: o.problem for o in outcomes if o.problem}
    assert problems == {"docs/c.md:3": "trained nothing, its text not saying so: [rank0] nothing trained: the "
                                       "checkpoint in outputs/x is at step 2 = training.steps",
                        "docs/d.md:2": "exit status 0, documented 1"}
    assert (tmp_path / "scratch" / "clone" / "from_a").exists(), "the clone is kept when a command fails"


def test_no_two_documents_train_in_the_same_dump_folder():
    """They run at once in one clone after the README and getting_started.md (docs_commands.run_commands)."""
    assert shared_folders(read_commands(REPO)) == {}


def test_a_command_s_cpu_seconds_are_its_processes_and_one_past_the_timeout_is_killed_whole(tmp_path, monkeypatch):
    burn = "python3 -c 'import time\nend = time.process_time() + 1\nwhile time.process_time() < end: pass'"
    status, output, cpu = run(f"{burn} && echo burnt", tmp_path)
    assert (status, output) == (0, "burnt\n") and 1.0 <= cpu < 3.0

    monkeypatch.setattr(docs_commands, "TIMEOUT", 1)
    status, output, _ = run("(sleep 60; echo late) & echo started", tmp_path)  # bash ends, its child holds the pipe
    assert status == TIMED_OUT and output.startswith("started") and "late" not in output
    assert "[timed out after 1 s]" in output
