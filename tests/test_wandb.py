"""Weights & Biases logging (metrics.enable_wandb): every figure of metrics.jsonl reaches the W&B run with the config
and git commit, a resume continues the same run, only rank 0 writes, and a run without wandb installed stops at
start-up with one line. The runs are offline (WANDB_MODE=offline), read back from their .wandb files."""

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, TINY, metric_lines

from components.metrics.wandb_logging import INSTALL, RUN_ID_FILE

BLOCK, HEADER = 32768, 7
FULL, LAST = 1, 4


def launch(dump: Path, *args: str, nproc: int = 1, **env: str) -> subprocess.CompletedProcess:
    """./run_train.sh with W&B on, the test's WANDB_* variables only (none of the caller's)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")} | dict(
        OMP_NUM_THREADS="1", NGPU=str(nproc), WANDB_SILENT="true",
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}", **env)
    return subprocess.run([str(REPO / "run_train.sh"), *TINY, "--training.dataloader_workers", "0",
                           "--metrics.enable_wandb", "true", *args, "--job.dump_folder", str(dump)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def run_train(dump: Path, *args: str, nproc: int = 1, **env: str) -> None:
    """A launch with W&B offline, which must succeed."""
    result = launch(dump, *args, nproc=nproc, **{"WANDB_MODE": "offline", **env})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def offline_runs(dump: Path) -> list[Path]:
    return sorted(dump.glob("wandb/offline-run-*/run-*.wandb"))


def wandb_records(path: Path) -> list:
    """The records of a .wandb file. wandb 0.30 has no Python reader of its own: the file is a 7-byte header, then
    LevelDB's log format, 32 KiB blocks of chunks each with a 7-byte header (checksum, length, type), a record being
    one FULL chunk or FIRST, MIDDLE..., LAST ones; each record is a wandb_internal_pb2.Record."""
    from wandb.proto.wandb_internal_pb2 import Record

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    records, pending, pos = [], b"", HEADER
    while pos + HEADER <= len(data):
        if BLOCK - pos % BLOCK < HEADER:  # a block's tail too short for a chunk header is padding
            pos += BLOCK - pos % BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        pending += data[pos + HEADER:pos + HEADER + length]
        pos += HEADER + length
        if kind in (FULL, LAST):
            records.append(Record.FromString(pending))
            pending = b""
    return records


def run_record(records: list):
    return next(r.run for r in records if r.WhichOneof("record_type") == "run")


def history(records: list) -> dict[int, dict]:
    """step -> the figures logged at it, W&B's own (_step, _runtime...) left out."""
    rows = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
            rows[row["_step"]] = {k: v for k, v in row.items() if not k.startswith("_")}
    return rows


@pytest.mark.slow
def test_every_figure_of_metrics_jsonl_reaches_the_wandb_run_with_the_config_and_git_commit(tmp_path):
    run_train(tmp_path, "--training.steps", "5", "--metrics.wandb_project", "ingot-tests", "--metrics.wandb_run_name",
              "tiny", "--metrics.wandb_group", "wandb", "--metrics.wandb_tags", "a,b")
    [path] = offline_runs(tmp_path)
    records = wandb_records(path)
    expected = {m["step"]: {f"train/{k}": v for k, v in m.items() if k not in ("step", "data_hash") and v is not None}
                for m in metric_lines(tmp_path)}  # the data's fingerprint names batches: not a figure to plot
    assert sorted(expected) == [1, 2, 3, 4, 5] and all("data_hash" in m for m in metric_lines(tmp_path))
    assert history(records) == expected  # the losses among them, exactly

    run = run_record(records)
    assert (run.project, run.display_name, run.run_group) == ("ingot-tests", "tiny", "wandb")
    assert list(run.tags) == ["a", "b"]
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["training"]["steps"] == 5 and config["metrics"]["enable_wandb"] is True
    assert config["model"]["n_layers"] == 2
    commit = (tmp_path / "config.toml").read_text().splitlines()[0].removeprefix("# git commit: ")
    assert config["git_commit"] == commit and commit != "unknown"


