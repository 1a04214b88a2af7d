"""Sweeps (scripts/sweep/): expansion and naming, validation before launch, dry runs, device slots,
reports and `compare`; then real tiny sweeps: completion, skipping, resuming and a failing run."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, read_csv

from components.metrics.reporting import read_metrics
from scripts.sweep import launch, report
from scripts.sweep.__main__ import main
from scripts.sweep.plan import SweepError, read_sweep, run_names
from scripts.sweep.state import last_logged_step

# The debug model cut down as in conftest.TINY, with checkpoints every 3 steps so that a run can resume.
TINY_OVERRIDES = """
[overrides]
"training.steps" = 6
"model.n_layers" = 2
"training.seq_len" = 64
"training.local_batch_size" = 4
"lr_scheduler.warmup_steps" = 2
"checkpoint.interval" = 3
"metrics.log_freq" = 1
"metrics.enable_tensorboard" = false
"""


def write_sweep(tmp_path: Path, body: str, name: str = "sweep.toml") -> Path:
    path = tmp_path / name
    path.write_text('base_config = "train_configs/debug_model.toml"\n' + body)
    return path


# --- Fast: planning, naming, validation -----------------------------------------------------------------


def test_grid_times_overrides_plus_runs_expand_to_readable_unique_names(tmp_path):
    path = write_sweep(tmp_path, """
