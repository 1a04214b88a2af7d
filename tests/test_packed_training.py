"""Training on packed data end to end: preprocess the shipped corpus, train, validate, resume
exactly, also under another data-parallel degree."""

import shutil

import pytest
from conftest import REPO, TINY, losses, torchrun, val_losses

from scripts.preprocess import main as preprocess

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    folder = tmp_path_factory.mktemp("data") / "shakespeare"
    corpus = REPO / "tests" / "assets" / "shakespeare" / "train.jsonl"
    assert preprocess([str(corpus), "--output", str(folder), "--val-fraction", "0.05", "--workers", "2"]) == 0
    return folder


def packed_args(folder, steps):
    return [*TINY, "--training.dataset", "packed", "--training.dataset_path", str(folder),
            "--training.steps", str(steps), "--training.dataloader_workers", "1",
            "--validation.enable", "true", "--validation.dataset_path", str(folder),
            "--validation.freq", "3", "--validation.steps", "2"]


def test_trains_validates_and_resumes_exactly(packed, tmp_path, train_in_process):
    straight = tmp_path / "straight"
    assert train_in_process([*packed_args(packed, 6), "--job.dump_folder", str(straight)]) == 0
    curve = losses(straight)
    assert sorted(curve) == list(range(1, 7)) and curve[6] < curve[1]
    assert sorted(val_losses(straight)) == [3, 6]

    resumed = tmp_path / "resumed"
    checkpoints = ["--checkpoint.enable", "true", "--checkpoint.interval", "3", "--job.dump_folder", str(resumed)]
    assert train_in_process([*packed_args(packed, 6), *checkpoints]) == 0
    shutil.rmtree(resumed / "checkpoint" / "step-6")
    (resumed / "metrics.jsonl").write_text("")
    assert train_in_process([*packed_args(packed, 6), *checkpoints]) == 0
    assert losses(resumed) == {step: loss for step, loss in curve.items() if step > 3}
    assert val_losses(resumed) == {6: val_losses(straight)[6]}


def test_resume_under_another_data_parallel_degree(packed, tmp_path, train_in_process):
    """Saved by 2 FSDP ranks at step 3, resumed by 1 process: the same batches follow."""
    reference = tmp_path / "reference"
    assert train_in_process([*packed_args(packed, 6), "--job.dump_folder", str(reference)]) == 0
    dump = tmp_path / "run"
    checkpoints = ["--checkpoint.enable", "true", "--checkpoint.interval", "3", "--job.dump_folder", str(dump)]
    two_ranks = ["--parallelism.data_parallel_shard_degree", "2", "--training.local_batch_size", "2"]
    torchrun(2, [*packed_args(packed, 6), *two_ranks, *checkpoints])
    shutil.rmtree(dump / "checkpoint" / "step-6")
    (dump / "metrics.jsonl").write_text("")
    assert train_in_process([*packed_args(packed, 6), *checkpoints]) == 0
    got, expected = losses(dump), losses(reference)
    assert sorted(got) == [4, 5, 6]
    for step in got:
        assert got[step] == pytest.approx(expected[step], rel=1e-4)


def test_tokenizer_mismatch_is_refused(packed, tmp_path, train_in_process, capsys):
    other = REPO / "tests" / "assets" / "tokenizers" / "gpt2.tiktoken"
    args = [*packed_args(packed, 1), "--model.tokenizer_path", str(other), "--job.dump_folder", str(tmp_path)]
    assert train_in_process(args) == 2
    err = capsys.readouterr().err
    assert "was tokenized with " in err and f"but model.tokenizer_path is {other} (sha256:" in err


def test_validation_on_fewer_windows_than_asked_uses_them_and_says_so_once(tmp_path, train_in_process, capsys):
    """The README's packed + validation command on the default split (1% of documents held out): the
    validation split holds fewer windows than validation.steps x batch, so every validation uses what
    there is, the run says so once, and the final checkpoint is written."""
    folder = tmp_path / "corpus"
    corpus = REPO / "tests" / "assets" / "shakespeare" / "train.jsonl"
    assert preprocess([str(corpus), "--output", str(folder), "--workers", "1"]) == 0
    dump = tmp_path / "run"
    args = [*TINY, "--training.dataset", "packed", "--training.dataset_path", str(folder), "--validation.enable",
            "true", "--validation.dataset_path", str(folder), "--validation.freq", "2", "--validation.steps", "1000",
            "--training.steps", "4", "--checkpoint.enable", "true", "--job.dump_folder", str(dump)]
    assert train_in_process(args) == 0
    assert sorted(val_losses(dump)) == [2, 4] and val_losses(dump)[2] != val_losses(dump)[4]
    err = capsys.readouterr().err
    assert err.count("fewer than validation.steps 1000: validating on those") == 1
    assert (dump / "checkpoint" / "step-4").is_dir()
