"""Validation loss: the logged value equals the loss computed by hand on the same windows."""

import json
import math

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from conftest import REPO, TINY, metric_lines, val_losses

from components.config import load_config
from components.tokenizer import build_tokenizer
from models.llama3 import Transformer, build_model_args

pytestmark = pytest.mark.slow

VALIDATION = ["--validation.enable", "true", "--validation.freq", "2", "--validation.steps", "2"]


def hand_validation_loss(args: list[str], checkpoint) -> float:
    """Mean next-token loss of the checkpoint's model on the first 2 x 4 windows of the validation
    documents, packed as BOS + tokens + EOS and cut into windows of seq_len + 1 tokens."""
    config = load_config(args)
    tokenizer = build_tokenizer(REPO / config.model.tokenizer_path)
    model = Transformer(build_model_args(config, tokenizer.vocab_size))
    weights = model.state_dict()
    dcp.load({"model": weights}, checkpoint_id=str(checkpoint))
    model.load_state_dict(weights)
    window, needed = config.training.seq_len + 1, 2 * 4 * (config.training.seq_len + 1)
    stream = []
    with open(REPO / config.validation.dataset_path) as f:
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
    assert "validation.freq and validation.steps must be >= 1" in capsys.readouterr().err
