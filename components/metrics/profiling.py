"""torch.profiler traces and CUDA memory snapshots, taken in windows every `profile_freq` steps.

Windows of profile_freq steps end at multiples of profile_freq (also in a resumed run); in each the
profiler idles, then warms up for `profiler_warmup` steps and records `profiler_active` steps; at the
end of the window every rank writes
<dump>/<save_traces_folder>/step-N/rank<R>_trace.json, a chrome trace (open it in
https://ui.perfetto.dev or chrome://tracing). With `enable_memory_snapshot` on CUDA, the allocator's
history is recorded from the start and dumped next to the traces at the end of each window and when
the run runs out of memory (rank<R>_memory_snapshot.pickle, for https://pytorch.org/memory_viz).
The CUDA allocator is what makes those snapshots; on CPU there is none, and the traces' memory view
(recorded with profile_memory) is what there is.
"""

from __future__ import annotations

import logging
from functools import partial
from pathlib import Path

import torch
from torch.profiler import ProfilerAction, ProfilerActivity, profile

from components.config import ConfigError, Profiling as ProfilingConfig
from components.torch_private import dump_memory_snapshot, record_memory_history

logger = logging.getLogger(__name__)


def window_action(start_step: int, last_step: int, freq: int, warmup: int, active: int, first_trace: int,
                  index: int) -> ProfilerAction:
    """What the profiler does at its `index`-th step (step start_step + 1 + index of the run): windows of
    `freq` steps end at multiples of freq with `warmup` steps then `active` recorded ones, the last of which
    saves the trace. Windows ending before `first_trace` or after `last_step` are left out."""
    step = start_step + 1 + index
    until_end = -step % freq  # 0 at the window's last step
    if not first_trace <= step + until_end <= last_step or until_end >= warmup + active:
        return ProfilerAction.NONE
    if until_end >= active:
        return ProfilerAction.WARMUP
    return ProfilerAction.RECORD_AND_SAVE if until_end == 0 else ProfilerAction.RECORD


class Profiler:
    """A context around the training loop: call `step(step)` after every training step. Does
    nothing when profiling is off; an out-of-memory error leaving the loop dumps a memory snapshot."""

    def __init__(self, cfg: ProfilingConfig, dump_folder: Path, rank: int, device: torch.device, start_step: int,
                 last_step: int):
        """`start_step`: the step the run resumes after (0 for a fresh run); `last_step`: its last step. The
        windows end at multiples of profile_freq whatever the start, so a resumed run traces the same steps."""
        self.folder, self.rank, self.device = dump_folder / cfg.save_traces_folder, rank, device
        self.step_number = 0
        self.memory_snapshots = cfg.enable_memory_snapshot and device.type == "cuda"
        if cfg.enable_memory_snapshot and not self.memory_snapshots:
            logger.info("profiling.enable_memory_snapshot needs CUDA (the caching allocator records the snapshots); "
                        "on CPU the profiler traces' memory view is recorded instead")
        self.profiler = None
        if cfg.enable_profiling:
            freq, warmup, active = cfg.profile_freq, cfg.profiler_warmup, cfg.profiler_active
            if active < 1 or warmup < 0 or freq < warmup + active:
                raise ConfigError(
                    f"profiling.profile_freq ({freq}) must be at least profiler_warmup ({warmup}) + "
                    f"profiler_active ({active}), with profiler_active >= 1"
                )
            # A window that began before the start cannot warm up: the first one is the next whole one.
            first_whole = start_step + (-(start_step + warmup + active) % freq) + warmup + active
            traces = list(range(first_whole, last_step + 1, freq))
            if rank == 0:
                if traces:
                    logger.info(f"profiling: traces of steps ending at {', '.join(map(str, traces[:3]))}"
                                f"{', ...' if len(traces) > 3 else ''} (every profiling.profile_freq = {freq} steps)")
                else:
                    logger.warning(f"profiling: no trace in steps {start_step + 1} to {last_step}: the next window "
                                   f"ends at step {first_whole} (windows end at multiples of profiling.profile_freq "
                                   f"= {freq}, after {warmup} warmup steps); lower profile_freq for one")
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
            self.profiler = profile(
                activities=activities,
                schedule=partial(window_action, start_step, last_step, freq, warmup, active, first_whole),
                on_trace_ready=self._write_trace,
                profile_memory=True,
                record_shapes=True,
            )
            self.profiler.start()
        if self.memory_snapshots:
            record_memory_history(True)

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
            dump_memory_snapshot(str(path))
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
            record_memory_history(False)
