"""The fault soak: one training run, faults of every kind thrown at it at random moments, relaunched the way a
scheduler relaunches a job until it completes; then compared with the same run uninterrupted.

    python -m scripts.soak --faults 20 --seed 0 --nproc 2 [--dataset hf|packed] [--output soak.json]

A seeded plan draws the faults (each kind once per round, in a shuffled order) and their moments: the step after
which one strikes, the rank it hits. Faults are what the world does to a job: SIGKILL of a rank in a step, during
start-up or as the checkpoint loads, and of the whole job while a blocking or an asynchronous save writes or just
before it commits (tests/fault_injection.py arms those inside the trainer); SIGTERM and SIGUSR1 to the launcher and
to every process of the job; a rank frozen by SIGSTOP until the hang timeout; a data loader's worker killed; the
newest checkpoint truncated or a byte of it flipped between two launches; the file system of the dump folder full
during a save (a tmpfs of the soak's own, scripts/small_disk.py, filled up to half a checkpoint of room and freed
once the save has failed); a NaN in a step's gradients. The job is relaunched after every status but 0 (a person
would look at a 3 or a 74 first, and then rerun) until it exits 0 having trained every step.

Then every step's loss and gradient norm, and every tensor and value of the final checkpoint (weights, optimizer
state, data loader position, RNG states), must equal those of the uninterrupted run bit for bit, each step logged
once. It prints a table (faults by kind, survived, seconds lost per fault: an attempt's wall time less the steps it
added to the run at the uninterrupted run's pace) and the figure, and writes them as JSON (--output).
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from scripts.job_processes import Launch, descendants, signal_quietly
from scripts.soak_compare import differences, final_state, flatten

REPO = Path(__file__).resolve().parent.parent
CORPUS = REPO / "tests/assets/shakespeare/train.jsonl"
TOKENIZER = REPO / "tests/assets/tokenizers/shakespeare_bpe_4k.model"
INTERVAL, KEEP, HANG_TIMEOUT = 2, 3, 8
"""Checkpoint interval, checkpoints kept, comm.train_timeout_seconds: a frozen rank ends its job in seconds."""
DISK_MB = 320
"""The soak's file system: room for KEEP + 1 checkpoints of the tiny model (42 MB each, with Adam's moments)."""

KINDS = {  # kind: what happens, and how it must end the launch it strikes (statuses; "continues": it goes on)
    "kill-rank-in-step": ("SIGKILL to one rank during a step", "crash"),
    "kill-rank-at-start": ("SIGKILL to one rank during start-up (imports, rendezvous, model build)", "crash"),
    "kill-rank-at-load": ("SIGKILL to one rank as the checkpoint loads", "crash"),
    "kill-during-blocking-save": ("SIGKILL to the job once a rank wrote its files of a blocking save", "crash"),
    "kill-during-async-save": ("SIGKILL to the job once a rank wrote its files of an async save", "crash"),
    "kill-before-commit": ("SIGKILL to the job between the last file of a save and its commit", "crash"),
    "sigterm-launcher": ("SIGTERM to the launcher", "preempted"),
    "sigusr1-launcher": ("SIGUSR1 to the launcher", "preempted"),
    "sigterm-every-process": ("SIGTERM to every process of the job", "preempted"),
    "sigusr1-every-process": ("SIGUSR1 to every process of the job", "preempted"),
    "sigstop-rank": ("one rank frozen by SIGSTOP until the hang timeout", "hung"),
    "kill-loader-worker": ("SIGKILL to a data loader's worker process", "crash"),
    "truncate-newest-checkpoint": ("the newest checkpoint's largest file cut in half between launches", "damaged"),
    "corrupt-newest-checkpoint": ("a byte flipped in the newest checkpoint between launches", "damaged"),
    "disk-full-during-save": ("the dump folder's file system full (half a checkpoint of room) during a save",
                              "continues"),
    "nan-in-step": ("a NaN in one rank's gradients", "stopped"),
}
BETWEEN_LAUNCHES = ("truncate-newest-checkpoint", "corrupt-newest-checkpoint")
STATUSES = {"preempted": {75}, "hung": {4}, "stopped": {3}}
"""A "crash" is any status but 0, 2, 3, 74 and 75."""


@dataclass
class Fault:
    kind: str
    after_step: int = 0
    """The run's step after which it strikes (0: at the launch)."""
    rank: int = 0
    outcome: str = ""
    """What happened: the launch's status, or what the relaunch found."""
    survived: bool = False
    seconds_lost: float = 0.0


