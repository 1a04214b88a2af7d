"""Preprocessing under torchrun (scripts/preprocess/distributed.py): the ranks share out the input files,
and the output holds the same token streams as a one-process run's."""

import gzip
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from components.data.packed_format import PackedSplit, read_manifest
from scripts.preprocess import main
from scripts.preprocess.distributed import FOLDER_PREFIX, RankStopped, World, assign_files
from scripts.preprocess.errors import UsageError
from scripts.preprocess.output import OUTPUT_FILE, prepare_output

REPO = Path(__file__).resolve().parent.parent
TOKENIZER = str(REPO / "tests/assets/tokenizers/shakespeare_bpe_4k.model")
TRAIN = REPO / "tests/assets/shakespeare/train.jsonl"
OPTIONS = ["--tokenizer", TOKENIZER, "--val-fraction", "0.2", "--max-bad-fraction", "0.1", "--shard-tokens", "20000",
           "--batch-bytes", "20000", "--quiet"]


def torchrun(*argv) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc_per_node 2 -m scripts.preprocess ARGV`, one tokenizer worker per rank."""
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         "-m", "scripts.preprocess", *map(str, argv), *OPTIONS, "--workers", "1"],
        cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=120,
    )


def write_inputs(folder: Path, count: int) -> list[Path]:
    """`count` small JSON-lines files of slices of the shipped plays, of different sizes, one bad line each."""
    with TRAIN.open() as f:
        plays = [json.loads(line)["text"] for _, line in zip(range(60), f)]
    paths = []
    for i in range(count):
        lines = [json.dumps({"text": play[:400 + 150 * i]}) for play in plays[15 * i : 15 * i + 10 + 2 * i]]
        lines.insert(3, '{"title": "no text"}')
        paths.append(folder / f"part-{i}.jsonl")
        paths[-1].write_text("\n".join(lines) + "\n")
    return paths


def streams(folder: Path) -> dict[str, list[int]]:
    """The token stream of each split, read back in manifest order."""
    manifest = read_manifest(folder)
    return {split: PackedSplit(folder, split, manifest).read(0, manifest["splits"][split]["tokens"]).tolist()
            for split in ("train", "validation")}


def only_output_files(folder: Path) -> bool:
    """The folder holds shards and the manifest, no coordination folder of the ranks."""
    return all(p.is_file() and OUTPUT_FILE.fullmatch(p.name) for p in folder.iterdir())


def ranks(output: Path, size: int, body, run: str = "run-0") -> list:
    """body(world) run by `size` ranks in threads, each then closing its world as main() does; -> per rank
    what body returned or the exception it raised."""
    outcomes: list = [None] * size

    def rank(r: int) -> None:
        world = World(r, size, run)
        try:
            world.start(output)
            outcomes[r] = body(world)
        except Exception as e:
            outcomes[r] = e
        finally:
            world.close()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not any(thread.is_alive() for thread in threads), "a rank is still waiting"
    return outcomes


def test_ranks_exchange_through_files_in_a_folder_of_the_output_that_rank_0_removes_at_the_end(tmp_path):
    out = tmp_path / "a" / "out"
    seen = []

    def body(world):
        seen.append(world.folder)
        assert world.folder.parent == out and world.folder.name == f"{FOLDER_PREFIX}run-0"
        first = world.on_rank0(lambda: ["checked", world.rank])
        everyone = world.all_gather(world.rank * 10)
        (out / f"train-r{world.rank:05d}-00000.bin").write_bytes(b"")
        return first, everyone, world.on_every_rank(lambda: world.rank)

    assert ranks(out, 3, body) == [(["checked", 0], [0, 10, 20], r) for r in range(3)]
    assert len(seen) == 3 and only_output_files(out)


def test_a_usage_error_on_any_rank_reaches_every_rank_and_an_output_made_for_nothing_is_removed(tmp_path):
    out = tmp_path / "new" / "out"

    def body(world):
        def check():
            if world.rank == 1:
                raise UsageError("no text column")
        world.on_every_rank(check)

    outcomes = ranks(out, 2, body)
    assert all(isinstance(o, UsageError) and str(o) == "rank 1: no text column" for o in outcomes)
    assert not (tmp_path / "new").exists()


def test_the_other_ranks_leave_only_once_rank_0_has_reported_the_error(tmp_path):
    """torchrun stops the ranks still running as soon as one exits with an error: a rank that left before rank 0
    logged the job's error would cut that report."""
    events = []

    def check(r: int) -> None:
        if r == 1:
            raise UsageError("no text column")

    def rank(r: int) -> None:
        world = World(r, 2, "run-0")
        world.start(tmp_path / "out")
        try:
            world.on_every_rank(lambda: check(r))
        except UsageError:
            if r == 0:
                time.sleep(0.5)  # logging, slowly
                events.append("rank 0 reported")
        finally:
            world.close()
            events.append(f"rank {r} left")

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert events[0] == "rank 0 reported" and sorted(events[1:]) == ["rank 0 left", "rank 1 left"]


@pytest.mark.parametrize("where", ["between exchanges", "in on_rank0"])
def test_rank_0_stopping_with_an_exception_stops_the_ranks_waiting_for_it(tmp_path, where):
    def fail():
        raise OSError("disk full")

    def body(world):
        world.on_rank0(lambda: 1)
        if where == "in on_rank0":
            world.on_rank0(fail)
        elif world.rank == 0:
            fail()  # the others wait in the next exchange
        return world.all_gather(world.rank)

    outcomes = ranks(tmp_path / "out", 3, body)
    assert isinstance(outcomes[0], OSError)
    assert all(isinstance(o, RankStopped) and "rank 0 stopped" in str(o) for o in outcomes[1:])
    assert not (tmp_path / "out").exists()  # rank 0 made it, and removed it with its coordination folder


def test_a_coordination_folder_left_by_a_crashed_job_is_refused_with_the_same_run_id_and_cleared_otherwise(
        tmp_path):
    out = tmp_path / "out"
    (out / f"{FOLDER_PREFIX}none-0").mkdir(parents=True)
    (out / f"{FOLDER_PREFIX}none-0" / "0-0.pkl").write_bytes(b"stale")
    (out / "train-r00000-00000.bin").write_bytes(b"")
    world = World(0, 2, "none-0")
    with pytest.raises(UsageError, match=re.escape(f"{out / FOLDER_PREFIX}none-0 is there already") +
                       ".*its own --rdzv-id"):
        world.start(out)
    world.close()
    world = World(0, 2, "prep-1")
    world.start(out)  # a new run id: rank 0 clears the leftover with the earlier output, keeping its own
    (out / f"{FOLDER_PREFIX}notes").mkdir()
    (out / f"{FOLDER_PREFIX}notes" / "todo.txt").write_text("not ours")
    with pytest.raises(UsageError, match=f"holds files this tool did not write \\({re.escape(FOLDER_PREFIX)}notes\\)"):
        prepare_output(out, keep=world.folder)
    (out / f"{FOLDER_PREFIX}notes" / "todo.txt").unlink()
    assert prepare_output(out, keep=world.folder)
    assert sorted(p.name for p in out.iterdir()) == [f"{FOLDER_PREFIX}prep-1"]


def test_files_are_dealt_out_to_the_ranks_in_contiguous_ranges_of_about_equal_bytes():
    assert assign_files([10, 10, 10, 10], 2) == [range(0, 2), range(2, 4)]
    assert assign_files([50, 25, 25], 2) == [range(0, 1), range(1, 3)]
    assert assign_files([100, 1, 1, 1], 2) == [range(0, 1), range(1, 4)]
    assert assign_files([0, 0, 0, 0], 2) == [range(0, 2), range(2, 4)]  # empty files count too
    assert assign_files([7], 2) == [range(0, 0), range(0, 1)]  # fewer files than ranks: a rank gets none
    sizes = list(np.random.default_rng(0).integers(1, 1000, size=50))
    shares = assign_files(sizes, 4)
    assert [i for share in shares for i in share] == list(range(50))
    assert max(sum(sizes[i] for i in share) for share in shares) < sum(sizes) / 4 + max(sizes)


@pytest.mark.slow
@pytest.mark.parametrize("files", [4, 1])
def test_two_ranks_write_the_token_streams_and_counts_of_one_process(tmp_path, files):
    inputs = write_inputs(tmp_path, files)
    assert main([*map(str, inputs), "--output", str(tmp_path / "one"), *OPTIONS, "--workers", "0"]) == 0
    result = torchrun(*inputs, "--output", tmp_path / "two")
    assert result.returncode == 0, result.stderr

    one, two = read_manifest(tmp_path / "one"), read_manifest(tmp_path / "two")
    assert streams(tmp_path / "two") == streams(tmp_path / "one")
    assert one["splits"]["validation"]["documents"] > 0
    assert two["counts"] == one["counts"] and two["counts"]["skipped"]["total"] == files
    for split in ("train", "validation"):
        assert {k: two["splits"][split][k] for k in ("documents", "tokens")} == \
               {k: one["splits"][split][k] for k in ("documents", "tokens")}
    ranks = {shard["name"].split("-")[1] for split in two["splits"].values() for shard in split["shards"]}
    assert ranks == ({"r00000", "r00001"} if files > 1 else {"r00001"})  # one file: rank 0 has none
    assert result.stderr.count("preprocess: done:") == 1  # rank 0 reports for the job
    assert only_output_files(tmp_path / "two")  # the ranks' coordination folder is gone


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["broken gzip", "no text column"])
def test_a_failing_rank_fails_the_job_naming_the_rank_and_file_and_no_manifest_is_written(tmp_path, damage):
    inputs = write_inputs(tmp_path, 3)
    if damage == "broken gzip":  # found while reading: exit 1
        bad = tmp_path / "last.jsonl.gz"
        with gzip.open(bad, "wb") as f:
            f.write(inputs[0].read_bytes())
        bad.write_bytes(bad.read_bytes()[:-40])  # cut short
    else:  # found before anything is written: exit 2
        import pyarrow as pa
        import pyarrow.parquet as pq

        bad = tmp_path / "last.parquet"
        pq.write_table(pa.table({"body": ["a play"]}), bad)
    out = tmp_path / "out"
    result = torchrun(*inputs, bad, "--output", out)

    assert result.returncode != 0
    assert f"rank 1: {bad}" in result.stderr, result.stderr  # the last file is rank 1's
    assert not (out / "manifest.json").exists()
    if damage == "no text column":
        assert not out.exists()
    else:
        assert only_output_files(out)
