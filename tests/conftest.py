"""Helpers to run the trainer from tests: in this process (fast) or under torchrun (several ranks)."""

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


def read_metrics(dump: Path) -> list[dict]:
    return [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]


def losses(dump: Path) -> dict[int, float]:
    """step -> loss; a resumed run's later entries replace the earlier ones."""
    return {m["step"]: m["loss"] for m in read_metrics(dump)}


@pytest.fixture
def train_in_process():
    """Run train.main in this process (one rank) and return its exit code."""
    sys.path.insert(0, str(REPO))
    import train

    return train.main


def torchrun(nproc: int, args: list[str], timeout: int = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), str(REPO / "train.py"), *args]
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        raise AssertionError(f"torchrun failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}")
    return result
