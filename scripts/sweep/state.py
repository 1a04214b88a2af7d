"""A run's state on disk: the sweep's record of it (sweep_run.json), how far its metrics reach and its
newest checkpoint. All of a sweep's state lives in these files, so a sweep can be re-run at any time:
a complete run is skipped and any other one resumes from its checkpoint or starts again."""

from __future__ import annotations

import json
import os
from pathlib import Path

from components.metrics.reporting import read_metrics
from scripts.sweep.plan import Run

STATE_FILE = "sweep_run.json"


def read_state(dump: Path) -> dict:
    try:
        return json.loads((dump / STATE_FILE).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def write_state(dump: Path, state: dict) -> None:
    tmp = dump / f".{STATE_FILE}.tmp"
    tmp.write_text(json.dumps(state, indent=2) + "\n")
    os.replace(tmp, dump / STATE_FILE)  # atomic: a killed sweep never leaves half a file


def last_logged_step(steps: int, log_freq: int) -> int:
    """The last step train.py logs: step 1 and every log_freq-th step."""
    log_freq = max(log_freq, 1)
    return max(1, steps - steps % log_freq) if steps >= 1 else 0


def newest_checkpoint(dump: Path, folder: str = "checkpoint") -> int | None:
    """The step of the newest complete checkpoint (the rule of components.checkpoint.dcp.step_folders:
    DCP writes .metadata last), read from the folder names alone."""
    steps = [int(p.name[5:]) for p in (dump / folder).glob("step-*")
             if p.name[5:].isdigit() and (p / ".metadata").is_file()]
    return max(steps) if steps else None


def is_complete(run: Run) -> bool:
    """Done by the sweep's record and by the metrics: both, so that neither a stale status nor
    metrics copied from elsewhere is trusted alone."""
    if read_state(run.dump).get("status") != "done":
        return False
    train, _ = read_metrics(run.dump / "metrics.jsonl")
    return bool(train) and train[-1]["step"] >= last_logged_step(run.config.training.steps, run.config.metrics.log_freq)


def next_action(run: Run) -> tuple[str, str]:
    """skip (complete), resume (from a checkpoint) or start, with a few words for the log."""
    if is_complete(run):
        return "skip", "done"
    step = newest_checkpoint(run.dump, run.config.checkpoint.folder)
    if step is not None:
        return "resume", f"from checkpoint step-{step}"
    status = read_state(run.dump).get("status")
    return "start", (f"again, from scratch (was {status}, no checkpoint)" if status else "")
