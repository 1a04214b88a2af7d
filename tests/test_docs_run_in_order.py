"""Every command of README.md and docs/*.md runs as documented, in order, in scratch copies of the
repository with its steps cut short; tests/docs_commands.py states the rules. The slowest test of the suite:
the 90-odd commands that run take about 50 minutes of CPU, most of it their processes' start-up, spread over
two copies at once."""

import pytest
from conftest import REPO
from docs_commands import report, run_commands


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
