"""Several trainings in one torchrun launch, one after the other, for tests that compare many layouts of one world
size (conftest.torchrun_runs). Each rank runs train.main on each run's arguments in turn, as train.py would in a
process of its own, and appends `{"run": name, "rank": r, "status": s}` to the file it is given:

    torchrun --nproc_per_node N tests/train_runs.py RUNS.json STATUS.jsonl

RUNS.json maps a run's name to its train.py arguments. Starting Python and importing torch is most of a tiny run's
CPU; here a launch pays it once for all its runs. A run may not leave anything behind for the next: each joins a
process group of its own, over a store of its own (torchrun's, reused, would hand a run the previous run's addresses
under the same keys), train.main destroys it, and the caches of torch that outlive a process group are cleared
between runs (forget_compiled_and_sharded_ops). That the runs then train as they do alone is what the layout
tests check against separate one-process references; train.py keeping no state in module globals makes it hold.
"""

import json
import os
import socket
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import train  # noqa: E402

RUN_START = "=== train_runs: "
"""Rank 0's line before each run's output."""


def own_store(agent: dist.TCPStore, run: int, rank: int) -> None:
    """Point env:// (what train.main joins) at a new store that rank 0 hosts on a free port, told to the other ranks
    through torchrun's store."""
    if rank == 0:
        with socket.socket() as s:
            s.bind((os.environ["MASTER_ADDR"], 0))
            agent.set(f"train_runs/{run}", str(s.getsockname()[1]))
    os.environ["MASTER_PORT"] = agent.get(f"train_runs/{run}").decode()
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "False"


def forget_compiled_and_sharded_ops() -> None:
    """The compiler's caches, and DTensor's of how each op shards: keyed by meshes, and the next run's meshes equal
    this one's (the same ranks, shape and names) but hold new process groups; kept, they would hand the next run
    this one's destroyed groups."""
    torch._dynamo.reset()
    from torch.distributed.tensor import debug

    getattr(debug, "_clear_sharding_prop_cache", debug._clear_python_sharding_prop_cache)()


def main(runs_file: str, status_file: str) -> int:
    runs = json.loads(Path(runs_file).read_text())
    agent = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timedelta(minutes=10))
    rank, failed = int(os.environ["RANK"]), 0
    for run, (name, args) in enumerate(runs.items()):
        own_store(agent, run, rank)
        if rank == 0:
            print(f"{RUN_START}{name}", file=sys.stderr, flush=True)
        status = train.main(args)
        with open(status_file, "a") as f:
            f.write(json.dumps({"run": name, "rank": rank, "status": status}) + "\n")
        failed = failed or status
        forget_compiled_and_sharded_ops()
    return failed


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
