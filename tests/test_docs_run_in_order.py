"""Every command of README.md and docs/*.md runs as documented, in order, in scratch copies of the
repository with its steps cut short; tests/docs_commands.py states the rules. The slowest test of the suite:
the 100-odd commands that run took 24 CPU-minutes (20 min on an idle 2-core machine), most of it their processes'
start-up, spread over two copies at once; its report (kept when it fails) gives each command's CPU seconds."""

import subprocess

import docs_commands
import pytest
from conftest import REPO
from docs_commands import TIMED_OUT, report, run, run_commands


def describe(outcome) -> str:
    tail = "\n".join(outcome.output.splitlines()[-30:])
    return f"{outcome.command.where}: {outcome.ran}\n{outcome.problem}; the last 30 lines:\n{tail}"


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_the_documented_commands_run_in_order(tmp_path):
    outcomes = run_commands(REPO, tmp_path / "repo")
    (tmp_path / "report.md").write_text(report(outcomes))
    assert [o for o in outcomes if o.ran], "no documented command ran"
    failed = [o for o in outcomes if o.problem]
    assert not failed, f"{len(failed)} command(s) not as documented (report: {tmp_path / 'report.md'}):\n\n" + (
        "\n\n".join(describe(o) for o in failed))


def test_each_document_sees_what_the_readme_and_its_own_commands_wrote_and_nothing_of_the_others(tmp_path):
    repo = tmp_path / "repo"
    documents = {"README.md": "echo > from_readme\nmkdir -p run/checkpoint/step-1 && echo > run/checkpoint/step-1/x",
                 "docs/getting_started.md": "test -e from_readme",
                 "docs/a.md": "echo > from_a\ntest -e from_readme", "docs/b.md": "test -e from_a  # exits 1",
                 "docs/c.md": "echo > from_c\nfalse",
                 "docs/d.md": 'test "$(stat -c %h run/checkpoint/step-1/x)" -ge 2'}  # a hard link
    for name, commands in documents.items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text(f"```bash\n{commands}\n```\n")
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run(["git", "add", "."], cwd=repo, check=True)

    outcomes = run_commands(repo, tmp_path / "scratch")

    assert [(o.command.where, o.status) for o in outcomes] == [
        ("README.md:2", 0), ("README.md:3", 0), ("docs/getting_started.md:2", 0), ("docs/a.md:2", 0),
        ("docs/a.md:3", 0), ("docs/b.md:2", 1), ("docs/c.md:2", 0), ("docs/c.md:3", 1), ("docs/d.md:2", 0)]
    assert [o.command.where for o in outcomes if o.problem] == ["docs/c.md:3"]
    copies = [p for p in (tmp_path / "scratch").iterdir() if p.name != "first"]
    assert len(copies) == 1 and (copies[0] / "from_c").exists(), "only the failing document's copy is kept"


def test_a_command_s_cpu_seconds_are_its_processes_and_one_past_the_timeout_is_killed_whole(tmp_path, monkeypatch):
    burn = "python3 -c 'import time\nend = time.process_time() + 1\nwhile time.process_time() < end: pass'"
    status, output, cpu = run(f"{burn} && echo burnt", tmp_path)
    assert (status, output) == (0, "burnt\n") and 1.0 <= cpu < 3.0

    monkeypatch.setattr(docs_commands, "TIMEOUT", 1)
    status, output, _ = run("(sleep 60; echo late) & echo started", tmp_path)  # bash ends, its child holds the pipe
    assert status == TIMED_OUT and output.startswith("started") and "late" not in output
    assert "[timed out after 1 s]" in output
