"""Where each rank is, whether it is alive and which collective it waits in, so that a run that hangs names the
ranks that stopped.

Every rank publishes in the job's c10d store (the key-value store the process group was built on) where it is: its
step and the phase of it (reading its data, computing, in its optimizer step, past it). A thread of its own adds a
sign of life every few seconds, which a process that is frozen (SIGSTOP), dead, or wedged in native code that holds the
interpreter stops giving. When a collective times out (comm.train_timeout_seconds), or loses a peer (gloo: the
connection closed), the ranks still running publish the last collective of each process group torch's flight recorder
holds for them (comm.trace_buf_size), then read everyone's: the ranks without a recent sign of life are frozen or
dead; the live ones behind the furthest (or never heard from) are stuck where they are (in their data, in their
optimizer step); a live one at the furthest place that waits in no collective is stuck outside them (a long
computation); ranks whose last collectives of one group differ are desynchronised (one in another collective); where
every rank is alive in the same collective, the collective itself is stuck (the network). train.py turns the error
into Hung, which ends the run with EXIT_HUNG (components/run/stopping.py) and that one screen. On CUDA the NCCL flight
recorder also dumps each rank's last collectives (comm.flight_recorder_folder).
"""

from __future__ import annotations

import json
import pickle
import threading
import time
from collections.abc import Iterable, Iterator
from datetime import timedelta

import torch
import torch.distributed as dist

from components.torch_private import default_store

KEY = "ingot/heartbeat/"
ALIVE = "ingot/alive/"
WAITING = "ingot/waiting/"
READING, COMPUTING, OPTIMIZING, STEPPED = range(4)
PHASES = ("reading its data", "computing its micro-batches and gradients", "in its optimizer step",
          "after its optimizer step")
"""A step's phases, in order: each micro-batch's data then its forward and backward, the gradients' reduction and
clipping; the optimizer step; then metrics, evaluation, checkpoints."""
LIFE_SIGNS = 5
"""Signs of life per timeout: a rank silent for three of their intervals is taken as frozen."""
LOST_PEER = ("connection closed by peer", "connection reset by peer", "remote process exited")
"""How gloo (and NCCL) say that a collective lost a peer: a process or its host died."""


class Hung(RuntimeError):
    """A collective timed out or lost a peer: the message names the ranks that stopped and where."""


def is_timeout(error: BaseException) -> bool:
    """Whether `error` is a collective that timed out (gloo, NCCL; gloo says "Application timeout caused pair closure"
    when its timeout ends a wait for a peer)."""
    text = str(error).lower()
    return "timed out" in text or "timeout" in text and ("collective" in text or "pair closure" in text)


def is_lost_peer(error: BaseException) -> bool:
    """Whether `error` is a collective whose peer went away (its process or host died)."""
    return any(words in str(error).lower() for words in LOST_PEER)


def last_collectives() -> dict[str, list]:
    """This rank's last collective in each process group it used, by group name: [group description, sequence
    number, operation, input sizes], from torch's flight recorder (empty when it is off), the group of the newest last.
    Point-to-point operations (a pipeline's sends and receives) are left out: a sender and its receiver record
    different ones."""
    # torch records the collectives (TORCH_FR_BUFFER_SIZE, components/distributed/mesh.py) but offers no public reader:
    # one recorder for gloo (and other CPU backends), one for NCCL.
    entries = []
    for reader in ("_dump_fr_trace", "_dump_nccl_trace"):
        dump = getattr(torch._C._distributed_c10d, reader, None)
        try:
            entries += pickle.loads(dump(True, False, False)).get("entries", []) if dump else []
        except Exception:  # noqa: BLE001 - no recorder for this backend
            pass
    last = {}
    for entry in sorted(entries, key=lambda e: e.get("time_created_ns", 0)):
        if not entry.get("is_p2p"):
            name, description = entry["process_group"]
            last.pop(name, None)
            last[name] = [description, entry["collective_seq_id"], entry["profiling_name"].split(":")[-1],
                          entry["input_sizes"]]
    return last


