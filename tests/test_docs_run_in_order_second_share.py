"""The second share of the documents after the README (tests/docs_commands.py, `shares`), in the clone where
tests/test_docs_run_in_order.py's first share runs: a test file of its own so that the other pytest-xdist worker
runs it."""

import pytest
from conftest import REPO
from docs_commands import run_first, run_share
from test_docs_run_in_order import assert_as_documented


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_the_second_share_of_the_documents_runs_as_documented_after_the_readme(documents_clone, tmp_path):
    first = run_first(REPO, documents_clone)
    assert not [o for o in first if o.problem], "the README's commands failed: see the first share's report"
    assert_as_documented(run_share(documents_clone, 1), tmp_path / "report.md")
