"""The second lane of the documented commands (tests/test_docs_run_in_order.py): a test file of its own, so that
pytest-xdist (`--dist loadfile`) runs it on the other worker, and both take documents from the shared clone."""

import pytest
from test_docs_run_in_order import run_a_lane


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_the_documented_commands_run_in_order_in_a_second_lane(tmp_path_factory, tmp_path):
    run_a_lane(tmp_path_factory, tmp_path)