class Heartbeat:
    def __init__(self, timeout_seconds: int):
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.timeout, self.step = timeout_seconds, 0
        self.interval = max(0.5, timeout_seconds / LIFE_SIGNS)
        self.store = default_store() if self.world > 1 else None  # the store the default group was built on
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

    def _read(self, key: str) -> str | None:
        """The key's value; None at once for a key nobody set (a store's get would wait for it, and block the other
        thread's use of the store meanwhile)."""
        try:
            return self.store.get(key).decode() if self.store.check([key]) else None
        except Exception:  # noqa: BLE001 - a store that is gone
            return None

    def stopped(self, error: BaseException) -> Hung:
        """The Hung to raise after `error`, a collective that timed out or lost a peer on this rank."""
        lost_peer = is_lost_peer(error)
        cause = ("a collective lost a peer" if lost_peer else
                 f"a collective timed out after comm.train_timeout_seconds {self.timeout} s")
        mine = f" in step {self.step}"
        if self.store is None:
            return Hung(f"{cause} on rank {self.rank}{mine} ({_first_line(error)})")
        self.store.set_timeout(timedelta(seconds=5))
        try:
            self.store.set(f"{WAITING}{self.rank}", json.dumps([time.time(), last_collectives()]))
        except Exception:  # noqa: BLE001 - the store's host is gone: nobody's state can be read
            return Hung(f"{cause} on rank {self.rank}{mine}: the job's c10d store does not answer (its host, the first "
                        f"node, is gone?) ({_first_line(error)})")
        summary = self._survey(lost_peer)
        heard = self._read(f"{KEY}{self.rank}")
        if heard:
            step, phase, _ = heard.split()
            mine = f" in step {step} {PHASES[int(phase)]}"
        return Hung(f"{cause} on rank {self.rank}{mine}: {summary} ({_first_line(error)})")

    def _survey(self, lost_peer: bool) -> str:
        """What every rank's heartbeat, sign of life and last collectives say of who stopped: after a lost peer once
        its silence shows (at most 4 intervals), and once the live ranks as far as the furthest published the
        collectives they wait in (at most an interval)."""
        deadline = time.time() + (4 if lost_peer else 1) * self.interval
        while True:
            now = time.time()
            heard, alive, waiting = {}, {}, {}
            for rank in range(self.world):
                beat, life, wait = (self._read(f"{key}{rank}") for key in (KEY, ALIVE, WAITING))
                heard[rank] = tuple(int(x) for x in beat.split()[:2]) if beat else None
                alive[rank] = float(life) if life else None
                at, collectives = json.loads(wait) if wait else (0.0, {})
                if now - at < self.timeout:  # not one left by an earlier attempt of the job
                    waiting[rank] = collectives
            frozen = [rank for rank, at in alive.items() if at is not None and now - at > 3 * self.interval]
            furthest = max((h for h in heard.values() if h), default=(0, 0))
            behind = [rank for rank, h in heard.items() if rank not in frozen and (h is None or h < furthest)]
            level = [rank for rank in range(self.world) if rank not in frozen and rank not in behind]
            settled = bool(frozen) if lost_peer else all(rank in waiting for rank in level)
            if settled or now > deadline:
                break
            time.sleep(self.interval / 4)  # every surviving rank reads every rank's keys: a few rounds, not a storm

        def where(rank: int) -> str:
            h = heard[rank]
            return f"in step {h[0]} {PHASES[h[1]]}" if h else "never heard from"

        named = [f"rank {rank} {'dead or frozen' if lost_peer else 'frozen'} {where(rank)}: no sign of life for "
                 f"{now - alive[rank]:.0f} s (a dead, stopped or wedged process, or its host gone)" for rank in frozen]
        named += [f"rank {rank} {where(rank)}, alive but behind the others" for rank in behind]
        compared = [rank for rank in level if waiting.get(rank)]
        if compared:  # the flight recorder is on: who waits in a collective, and in which
            named += [f"rank {rank} {where(rank)}, alive but in no collective (stuck outside them)"
                      for rank in level if rank not in waiting]
        more = f" and {len(named) - 8} more" if len(named) > 8 else ""
        if named:
            return f"{len(named)} rank(s) stopped making progress: {'; '.join(named[:8])}{more}"
        apart = _desynchronised({rank: waiting[rank] for rank in compared})
        if apart:
            return f"the ranks wait in different collectives (desynchronised): {apart}"
        if compared:
            description, sequence, operation, _ = _last(waiting[compared[0]])
            return (f"every rank is alive and waits in the same collective ({operation} #{sequence} of "
                    f"{description}): the network, or the collective library, is stuck")
        return ("every rank is alive and as far as the others (a collective they all entered is stuck: the network, or "
                "one rank in another collective)")


def _first_line(error: BaseException) -> str:
    return str(error).strip().splitlines()[0][:200] if str(error).strip() else type(error).__name__


def _last(collectives: dict[str, list]) -> list:
    """The newest of a rank's last collectives: the one it waits in, as far as the recorder tells."""
    return list(collectives.values())[-1]


def _desynchronised(waiting: dict[int, dict[str, list]]) -> str:
    """For each process group whose members' last collectives differ, what each member waits in; "" if none."""
    groups = {}
    for rank, collectives in waiting.items():
        for name, collective in collectives.items():
            groups.setdefault(name, {})[rank] = collective
    parts = []
    for members in groups.values():
        if len({json.dumps(c[1:]) for c in members.values()}) > 1:
            description = next(iter(members.values()))[0]
            parts.append(f"group {description}: " + ", ".join(
                f"rank {rank} in {c[2]} #{c[1]} {c[3]}" for rank, c in sorted(members.items())))
    return "; ".join(parts)[:600]
