"""What a relaunch may change before it resumes its dump folder's checkpoint, checked at start-up before the
run writes anything.

Every checkpoint holds run.json: the resolved config that wrote it, and what that config leaves implicit
(the global batch under global_batch_size = -1, the world size and layout, the tokenizer's fingerprint).
It lives in the checkpoint rather than in the dump folder's config.toml because it is committed with
the checkpoint (a save cut short leaves none), travels with it when the folder is moved or set aside,
and says what wrote that very checkpoint, where config.toml says what the latest launch asked for.

A change that makes the checkpoint unusable is refused, naming old -> new and the ways on: the model's
weights (any model.* or moe.* key that changes a weight's name or shape), the tokenizer's contents, and
the form of the state a part of the checkpoint holds (training.dataset, optimizer.name,
training.spike_window; for the hf loader also the global batch size, which decides its streams) unless that
part is left out with checkpoint.exclude_from_loading. The layout and the number of processes may change. Any other
change of what the run computes is allowed and named in one line.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path

import torch

from components.checkpoint.dcp import RUN_RECORD, mismatch, saved_entries, step_folders
from components.checkpoint.integrity import unused_name
from components.config import Config, ConfigError
from components.data.packed_format import tokenizer_fingerprint
from components.run.stopping import PREEMPTED_FILE

logger = logging.getLogger(__name__)

STATE_KINDS = {"training.dataset": "dataloader", "optimizer.name": "optimizer", "training.spike_window": "step_guard"}
"""Keys that decide the form of a part of the checkpoint, by that part."""
NAMED_SECTIONS = ("model", "moe", "optimizer", "lr_scheduler", "training", "float8")
"""Where a changed key changes what the run computes; the other sections say how it runs or what it reports."""
NOT_NAMED = {"training.global_batch_size", "training.dataloader_workers"}
"""The global batch is named by its resolved value; the loader's worker count changes nothing computed."""
MOST_LINES = 8


def run_record(config: Config, global_batch: int, world_size: int, layout: str) -> dict:
    """What a checkpoint records of the run that wrote it (its run.json)."""
    return {"config": dataclasses.asdict(config), "global_batch": global_batch, "world_size": world_size,
            "layout": layout, "tokenizer": tokenizer_fingerprint(config.model.tokenizer_path)}


def _read_record(checkpoint: Path) -> dict:
    """A checkpoint's run record; {} where it has none (written before run records) or an unreadable one
    (the resume then finds the checkpoint damaged: run.json is in its integrity record)."""
    try:
        return json.loads((checkpoint / RUN_RECORD).read_text())
    except (OSError, ValueError):
        return {}


def _flat(record: dict) -> dict[str, object]:
    return {f"{section}.{key}": value for section, values in record.get("config", {}).items()
            for key, value in values.items()}


def _shown(value) -> str:
    if value is None:
        return "unset"
    return ",".join(map(str, value)) if isinstance(value, list) else str(value)


def _changed(old: dict, new: dict, keys) -> list[str]:
    return [f"{key} {_shown(old[key])} → {_shown(new[key])}" for key in keys if key in old and old[key] != new[key]]


def check_resume(config: Config, dump_folder: Path, weights: dict[str, torch.Tensor], record: dict) -> None:
    """On rank 0, before the run writes anything: refuse a config that cannot resume the folder's newest
    checkpoint, apply checkpoint.fresh_start, and name what a resume changes. `weights`: the new model's
    state dict (on the meta device will do); `record`: its run_record."""
    newest = next(reversed(step_folders(dump_folder / config.checkpoint.folder).items()), None)
    saved = _read_record(newest[1]) if newest else {}
    refusals = _refusals(config, newest[1], saved, weights, record) if newest else []
    if config.checkpoint.fresh_start:
        if newest is None or refusals or not _flat(saved).get("checkpoint.fresh_start"):
            _set_aside(config, dump_folder)
            return
        logger.info(f"checkpoint.fresh_start: {newest[1]} was written by a fresh start of this model and data: "
                    "resuming it, as a relaunch should; to start over again, use a new --job.dump_folder")
    if newest is None:
        return
    step, path = newest
    if refusals:
        head, lines = refusals[0], refusals[1:]
        if len(lines) > MOST_LINES:
            lines = [*lines[:MOST_LINES], f"and {len(lines) - MOST_LINES} more"]
        raise ConfigError(
            head + "\n" + "".join(f"  {line}\n" for line in lines)
            + f"Either give this run its own --job.dump_folder, or start afresh here with --checkpoint.fresh_start "
            f"true (the earlier run's checkpoints, metrics and config move to {dump_folder / 'set_aside'}/<time>/)"
        )
    old, new = _flat(saved), _flat(record)
    changes = [f"global batch {saved['global_batch']} → {record['global_batch']}"] \
        if saved and saved["global_batch"] != record["global_batch"] else []
    if saved and saved["layout"] != record["layout"]:
        before, after = (dict(item.split("=") for item in r["layout"].split()) for r in (saved, record))
        moved = [f"{name} {before.get(name, 1)} → {after.get(name, 1)}" for name in dict.fromkeys([*before, *after])
                 if before.get(name) != after.get(name)]
        changes.append(f"layout {', '.join(moved)} ({saved['world_size']} → {record['world_size']} processes)")
    changes += _changed(old, new, [key for key in new if key.partition(".")[0] in NAMED_SECTIONS
                                   and key not in NOT_NAMED])
    if changes and step >= config.training.steps:
        logger.warning(f"{dump_folder} holds a finished run (its checkpoint is at step {step}): this launch's changes "
                       f"({', '.join(changes)}) apply to no step; for a run of its own, give it its own "
                       "--job.dump_folder")
    elif changes:
        logger.info(f"resuming step {step} with changes since it was saved: {', '.join(changes)}")
    if config.checkpoint.initial_load_path:
        logger.warning(f"checkpoint.initial_load_path {config.checkpoint.initial_load_path} is not loaded: this "
                       f"folder's own checkpoint {path} wins, so that a relaunch continues its run; to start from it "
                       "instead, use a new --job.dump_folder or --checkpoint.fresh_start true")


