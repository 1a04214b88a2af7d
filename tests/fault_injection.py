"""train.py with a fault injected, for tests/test_reliability.py. Run it like train.py (directly or
under torchrun) with INGOT_FAULT=<kind>:<step>[:<rank>] in the environment:

  kill-step:N      SIGKILL to the whole process group during step N, before its optimizer step
  kill-write:N     ... once this rank has written its files of the checkpoint of step N (for an
                   async save, in the background thread), before the save is committed
  kill-commit:N    ... once every rank's files and .metadata of step N are written, just before
                   integrity.json and the rename that commit the checkpoint
  hang-step:N:R    rank R stops responding (sleeps) during step N
  freeze-step:N:R  rank R freezes (SIGSTOP to itself, every thread stops) during step N
  freeze-save:N:R  ... as it starts writing its files of the checkpoint of step N
  hang-data:N:R    rank R waits for ever for its data of step N
  hang-forward:N:R rank R sleeps as its forward of step N starts, outside any collective
  desync-step:N:R  rank R enters a collective of its own (an all-reduce the others never make) as its forward of
                   step N starts
  raise-step:N[:R] a Python exception (a crash) during step N, on rank R or every rank
  nan-step:N[:R]   rank R (or every rank) finds a NaN in its gradients in step N (a corrupted value)
  kill-load:0[:R]  SIGKILL to rank R (or to the whole process group) as the checkpoint loads
  slow-steps:N[:R[:S]]  rank R (or every rank) sleeps S seconds (SLOW_STEP_SECONDS) in every step from step N on,
                   and waits there while the file INGOT_PAUSE names exists: a slow process, or one held back by the test
  busy-steps:N[:R[:S]]  rank R (or every rank) computes S seconds longer in every step from step N on: a straggler
                   (a slower or shared CPU)

With INGOT_FAULT_ONCE=<path> each rank arms the fault only where <path>.rank<R> does not exist yet, and creates
it: a job that restarts after the fault (job.max_restarts) then runs clean.

With INGOT_STOP_SIGNAL=<signal>:<point>:<target> (no INGOT_FAULT needed), rank 0 sends a stop signal to the launcher
(its parent; target `launcher`) or to the launcher and all its descendants (`every`) at a point of start-up:
  imports        before this worker imports torch and the trainer
  process-group  as the worker joins the process group
  checkpoint     as the checkpoint loads
  first-step     during the first step, before its optimizer step
"""

import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from scripts.job_processes import descendants  # noqa: E402  (no torch: imported before the first stop-signal point)


def send_stop_signal(point: str) -> None:
    """On rank 0, the stop signal INGOT_STOP_SIGNAL names for `point`, if it names that point."""
    name, at, target = os.environ.get("INGOT_STOP_SIGNAL", "::").split(":")
    if at == point and os.environ.get("RANK", "0") == "0":
        launcher = os.getppid()
        for pid in [launcher, *(descendants(launcher) if target == "every" else [])]:
            os.kill(pid, signal.Signals[name])


send_stop_signal("imports")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import train  # noqa: E402
from components.checkpoint import integrity as checkpoint_integrity  # noqa: E402
from components.checkpoint.dcp import CheckpointManager  # noqa: E402
from components.run.exit_codes import exit_process  # noqa: E402
from components.training.optimizers import Optimizers  # noqa: E402


def kill_tree(root: int, spare: int | None = None) -> None:
    """SIGKILL `root` and all its descendants (but `spare`)."""
    for pid in [root, *descendants(root)]:
        if pid != spare:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def kill_everything() -> None:
    """SIGKILL the run's whole process tree at once: under torchrun the agent and every worker
    (torchrun starts each in a session of its own) with their data loader workers."""
    kill_tree(os.getppid() if "TORCHELASTIC_RUN_ID" in os.environ else os.getpid(), spare=os.getpid())
    os.kill(os.getpid(), signal.SIGKILL)


SLOW_STEP_SECONDS = 0.3


