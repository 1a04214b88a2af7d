"""torch.profiler traces and CUDA memory snapshots, taken in windows every `profile_freq` steps.

In each window of profile_freq steps the profiler idles, then warms up for `profiler_warmup` steps
and records `profiler_active` steps; at the end of the window every rank writes
<dump>/<save_traces_folder>/step-N/rank<R>_trace.json, a chrome trace (open it in
https://ui.perfetto.dev or chrome://tracing). With `enable_memory_snapshot` on CUDA, the allocator's
history is recorded from the start and dumped next to the traces at the end of each window and when
the run runs out of memory (rank<R>_memory_snapshot.pickle, for https://pytorch.org/memory_viz).
The CUDA allocator is what makes those snapshots; on CPU there is none, and the traces' memory view
(recorded with profile_memory) is what there is.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, schedule

from components.config import ConfigError, Profiling as ProfilingConfig

logger = logging.getLogger(__name__)


class Profiler:
    """A context around the training loop: call `step(step)` after every training step. Does
    nothing when profiling is off; an out-of-memory error leaving the loop dumps a memory snapshot."""

    def __init__(self, cfg: ProfilingConfig, dump_folder: Path, rank: int, device: torch.device):
        self.folder, self.rank, self.device = dump_folder / cfg.save_traces_folder, rank, device
        self.step_number = 0
        self.memory_snapshots = cfg.enable_memory_snapshot and device.type == "cuda"
        if cfg.enable_memory_snapshot and not self.memory_snapshots:
            logger.info("profiling.enable_memory_snapshot needs CUDA (the caching allocator records the snapshots); "
                        "on CPU the profiler traces' memory view is recorded instead")
        self.profiler = None
        if cfg.enable_profiling:
            idle = cfg.profile_freq - cfg.profiler_warmup - cfg.profiler_active
            if cfg.profiler_active < 1 or cfg.profiler_warmup < 0 or idle < 0:
                raise ConfigError(
                    f"profiling.profile_freq ({cfg.profile_freq}) must be at least "
                    f"profiler_warmup ({cfg.profiler_warmup}) + profiler_active ({cfg.profiler_active}), "
                    "with profiler_active >= 1"
                )
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
            self.profiler = profile(
                activities=activities,
                schedule=schedule(wait=idle, warmup=cfg.profiler_warmup, active=cfg.profiler_active),
                on_trace_ready=self._write_trace,
                profile_memory=True,
                record_shapes=True,
            )
            self.profiler.start()
        if self.memory_snapshots:
            torch.cuda.memory._record_memory_history(max_entries=100_000)

    def _step_folder(self) -> Path:
        folder = self.folder / f"step-{self.step_number}"
        folder.mkdir(parents=True, exist_ok=True)
        return folder

    def _write_trace(self, prof) -> None:
        path = self._step_folder() / f"rank{self.rank}_trace.json"
        prof.export_chrome_trace(str(path))
        if self.rank == 0:
            logger.info(f"profiler trace written to {path}")
        if self.memory_snapshots:
            self.dump_memory_snapshot()

    def dump_memory_snapshot(self) -> None:
        """The CUDA allocator's recorded history, e.g. when an out-of-memory error ends the run."""
        if self.memory_snapshots:
            path = self._step_folder() / f"rank{self.rank}_memory_snapshot.pickle"
            torch.cuda.memory._dump_snapshot(str(path))
            logger.warning(f"memory snapshot written to {path}")

    def step(self, step: int) -> None:
        self.step_number = step
        if self.profiler is not None:
            self.profiler.step()

    def __enter__(self) -> Profiler:
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        if isinstance(exc, torch.OutOfMemoryError):
            self.dump_memory_snapshot()
        if self.profiler is not None:
            self.profiler.stop()
        if self.memory_snapshots:
            torch.cuda.memory._record_memory_history(enabled=None)