@pytest.mark.slow
def test_every_tensorboard_scalar_and_histogram_reaches_the_wandb_run(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_train(tmp_path, "--job.config_file", "debug_moe.toml", "--training.steps", "2", "--metrics.enable_tensorboard",
              "true", "--metrics.per_layer", "true", "--validation.enable", "true", "--validation.steps", "1",
              "--evaluation.enable", "true", "--evaluation.tasks", "tests/assets/tasks/shakespeare_word_order.jsonl",
              "--evaluation.limit", "4")
    events = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0, "histograms": 0})
    events.Reload()
    [path] = offline_runs(tmp_path)
    logged = history(wandb_records(path))
    scalars = events.Tags()["scalars"]
    assert {tag.split("/")[0] for tag in scalars} == {"train", "validation", "eval", "layers", "eval_seconds"}
    for tag in scalars:
        for event in events.Scalars(tag):
            assert logged[event.step][tag] == pytest.approx(event.value, rel=1e-6), tag  # TensorBoard's are float32
    histograms = events.Tags()["histograms"]
    assert histograms and all(logged[2][f"{tag}/_type"] == "histogram" for tag in histograms)


@pytest.mark.slow
def test_a_resumed_run_continues_the_same_wandb_run(tmp_path):
    checkpoints = ["--checkpoint.enable", "true", "--checkpoint.interval", "3"]
    run_train(tmp_path, "--training.steps", "3", *checkpoints, WANDB_PROJECT="from-env")
    run_train(tmp_path, "--training.steps", "5", *checkpoints, WANDB_PROJECT="from-env")
    first, second = offline_runs(tmp_path)
    run_id = (tmp_path / RUN_ID_FILE).read_text()
    assert run_record(wandb_records(first)).run_id == run_record(wandb_records(second)).run_id == run_id
    assert run_record(wandb_records(first)).project == "from-env"  # an empty key leaves it to WANDB_PROJECT
    assert sorted(history(wandb_records(second))) == [4, 5]


def test_without_wandb_installed_the_run_stops_at_start_up_with_one_line(tmp_path, train_in_process, monkeypatch,
                                                                         capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    (tmp_path / "earlier.txt").write_text("kept")
    status = train_in_process([*TINY, "--metrics.enable_wandb", "true", "--job.dump_folder", str(tmp_path)])
    assert status == 2
    assert capsys.readouterr().err.splitlines() == [
        f"config error: metrics.enable_wandb needs the wandb package: {INSTALL}"]
    assert list(tmp_path.iterdir()) == [tmp_path / "earlier.txt"]


@pytest.mark.slow
def test_only_rank_0_writes_a_wandb_run(tmp_path):
    run_train(tmp_path, "--training.steps", "3", "--parallelism.data_parallel_shard_degree", "2", nproc=2)
    [path] = offline_runs(tmp_path)
    assert sorted(history(wandb_records(path))) == [1, 2, 3]


@pytest.mark.slow
def test_a_run_wandb_will_not_start_stops_at_start_up_with_one_line(tmp_path):
    """Online, with no API key anywhere (HOME without ~/.netrc): exit 2, the fixes named, nothing written."""
    dump = tmp_path / "run"
    dump.mkdir()
    (dump / "earlier.txt").write_text("kept")
    result = launch(dump, "--training.steps", "2", HOME=str(tmp_path))
    out = (result.stdout + result.stderr).strip().splitlines()
    assert result.returncode == 2, out
    assert len(out) <= 15 and not any("Traceback" in line for line in out), out
    [error] = [line for line in out if "metrics.enable_wandb" in line]
    assert "wandb login" in error and "WANDB_MODE=offline" in error, error
    assert not (dump / "config.toml").exists() and not (dump / "metrics.jsonl").exists()
    assert (dump / "earlier.txt").read_text() == "kept"
