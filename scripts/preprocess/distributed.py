"""Preprocessing over several processes and nodes: `torchrun ... -m scripts.preprocess` starts one process
per rank; each tokenizes a contiguous range of the input files into shards of its own, and rank 0 writes
the one manifest once every rank is done. A run without torchrun is one rank and exchanges nothing.

The ranks exchange their few messages (the checked inputs, each rank's errors, its shards and counts)
through files, not a process group. A gloo group needs `import torch` in every rank, about 1.35
CPU-seconds each, which with torchrun's own ~1.5 (it imports torch too) made 2 ranks cost 1.40-1.46x the
CPU of one process on 58 MB of input; through files it is 1.15-1.19x (docs/data.md, "Across nodes"). The
files lie in a coordination folder in the output folder, `.ranks-<run id>-<restart>` after torchrun's
TORCHELASTIC_RUN_ID and TORCHELASTIC_RESTART_COUNT, which rank 0 makes at the start and removes at the
end, once every rank has read the last exchange: a finished output holds only its shards and manifest.
In exchange number s, every rank writes its pickled value to `<s>-<rank>.pkl` (under a temporary name
first, then os.replace, so a file is there whole or not at all), then polls, with sleeps of 10 ms growing
to 200 ms (next to no CPU), until the files it needs are there.

So every rank reads the same inputs and writes to and reads from the same output folder: on several
nodes both must be on a filesystem that all of them share (which the shards already needed). Every job
needs its own torchrun run id (`--standalone` makes one; otherwise `--rdzv-id`, which defaults to
"none": give it $SLURM_JOB_ID or the like), so that a coordination folder left by a job that crashed
never meets a new one: rank 0 refuses to start when its folder is there already, and a later run over
that output with another run id removes the leftover with the rest of the earlier output.

Waiting has no time limit (the gloo group's was 7 days): a rank that finished its files waits for the
others, for as long as they take. A rank that dies without writing its file ends the job anyway, since
torchrun stops the other ranks once one exits with an error. One that stops with an exception also
writes a "closed" file in place of its next value on its way out (close()), so that a rank waiting for
it fails too rather than waiting until torchrun stops it."""

from __future__ import annotations

import bisect
import os
import pickle
import re
import shutil
import time
from pathlib import Path

from scripts.preprocess.errors import UsageError

FOLDER_PREFIX = ".ranks-"
"""The start of the name of the ranks' coordination folder inside the output folder."""
EXCHANGE_FILE = re.compile(r"\d+-\d+\.pkl|\.\d+-\d+\.pkl\.tmp")
"""The names of the files in it (the second while one is written)."""
POLL_FIRST, POLL_MAX = 0.01, 0.2
"""Seconds between two looks for the files of an exchange: the first wait, and the longest."""
_CLOSED = "closed"


class RankStopped(RuntimeError):
    """Another rank stopped (with an error it reported itself) before it took part in an exchange."""


