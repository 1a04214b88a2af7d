"""Distributed checkpoints (torch.distributed.checkpoint) of everything a run needs to continue.

A checkpoint is the folder <dump_folder>/<checkpoint.folder>/step-N holding the model, optimizer,
LR scheduler, data loader position, RNG states, the step guard's statistics and the step. Each rank
writes its own shards, and DCP reshards on load, so a checkpoint saved under one parallel layout
loads under another. A checkpoint becomes visible only once complete on every rank, with sizes and
checksums of its files (checkpoint_integrity.py). A run whose dump folder already holds checkpoints
resumes from the newest intact one; otherwise it may start from the weights in
`checkpoint.initial_load_path`: a DCP checkpoint or a Hugging Face folder.
"""

from __future__ import annotations

import json
import logging
import random
import re
import shutil
import time
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.checkpoint.stateful import Stateful

from components.checkpoint.disk_full import DiskFull, causes, out_of_space
from components.checkpoint.integrity import (
    PARTIAL_SUFFIX,
    CommittingWriter,
    check_checkpoint,
    listed_files,
    unused_name,
)
from components.checkpoint.staging import Stager
from components.config import DTYPES, Checkpoint as CheckpointConfig, ConfigError
from components.run.heartbeat import is_lost_peer, is_timeout
from components.torch_private import stop_async_checkpoint_process

logger = logging.getLogger(__name__)

LEFTOVER = re.compile(rf"({re.escape(PARTIAL_SUFFIX)}|\.deleting|\.replaced)(-\d+)?$")
"""What an interrupted save, replacement or deletion leaves (unused_name may append -2, -3...)."""
DAMAGED = re.compile(r"step-(\d+)\.damaged(?:-(\d+))?")
RUN_RECORD = "run.json"
"""In every checkpoint: the resolved config that wrote it and what the config leaves implicit
(components/checkpoint/resume.py)."""
MISSING_KEY = re.compile(r"Missing key in checkpoint state_dict: (\S+)\.$")
SIZE_MISMATCH = re.compile(r"Size mismatch between saved (.+) and current: (.+) for (\S+)$")
WRITTEN_BY = {"dataloader": "the other training.dataset kind", "optimizer": "another optimizer.name",
              "step_guard": "another training.spike_window", "lr_scheduler": "another version"}
"""The parts a resume may leave out, and what usually wrote one that this run's state cannot read."""


@contextmanager
def one_process():
    """Silence DCP's warning that, without a process group (or with no_dist), it assumes one process:
    here it should."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


class ModelState(Stateful):
    """The weights of all model parts (pipeline stages) of this rank, keyed by parameter name as in
    the whole model, so that the keys do not depend on the layout."""

    def __init__(self, model_parts: list[nn.Module]):
        self.model_parts = model_parts

    def state_dict(self) -> dict:
        return {k: v for part in self.model_parts for k, v in get_model_state_dict(part).items()}

    def load_state_dict(self, state_dict: dict) -> None:
        # DCP has already checked that every key of this rank's parts was in the checkpoint; each
        # part takes its own keys from the merged dict.
        for part in self.model_parts:
            set_model_state_dict(part, state_dict, options=StateDictOptions(strict=False))


class TrainState(Stateful):
    """The step counter and the RNG states. Every rank seeds alike and draws alike, so one copy of
    the RNG states (DCP keeps one of identical entries) serves every rank and any layout."""

    def __init__(self):
        self.step = 0

    def state_dict(self) -> dict:
        state = {"step": self.step, "rng_cpu": torch.get_rng_state(), "rng_python": random.getstate()}
        if torch.cuda.is_available():
            state["rng_cuda"] = torch.cuda.get_rng_state()
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        self.step = int(state_dict["step"])
        torch.set_rng_state(state_dict["rng_cpu"])
        random.setstate(state_dict["rng_python"])
        if "rng_cuda" in state_dict:
            torch.cuda.set_rng_state(state_dict["rng_cuda"])


def step_folders(folder: Path) -> dict[int, Path]:
    """Committed checkpoints by step: folders named exactly step-N (see checkpoint_integrity.py;
    a save in progress or interrupted is step-N.partial)."""
    found = {}
    if folder.is_dir():
        for path in folder.iterdir():
            match = re.fullmatch(r"step-(\d+)", path.name)
            if match and path.is_dir():
                found[int(match.group(1))] = path
    return dict(sorted(found.items()))


def agreed_problems(problem: str | None) -> list[str]:
    """Every rank's finding (None: nothing wrong), so that all ranks take the same decision."""
    found = [None] * dist.get_world_size()
    dist.all_gather_object(found, problem)
    return [p for p in found if p]