[overrides]
"training.steps" = 50
[grid]
"optimizer.lr" = [1e-3, 3e-3]
"training.seed" = [1, 2]
[[runs]]
"model.n_layers" = 4
"training.dataset_path" = ["tests/assets/shakespeare/train.jsonl"]
[[runs]]
name = "baseline"
[[runs]]                 # unquoted dotted keys (nested tables) work too
optimizer.lr = 1e-2
[[runs]]                 # a repeat of a grid point runs once
"optimizer.lr" = 1e-3
"training.seed" = 1
""")
    plan = read_sweep(path, tmp_path / "out")
    names = [r.name for r in plan.runs]
    assert names == ["lr=0.001_seed=1", "lr=0.001_seed=2", "lr=0.003_seed=1", "lr=0.003_seed=2",
                     "n_layers=4_dataset_path=tests-assets-shakespeare-train.jsonl", "baseline", "lr=0.01"]
    by_name = {r.name: r for r in plan.runs}
    run = by_name["lr=0.003_seed=2"]
    assert run.overrides == {"optimizer.lr": 3e-3, "training.seed": 2}
    assert run.config.optimizer.lr == 3e-3 and run.config.training.seed == 2 and run.config.training.steps == 50
    assert run.dump == (tmp_path / "out" / "lr=0.003_seed=2").resolve()
    assert run.command[0].endswith("run_train.sh")
    base = str(REPO / "train_configs" / "debug_model.toml")
    assert run.command[1:5] == ["--job.config_file", base, "--job.dump_folder", str(run.dump)]
    assert run.command[5:] == ["--training.steps", "50", "--optimizer.lr", "0.003", "--training.seed", "2"]
    assert by_name["baseline"].overrides == {} and by_name["baseline"].config.training.steps == 50
    assert by_name["n_layers=4_dataset_path=tests-assets-shakespeare-train.jsonl"].config.model.n_layers == 4
    assert by_name["lr=0.01"].config.optimizer.lr == 1e-2


def test_names_stay_unique_when_keys_or_values_collide():
    assert run_names([{"model.name": "a"}, {"optimizer.name": "b"}], [None, None]) == [
        "model.name=a", "optimizer.name=b"]
    assert run_names([{"job.description": "a/b"}, {"job.description": "a b"}], [None, None]) == [
        "description=a-b", "description=a-b-2"]
    assert run_names([{}], [None]) == ["base"]


def test_a_typo_fails_the_sweep_before_anything_is_launched(tmp_path, capsys, no_launch):
    path = write_sweep(tmp_path, '[grid]\n"optimizer.lr" = [1e-3]\n"optimizer.lrr" = [1, 2]\n')
    output = tmp_path / "out"
    assert main([str(path), "--output", str(output)]) == 2
    err = capsys.readouterr().err
    assert "unknown config key 'optimizer.lrr' (did you mean optimizer.lr?)" in err, err
    assert not output.exists()
    # A wrong type and a misspelled sweep-file key fail the same way.
    wrong_type = write_sweep(tmp_path, '[overrides]\n"training.steps" = "many"\n', "b.toml")
    assert main([str(wrong_type), "--output", str(output)]) == 2
    assert "training.steps must be int" in capsys.readouterr().err
    misspelled = write_sweep(tmp_path, '[grids]\n"optimizer.lr" = [1e-3]\n', "c.toml")
    assert main([str(misspelled), "--output", str(output)]) == 2
    assert "unknown key 'grids' (did you mean grid?)" in capsys.readouterr().err
    assert not output.exists()


def test_dry_run_prints_the_runs_and_launches_nothing(tmp_path, capsys, no_launch):
    path = write_sweep(tmp_path, TINY_OVERRIDES + '[grid]\n"optimizer.lr" = [1e-3, 3e-3]\n')
    output = tmp_path / "out"
    assert main([str(path), "--output", str(output), "--parallel", "2", "--dry-run"]) == 0
    out = capsys.readouterr().out
    for name in ("lr=0.001", "lr=0.003"):
        assert f"  {name}  optimizer.lr=" in out and f"{name}: cd " in out
    assert "NGPU=1 OMP_NUM_THREADS=" in out and "run_train.sh --job.config_file" in out
    assert "--optimizer.lr 0.003" in out
    assert not output.exists()


def test_a_run_still_running_from_a_killed_sweep_is_not_launched_twice(tmp_path, capsys, no_launch):
    import socket

    path = write_sweep(tmp_path, TINY_OVERRIDES + '[grid]\n"optimizer.lr" = [1e-3]\n')
    run = tmp_path / "out" / "lr=0.001"
    run.mkdir(parents=True)
    # As an earlier sweep leaves it when killed with SIGKILL: status running, its process group alive.
    record = {"status": "running", "pid": os.getpgrp(), "host": socket.gethostname()}
    (run / "sweep_run.json").write_text(json.dumps(record))
    assert main([str(path), "--output", str(tmp_path / "out")]) == 2
    assert f"still running: lr=0.001 (process group {os.getpgrp()})" in capsys.readouterr().err


def test_the_first_argument_is_compare_or_a_sweep_file(capsys):
    with pytest.raises(SystemExit):
        main(["run", "sweep.toml"])
    assert "`compare` or a sweep file" in capsys.readouterr().err


def test_device_slots_are_disjoint_and_checked():
    gpus = ["0", "1", "2", "3"]
    assert [s["CUDA_VISIBLE_DEVICES"] for s in launch.slot_environments(2, 2, gpus, 16)] == ["0,1", "2,3"]
    assert [s["CUDA_VISIBLE_DEVICES"] for s in launch.slot_environments(4, 1, gpus, 16)] == ["0", "1", "2", "3"]
    assert all(s["NGPU"] == "2" for s in launch.slot_environments(2, 2, gpus, 16))
    with pytest.raises(SweepError, match="needs 6 GPUs, but 4 are visible"):
        launch.slot_environments(3, 2, gpus, 16)
    cpu = launch.slot_environments(2, 1, [], 16)
    assert cpu == [{"NGPU": "1", "OMP_NUM_THREADS": "8"}] * 2 and "CUDA_VISIBLE_DEVICES" not in cpu[0]
    assert launch.slot_environments(4, 1, [], 2)[0]["OMP_NUM_THREADS"] == "1"


def test_last_logged_step_and_error_summary():
    steps_and_freqs = ((60, 1), (60, 10), (65, 10), (5, 10), (1, 10))
    assert [last_logged_step(s, f) for s, f in steps_and_freqs] == [60, 60, 60, 1, 1]
    stderr = (
        "[rank0] 11:42:32 mesh: dp_replicate=1\n"
        "[rank0] 11:42:33 error: training.dataset_path: no data files at '/x.jsonl'\n"
        "error: training.dataset_path: no data files at '/x.jsonl'\n"
        "E1123 11:42:34.839000 26707 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 2)\n"
        "Traceback (most recent call last):\n  File \"torchrun\", line 8\n"
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n  exitcode  : 2 (pid: 26713)\n"
    )
    assert launch.error_summary(stderr) == "error: training.dataset_path: no data files at '/x.jsonl'"
    crash = ("Traceback (most recent call last):\n  File \"train.py\", line 3\n    raise RuntimeError('boom')\n"
             "RuntimeError: boom\n")
    assert launch.error_summary(crash) == "RuntimeError: boom"


# --- Fast: reports from hand-written run folders (compare) -----------------------------------------------


def fake_run(folder: Path, lr: float, seed: int, losses: list[float], tps: float = 1000.0,
             val: float | None = None) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.toml").write_text(
        f"# git commit: abc\n\n[job]\ndump_folder = \"{folder}\"\n\n[optimizer]\nlr = {lr!r}\n\n"
        f"[training]\nsteps = {len(losses)}\nseed = {seed}\nseq_len = 16\nlocal_batch_size = 2\n"
        "global_batch_size = -1\n\n"
        "[metrics]\nlog_freq = 1\n"
    )
    records = [{"step": i + 1, "loss": loss, "grad_norm": 1.0, "lr": lr,
                "tokens_per_second": tps * (0.1 if i == 0 else 1), "mfu": 10.0, "memory_gib": 1.0 + i / 10}
               for i, loss in enumerate(losses)]
    if val is not None:
        records.append({"step": len(losses), "val_loss": val, "val_perplexity": 2.0})
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return folder


def test_compare_groups_seeds_into_a_mean(tmp_path, capsys):
    a = fake_run(tmp_path / "a", 1e-3, 1, [4.0, 3.0, 2.0, 1.0], val=1.5)
    b = fake_run(tmp_path / "b", 1e-3, 2, [6.0, 5.0, 4.0, 3.0], val=2.5)
    c = fake_run(tmp_path / "c", 3e-3, 1, [5.0, 2.0, 1.0, 0.5], tps=2000.0)
    out = tmp_path / "report"
    assert main(["compare", str(a), str(b), str(c), "--output", str(out)]) == 0

    rows = {r["run"]: r for r in read_csv(out / "results.csv")}
    assert sorted(rows) == ["a", "b", "c"]
    assert rows["a"]["overrides"] == "optimizer.lr=0.001; training.seed=1"
    assert rows["a"]["status"] == "done" and rows["a"]["last_step"] == "4"
    assert float(rows["a"]["final_loss"]) == 1.0  # last 10% of 4 steps: the last one
    assert float(rows["b"]["best_loss"]) == 3.0 and float(rows["b"]["final_val_loss"]) == 2.5
    assert float(rows["c"]["tokens_per_second"]) == 2000.0  # the first (slow) step is left out
    assert float(rows["c"]["peak_memory_gib"]) == pytest.approx(1.3)

    groups = {g.label: g for g in report.group_by_setting(report.dump_results([a, b, c]))}
    assert sorted(groups) == ["lr=0.001", "lr=0.003"]
    steps, mean, low, high = groups["lr=0.001"].curve()
    assert steps == [1, 2, 3, 4] and mean == [5.0, 4.0, 3.0, 2.0]
    assert low == [4.0, 3.0, 2.0, 1.0] and high == [6.0, 5.0, 4.0, 3.0]
    assert groups["lr=0.003"].curve()[1] == [5.0, 2.0, 1.0, 0.5]
    assert groups["lr=0.001"].results[0].tokens_per_step == 2 * 16

    md = (out / "results.md").read_text()
    assert "| a | optimizer.lr=0.001 training.seed=1 | done | 4/4 | 1.0000 |" in md
    assert "| lr=0.001 | 2 | 2.0000 ± 1.4142 | 1.0000 – 3.0000 | 2.0000 | 2.0000 |" in md  # mean of the two seeds
    assert "![loss curves](loss_curves.png)" in md
    assert (out / "loss_curves.png").stat().st_size > 10_000
    assert "| lr=0.001 | 2 |" in capsys.readouterr().out

    # A resumed run repeats the steps logged after its checkpoint: the later records win.
    with open(a / "metrics.jsonl", "a") as f:
        repeated = {"step": 4, "loss": 0.25, "grad_norm": 1, "lr": 1, "tokens_per_second": 1, "mfu": 1, "memory_gib": 1}
        f.write(json.dumps(repeated) + "\n")
    train, val = read_metrics(a / "metrics.jsonl")
    assert [r["step"] for r in train] == [1, 2, 3, 4] and train[-1]["loss"] == 0.25 and len(val) == 1


# --- Slow: real tiny sweeps through run_train.sh ---------------------------------------------------------


def run_sweep_cli(*args: str) -> subprocess.CompletedProcess:
    # On CPU even where there are GPUs: two runs at a time must not need two GPUs.
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}", CUDA_VISIBLE_DEVICES="")
    return subprocess.run([sys.executable, "-m", "scripts.sweep", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)


@pytest.mark.slow
def test_sweep_runs_then_skips_completed_runs_then_resumes_an_interrupted_one(tmp_path):
    path = write_sweep(tmp_path, TINY_OVERRIDES + '[grid]\n"optimizer.lr" = [1e-3, 3e-3]\n')
    out = tmp_path / "sweep"
    result = run_sweep_cli(str(path), "--output", str(out), "--parallel", "2")
    assert result.returncode == 0, result.stdout + result.stderr
    rows = read_csv(out / "results.csv")
    assert [(r["run"], r["status"], r["last_step"], r["exit_code"]) for r in rows] == [
        ("lr=0.001", "done", "6", "0"), ("lr=0.003", "done", "6", "0")]
    assert all(float(r["final_loss"]) < 9 and float(r["tokens_per_second"]) > 0 for r in rows)
    assert (out / "results.md").read_text().count("| done | 6/6 |") == 2
    assert (out / "loss_curves.png").stat().st_size > 10_000
    first, second = out / "lr=0.001", out / "lr=0.003"
    for run in (first, second):
        state = json.loads((run / "sweep_run.json").read_text())
        assert state["status"] == "done" and state["exit_code"] == 0
        assert state["overrides"] == {"optimizer.lr": float(run.name[3:])}
        assert state["git_commit"] and state["start_time"] and state["end_time"] and len(state["attempts"]) == 1
        assert "run_train.sh --job.config_file" in (run / "command.txt").read_text()
        assert (run / "config.toml").read_text().startswith("# git commit: ")
        assert "training done: 6 steps" in (run / "stderr.log").read_text()

    # The same command again: nothing to do.
    mtimes = {run: (run / "metrics.jsonl").stat().st_mtime_ns for run in (first, second)}
    result = run_sweep_cli(str(path), "--output", str(out), "--parallel", "2")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "skip    lr=0.001 (done)" in result.stdout and "skip    lr=0.003 (done)" in result.stdout
    assert "start" not in result.stdout and "resume" not in result.stdout
    assert all((run / "metrics.jsonl").stat().st_mtime_ns == mtime for run, mtime in mtimes.items())
    assert len(json.loads((first / "sweep_run.json").read_text())["attempts"]) == 1

    # Interrupt the second run after step 4 (its newest checkpoint: step 3): it resumes at step 4.
    for step_folder in (second / "checkpoint").glob("step-6"):
        import shutil

        shutil.rmtree(step_folder)
    lines = (second / "metrics.jsonl").read_text().splitlines()
    (second / "metrics.jsonl").write_text("\n".join(lines[:4]) + "\n")
    state = json.loads((second / "sweep_run.json").read_text())
    (second / "sweep_run.json").write_text(json.dumps(state | {"status": "running", "end_time": None}))
    result = run_sweep_cli(str(path), "--output", str(out), "--parallel", "2")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "skip    lr=0.001 (done)" in result.stdout and "resume  lr=0.003 from checkpoint step-3" in result.stdout
    assert (first / "metrics.jsonl").stat().st_mtime_ns == mtimes[first]
    steps = [json.loads(line)["step"] for line in (second / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]  # step 4 of the interrupted attempt was dropped: the resumed run logged it again
    assert "resumed from" in (second / "stderr.log").read_text()
    state = json.loads((second / "sweep_run.json").read_text())
    assert state["status"] == "done" and [a["action"] for a in state["attempts"]] == ["start", "resume"]
    assert [r["last_step"] for r in read_csv(out / "results.csv")] == ["6", "6"]


@pytest.mark.slow
def test_a_failing_run_is_recorded_and_the_others_complete(tmp_path):
    path = write_sweep(tmp_path, TINY_OVERRIDES.replace('"training.steps" = 6', '"training.steps" = 3') + """
[[runs]]
name = "good"
[[runs]]
name = "no_data"
"training.dataset_path" = ["/nonexistent/corpus.jsonl"]
""")
    out = tmp_path / "sweep"
    result = run_sweep_cli(str(path), "--output", str(out), "--parallel", "2")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "FAILED  no_data (exit code 2): error: training.dataset_path: no data files" in result.stdout
    assert "1 of 2 run(s) not done: no_data" in result.stderr
    rows = {r["run"]: r for r in read_csv(out / "results.csv")}
    assert rows["good"]["status"] == "done" and rows["good"]["last_step"] == "3"
    assert rows["no_data"]["status"] == "failed" and rows["no_data"]["exit_code"] == "2"  # train.py's own status
    assert "no data files at '/nonexistent/corpus.jsonl'" in rows["no_data"]["error"]
    state = json.loads((out / "no_data" / "sweep_run.json").read_text())
    assert state["status"] == "failed" and "no data files" in state["stderr_tail"]
    assert "[rank0]" in (out / "no_data" / "stderr.log").read_text()  # the full log is kept
    md = (out / "results.md").read_text()
    assert "## Failed runs" in md and "- no_data (exit code 2): `error: training.dataset_path: no data files" in md