@dataclass
class Soak:
    faults: list[Fault] = field(default_factory=list)
    launches: list[dict] = field(default_factory=list)
    reference_seconds: float = 0.0
    differences: list[str] = field(default_factory=list)
    not_thrown: dict[str, str] = field(default_factory=dict)
    """Kinds left out of this soak, and why."""
    trained_alone: int = 0
    """Replica groups: steps a group trained alone, the away group's share of their batch untrained."""


def checkpoints(run: Path) -> dict[int, Path]:
    folder = run / "checkpoint"
    found = {int(p.name[5:]): p for p in folder.glob("step-*") if re.fullmatch(r"step-\d+", p.name)} \
        if folder.is_dir() else {}
    return dict(sorted(found.items()))


NOT_ON_ONE_PROCESS = {"sigstop-rank": "a lone process stopped by SIGSTOP has no peer whose collective times out, and "
                                      "is a suspended job to the launcher (SLURM's scontrol suspend sends SIGSTOP): "
                                      "it waits for SIGCONT"}
"""Kinds a job of one process cannot survive as the others do, and why: not thrown there, said in the report."""


def plan(count: int, rng: random.Random, nproc: int = 2) -> list[Fault]:
    """`count` faults, every kind once per round in a shuffled order (but NOT_ON_ONE_PROCESS's on one process). A
    full disk leaves its launch running: each goes just before a fault that strikes a running job, which ends that
    launch."""
    kinds: list[str] = []
    while len(kinds) < count:
        round_ = [kind for kind in KINDS if nproc > 1 or kind not in NOT_ON_ONE_PROCESS]
        rng.shuffle(round_)
        kinds += round_
    kinds = kinds[:count]
    full = [k for k in kinds if k == "disk-full-during-save"]
    others = [k for k in kinds if k != "disk-full-during-save"]
    enders = [i for i, kind in enumerate(others) if strikes_running_job(kind)]
    for i in sorted(rng.sample(enders, min(len(full), len(enders))), reverse=True):
        others.insert(i, "disk-full-during-save")
    others += [rng.choice([k for k in KINDS if strikes_running_job(k)]) for _ in range(len(full) - len(enders))]
    return [Fault(kind, rank=rng.randrange(1 << 16)) for kind in others]


def strikes_running_job(kind: str) -> bool:
    return kind in ("kill-rank-in-step", "sigterm-launcher", "sigusr1-launcher", "sigterm-every-process",
                    "sigusr1-every-process", "sigstop-rank", "kill-loader-worker")


def armed(fault: Fault, resume: int, steps: int, rng: random.Random) -> tuple[dict[str, str], list[str]]:
    """The environment and extra arguments of a launch that the trainer itself must strike (fault_injection.py)."""
    saves = [s for s in range(resume + 1, steps) if s % INTERVAL == 0] or [steps]
    if fault.kind == "kill-rank-at-load":
        return {"INGOT_FAULT": f"kill-load:0:{fault.rank}"}, []
    if fault.kind in ("kill-during-blocking-save", "kill-during-async-save", "kill-before-commit"):
        fault.after_step = rng.choice(saves[:3])
        what = "kill-commit" if fault.kind == "kill-before-commit" else "kill-write"
        async_mode = ["--checkpoint.async_mode", "async"] if fault.kind == "kill-during-async-save" else []
        return {"INGOT_FAULT": f"{what}:{fault.after_step}"}, async_mode
    if fault.kind == "nan-in-step":
        fault.after_step = resume + rng.randint(1, 4)
        return {"INGOT_FAULT": f"nan-step:{fault.after_step - resume}:{fault.rank}"}, []
    return {}, []


def damage_newest(run: Path, kind: str, rng: random.Random) -> str:
    newest = list(checkpoints(run).values())[-1]
    victim = max((p for p in newest.iterdir() if p.suffix == ".distcp"), key=lambda p: p.stat().st_size)
    with open(victim, "r+b") as f:
        if kind == "truncate-newest-checkpoint":
            f.truncate(victim.stat().st_size // 2)
        else:
            f.seek(rng.randrange(victim.stat().st_size))
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0xFF]))
    return f"{newest.name}/{victim.name}"