def inject(kind: str, step: int, rank: int | None, seconds: float = SLOW_STEP_SECONDS) -> None:
    if kind in ("slow-steps", "busy-steps"):
        original_step, calls = Optimizers.step, [0]

        def slow_step(self, *args, **kwargs):
            calls[0] += 1
            if calls[0] >= step and (rank is None or dist.get_rank() == rank):
                if kind == "busy-steps":
                    end = time.perf_counter() + seconds
                    while time.perf_counter() < end:
                        pass
                else:
                    time.sleep(seconds)
                while os.path.exists(os.environ.get("INGOT_PAUSE", "")):
                    time.sleep(0.05)
            return original_step(self, *args, **kwargs)

        Optimizers.step = slow_step
    elif kind == "hang-data":
        original_prepare, calls = train.prepare_batch, [0]

        def prepare_or_wait(*args, **kwargs):
            calls[0] += 1
            if calls[0] == step and dist.get_rank() == rank:
                time.sleep(3600)
            return original_prepare(*args, **kwargs)

        train.prepare_batch = prepare_or_wait
    elif kind in ("hang-forward", "desync-step"):
        original_forward, calls = train.forward_backward, [0]

        def forward_with_fault(*args, **kwargs):
            calls[0] += 1
            if calls[0] == step and dist.get_rank() == rank:
                if kind == "desync-step":
                    dist.all_reduce(torch.zeros(7))
                time.sleep(3600)
            return original_forward(*args, **kwargs)

        train.forward_backward = forward_with_fault
    elif kind in ("kill-step", "hang-step", "freeze-step", "raise-step"):
        original_step, calls = Optimizers.step, [0]

        def step_with_fault(self, *args, **kwargs):
            calls[0] += 1
            if calls[0] == step and (rank is None or dist.get_rank() == rank):
                if kind == "kill-step":
                    kill_everything()
                if kind == "raise-step":
                    raise RuntimeError(f"fault injected at step {step}")
                if kind == "freeze-step":
                    os.kill(os.getpid(), signal.SIGSTOP)
                time.sleep(3600)
            return original_step(self, *args, **kwargs)

        Optimizers.step = step_with_fault
    elif kind == "nan-step":
        original_forward, calls = train.forward_backward, [0]

        def forward_then_nan(model, *args, **kwargs):
            loss = original_forward(model, *args, **kwargs)
            calls[0] += 1
            if calls[0] == step and (rank is None or dist.get_rank() == rank):
                grad = next(p.grad for part in model.parts for p in part.parameters() if p.grad is not None)
                with torch.no_grad():
                    (grad.to_local() if hasattr(grad, "to_local") else grad).view(-1)[0] = float("nan")
            return loss

        train.forward_backward = forward_then_nan
    elif kind == "kill-load":
        original_load = CheckpointManager.load

        def die_loading(self):
            if rank is None:
                kill_everything()
            if dist.get_rank() == rank:
                os.kill(os.getpid(), signal.SIGKILL)
            return original_load(self)

        CheckpointManager.load = die_loading
    elif kind == "freeze-save":
        original_write = checkpoint_integrity.CommittingWriter.write_data

        def freeze_then_write(self, plan, planner):
            if self.final.name == f"step-{step}" and dist.get_rank() == rank:
                os.kill(os.getpid(), signal.SIGSTOP)
            return original_write(self, plan, planner)

        checkpoint_integrity.CommittingWriter.write_data = freeze_then_write
    elif kind == "kill-write":
        original_write = checkpoint_integrity.CommittingWriter.write_data

        def write_then_kill(self, plan, planner):
            result = original_write(self, plan, planner)
            if self.final.name == f"step-{step}":
                kill_everything()
            return result

        checkpoint_integrity.CommittingWriter.write_data = write_then_kill
    elif kind == "kill-commit":
        original_json = checkpoint_integrity.write_json_atomically

        def kill_before_commit(path, obj):
            if path.name == checkpoint_integrity.INTEGRITY_FILE and path.parent.name == f"step-{step}.partial":
                kill_everything()
            original_json(path, obj)

        checkpoint_integrity.write_json_atomically = kill_before_commit
    else:
        raise SystemExit(f"unknown INGOT_FAULT kind {kind!r}")


def signal_at_start_up_points() -> None:
    """send_stop_signal at the points of start-up after the imports (train.main has its handler in place)."""
    def before(owner, name: str, point: str) -> None:
        original, calls = getattr(owner, name), [0]

        def signalled_first(*args, **kwargs):
            calls[0] += 1
            if calls[0] == 1:
                send_stop_signal(point)
            return original(*args, **kwargs)
        setattr(owner, name, signalled_first)

    before(dist, "init_process_group", "process-group")
    before(CheckpointManager, "load", "checkpoint")
    before(Optimizers, "step", "first-step")


if __name__ == "__main__":
    signal_at_start_up_points()
    if "INGOT_FAULT" in os.environ:
        kind, step, *rank = os.environ["INGOT_FAULT"].split(":")
        once = os.environ.get("INGOT_FAULT_ONCE")
        marker = Path(f"{once}.rank{os.environ.get('RANK', '0')}") if once else None
        if marker is None or not marker.exists():
            if marker is not None:
                marker.touch()
            inject(kind, int(step), int(rank[0]) if rank else None, *map(float, rank[1:]))
    exit_process(train.run_worker(train.main))
