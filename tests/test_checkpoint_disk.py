"""Bounded disk: a checkpoint folder holds at most keep_latest_k committed checkpoints, one being
written and checkpoint.keep_damaged damaged ones; replaced copies and leftovers go."""

import re

from conftest import TINY

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
