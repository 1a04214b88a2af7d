"""Helpers to run the trainer from tests: in this process (fast) or under torchrun (several ranks)."""

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# A small but real configuration: the debug model's shape on the shipped corpus, cut for speed.
TINY = [
    "--job.config_file", "debug_model.toml", "--model.n_layers", "2", "--training.seq_len", "64",
    "--training.local_batch_size", "4", "--lr_scheduler.warmup_steps", "2", "--checkpoint.enable", "false",
    "--metrics.enable_tensorboard", "false",
]


def tiny_model_args(**overrides):
    """A model small enough for exact comparisons in milliseconds."""
    from models.llama3.model import ModelArgs

    args = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=97, max_seq_len=32, multiple_of=32)
    return ModelArgs(**(args | overrides))


def build_model(args, seed: int = 0):
    """A model built on meta and initialized with `init_weights`, as train.py does on one CPU."""
    import torch

    from models.llama3.model import Transformer

    torch.manual_seed(seed)
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    model.init_weights()
    return model


def metric_lines(dump: Path) -> list[dict]:
    """Every record of a run's metrics.jsonl as written, repeats included (tests check what was
    written; components.metrics.read_metrics is the reader that keeps one record per step)."""
    return [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]


def losses(dump: Path) -> dict[int, float]:
    """step -> loss; a resumed run's later entries replace the earlier ones."""
    return {m["step"]: m["loss"] for m in metric_lines(dump) if "loss" in m}


def val_losses(dump: Path) -> dict[int, float]:
    return {m["step"]: m["val_loss"] for m in metric_lines(dump) if "val_loss" in m}


@pytest.fixture
def train_in_process():
    """Run train.main in this process (one rank) and return its exit code."""
    sys.path.insert(0, str(REPO))
    import train

    return train.main


def read_csv(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.fixture
def no_launch(monkeypatch):
    """Fail the test if the sweep runner launches anything; no GPUs (so no torch import either)."""
    from scripts.sweep import launch

    def refuse(*args, **kwargs):
        raise AssertionError(f"launched {args}")

    monkeypatch.setattr(launch.subprocess, "Popen", refuse)
    monkeypatch.setattr(launch, "visible_gpus", lambda: [])


def torchrun(nproc: int, args: list[str], timeout: int = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           str(REPO / "train.py"), *args]
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        raise AssertionError(f"torchrun failed ({result.returncode}):\n"
                             f"{result.stdout[-3000:]}\n{result.stderr[-5000:]}")
    return result


def pytest_collection_modifyitems(config, items):
    """cuda-marked tests skip cleanly on a machine without a CUDA GPU."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