class World:
    """This process's rank among `size`, which exchange values through files in a coordination folder when
    size > 1 (`run`: torchrun's run id and restart count, naming that folder); plain calls otherwise."""

    def __init__(self, rank: int = 0, size: int = 1, run: str | None = None):
        self.rank, self.size, self.run = rank, size, run
        self.folder: Path | None = None
        """The coordination folder, from start() until close() (always None with one rank)."""
        self._seq = 0  # the next exchange; counts only completed ones
        self._made: list[Path] = []  # the folders rank 0 made for the output, deepest first

    def __repr__(self) -> str:
        return f"World(rank={self.rank}, size={self.size}, run={self.run!r})"

    @property
    def distributed(self) -> bool:
        return self.size > 1

    @classmethod
    def from_env(cls) -> World:
        """The ranks torchrun set up (RANK and WORLD_SIZE in the environment), or one rank without it."""
        size = int(os.environ.get("WORLD_SIZE", "1"))
        if "RANK" not in os.environ or size == 1:
            return cls()
        run_id = os.environ.get("TORCHELASTIC_RUN_ID")
        run = f"{run_id}-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}" if run_id else None
        return cls(int(os.environ["RANK"]), size, run)

    def start(self, output: Path) -> None:
        """From here on the ranks exchange through a coordination folder in `output`: rank 0 makes both,
        the other ranks wait until the folder is there. Nothing with one rank."""
        if not self.distributed:
            return
        if self.run is None:
            raise UsageError("RANK and WORLD_SIZE are set but TORCHELASTIC_RUN_ID is not: run several ranks with "
                             "torchrun")
        folder = output / (FOLDER_PREFIX + re.sub(r"[^\w.-]", "_", self.run))
        if self.rank == 0:
            self._make(output, folder)
        else:
            self._poll(Path.exists, [folder])
        self.folder = folder

    def _make(self, output: Path, folder: Path) -> None:
        if output.exists() and not output.is_dir():
            raise UsageError(f"--output {output}: exists and is not a folder")
        path = output
        while not path.exists() and path != path.parent:
            self._made.append(path)
            path = path.parent
        try:
            output.mkdir(parents=True, exist_ok=True)
            folder.mkdir()
        except FileExistsError:
            raise UsageError(
                f"{folder} is there already: a job with the same torchrun run id ({self.run.rpartition('-')[0]}) "
                f"stopped before it finished. Remove that folder, and give every job its own --rdzv-id (such "
                f"as $SLURM_JOB_ID)") from None
        except OSError as e:
            self._remove_made()
            raise UsageError(f"--output {output}: cannot make the ranks' coordination folder {folder}: {e}") from e

    def close(self) -> None:
        """Leave the exchanges: every rank writes a "closed" file once it has read its last exchange, and
        rank 0 waits for all of them before it removes the coordination folder (and the output folder, when
        it made it and it is still empty: a run that failed before writing anything).

        Rank 0 may be leaving with an exception, while the others wait for its next file, or for the one
        after (a rank that read the value rank 0 wrote before it failed): its "closed" files at both numbers
        make them stop, and they write theirs on their way out. A rank that has not got that far when it
        dies ends the job through torchrun. The other ranks leave once rank 0 has closed: torchrun stops the
        ranks still running as soon as one exits with an error, which would cut rank 0's report short."""
        if self.folder is None:
            return
        if self.rank == 0:
            seq = self._seq
            for number in (seq + 1, seq):
                self._write(None, _CLOSED, number)
            self._poll(lambda rank: self._closed(seq, rank) or self._closed(seq + 1, rank), range(1, self.size))
            shutil.rmtree(self.folder, ignore_errors=True)
            self._remove_made()
        else:  # not a failure to ignore: rank 0 would wait for this file
            self._write(None, _CLOSED)
            # then wait for rank 0 to close (it has reported the job's outcome by then): a rank that ended first
            # would have torchrun stop rank 0 before its report
            seq, folder = self._seq, self.folder
            self._poll(lambda rank: not folder.exists() or self._closed(seq, rank) or self._closed(seq + 1, rank), [0])
        self.folder = None

    def _remove_made(self) -> None:
        for path in self._made:
            try:
                path.rmdir()
            except OSError:  # not empty: the output is there
                break
        self._made = []

    def _path(self, rank: int, seq: int | None = None) -> Path:
        return self.folder / f"{self._seq if seq is None else seq}-{rank}.pkl"

    def _write(self, value, kind: str = "value", seq: int | None = None) -> None:
        """This rank's file of the current exchange (or of exchange `seq`): (kind, value), kind "value" or
        _CLOSED."""
        path = self._path(self.rank, seq)
        temporary = path.with_name(f".{path.name}.tmp")
        temporary.write_bytes(pickle.dumps((kind, value), protocol=pickle.HIGHEST_PROTOCOL))
        os.replace(temporary, path)

    def _load(self, rank: int, seq: int | None = None) -> tuple[str, object]:
        return pickle.loads(self._path(rank, seq).read_bytes())

    def _closed(self, seq: int, rank: int) -> bool:
        try:
            return self._load(rank, seq)[0] == _CLOSED
        except FileNotFoundError:  # not written yet, or (rank 0's) the folder is gone
            return False

    @staticmethod
    def _poll(ready, items) -> None:
        """Return once ready(item) is true for every item (checked again after sleeps of POLL_FIRST growing
        to POLL_MAX; an item found ready is not checked again)."""
        delay, waiting = POLL_FIRST, list(items)
        while True:
            waiting = [item for item in waiting if not ready(item)]
            if not waiting:
                return
            time.sleep(delay)
            delay = min(delay * 1.5, POLL_MAX)

    def _exchange(self, value, sources: range) -> list:
        """Write `value` as this rank's; -> the values of the ranks in `sources`, once they are written."""
        self._write(value)
        self._poll(lambda rank: self._path(rank).exists(), sources)
        values = []
        for rank in sources:
            kind, value = self._load(rank)
            if kind == _CLOSED:
                raise RankStopped(f"rank {rank} stopped with an error (see its messages); rank {self.rank} "
                                  f"stops too")
            values.append(value)
        self._seq += 1
        return values

    def all_gather(self, obj) -> list:
        """Every rank's `obj`, in rank order, on every rank."""
        if not self.distributed:
            return [obj]
        return self._exchange(obj, range(self.size))

    def on_rank0(self, fn):
        """fn() run by rank 0, its result given to every rank; a UsageError it raises is raised on every rank."""
        if not self.distributed:
            return fn()
        if self.rank == 0:
            try:
                outcome = ("ok", fn())
            except UsageError as e:
                outcome = ("error", str(e))
            self._exchange(outcome, range(0))
        else:  # writes a file too, which tells rank 0 in close() that this rank is here
            [outcome] = self._exchange(None, range(1))
        kind, value = outcome
        if kind == "error":
            raise UsageError(value)
        return value

    def on_every_rank(self, fn):
        """fn() run by every rank; when any of them raises UsageError, every rank raises one that names the
        failed ranks and their messages."""
        if not self.distributed:
            return fn()
        try:
            value, error = fn(), None
        except UsageError as e:
            value, error = None, str(e)
        failed: dict[str, list[str]] = {}  # message -> the ranks that gave it
        for rank, message in enumerate(self.all_gather(error)):
            if message is not None:
                failed.setdefault(message, []).append(str(rank))
        if failed:
            raise UsageError("; ".join(f"rank{'s' * (len(ranks) > 1)} {', '.join(ranks)}: {message}"
                                       for message, ranks in failed.items()))
        return value


def assign_files(sizes: list[int], ranks: int) -> list[range]:
    """Contiguous ranges of the files (in input order), one per rank, of about equal bytes: a file goes to
    the rank whose equal share of the total its middle byte falls in. A file is never split, so with fewer
    files than ranks some ranks get none. Every file weighs one byte more than its size, so that empty
    files are dealt out too."""
    total = sum(sizes) + len(sizes)
    owners, before = [], 0
    for size in sizes:
        owners.append(min(ranks - 1, ranks * (2 * before + size + 1) // (2 * total)))
        before += size + 1
    starts = [bisect.bisect_left(owners, rank) for rank in range(ranks + 1)]  # owners never decrease
    return [range(starts[rank], starts[rank + 1]) for rank in range(ranks)]
