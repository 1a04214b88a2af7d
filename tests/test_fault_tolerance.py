"""Replica groups on torchft (components/distributed/fault_tolerance.py), on CPU over gloo: a job of two groups, each
its own ./run_train.sh, joined by a torchft lighthouse. Without a fault they train as one data-parallel run; a group
killed with SIGKILL at a random step leaves the other training, and relaunched it takes a live group's state (no
checkpoint read) and from then on holds bitwise the weights of the other."""

import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, TINY, free_port, losses, metric_lines, step_figures, torchrun
from fault_injection import kill_tree

pytestmark = pytest.mark.slow
STEPS = 8

FT = ["--fault_tolerance.enable", "true", "--fault_tolerance.timeout_seconds", "20", "--checkpoint.enable", "true",
      "--checkpoint.interval", "1000"]  # a checkpoint of the last step only


@pytest.fixture
def lighthouse():
    """Start a torchft lighthouse on a free port, as docs/reliability.md does: lighthouse(min_replicas) -> its address.
    With min_replicas 2 the first step waits for both groups; with 1 a group that is alone trains alone."""
    started = []

    def start(min_replicas: int = 1) -> str:
        port = free_port()
        started.append(subprocess.Popen(
            [str(Path(sys.executable).parent / "torchft_lighthouse"), "--min_replicas", str(min_replicas),
             "--join_timeout_ms", "5000", "--quorum_tick_ms", "50", "--bind", f"[::]:{port}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        return f"http://localhost:{port}"

    yield start
    for proc in started:
        proc.kill()
        proc.wait()


def start_group(group: int, nproc: int, dump: Path, lighthouse: str, log: Path, steps: int,
                pause: Path | None = None, layout: tuple[str, ...] = (), held_from: int = 1) -> subprocess.Popen:
    """One group's ./run_train.sh, laid out inside by `layout`; with `pause`, the same launcher running train.py
    with a short sleep in every step from its `held_from`-th and a wait there while the file `pause` exists
    (tests/fault_injection.py): the test holds it back meanwhile."""
    env = dict(os.environ, NGPU=str(nproc), OMP_NUM_THREADS="1",
               PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    args = [*TINY, *FT, "--fault_tolerance.replica_id", str(group), "--fault_tolerance.lighthouse", lighthouse,
            "--training.steps", str(steps), "--job.dump_folder", str(dump), *layout]
    command = ["./run_train.sh", *args]
    if pause:
        env |= {"INGOT_FAULT": f"slow-steps:{held_from}", "INGOT_PAUSE": str(pause)}
        command = [sys.executable, "-m", "components.run.launch", "--standalone", "--nproc_per_node", str(nproc),
                   "tests/fault_injection.py", *args]
    return subprocess.Popen(command, cwd=REPO, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)


def final_weights(dump: Path, steps: int) -> dict:
    import torch
    import torch.distributed.checkpoint as dcp

    from components.checkpoint.dcp import one_process, saved_entries

    step = dump / "checkpoint" / f"step-{steps}"
    names = {n.removeprefix("model."): e.size for n, e in saved_entries(step).items() if n.startswith("model.")}
    weights = {name: torch.empty(size) for name, size in names.items()}
    with one_process():
        dcp.load({"model": weights}, checkpoint_id=str(step), no_dist=True)
    return weights


def assert_same_weights(a: Path, b: Path, steps: int) -> None:
    wa, wb = final_weights(a, steps), final_weights(b, steps)
    assert wa.keys() == wb.keys()
    assert all(wa[k].equal(wb[k]) for k in wa), [k for k in wa if not wa[k].equal(wb[k])]


def test_two_replica_groups_train_as_one_data_parallel_run(tmp_path, lighthouse):
    """Group g reads data-parallel share g of 2: the losses of a run with data_parallel_shard_degree 2 (the groups
    average their gradients as FSDP does), the same in both groups, and the same final weights."""
    logs = [tmp_path / f"group{g}.log" for g in (0, 1)]
    address = lighthouse(min_replicas=2)  # both groups from the first step
    groups = [start_group(g, 1, tmp_path / "ft", address, logs[g], STEPS) for g in (0, 1)]
    assert [g.wait(timeout=600) for g in groups] == [0, 0], logs[0].read_text()[-3000:] + logs[1].read_text()[-3000:]
    one = tmp_path / "one_job"
    torchrun(2, [*TINY, "--training.steps", str(STEPS), "--parallelism.data_parallel_shard_degree", "2",
                 "--job.dump_folder", str(one)])
    replica = [tmp_path / "ft" / f"replica_{g}" for g in (0, 1)]
    assert losses(replica[0]) == losses(replica[1])
    for step, loss in losses(one).items():
        assert losses(replica[0])[step] == pytest.approx(loss, rel=1e-5), step
    assert_same_weights(replica[0], replica[1], STEPS)
    assert "took the state" not in logs[0].read_text() + logs[1].read_text()


MOE = ("--job.config_file", "debug_moe.toml", "--model.n_layers", "2")  # the debug MoE model, TINY's shape
GROUP_LAYOUTS = {  # inside each group of 2 processes
    "tp2": ("--parallelism.tensor_parallel_degree", "2"),
    "pp2": ("--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size", "2"),
    "cp2": ("--parallelism.context_parallel_degree", "2"),
    "moe_ep2": (*MOE, "--parallelism.expert_parallel_degree", "2", "--training.local_batch_size", "2"),  # FSDP 2
}


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> dict[bool, Path]:
    """The runs that two groups, each reading half of a global batch of 8, should equal, dense and MoE."""
    dumps = {moe: tmp_path_factory.mktemp("one_process") for moe in (False, True)}
    for moe, dump in dumps.items():
        torchrun(1, [*TINY, *(MOE if moe else ()), "--training.steps", str(STEPS), "--training.local_batch_size", "8",
                     "--job.dump_folder", str(dump)])
    return dumps


@pytest.mark.parametrize("name", GROUP_LAYOUTS)
def test_replica_groups_of_any_layout_and_moe_models_train_as_one_process(tmp_path, lighthouse, one_process, name):
    """Rank r of one group averages its gradients with rank r of the other, the same shard of the same stage, and
    sums its routing tally with it: the groups move their routing biases as one job."""
    logs = [tmp_path / f"group{g}.log" for g in (0, 1)]
    address = lighthouse(min_replicas=2)
    groups = [start_group(g, 2, tmp_path / "ft", address, logs[g], STEPS, layout=GROUP_LAYOUTS[name])
              for g in (0, 1)]
    assert [g.wait(timeout=600) for g in groups] == [0, 0], logs[0].read_text()[-3000:] + logs[1].read_text()[-3000:]
    replica, reference = [tmp_path / "ft" / f"replica_{g}" for g in (0, 1)], one_process[MOE[1] in GROUP_LAYOUTS[name]]
    assert losses(replica[0]) == losses(replica[1])
    assert losses(replica[0]) == pytest.approx(losses(reference), rel=1e-5)
    if "moe" in name:  # the routing: every group's biases moved by the tally of all
        got, expected = step_figures(replica[0]), step_figures(reference)
        assert [got[s]["moe_max_load"] for s in got] == pytest.approx([expected[s]["moe_max_load"] for s in got],
                                                                      rel=1e-5)
    assert_same_weights(replica[0], replica[1], STEPS)
    if "moe" in name:
        biases = {k: v for k, v in final_weights(replica[0], STEPS).items() if "expert_bias" in k}
        assert biases and any(b.abs().sum() > 0 for b in biases.values())


def wait_for(logs: list[Path], condition, process: subprocess.Popen) -> None:
    """Until `condition()`, while `process` runs, for 300 s at most (the groups' logs in the failure)."""
    deadline = time.monotonic() + 300
    while not condition():
        assert process.poll() is None and time.monotonic() < deadline, [log.read_text()[-3000:] for log in logs
                                                                        if log.exists()]
        time.sleep(0.05)


def step_lines(log: Path) -> list[int]:
    return [int(line.split("step")[1].split()[0]) for line in log.read_text().splitlines() if "  loss  " in line]


REJOINING = {name: GROUP_LAYOUTS[name] for name in ("tp2", "pp2", "moe_ep2")}
"""The layouts whose state a rejoining group takes in another form: TP's shards of other dimensions; a pipeline
stage's part of the model; FSDP shards with experts split by EP and their routing biases (moe_ep2 is FSDP 2 x EP 2,
which covers FSDP alone; CP shards the state as FSDP does)."""


@pytest.mark.parametrize("layout", REJOINING.values(), ids=REJOINING)
def test_a_killed_group_rejoins_from_a_live_group_while_the_other_trains_on(tmp_path, lighthouse, layout):
    """Each group two processes, FSDP or another layout (groups of one process: the test above). Group 1's
    launcher and workers are SIGKILLed after a random number (2 to 4) of its steps; group 0 goes on alone, saying so;
    group 1, relaunched, reads no checkpoint, takes group 0's state, and ends with its weights (routing biases
    included). (Group 1 first joins group 0 the same way.) Group 0 is held back between its steps while group 1
    starts, and again while it starts again, so that group 0 cannot run far ahead or finish first on a busy
    machine."""
    logs = [tmp_path / "group0.log", tmp_path / "group1.log", tmp_path / "group1_relaunched.log"]
    dump, steps, pause, address = tmp_path / "ft", 30, tmp_path / "hold_group0", lighthouse(min_replicas=1)
    nproc = 2

    pause.touch()  # group 0 waits after its first step until group 1 has started: group 1 joins it, not the reverse
    survivor = start_group(0, nproc, dump, address, logs[0], steps, pause, layout)
    started = [survivor]
    try:
        wait_for(logs, lambda: "training steps 1 to" in logs[0].read_text(), survivor)
        started.append(victim := start_group(1, nproc, dump, address, logs[1], steps, layout=layout))
        wait_for(logs, lambda: "replica group 1 of 2" in logs[1].read_text(), victim)  # its manager is up
        pause.unlink()
        kill_after = random.randint(2, 4)
        wait_for(logs, lambda: len(step_lines(logs[1])) >= kill_after, victim)
        kill_tree(victim.pid)
        victim.wait()
        killed_at = step_lines(logs[1])[-1]
        wait_for(logs, lambda: max(step_lines(logs[0]), default=0) >= killed_at + 3, survivor)
        pause.touch()
        started.append(relaunched := start_group(1, nproc, dump, address, logs[2], steps, layout=layout))
        wait_for(logs, lambda: "replica group 1 of 2" in logs[2].read_text(), relaunched)
        pause.unlink()
        assert survivor.wait(timeout=600) == 0, logs[0].read_text()[-3000:]
        assert relaunched.wait(timeout=600) == 0, logs[2].read_text()[-3000:]
    finally:  # nothing left running after a failure
        for process in started:
            if process.poll() is None:
                kill_tree(process.pid)

    alone = [int(line.split("step ")[1].split(":")[0]) for line in logs[0].read_text().splitlines()
             if "1 of 2 replica groups take part; the share of the 1 away is not trained" in line]
    assert any(step > killed_at for step in alone), alone  # the survivor said it went on alone
    assert [m["step"] for m in metric_lines(dump / "replica_0")] == list(range(1, steps + 1))  # no step lost
    hashes = [m["data_hash"] for m in metric_lines(dump / "replica_0")]
    assert len(set(hashes)) == len(hashes)  # group 0 never read a batch twice
    rejoined = logs[2].read_text()
    assert "took the state of step" in rejoined and "resuming" not in rejoined  # no checkpoint read
    joined_at = int(rejoined.split("took the state of step ")[1].split()[0])
    assert joined_at > killed_at + 2
    after = {s: loss for s, loss in losses(dump / "replica_1").items() if s > joined_at}
    assert len(after) == steps - joined_at and all(losses(dump / "replica_0")[s] == loss for s, loss in after.items())
    assert_same_weights(dump / "replica_0", dump / "replica_1", steps)
    # Group 1 keeps what it logged before it was killed, and marks each stretch it took from group 0 instead.
    records = metric_lines(dump / "replica_1")
    trained = [m["step"] for m in records if "loss" in m]
    holes = [m["not_trained_here"] for m in records if "not_trained_here" in m]
    assert killed_at in trained and any(first > killed_at and last == joined_at for first, last in holes), holes
    assert sorted(trained + [s for first, last in holes for s in range(first, last + 1)]) == list(range(1, steps + 1))
    # Each group's lines name it, in the terminal and in its own log.txt; no transfer's access log, no warning.
    own_log = (dump / "replica_1" / "log.txt").read_text()
    assert "[g1 rank0]" in own_log and "took the state of step" in own_log and "[g0 " not in own_log
    assert "[g0 rank0]" in logs[0].read_text() and "[g1 rank0]" in rejoined
    for log in logs:
        assert "GET /checkpoint" not in log.read_text() and "Warning" not in log.read_text(), log.read_text()[-3000:]


DILOCO = ("--fault_tolerance.semi_sync_method", "diloco", "--fault_tolerance.sync_every", "4")


def synchronisations(log: Path) -> list[tuple[int, int]]:
    """(step, groups taking part) of each DiLoCo synchronisation a group logged."""
    return [(int(line.split("step ")[1].split(":")[0]), int(line.split(": ")[1].split(" of ")[0]))
            for line in log.read_text().splitlines() if "replica groups synchronised" in line]


def test_diloco_groups_synchronise_every_interval_and_train_as_well_as_groups_synchronised_every_step(
        tmp_path, lighthouse):
    """Two groups of one process, 16 steps, synchronising every 4 (fault_tolerance.sync_every): four exchanges of
    one model's worth of pseudo-gradients (a quarter of the all-reduces that averaging gradients every step makes),
    bitwise the same weights in both groups after the last, and about the losses of training on the same tokens
    synchronised at every step (one process at the global batch of both groups)."""
    steps, logs = 16, [tmp_path / f"group{g}.log" for g in (0, 1)]
    address = lighthouse(min_replicas=2)
    groups = [start_group(g, 1, tmp_path / "ft", address, logs[g], steps, layout=DILOCO) for g in (0, 1)]
    assert [g.wait(timeout=600) for g in groups] == [0, 0], logs[0].read_text()[-3000:] + logs[1].read_text()[-3000:]
    assert synchronisations(logs[0]) == synchronisations(logs[1]) == [(4, 2), (8, 2), (12, 2), (16, 2)]
    replica = [tmp_path / "ft" / f"replica_{g}" for g in (0, 1)]
    assert losses(replica[0]) != losses(replica[1])  # each group trains apart, on its own share
    assert_same_weights(replica[0], replica[1], steps)
    synchronous = torchrun(1, [*TINY, "--training.steps", str(steps), "--training.local_batch_size", "8",
                               "--job.dump_folder", str(tmp_path / "synchronous")])
    assert synchronous.returncode == 0
    last = [sum(list(losses(folder).values())[-4:]) / 4 for folder in (*replica, tmp_path / "synchronous")]
    assert (last[0] + last[1]) / 2 == pytest.approx(last[2], rel=0.05), last


def test_a_diloco_group_killed_mid_interval_rejoins_at_the_next_synchronisation(tmp_path, lighthouse):
    """Group 1 joins group 0 at its first synchronisation, is SIGKILLed in the next interval, and relaunched joins
    again at a later synchronisation, taking group 0's state (no checkpoint read); group 0 trains every step,
    synchronising alone while group 1 is away, and both end with the same weights. Group 0 is held back while group 1
    starts and while it starts again (tests/fault_injection.py), so that it cannot finish first on a busy machine;
    group 1 is held in its second step after joining (step 6), so that it is killed there and never in step 8's
    synchronisation (which group 0 would then not commit)."""
    logs = [tmp_path / "group0.log", tmp_path / "group1.log", tmp_path / "group1_relaunched.log"]
    dump, steps, pause, address = tmp_path / "ft", 24, tmp_path / "hold_group0", lighthouse(min_replicas=1)
    hold_victim = tmp_path / "hold_group1"

    pause.touch()
    hold_victim.touch()
    started = [survivor := start_group(0, 1, dump, address, logs[0], steps, pause, DILOCO)]
    try:
        wait_for(logs, lambda: "training steps 1 to" in logs[0].read_text(), survivor)
        started.append(victim := start_group(1, 1, dump, address, logs[1], steps, hold_victim, DILOCO, held_from=2))
        wait_for(logs, lambda: "replica group 1 of 2" in logs[1].read_text(), victim)
        pause.unlink()
        wait_for(logs, lambda: step_lines(logs[1]), victim)
        assert step_lines(logs[1]) == [5], logs[1].read_text()[-3000:]  # joined at step 4, trained 5, held in 6
        kill_tree(victim.pid)
        victim.wait()
        wait_for(logs, lambda: max(step_lines(logs[0]), default=0) >= 13, survivor)
        pause.touch()
        started.append(relaunched := start_group(1, 1, dump, address, logs[2], steps, layout=DILOCO))
        wait_for(logs, lambda: "replica group 1 of 2" in logs[2].read_text(), relaunched)
        pause.unlink()
        assert survivor.wait(timeout=600) == 0, logs[0].read_text()[-3000:]
        assert relaunched.wait(timeout=600) == 0, logs[2].read_text()[-3000:]
    finally:
        for process in started:
            if process.poll() is None:
                kill_tree(process.pid)

    synced = synchronisations(logs[0])
    assert [step for step, _ in synced] == [4, 8, 12, 16, 20, 24] and (12, 1) in synced and synced[-1] == (24, 2)
    rejoined = logs[2].read_text()
    joined_at = int(rejoined.split("took the state of step ")[1].split()[0])
    assert joined_at % 4 == 0 and joined_at > 12 and "resuming" not in rejoined
    assert [m["step"] for m in metric_lines(dump / "replica_0")] == list(range(1, steps + 1))
    assert_same_weights(dump / "replica_0", dump / "replica_1", steps)


@pytest.mark.parametrize("args, message", [
    (["--fault_tolerance.replica_id", "2"], "fault_tolerance.replica_id 2 is not a group of replica_groups 2"),
    ([], "fault_tolerance needs torchrun's store: launch each group with ./run_train.sh"),
    (["--fault_tolerance.enable", "false", "--fault_tolerance.semi_sync_method", "diloco"],
     "fault_tolerance.semi_sync_method diloco synchronises replica groups: set fault_tolerance.enable true"),
], ids=["replica_id_out_of_range", "without_torchrun", "diloco_without_groups"])
def test_fault_tolerance_refuses_at_start_up_what_it_cannot_do(tmp_path, train_in_process, capsys, args, message):
    assert train_in_process([*TINY, "--fault_tolerance.enable", "true", *args, "--job.dump_folder",
                             str(tmp_path)]) == 2
    assert message in capsys.readouterr().err
