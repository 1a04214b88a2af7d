"""Where each rank is, and whether it is alive, so that a run that hangs names the ranks that stopped.

Every rank publishes in the job's c10d store (the key-value store the process group was built on) where it is: its
step and the phase of it (reading its data, computing, past its optimizer step). A thread of its own adds a sign of
life every few seconds, which a process that is frozen (SIGSTOP), dead, or wedged in native code that holds the
interpreter stops giving. When a collective times out (comm.train_timeout_seconds), the ranks still running read
everyone's last heartbeat and sign of life: the ranks without a recent one are frozen, the live ones behind the
furthest (or never heard from) are stuck where they are (in their data, in another collective); where every rank is
alive at the same place, the collective itself is stuck (the network). train.py turns the timeout into Hung, which
ends the run with EXIT_HUNG (components/stopping.py) and that one screen. On CUDA the NCCL flight recorder also dumps
each rank's last collectives (comm.trace_buf_size, comm.flight_recorder_folder).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator
from datetime import timedelta

import torch.distributed as dist

KEY = "ingot/heartbeat/"
ALIVE = "ingot/alive/"
READING, COMPUTING, STEPPED = range(3)
PHASES = ("reading its data", "computing (forward, backward, optimizer step)", "after its optimizer step")
"""A step's phases, in order: each micro-batch's data then its forward and backward, the optimizer step; then
metrics, evaluation, checkpoints."""
LIFE_SIGNS = 5
"""Signs of life per timeout: a rank silent for three of their intervals is taken as frozen."""


class Hung(RuntimeError):
    """A collective timed out: the message names the ranks that stopped and where."""


def is_timeout(error: BaseException) -> bool:
    """Whether `error` is a collective that timed out (gloo, NCCL)."""
    text = str(error).lower()
    return "timed out" in text or "timeout" in text and "collective" in text


class Heartbeat:
    def __init__(self, timeout_seconds: int):
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.timeout, self.step = timeout_seconds, 0
        self.interval = max(0.5, timeout_seconds / LIFE_SIGNS)
        # torch's handle on the store its default group was built on (private: there is no public one).
        self.store = dist.distributed_c10d._get_default_store() if self.world > 1 else None
        self.done = threading.Event()
        if self.store is not None:
            threading.Thread(target=self._live, name="ingot-heartbeat", daemon=True).start()

    def _live(self) -> None:
        while not self.done.is_set():
            try:
                self.store.set(f"{ALIVE}{self.rank}", str(time.time()))
            except Exception:  # noqa: BLE001 - the store went away: the run is ending
                return
            self.done.wait(self.interval)

    def close(self) -> None:
        self.done.set()

    def start(self, step: int) -> None:
        """This rank starts `step`; it publishes READING as it asks for the step's first batch (`reading`)."""
        self.step = step

    def beat(self, step: int, phase: int) -> None:
        """This rank has reached `phase` (an index into PHASES) of `step`."""
        self.step = step
        if self.store is not None:
            self.store.set(f"{KEY}{self.rank}", f"{step} {phase} {time.time()}")

    def reading(self, batches: Iterable) -> Iterator:
        """The batches, this rank's heartbeat saying whether it waits for one (READING) or computes (COMPUTING)."""
        batches = iter(batches)
        while True:
            self.beat(self.step, READING)
            try:
                batch = next(batches)
            except StopIteration:
                return
            self.beat(self.step, COMPUTING)
            yield batch

    def _read(self, key: str) -> list[str] | None:
        try:
            return self.store.get(key).decode().split()
        except Exception:  # noqa: BLE001 - a rank that never published, or a store that is gone
            return None

    def stopped(self, error: BaseException) -> Hung:
        """The Hung to raise after `error`, a collective that timed out on this rank."""
        heard, alive = {}, {}
        if self.store is not None:
            self.store.set_timeout(timedelta(seconds=5))
            for rank in range(self.world):
                beat, life = self._read(f"{KEY}{rank}"), self._read(f"{ALIVE}{rank}")
                heard[rank] = (int(beat[0]), int(beat[1]), float(beat[2])) if beat else None
                alive[rank] = float(life[0]) if life else None
        now = time.time()
        frozen = [rank for rank, at in alive.items() if at is not None and now - at > 3 * self.interval]
        furthest = max((h[:2] for h in heard.values() if h), default=(0, 0))
        behind = [rank for rank, h in heard.items() if rank not in frozen and (h is None or h[:2] < furthest)]

        def where(rank: int) -> str:
            h = heard[rank]
            return f"in step {h[0]} {PHASES[h[1]]}" if h else "never heard from"

        named = ([f"rank {rank} frozen {where(rank)}: no sign of life for {now - alive[rank]:.0f} s (a stopped or "
                  "dead process, or one wedged in native code)" for rank in frozen]
                 + [f"rank {rank} {where(rank)}, alive but behind the others" for rank in behind])
        more = f" and {len(named) - 8} more" if len(named) > 8 else ""
        summary = (f"{len(named)} rank(s) stopped making progress: {'; '.join(named[:8])}{more}" if named else
                   "every rank is alive and as far as the others (a collective they all entered is stuck: the "
                   "network, or one rank in another collective)")
        mine = heard.get(self.rank)
        at = f" in step {mine[0]} {PHASES[mine[1]]}" if mine else ""
        return Hung(f"a collective timed out after comm.train_timeout_seconds {self.timeout} s on rank {self.rank}"
                    f"{at}: {summary} ({str(error).strip().splitlines()[0][:200]})")