def fill(filler: Path, size: int) -> None:
    """A file of `size` bytes, or as many as fit: the job writes meanwhile, and a full disk is what is wanted."""
    chunk = bytes(1 << 20)
    with open(filler, "wb", buffering=0) as f:
        try:
            while size > 0:
                size -= f.write(chunk[:size])
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise


def strike(fault: Fault, launch: Launch, resume: int, steps: int, disk: Path | None, rng: random.Random) -> str:
    """Throw a fault that strikes the running job; what was done, or why it could not be."""
    if fault.kind == "kill-rank-at-start":
        if not launch.wait_until(lambda: fault.rank in launch.ranks()):
            return "the job ended before its ranks started"
        time.sleep(rng.uniform(0.0, 3.0))
        signal_quietly(launch.ranks().get(fault.rank, -1), signal.SIGKILL)
        return f"rank {fault.rank} killed {time.perf_counter() - launch.start:.1f} s after the launch"
    fault.after_step = min(resume + rng.randint(1, 3), steps - 1)
    if not launch.wait_until(lambda: launch.last_step() >= fault.after_step):
        return f"the job ended before step {fault.after_step}"
    if fault.kind == "disk-full-during-save":
        filler = disk / "filler"
        largest = max((sum(f.stat().st_size for f in p.iterdir()) for p in checkpoints(disk / "run").values()),
                      default=45 << 20)
        fill(filler, shutil.disk_usage(disk).free - largest // 2)
        failed = launch.wait_until(lambda: launch.said("not saved: no space left"))
        filler.unlink()
        return "a save found no space" if failed else "the job ended before a save found the disk full"
    pids = {"kill-rank-in-step": lambda: [launch.ranks().get(fault.rank)],
            "sigstop-rank": lambda: [launch.ranks().get(fault.rank)],
            "kill-loader-worker": lambda: launch.loader_workers(fault.rank)[:1],
            "sigterm-launcher": lambda: [launch.proc.pid], "sigusr1-launcher": lambda: [launch.proc.pid],
            "sigterm-every-process": lambda: [launch.proc.pid, *descendants(launch.proc.pid)],
            "sigusr1-every-process": lambda: [launch.proc.pid, *descendants(launch.proc.pid)]}[fault.kind]()
    sig = {"sigstop-rank": signal.SIGSTOP, "sigterm-launcher": signal.SIGTERM, "sigterm-every-process": signal.SIGTERM,
           "sigusr1-launcher": signal.SIGUSR1, "sigusr1-every-process": signal.SIGUSR1}.get(fault.kind, signal.SIGKILL)
    if not [pid for pid in pids if pid]:
        return "no process to strike"
    for pid in pids:
        if pid:
            signal_quietly(pid, sig)
    return f"{signal.Signals(sig).name} after step {fault.after_step}"


def expected(kind: str, status: int, launch: Launch) -> bool:
    want = KINDS[kind][1]
    if want == "continues":
        return launch.said("not saved: no space left")
    if want == "crash":
        return status not in (0, 2, 3, 74, 75)
    return status in STATUSES[want]


def trainer_args(work: Path, steps: int, dataset: str) -> list[str]:
    data = ["--training.dataset", "packed", "--training.dataset_path", str(work / "packed")] if dataset == "packed" \
        else ["--training.dataset", "hf", "--training.dataset_path", str(CORPUS)]
    return ["--job.config_file", str(REPO / "train_configs/debug_model.toml"), *data, "--model.n_layers", "2",
            "--training.seq_len", "64", "--training.local_batch_size", "4", "--training.steps", str(steps),
            "--lr_scheduler.warmup_steps", "2", "--checkpoint.enable", "true", "--checkpoint.interval", str(INTERVAL),
            "--checkpoint.keep_latest_k", str(KEEP), "--metrics.log_freq", "1",
            "--comm.train_timeout_seconds", str(HANG_TIMEOUT)]


def soak(count: int, seed: int, nproc: int, dataset: str, steps: int, work: Path, disk: Path) -> Soak:
    rng, result = random.Random(seed), Soak()
    if dataset == "packed":
        from scripts.preprocess import preprocess

        preprocess([str(CORPUS)], str(work / "packed"), str(TOKENIZER), workers=0, val_fraction=0.0, progress=False)
    reference, run = work / "reference", disk / "run"
    launch = Launch(nproc, [*trainer_args(work, steps, dataset), "--job.dump_folder", str(reference)],
                    work / "reference.log", {})
    status, result.reference_seconds = launch.end()
    if status != 0:
        raise SystemExit(f"the uninterrupted run failed (status {status}): {work / 'reference.log'}")
    pace = result.reference_seconds / steps
    pending, running, resume, attempt, unread = plan(count, rng, nproc), None, 0, 0, []
    result.not_thrown = dict(NOT_ON_ONE_PROCESS) if nproc == 1 else {}
    """unread: the damage done since the last launch, which the next launch must name and fall back from."""
    for fault in pending:
        fault.rank %= nproc
    while True:
        fault = pending.pop(0) if pending else None
        if fault and fault.kind in BETWEEN_LAUNCHES:
            if unread or len(checkpoints(run)) < 2:  # wait for a launch, and an older checkpoint to fall back on
                later = next((i for i, f in enumerate(pending) if f.kind not in BETWEEN_LAUNCHES), None)
                pending.insert(len(pending) if later is None else later + 1, fault)
                fault = pending.pop(0) if later is not None else None
            else:
                fault.outcome = f"damaged {damage_newest(run, fault.kind, rng)}"
                result.faults.append(fault)
                unread.append(fault)
                continue
        if running is None:
            env, extra = armed(fault, resume, steps, rng) if fault else ({}, [])
            attempt += 1
            running = Launch(nproc, [*trainer_args(work, steps, dataset), *extra, "--job.dump_folder", str(run)],
                             work / f"attempt-{attempt}.log", env)
        if fault and (strikes_running_job(fault.kind) or fault.kind in ("kill-rank-at-start", "disk-full-during-save")):
            fault.outcome = strike(fault, running, resume, steps, disk, rng)
            if fault.kind == "disk-full-during-save":
                fault.survived = expected(fault.kind, 0, running)
                result.faults.append(fault)
                continue  # the launch goes on: the next fault ends it
        status, seconds = running.end()
        if running.said("is damaged") or running.said("resumed from"):  # the launch read the checkpoints
            for damaged in unread:
                damaged.survived = running.said("is damaged") and running.said("skipping it")
                damaged.outcome += "; the next launch to load named it and fell back" if damaged.survived else \
                    "; not noticed"
            unread = []
        new_resume = max(checkpoints(run), default=0)
        result.launches.append({"attempt": attempt, "status": status, "seconds": round(seconds, 2),
                                "resumed_from": resume, "reached": running.last_step(), "checkpoint": new_resume})
        if fault:
            fault.outcome = f"{fault.outcome + '; ' if fault.outcome else ''}exit status {status}"
            fault.survived = expected(fault.kind, status, running)
            fault.seconds_lost = round(max(seconds - (new_resume - resume) * pace, 0.0), 2)
            result.faults.append(fault)
        running, resume = None, new_resume
        if status == 0 and not pending:
            break
        if status == 0 and resume >= steps:
            raise SystemExit(f"the run completed with {len(pending)} fault(s) not thrown: raise --steps")
        if attempt > 4 * count + 10:
            raise SystemExit(f"no end after {attempt} launches: {work}")
    result.differences = differences(reference, run, steps, work)
    return result


REJOINED = "took the state of step"
ALONE = re.compile(r"step (\d+): 1 of 2 replica groups take part")


def replica_soak(count: int, seed: int, nproc: int, dataset: str, steps: int, work: Path) -> Soak:
    """Two replica groups (torchft, one job each, a lighthouse between them); `count` times a whole group, drawn at
    random, is SIGKILLed after a random number of its steps and relaunched, and rejoins from the live group without
    reading a checkpoint. The live group is held (tests/fault_injection.py's INGOT_PAUSE) from the kill until the
    relaunched group is back, so that the run goes on through all the faults. The groups must end with the same
    weights, bit for bit, each step logged once per group. Unlike a single job's, this run cannot equal the
    uninterrupted one: a step that the live group trains alone leaves the away group's share of the batch untrained
    (docs/reliability.md); the soak counts those steps instead."""
    rng, result = random.Random(seed), Soak()
    port = free_port()
    lighthouse = subprocess.Popen([str(Path(sys.executable).parent / "torchft_lighthouse"), "--min_replicas", "1",
                                   "--join_timeout_ms", "5000", "--quorum_tick_ms", "50", "--bind", f"[::]:{port}"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    dump, launches = work / "groups", {}
    pauses = {g: work / f"hold_group{g}" for g in (0, 1)}

    def start(group: int) -> Launch:
        args = [*trainer_args(work, steps, dataset), "--checkpoint.interval", str(steps),
                "--fault_tolerance.enable", "true", "--fault_tolerance.replica_id", str(group),
                "--fault_tolerance.lighthouse", f"http://localhost:{port}", "--fault_tolerance.timeout_seconds", "20",
                "--job.dump_folder", str(dump)]
        env = {"INGOT_FAULT": "slow-steps:1:0:0.05", "INGOT_PAUSE": str(pauses[group])}
        launches[group] = Launch(nproc, args, work / f"group{group}-{len(result.launches)}.log", env)
        result.launches.append({"group": group, "log": launches[group].log.name})
        return launches[group]

    try:
        if dataset == "packed":
            from scripts.preprocess import preprocess

            preprocess([str(CORPUS)], str(work / "packed"), str(TOKENIZER), workers=0, val_fraction=0.0,
                       progress=False)
        pauses[0].touch()  # group 0 waits after its first step for group 1 to join
        start(0).wait_until(lambda: launches[0].said("training steps 1 to"))
        start(1).wait_until(lambda: launches[1].said("replica group 1 of 2"))
        pauses[0].unlink()
        for _ in range(count):
            victim = rng.randrange(2)
            survivor, launch = 1 - victim, launches[victim]
            fault = Fault("kill-replica-group", rank=victim)
            target = launch.last_step() + rng.randint(2, 4)
            if not launch.wait_until(lambda: launch.last_step() >= target) or target >= steps - 5:
                break
            fault.after_step = launch.last_step()
            start_kill = time.perf_counter()
            for pid in [launch.proc.pid, *descendants(launch.proc.pid)]:
                signal_quietly(pid, signal.SIGKILL)
            launch.end()
            pauses[survivor].touch()  # held until the victim is back
            relaunched = start(victim)
            relaunched.wait_until(lambda: relaunched.said(f"replica group {victim} of 2"))  # its manager is up
            pauses[survivor].unlink()
            back = relaunched.wait_until(lambda: relaunched.said(REJOINED))
            fault.survived = back
            fault.seconds_lost = round(time.perf_counter() - start_kill, 2)
            fault.outcome = f"SIGKILL after step {fault.after_step}; " + (
                "relaunched, it took the live group's state" if back else "relaunched, it did not rejoin")
            result.faults.append(fault)
        statuses = [launches[g].end()[0] for g in (0, 1)]
    finally:
        for path in pauses.values():
            path.unlink(missing_ok=True)
        for launch in launches.values():
            for pid in [launch.proc.pid, *descendants(launch.proc.pid)]:
                signal_quietly(pid, signal.SIGKILL)
        lighthouse.kill()
        lighthouse.wait()
    if statuses != [0, 0]:
        result.differences.append(f"the groups ended with statuses {statuses}")
        return result
    for group in (0, 1):
        logged = [r["step"] for r in map(json.loads, (dump / f"replica_{group}" / "metrics.jsonl").read_text()
                                         .splitlines()) if "loss" in r]
        if len(logged) != len(set(logged)):
            result.differences.append(f"group {group} logged a step twice")
    states = [flatten(final_state(dump / f"replica_{g}", steps, work)) for g in (0, 1)]
    import torch

    for key in sorted(set(states[0]) | set(states[1])):
        a, b = states[0].get(key), states[1].get(key)
        if key.startswith(("model.", "optimizer.")) and not (
                torch.equal(a, b) if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) else a == b):
            result.differences.append(f"the groups' final {key} differ")
    alone = {int(m[1]) for log in work.glob("group*.log") for m in ALONE.finditer(log.read_text())}
    result.trained_alone = len(alone)
    return result


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def report(result: Soak) -> str:
    rows = ["| fault | count | survived | seconds lost per fault (mean) |", "| --- | ---: | ---: | ---: |"]
    for kind in [*KINDS, "kill-replica-group"]:
        of_kind = [f for f in result.faults if f.kind == kind]
        if of_kind:
            lost = sum(f.seconds_lost for f in of_kind) / len(of_kind)
            rows.append(f"| {kind} | {len(of_kind)} | {sum(f.survived for f in of_kind)} | {lost:.1f} |")
    survived = sum(f.survived for f in result.faults)
    nothing_lost = "nothing lost" if not result.differences else f"{len(result.differences)} difference(s)"
    against = "the two groups' final weights and optimizer states against each other" if result.trained_alone or \
        any(f.kind == "kill-replica-group" for f in result.faults) else \
        "every step's loss and gradient norm and the final checkpoint against the uninterrupted run"
    rows.append(f"\n{survived} of {len(result.faults)} faults survived, {nothing_lost} ({against}, bitwise), in "
                f"{len(result.launches)} launches")
    rows += [f"not thrown: {kind}: {why}" for kind, why in result.not_thrown.items()]
    if result.trained_alone:
        rows.append(f"{result.trained_alone} step(s) trained by one group alone: the other's share of their batch "
                    "was not trained (by design), so this run differs from an uninterrupted one there")
    return "\n".join(rows + [f"  {d}" for d in result.differences[:20]])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--faults", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--nproc", type=int, default=2, help="processes of the job")
    parser.add_argument("--dataset", choices=("hf", "packed"), default="hf", help="the data loader")
    parser.add_argument("--steps", type=int, default=0, help="the run's steps (default: 4 per fault, 24 at least)")
    parser.add_argument("--replica-groups", action="store_true",
                        help="two replica groups (torchft): whole groups killed and relaunched")
    parser.add_argument("--output", type=Path, help="the figures as JSON")
    parser.add_argument("--work", type=Path, help="a folder for the runs and their logs (default: a temporary one)")
    parser.add_argument("--inside", type=Path, help=argparse.SUPPRESS)  # the mounted file system (re-executed)
    args = parser.parse_args(argv)
    steps = args.steps or max(4 * args.faults, 24)
    work = args.work or Path(tempfile.mkdtemp(prefix="ingot-soak-"))
    work.mkdir(parents=True, exist_ok=True)
    if args.replica_groups:
        start = time.perf_counter()
        result = replica_soak(args.faults, args.seed, args.nproc, args.dataset, steps, work)
    elif args.inside is None:  # the dump folder on a small file system of its own: re-run inside it
        from scripts.small_disk import in_small_file_system, why_no_small_file_system

        why = why_no_small_file_system(work)
        if why:
            raise SystemExit(f"the soak needs a file system of its own to fill: {why}")
        (work / "disk").mkdir(exist_ok=True)
        inner = [sys.executable, "-m", "scripts.soak", *(argv if argv is not None else sys.argv[1:]),
                 "--work", str(work), "--inside", str(work / "disk")]
        return subprocess.run(in_small_file_system(work / "disk", DISK_MB, inner), cwd=REPO).returncode
    else:
        start = time.perf_counter()
        result = soak(args.faults, args.seed, args.nproc, args.dataset, steps, work, args.inside)
    print(report(result))
    for leftover in [*work.glob("*.pt"), *work.glob("**/checkpoint")]:  # the logs stay, a gigabyte of states not
        shutil.rmtree(leftover, ignore_errors=True) if leftover.is_dir() else leftover.unlink()
    print(f"({time.perf_counter() - start:.0f} s; logs in {work})")
    if args.output:
        args.output.write_text(json.dumps({"faults": [asdict(f) for f in result.faults], "launches": result.launches,
                                           "seed": args.seed, "nproc": args.nproc, "dataset": args.dataset,
                                           "steps": steps, "reference_seconds": round(result.reference_seconds, 2),
                                           "survived": sum(f.survived for f in result.faults),
                                           "trained_alone": result.trained_alone, "not_thrown": result.not_thrown,
                                           "differences": result.differences}, indent=1))
    return 0 if not result.differences and all(f.survived for f in result.faults) else 1


if __name__ == "__main__":
    sys.exit(main())