def intact(path: Path, verify_checksums: bool) -> str | None:
    """What is wrong with a checkpoint (the same answer on every rank), or None. The ranks share
    the checksum reading: each verifies every world_size-th file."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = set(listed_files(path)[rank::world])
    problems = agreed_problems(check_checkpoint(path, verify_checksums, mine))
    return problems[0] if problems else None


def saved_entries(path: Path) -> dict:
    """The tensors and values a DCP checkpoint holds, by flattened key ("model.layers.0...")."""
    return dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata


def mismatch(saved: dict, weights: dict[str, torch.Tensor], model_names: set[str]) -> str | None:
    """The first difference between the model and the checkpoint's weights: one of this rank's
    `weights` whose global shape differs or that the checkpoint lacks, or a checkpoint weight that
    is none of `model_names` (the whole model's, all ranks together), e.g. a layer more. `saved`:
    the checkpoint's saved_entries."""
    for name, tensor in weights.items():
        entry = saved.get(f"model.{name}")
        if entry is None:
            return f"model weight {name} is not in the checkpoint"
        if tuple(entry.size) != tuple(tensor.shape):
            return (f"model weight {name} has shape {tuple(entry.size)} in the checkpoint "
                    f"and {tuple(tensor.shape)} in this model")
    extra = sorted(key.removeprefix("model.") for key in saved
                   if key.startswith("model.") and key.removeprefix("model.") not in model_names)
    if extra:
        return f"the checkpoint has model weight {extra[0]}, which this model lacks"
    return None


def is_hf_folder(path: Path) -> bool:
    """A Hugging Face model folder: config.json and safetensors weights."""
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def is_model_only(saved: dict) -> bool:
    return not any(key.startswith("train_state.") for key in saved)


def unreadable_part(path: Path, error: CheckpointException) -> ConfigError | None:
    """A DCP load that failed because a part of the checkpoint that a resume may leave out lacks a key
    of this run's state or holds it in another shape, as a clear error naming the part and the ways on;
    None for any other failure."""
    for exception, _ in error.failures.values():
        missing, resized = MISSING_KEY.search(str(exception)), SIZE_MISMATCH.search(str(exception))
        key = missing.group(1) if missing else resized.group(3) if resized else ""
        part = key.partition(".")[0]
        if part in WRITTEN_BY:
            detail = (f"it has no {key}" if missing else
                      f"its {key} has shape {resized.group(1)}, this run's {resized.group(2)}")
            return ConfigError(
                f"{path} does not fit this run's {part} state: {detail} (written e.g. by {WRITTEN_BY[part]}). "
                f"Resume without it with --checkpoint.exclude_from_loading {part}, or start anew: a new "
                "--job.dump_folder, or --checkpoint.fresh_start true"
            )
    return None


class CheckpointManager:
    def __init__(self, cfg: CheckpointConfig, dump_folder: Path, model_parts: list[nn.Module], optimizers: Stateful,
                 lr_schedule: Stateful, dataloader, train_state: TrainState, step_guard: Stateful, total_steps: int,
                 device: torch.device, load_hf: Callable[[Path], None], run_record: dict | None = None,
                 outer_step: Stateful | None = None):
        """`load_hf(path)` loads the weights of a Hugging Face folder into the model parts
        (components.hf.load.load_hf_weights), for an initial_load_path that is one. `run_record` is written
        into every checkpoint as run.json. `outer_step`: DiLoCo's state (components/distributed/diloco.py), saved
        too."""
        self.cfg, self.total_steps = cfg, total_steps
        self.extra_files = {RUN_RECORD: json.dumps(run_record, indent=1)} if run_record else {}
        self.load_hf = load_hf
        self.folder = dump_folder / cfg.folder
        self.states = {
            "model": ModelState(model_parts),
            "optimizer": optimizers,
            "lr_scheduler": lr_schedule,
            "dataloader": dataloader,
            "train_state": train_state,
            "step_guard": step_guard,
        } | ({"outer_step": outer_step} if outer_step is not None else {})
        excludable = [name for name in self.states if name != "train_state"]
        unknown = [name for name in cfg.exclude_from_loading if name not in excludable]
        if unknown:
            raise ConfigError(
                f"checkpoint.exclude_from_loading: {', '.join(map(repr, unknown))} is not a part a resume can leave "
                f"out; choose among {', '.join(excludable)} (train_state holds the step a run resumes at: to count "
                "from 0 again, start a new dump folder with checkpoint.initial_load_path)"
            )
        if cfg.last_save_in_hf and not cfg.enable:
            raise ConfigError("checkpoint.last_save_in_hf exports the final checkpoint: it needs checkpoint.enable")
        self.pending, self.pending_step = None, None
        self.last_saved = None
        self.async_kwargs = {}
        self.mode, self.stager = cfg.async_mode, None
        if self.mode == "async":
            # A group of its own, so that the background save never interleaves its collectives
            # with the training step's.
            self.async_kwargs = {"process_group": dist.new_group(backend="gloo")}
        elif self.mode == "async_with_pinned_mem":
            self.stager = Stager(device)

    def load(self) -> int:
        """Restore the newest intact checkpoint of this run, or the initial weights; return the step
        to continue after (0 for a fresh start). A damaged checkpoint is named, renamed
        step-N.damaged (kept for inspection) and the next older one tried."""
        if dist.get_rank() == 0:
            self._remove_leftovers()
        damaged, newest_intact = [], None
        for step, path in reversed(step_folders(self.folder).items()):
            problem = intact(path, self.cfg.checksums)
            if problem is None:
                newest_intact = step, path
                break
            damaged.append(f"{path.name}: {problem}")
            logger.warning(f"checkpoint {path} is damaged ({problem}); skipping it")
            if dist.get_rank() == 0:
                path.rename(unused_name(path, ".damaged"))
            dist.barrier()
        if dist.get_rank() == 0:
            self._bound_damaged()
        if newest_intact is not None:
            return self._resume(*newest_intact)
        if damaged:
            raise ValueError(
                f"no intact checkpoint in {self.folder} ({'; '.join(damaged)}); they were renamed *.damaged. "
                f"Rerun to start from step 0, or use another job.dump_folder"
            )
        if self.cfg.initial_load_path:
            return self._load_weights(Path(self.cfg.initial_load_path))
        return 0

    def _remove_leftovers(self) -> None:
        """Folders of saves, replacements or deletions that a killed run left behind; never read, so removed."""
        if not self.folder.is_dir():
            return
        for path in sorted(self.folder.iterdir()):
            if path.is_dir() and LEFTOVER.search(path.name):
                logger.info(f"removing {path}, left by an interrupted save or deletion")
                shutil.rmtree(path, ignore_errors=True)

    def _bound_damaged(self) -> None:
        """Name the damaged checkpoints kept for inspection, with their sizes, and delete all but the
        newest checkpoint.keep_damaged of them."""
        found = sorted((path for path in self.folder.glob("step-*.damaged*") if DAMAGED.fullmatch(path.name)),
                       key=lambda path: tuple(int(n or 1) for n in DAMAGED.fullmatch(path.name).groups()))
        keep = max(self.cfg.keep_damaged, 0)
        doomed, kept = found[: len(found) - keep], found[len(found) - keep:]
        for path in doomed:
            shutil.rmtree(path.rename(unused_name(path, ".deleting")), ignore_errors=True)
        if kept:
            sizes = ", ".join(f"{path.name} ({folder_bytes(path) / 2**30:.2f} GiB)" for path in kept)
            logger.warning(f"damaged checkpoints kept for inspection in {self.folder}: {sizes}"
                           + (f"; {len(doomed)} older one(s) deleted" if doomed else "")
                           + f" (checkpoint.keep_damaged = {keep})")

    def _check_fits(self, path: Path, saved: dict) -> None:
        weights = self.states["model"].state_dict()
        names = [None] * dist.get_world_size()  # under PP each rank holds some of the weights
        dist.all_gather_object(names, list(weights))
        problems = agreed_problems(mismatch(saved, weights, {name for part in names for name in part}))
        if problems:
            raise ValueError(f"checkpoint {path} does not fit this model: {problems[0]} "
                             "(check model.flavor and the model.* overrides)")

    def _resume(self, step: int, path: Path) -> int:
        saved = saved_entries(path)
        if is_model_only(saved):
            if step != 0:
                raise ValueError(
                    f"{path} holds model weights only and cannot resume a run; start a new dump folder "
                    f"with --checkpoint.initial_load_path {path}"
                )
            return self._load_weights(path)
        self._check_fits(path, saved)
        states = {name: state for name, state in self.states.items() if name not in self.cfg.exclude_from_loading}
        if self.cfg.exclude_from_loading:
            logger.info(f"resuming without the checkpoint's {', '.join(self.cfg.exclude_from_loading)} "
                        "(checkpoint.exclude_from_loading): they start afresh")
        if "step_guard" in states and not any(key.startswith("step_guard.") for key in saved):
            logger.warning(f"{path} predates the step guard's state: its counters and spike window start empty")
            states = {name: state for name, state in states.items() if name != "step_guard"}
        fresh_outer_step = "outer_step" in states and not any(key.startswith("outer_step.") for key in saved)
        if fresh_outer_step:
            logger.info(f"{path} holds no DiLoCo state (fault_tolerance.semi_sync_method): the groups start their "
                        "first interval from its weights")
            states = {name: state for name, state in states.items() if name != "outer_step"}
        start = time.perf_counter()
        try:
            dcp.load(states, checkpoint_id=str(path))
        except CheckpointException as e:
            raise unreadable_part(path, e) or e from None
        logger.info(f"resumed from {path} in {time.perf_counter() - start:.1f}s")
        if fresh_outer_step:
            self.states["outer_step"].snapshot()
        self.last_saved = step
        return self.states["train_state"].step

    def _load_weights(self, path: Path) -> int:
        start = time.perf_counter()
        if is_hf_folder(path):
            self.load_hf(path)
        elif (path / ".metadata").is_file():
            problem = intact(path, self.cfg.checksums)
            if problem:
                raise ValueError(f"checkpoint.initial_load_path {path} is damaged: {problem}")
            self._check_fits(path, saved_entries(path))
            dcp.load({"model": self.states["model"]}, checkpoint_id=str(path))
        else:
            raise FileNotFoundError("no DCP checkpoint (.metadata) or Hugging Face model "
                                    f"(config.json, *.safetensors) at {path}")
        logger.info(f"loaded model weights from {path} in {time.perf_counter() - start:.1f}s; "
                    "training starts at step 1")
        return 0

    def _writer(self, step: int) -> CommittingWriter:
        """A writer for step-N; what an earlier, interrupted save of the same step left is removed first."""
        final = self.folder / f"step-{step}"
        if dist.get_rank() == 0:
            shutil.rmtree(str(final) + PARTIAL_SUFFIX, ignore_errors=True)
        dist.barrier()
        return CommittingWriter(final, self.cfg.checksums, self.extra_files)

    def save_seed(self) -> Path:
        """The freshly initialised weights as step-0, for runs that must start from identical weights."""
        dcp.save({"model": self.states["model"]}, storage_writer=self._writer(0))
        return self.folder / "step-0"

    def due(self, step: int) -> bool:
        """Whether maybe_save(step) saves: at the configured interval and at the last step."""
        return (self.cfg.enable and (step == self.total_steps or step % self.cfg.interval == 0)
                and step != self.last_saved)

    def maybe_save(self, step: int, force: bool = False) -> None:
        """Save if due, or now when `force` (preemption). A save that runs out of space is named in one line and its
        folder removed, the older checkpoints kept (_save_failed)."""
        if not (self.due(step) or force and step != self.last_saved):
            return
        last = step == self.total_steps
        self.wait()
        path = self.folder / f"step-{step}"
        start = time.perf_counter()
        writer = self._writer(step)
        self.last_saved = step
        try:
            if last and self.cfg.last_save_model_only:
                dtype = DTYPES[self.cfg.export_dtype]
                weights = {k: v.to(dtype) for k, v in self.states["model"].state_dict().items()}
                dcp.save({"model": weights}, storage_writer=writer)
            elif self.mode == "disabled" or force:
                dcp.save(self.states, storage_writer=writer)
            elif self.stager is not None:
                result = dcp.async_save(self.states, storage_writer=writer, async_stager=self.stager.for_save(),
                                        async_checkpointer_type=AsyncCheckpointerType.PROCESS)
                # Staging copies the state into (pinned) host memory; it must end before the optimizer changes the
                # parameters again. The upload to disk goes on in a background process.
                result.staging_completion.result()
                self.stager.staged()
                self.pending, self.pending_step = result.upload_completion, step
            else:
                self.pending = dcp.async_save(self.states, storage_writer=writer, **self.async_kwargs)
                self.pending_step = step
        except (Exception, CheckpointException) as e:  # DCP's is a BaseException; whether it was for space decides
            self._save_failed(step, e, force)
            return
        what = "queued" if self.pending is not None else "saved"
        logger.info(f"checkpoint {path} {what} in {time.perf_counter() - start:.2f}s")
        self.purge()
        if last:  # nothing left to overlap with: the run ends once its last checkpoint is in
            self.wait()

    def wait(self) -> None:
        """Block until a background save has finished (and its checkpoint is committed)."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            try:
                pending.result()
            except (Exception, CheckpointException) as e:  # whether it was for space decides
                self._save_failed(self.pending_step, e, force=False)
                return
            self.purge()

    def _save_failed(self, step: int, error: BaseException, force: bool) -> None:
        """After a failed save of `step` on every rank: a rank that stopped or died meanwhile is a hang, re-raised for
        the training loop to name; any other failure is re-raised unless some rank's file system ran out of space. If
        one did, the save's folder goes, the older checkpoints stay, and training goes on to save again
        at the next interval (checkpoint.on_disk_full "continue"), or stops with DiskFull ("stop", and always for
        the last step's and a preemption's save, which nothing later makes up for)."""
        stopped = next((e for e in causes(error) if isinstance(e, RuntimeError) and (is_timeout(e) or is_lost_peer(e))),
                       None)
        if stopped is not None:  # a rank stopped or died during the save: the training loop names the hang
            raise stopped
        full = agreed_problems(out_of_space(self.folder, error))
        if not full:
            raise error
        partial = Path(f"{self.folder / f'step-{step}'}{PARTIAL_SUFFIX}")
        if dist.get_rank() == 0:
            shutil.rmtree(partial, ignore_errors=True)
        dist.barrier()
        committed = step_folders(self.folder)
        self.last_saved = max(committed, default=None)
        kept = f"{committed[self.last_saved].name} kept" if committed else "no older checkpoint"
        line = (f"checkpoint step-{step} not saved: no space left in {self.folder} ({full[0]}; "
                f"{type(error).__name__}); {partial.name} removed, {kept}")
        if self.cfg.on_disk_full == "stop" or force or step == self.total_steps:
            why = "checkpoint.on_disk_full = stop" if self.cfg.on_disk_full == "stop" else \
                "a preemption's save" if force else "the last step's save"
            raise DiskFull(f"{line} ({why}): free space and rerun the same command to resume"
                           + (f" from {committed[self.last_saved].name}" if committed else ""))
        following = (step // self.cfg.interval + 1) * self.cfg.interval
        logger.warning(f"{line}; training goes on and saves again at step {min(following, self.total_steps)} "
                       "(checkpoint.on_disk_full = continue)")

    def purge(self) -> None:
        """Delete the oldest committed checkpoints beyond keep_latest_k. A save in progress is not
        committed yet, so it never counts towards the k kept. A folder is renamed first, so that a
        deletion cut short never leaves something that looks like a checkpoint."""
        if self.cfg.keep_latest_k <= 0 or dist.get_rank() != 0:
            return
        committed = list(step_folders(self.folder).values())
        for path in committed[: -self.cfg.keep_latest_k]:
            doomed = path.rename(unused_name(path, ".deleting"))
            shutil.rmtree(doomed, ignore_errors=True)

    def close(self) -> None:
        self.wait()
        if self.stager is not None:
            self.stager.close()
            stop_async_checkpoint_process()
