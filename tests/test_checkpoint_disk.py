"""Bounded disk: a checkpoint folder holds at most keep_latest_k committed checkpoints, one being
written and checkpoint.keep_damaged damaged ones; replaced copies and leftovers go."""

import json
import os
import re
import subprocess

import pytest
from conftest import REPO, TINY, metric_lines

ARGS = [*TINY, "--checkpoint.enable", "true", "--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "3",
        "--checkpoint.keep_damaged", "1"]


def names(folder) -> list[str]:
    return sorted(path.name for path in folder.iterdir())


def truncate(path) -> None:
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)


def test_a_replaced_checkpoint_is_deleted_once_the_new_one_is_committed(tmp_path, train_in_process):
    seed = [*ARGS, "--checkpoint.create_seed_checkpoint", "true", "--job.dump_folder", str(tmp_path)]
    assert train_in_process(seed) == 0
    assert train_in_process(seed) == 0
    assert names(tmp_path / "checkpoint") == ["step-0"]


def test_after_damaged_and_leftover_folders_the_checkpoint_folder_stays_bounded(tmp_path, train_in_process, capsys):
    args = [*ARGS, "--job.dump_folder", str(tmp_path)]
    folder = tmp_path / "checkpoint"
    assert train_in_process([*args, "--training.steps", "6"]) == 0
    assert names(folder) == ["step-2", "step-4", "step-6"]
    truncate(folder / "step-4" / "__0_0.distcp")
    truncate(folder / "step-6" / "__0_0.distcp")
    (folder / "step-6.replaced").mkdir()  # what a save killed between its commit and the clean-up leaves
    assert train_in_process([*args, "--training.steps", "8"]) == 0
    assert names(folder) == ["step-4", "step-6", "step-6.damaged", "step-8"]
    log = capsys.readouterr().err
    assert "damaged checkpoints kept for inspection in" in log
    kept = r"step-6\.damaged \(\d+\.\d\d GiB\); 1 older one\(s\) deleted \(checkpoint.keep_damaged = 1\)"
    assert re.search(kept, log)


FILL = """import os, shutil, sys
from pathlib import Path
folder, share, checkpoint = Path(sys.argv[1]), float(sys.argv[2]), Path(sys.argv[3])
size = sum(f.stat().st_size for f in checkpoint.iterdir())
with open(folder / "filler", "wb") as f:
    f.write(bytes(int(shutil.disk_usage(folder).free - share * size)))
"""
"""Leaves room for argv[2] checkpoints of the size of argv[3] in the file system of the folder argv[1] (a file
argv[1]/filler takes the rest)."""
ON_SMALL_DISK = """set -u
run() {  # name, then the trainer's arguments: its exit status, log, checkpoint folder listing and metrics
    name=$1; shift
    ./run_train.sh "$@" --job.dump_folder "$SMALL/run" > "$OUT/$name.log" 2>&1
    echo $? > "$OUT/$name.status"
    ls "$SMALL/run/checkpoint" > "$OUT/$name.listing"
    cp "$SMALL/run/metrics.jsonl" "$OUT/$name.metrics.jsonl"
}
python -c "$FILL" "$SMALL" 1.6 "$CHECKPOINT"
run full "$@" --training.steps 6 --checkpoint.async_mode async
rm "$SMALL/filler"
run freed "$@" --training.steps 6 --checkpoint.async_mode async
python -c "$FILL" "$SMALL" 0.6 "$CHECKPOINT"
run stop "$@" --training.steps 10 --checkpoint.on_disk_full stop
"""


def test_a_save_that_finds_the_disk_full_costs_no_checkpoint_and_the_run_resumes_exactly_once_there_is_room(
        tmp_path, train_in_process):
    """A real full file system (a tmpfs of the test's own, scripts/small_disk.py) with room for 1.6 checkpoints:
    the save of step 4 is named in one line, its partial folder removed, step-2 kept, and training goes on to step 6,
    whose save, the last, fails too: exit status 74. Once the space is freed, the same command resumes from step-2
    and ends as an uninterrupted run, bitwise. With checkpoint.on_disk_full stop, the first save that finds no
    space stops the run (74)."""
    from scripts.small_disk import in_small_file_system, why_no_small_file_system

    why = why_no_small_file_system(tmp_path)
    if why:
        pytest.skip(f"no small file system on this machine: {why}")
    common = [*TINY, "--checkpoint.enable", "true", "--checkpoint.interval", "2", "--training.steps", "6"]
    assert train_in_process([*common, "--job.dump_folder", str(tmp_path / "uninterrupted")]) == 0
    small, out = tmp_path / "small", tmp_path / "out"
    small.mkdir()
    out.mkdir()
    env = dict(os.environ, SMALL=str(small), OUT=str(out), FILL=FILL,
               CHECKPOINT=str(tmp_path / "uninterrupted" / "checkpoint" / "step-6"))
    subprocess.run(in_small_file_system(small, 160, ["bash", "-c", ON_SMALL_DISK, "bash", *common[:-2]]),
                   cwd=REPO, env=env, check=True, timeout=600)

    def ended(name: str) -> tuple[int, list[str], list[int]]:
        return (int((out / f"{name}.status").read_text()), (out / f"{name}.listing").read_text().split(),
                [r["step"] for r in (json.loads(line) for line in (out / f"{name}.metrics.jsonl").open())])

    assert ended("full") == (74, ["step-2"], [1, 2, 3, 4, 5, 6])
    log = (out / "full.log").read_text()
    assert re.search(r"checkpoint step-4 not saved: no space left in \S+ \(0\.0\d GiB free of 0\.16 GiB; "
                     r"CheckpointException\); step-4\.partial removed, step-2 kept; training goes on and saves "
                     r"again at step 6 \(checkpoint.on_disk_full = continue\)", log), log[-3000:]
    assert log.splitlines()[-1].startswith("disk full: checkpoint step-6 not saved: no space left") and \
        log.splitlines()[-1].endswith("(the last step's save): free space and rerun the same command to resume "
                                      "from step-2"), log[-3000:]
    assert "Traceback" not in log
    assert ended("freed") == (0, ["step-4", "step-6"], [1, 2, 3, 4, 5, 6])  # the debug config keeps 2
    records = [json.loads(line) for line in (out / "freed.metrics.jsonl").open()]
    assert [(r["loss"], r["grad_norm"]) for r in records] == \
        [(r["loss"], r["grad_norm"]) for r in metric_lines(tmp_path / "uninterrupted")]
    assert ended("stop") == (74, ["step-4", "step-6"], [1, 2, 3, 4, 5, 6, 7, 8])
    last = (out / "stop.log").read_text().splitlines()[-1]
    assert last.startswith("disk full: checkpoint step-8 not saved") and "(checkpoint.on_disk_full = stop)" in last
