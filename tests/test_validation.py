"""Validation loss: the logged value equals the loss computed by hand on the same windows."""

import json
import math

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from conftest import REPO, TINY, metric_lines, val_losses

from components.config import load_config
from components.data.tokenizer import build_tokenizer
from models.families import model_config_class
from models.llama3 import Transformer, build_model_args

pytestmark = pytest.mark.slow

VALIDATION = ["--validation.enable", "true", "--validation.freq", "2", "--validation.steps", "2"]


def hand_validation_loss(args: list[str], checkpoint) -> float:
    """Mean next-token loss of the checkpoint's model on the first 2 x 4 windows of the validation
    documents, packed as BOS + tokens + EOS and cut into windows of seq_len + 1 tokens."""
    config = load_config(args, model_config_class)
    tokenizer = build_tokenizer(REPO / config.model.tokenizer_path)
    model = Transformer(build_model_args(config, tokenizer.vocab_size))
    weights = model.state_dict()
    dcp.load({"model": weights}, checkpoint_id=str(checkpoint))
    model.load_state_dict(weights)
    window, needed = config.training.seq_len + 1, 2 * 4 * (config.training.seq_len + 1)
    stream = []
    with open(REPO / config.validation.dataset_path[0]) as f:
        for line in f:
            stream += tokenizer.encode(json.loads(line)["text"], bos=True, eos=True)
            if len(stream) >= needed:
                break
    windows = torch.tensor(stream[:needed]).view(-1, window)
    with torch.no_grad():
        logits = model(windows[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten()).item()


def test_validation_loss_matches_a_hand_computation(tmp_path, train_in_process):
    args = [*TINY, *VALIDATION, "--training.steps", "4", "--checkpoint.enable", "true", "--checkpoint.interval", "4",
            "--job.dump_folder", str(tmp_path)]
    assert train_in_process(args) == 0
    logged = val_losses(tmp_path)
    assert sorted(logged) == [2, 4]
    assert logged[4] == pytest.approx(hand_validation_loss(args, tmp_path / "checkpoint" / "step-4"), rel=1e-5)
    record = next(m for m in metric_lines(tmp_path) if m.get("val_loss") == logged[4])
    assert record["val_perplexity"] == pytest.approx(math.exp(logged[4]))


def test_bad_validation_settings_are_refused(tmp_path, train_in_process, capsys):
    args = [*TINY, "--validation.enable", "true", "--validation.steps", "0", "--job.dump_folder", str(tmp_path)]
    assert train_in_process(args) == 2
    assert "validation.steps must be >= 1, got 0" in capsys.readouterr().err


def test_each_named_validation_source_gets_its_own_loss(tmp_path, train_in_process):
    """Two sources: the one reading the default file logs the same loss as a run validating on it
    alone, under its own name; the other source's loss differs."""
    single = [*TINY, *VALIDATION, "--training.steps", "2"]
    assert train_in_process([*single, "--job.dump_folder", str(tmp_path / "one")]) == 0
    sources = "plays=tests/assets/shakespeare/validation.jsonl,tests/assets/shakespeare/train.jsonl"
    assert train_in_process([*single, "--validation.dataset_path", sources,
                             "--job.dump_folder", str(tmp_path / "two")]) == 0
    record = next(m for m in metric_lines(tmp_path / "two") if "val_loss/plays" in m)
    assert "val_loss" not in record and record["step"] == 2
    assert record["val_loss/plays"] == val_losses(tmp_path / "one")[2]
    assert record["val_loss/train"] != record["val_loss/plays"]
    assert record["val_perplexity/train"] == pytest.approx(math.exp(record["val_loss/train"]))


def test_two_validation_sources_of_one_name_are_refused(tmp_path, train_in_process, capsys):
    sources = "tests/assets/shakespeare/validation.jsonl,validation=tests/assets/shakespeare/train.jsonl"
    assert train_in_process([*TINY, *VALIDATION, "--validation.dataset_path", sources,
                             "--job.dump_folder", str(tmp_path)]) == 2
    assert "validation.dataset_path names two sources 'validation'" in capsys.readouterr().err
