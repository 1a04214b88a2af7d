"""Training on the streaming hf loader: the shipped corpus as a local dataset repository of 4 Parquet shards trains
on 2 processes (run_train.sh) without an Arrow copy and resumes bitwise; a run moved from 2 processes to 1 and then
to 4 trains on the batches of one uninterrupted run, with either loader; a resume with another global batch is
refused; bad data stops the run with one line and exit status 2. One-process runs are train.main in this process
(the launcher's part in a failure, the report it shows once, is tests/test_launcher.py's)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import CORPUS, REPO, TINY, losses, metric_lines, train_main

pytestmark = pytest.mark.slow

HF = [*TINY, "--training.dataset", "hf", "--metrics.log_freq", "1"]


@pytest.fixture(scope="module")
def repository(tmp_path_factory):
    """The whole shipped corpus as a dataset repository: data/train-0000i-of-00004.parquet."""
    import datasets

    folder = tmp_path_factory.mktemp("corpus")
    (folder / "data").mkdir()
    docs = [json.loads(line)["text"] for line in CORPUS.read_text().splitlines()]
    per = -(-len(docs) // 4)
    for i in range(4):
        datasets.Dataset.from_dict({"text": docs[i * per:(i + 1) * per]}).to_parquet(
            str(folder / "data" / f"train-{i:05d}-of-00004.parquet"))
    return folder


def run_train(nproc: int, args: list[str], tmp_path: Path) -> tuple[int, str]:
    """./run_train.sh with this interpreter first on PATH; its status and output (stdout and stderr)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", NGPU=str(nproc), HF_DATASETS_CACHE=str(tmp_path / "hf_cache"),
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    result = subprocess.run([str(REPO / "run_train.sh"), *args], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=600)
    return result.returncode, result.stdout + result.stderr


def train_here(args: list[str], capfd) -> tuple[int, str]:
    """train.main in this process: its status and what it printed (stdout and stderr)."""
    capfd.readouterr()
    status = train_main(args)
    captured = capfd.readouterr()
    return status, captured.out + captured.err


def large_arrow_files(*folders: Path) -> list[Path]:
    return [f for folder in folders for f in folder.rglob("*.arrow") if f.stat().st_size > 1 << 20]


def test_two_processes_stream_their_shards_with_falling_loss_and_no_arrow_copy(repository, tmp_path):
    dump = tmp_path / "run"
    status, out = run_train(2, [*HF, "--training.dataset_path", str(repository), "--training.steps", "30",
                                "--parallelism.data_parallel_shard_degree", "2", "--job.dump_folder", str(dump)],
                            tmp_path)
    assert status == 0, out[-3000:]
    assert f"data: {repository.name} (4 files, 1,151 rows) read in 8 shares of about 143 rows, one per stream; this " \
           "rank reads 4 streams" in out
    loss = losses(dump)
    assert len(loss) == 30
    assert sum(loss[s] for s in range(26, 31)) < sum(loss[s] for s in range(1, 6)) - 5 * 1.0
    assert large_arrow_files(tmp_path / "hf_cache", dump) == []


def test_a_run_resumed_at_step_8_matches_16_steps_straight_bitwise(repository, tmp_path, capfd):
    # A constant learning rate after warmup: the schedule of an 8-step run is then that of a 16-step one.
    args = [*HF, "--training.dataset_path", str(repository), "--training.dataloader_workers", "2",
            "--lr_scheduler.decay_type", "constant", "--checkpoint.enable", "true", "--checkpoint.interval", "8"]
    status, out = train_here([*args, "--training.steps", "16", "--job.dump_folder", str(tmp_path / "straight")],
                             capfd)
    assert status == 0, out[-3000:]
    resumed = tmp_path / "resumed"
    for steps in (8, 16):
        status, out = train_here([*args, "--training.steps", str(steps), "--job.dump_folder", str(resumed)], capfd)
        assert status == 0, out[-3000:]
    assert "loading checkpoint" in out.lower() or "resum" in out.lower(), out[-3000:]
    assert losses(resumed) == losses(tmp_path / "straight")