def _refusals(config: Config, path: Path, saved: dict, weights: dict[str, torch.Tensor], record: dict) -> list[str]:
    """Why the checkpoint at `path` is unusable under `config`: a first line, then what differs, one line
    each; [] when it is usable. `saved`: its run record ({} for a checkpoint written before run records)."""
    old, new = _flat(saved), _flat(record)
    lines = []
    try:
        misfit = mismatch(saved_entries(path), weights, set(weights))
    except Exception:  # noqa: BLE001 - a damaged .metadata: the resume names it and falls back to an older checkpoint
        misfit = None
    if misfit:
        lines += _changed(old, new, [key for key in new if key.partition(".")[0] in ("model", "moe")
                                     and key != "model.tokenizer_path"])
    if saved and saved["tokenizer"] != record["tokenizer"]:
        lines.append(f"model.tokenizer_path {_shown(old['model.tokenizer_path'])} → {config.model.tokenizer_path}: "
                     "another tokenizer (its contents differ), so the token ids mean other text")
    for key, part in STATE_KINDS.items():
        if part not in config.checkpoint.exclude_from_loading and key in old and old[key] != new[key]:
            lines.append(f"{key} {old[key]} → {new[key]}: the checkpoint's {part} state does not fit the new one "
                         f"(or resume without it: --checkpoint.exclude_from_loading {part})")
    if saved and "dataloader" not in config.checkpoint.exclude_from_loading and old.get("training.dataset") == "hf" \
            and new["training.dataset"] == "hf":
        way_on = ("resume without the data position (the data starts again from its beginning): "
                  "--checkpoint.exclude_from_loading dataloader")
        if saved["global_batch"] != record["global_batch"]:
            lines.append(f"global batch {saved['global_batch']} → {record['global_batch']}: the hf loader reads one "
                         "stream of the data per sequence of the global batch (docs/data.md), so another global batch "
                         f"reads other streams; resume with a global batch of {saved['global_batch']}, or {way_on}")
        elif any(name.startswith("dataloader.dp_rank_") for name in _entries(path)):
            lines.append("the checkpoint's hf data position was saved per data-parallel rank, by an earlier ingot: "
                         f"it cannot be carried to the streams of this one; {way_on}")
    if misfit:
        return [f"checkpoint {path} does not fit this model: {misfit} (check model.flavor and the model.* overrides)",
                *lines]
    return [f"checkpoint {path} cannot be resumed under this config:", *lines] if lines else []


def _entries(path: Path) -> dict:
    try:
        return saved_entries(path)
    except Exception:  # noqa: BLE001 - a damaged .metadata: the resume names it and falls back to an older checkpoint
        return {}


def _set_aside(config: Config, dump_folder: Path) -> None:
    """checkpoint.fresh_start: move what the earlier run left (its checkpoints last, so that a move cut
    short is redone by the next launch) to <dump_folder>/set_aside/<time>/; nothing is deleted."""
    names = ["metrics.jsonl", config.metrics.save_tb_folder, "hf", PREEMPTED_FILE,
             config.profiling.save_traces_folder, "config.toml", config.checkpoint.folder]
    found = [dump_folder / name for name in names if (dump_folder / name).exists()]
    if not found:
        return
    destination = unused_name(dump_folder / "set_aside" / time.strftime("%Y%m%d-%H%M%S"), "")
    destination.mkdir(parents=True)
    for path in found:
        path.rename(destination / path.name)
    logger.info(f"checkpoint.fresh_start: moved the earlier run's {', '.join(p.name for p in found)} to "
                f"{destination}; training starts at step 1")
