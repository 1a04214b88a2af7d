"""The fault soak in CI (scripts/soak.py): every kind of fault once, at random moments of a fixed seed, thrown at one
run of 2 processes on the default loader, which is relaunched after each until it completes; then every step's loss
and gradient norm and the final checkpoint (weights, optimizer, loader position, RNG states) equal those of the
uninterrupted run, bit for bit. docs/reliability.md quotes the long soak's figures."""

import json
import subprocess
import sys

import pytest
from conftest import REPO

from scripts.small_disk import why_no_small_file_system
from scripts.soak import KINDS


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sixteen_faults_of_every_kind_leave_the_run_bitwise_as_if_none_had_happened(tmp_path):
    why = why_no_small_file_system(tmp_path)
    if why:
        pytest.skip(f"the soak fills a file system of its own, which this machine cannot give: {why}")
    output = tmp_path / "soak.json"
    result = subprocess.run([sys.executable, "-m", "scripts.soak", "--faults", str(len(KINDS)), "--seed", "0",
                             "--nproc", "2", "--work", str(tmp_path / "work"), "--output", str(output)],
                            cwd=REPO, capture_output=True, text=True, timeout=850)
    print(result.stdout)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    soak = json.loads(output.read_text())
    assert sorted(f["kind"] for f in soak["faults"]) == sorted(KINDS)
    assert soak["survived"] == len(KINDS) and soak["differences"] == []
    assert f"{len(KINDS)} of {len(KINDS)} faults survived, nothing lost" in result.stdout
    statuses = {launch["status"] for launch in soak["launches"]}
    assert {0, 3, 4, 75} <= statuses and statuses - {0, 3, 4, 75} and max(f["seconds_lost"] for f in soak["faults"]) > 0


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_replica_groups_killed_whole_at_random_rejoin_and_end_with_the_same_weights(tmp_path):
    """Two replica groups (torchft) of one process; four times a group drawn at random is SIGKILLed and relaunched:
    it rejoins from the live group, and the two end with the same weights and optimizer states, bit for bit. The
    steps one group trained alone are counted: there the run differs from an uninterrupted one by design."""
    output = tmp_path / "soak.json"
    result = subprocess.run([sys.executable, "-m", "scripts.soak", "--replica-groups", "--faults", "4", "--seed", "0",
                             "--nproc", "1", "--work", str(tmp_path / "work"), "--output", str(output)],
                            cwd=REPO, capture_output=True, text=True, timeout=550)
    print(result.stdout)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    soak = json.loads(output.read_text())
    assert [f["kind"] for f in soak["faults"]] == ["kill-replica-group"] * 4
    assert {f["rank"] for f in soak["faults"]} == {0, 1}  # each group was killed
    assert soak["survived"] == 4 and soak["differences"] == [] and soak["trained_alone"] > 0