def test_a_run_moved_from_2_processes_to_1_and_then_to_4_trains_on_the_batches_of_one_run(tmp_path, train_in_process):
    """Steps 1-4 on 2 processes, 5-8 on 1, 9-12 on 4 (each a resume of the last one's checkpoint): the token ids
    of every global batch (data_hash) are those of a 12-step run on 1 process, and so are the losses. (The packed
    loader's share moves with the same global position: tests/test_packed_training.py.)"""
    args = [*HF, "--training.dataset", "hf", "--training.dataset_path", str(CORPUS), "--training.global_batch_size",
            "8", "--lr_scheduler.decay_type", "constant", "--checkpoint.enable", "true", "--checkpoint.interval", "4"]
    assert train_in_process([*args, "--training.local_batch_size", "8", "--training.steps", "12",
                             "--job.dump_folder", str(tmp_path / "straight")]) == 0
    moved = tmp_path / "moved"
    for nproc, steps in ((2, 4), (1, 8), (4, 12)):
        run = [*args, "--training.local_batch_size", str(8 // nproc), "--training.steps", str(steps),
               "--job.dump_folder", str(moved)]
        if nproc == 1:
            assert train_in_process(run) == 0
        else:
            status, out = run_train(nproc, run, tmp_path)
            assert status == 0, out[-3000:]
    straight, resumed = ({m["step"]: m for m in metric_lines(dump) if "loss" in m} for dump in (tmp_path / "straight",
                                                                                              moved))
    assert sorted(resumed) == list(range(1, 13))
    assert [resumed[s]["data_hash"] for s in resumed] == [straight[s]["data_hash"] for s in resumed]
    assert [resumed[s]["loss"] for s in resumed] == pytest.approx([straight[s]["loss"] for s in resumed], rel=1e-4)


def test_a_resume_with_another_global_batch_is_refused_before_anything_is_written(repository, tmp_path, capfd):
    dump = tmp_path / "run"
    args = [*HF, "--training.dataset_path", str(repository), "--checkpoint.enable", "true",
            "--checkpoint.interval", "2", "--training.steps", "2", "--job.dump_folder", str(dump)]
    status, out = train_here(args, capfd)
    assert status == 0, out[-3000:]
    before = files(dump)
    status, out = train_here([*args, "--training.steps", "4", "--training.global_batch_size", "8"], capfd)
    assert status == 2, out[-3000:]
    assert "global batch 4 → 8: the hf loader reads one stream of the data per sequence of the global batch" in out
    assert "--checkpoint.exclude_from_loading dataloader" in out
    assert "Traceback" not in out and len(out.strip().splitlines()) <= 15
    assert files(dump) == before


def files(folder: Path) -> dict[Path, bytes]:
    """What a run left in `folder`, but the run lock (which names the last job that held the folder)."""
    return {p: p.read_bytes() for p in folder.rglob("*") if p.is_file() and p.name != ".lock"}


def bad_input(tmp_path: Path, capfd, dataset_path: str, *extra: str) -> str:
    """The one line a run on `dataset_path` stops with (exit status 2, no traceback)."""
    status, out = train_here([*HF, "--training.dataset_path", dataset_path, "--training.steps", "2", *extra,
                              "--job.dump_folder", str(tmp_path / "run")], capfd)
    assert status == 2, out[-3000:]
    assert "Traceback" not in out, out
    errors = [line for line in out.splitlines() if "error:" in line]
    assert len(errors) == 1, out
    return errors[0]


def test_bad_sources_stop_the_run_with_one_line(repository, tmp_path, capfd, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    line = bad_input(tmp_path, capfd, "allenai/c4:en")
    assert "'allenai/c4:en' is not a local path" in line and "offline" in line
    broken = tmp_path / "broken"
    (broken / "data").mkdir(parents=True)
    for shard in sorted((repository / "data").iterdir())[:3]:
        (broken / "data" / shard.name).write_bytes(shard.read_bytes())
    (broken / "data" / "train-00003-of-00004.parquet").write_bytes(b"PAR1 not really")
    assert "cannot read" in (line := bad_input(tmp_path, capfd, str(broken))) and "train-00003-of-00004.parquet" in line
    line = bad_input(tmp_path, capfd, str(repository), "--training.dataset_text_field", "content")
    assert "has no field 'content' (columns: text)" in line
    (tmp_path / "empty.jsonl").write_bytes(b"")
    line = bad_input(tmp_path, capfd, str(tmp_path / "empty.jsonl"))
    assert "empty.jsonl' holds no documents (its 1 file(s) are empty)" in line
    (tmp_path / "blank.jsonl").write_text('{"text": ""}\n{"text": null}\n{"id": 3}\n')
    assert "blank is too small for 4 streams" in bad_input(tmp_path, capfd, str(tmp_path / "blank.jsonl"))
    line = bad_input(tmp_path, capfd, f"{tmp_path / 'empty.jsonl'}:0,{repository}:0")
    assert "a blend weight must be a positive number" in line
