"""Scaling-law ladders (scripts/ladder/): the fit on synthetic losses, bad ladder files, the memory
budget, a held-out rung on synthetic run folders, and a real tiny ladder run twice."""

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, read_csv

from scripts.ladder import plan
from scripts.ladder.__main__ import main
from scripts.ladder.fit import Law, bootstrap, fit_law
from scripts.ladder.plan import held_out, plan_runs
from scripts.ladder.spec import read_ladder

# Two-layer shapes of the debug model at seq 64 x batch 4 (256 tokens per step): 10 and 20 steps.
TINY_LADDER = """
base_config = "train_configs/debug_model.toml"
tokens = [2560, 5120]
bootstrap = 5
[overrides]
"training.seq_len" = 64
"training.local_batch_size" = 4
"lr_scheduler.warmup_steps" = 2
"model.n_layers" = 2
"model.multiple_of" = 32
"validation.enable" = true
"validation.steps" = 2
"validation.freq" = 1000
"checkpoint.enable" = false
"metrics.log_freq" = 1
"metrics.enable_tensorboard" = false
[[rungs]]
name = "d32"
"model.dim" = 32
"model.n_heads" = 2
"model.n_kv_heads" = 1
[[rungs]]
name = "d64"
"model.dim" = 64
"model.n_heads" = 4
"model.n_kv_heads" = 2
"""
TARGET = "[target]\nn_params = 1e7\ntokens = 1e9\n"


def write_ladder(tmp_path: Path, body: str, name: str = "ladder.toml") -> Path:
    path = tmp_path / name
    path.write_text(body)
    return path


# --- The fit ----------------------------------------------------------------------------------------------


CHINCHILLA = Law(E=1.69, A=406.4, alpha=0.34, B=410.7, beta=0.28)


def test_the_fit_recovers_known_parameters_from_noisy_synthetic_losses():
    n, d = (v.ravel() for v in np.meshgrid(np.geomspace(1e7, 1e9, 5), np.geomspace(2e8, 2e10, 5)))
    loss = CHINCHILLA.loss(n, d) * np.exp(np.random.default_rng(1).normal(0, 0.003, n.size))  # 0.3% noise
    fit = fit_law(n, d, loss)
    law = fit.law
    assert law.E == pytest.approx(CHINCHILLA.E, rel=0.03)
    assert law.alpha == pytest.approx(CHINCHILLA.alpha, abs=0.02)
    assert law.beta == pytest.approx(CHINCHILLA.beta, abs=0.02)
    assert law.A == pytest.approx(CHINCHILLA.A, rel=0.25) and law.B == pytest.approx(CHINCHILLA.B, rel=0.25)
    # Extrapolated 10x beyond the largest size and token count, the loss is still within 1%.
    assert law.loss(1e10, 2e11) == pytest.approx(CHINCHILLA.loss(1e10, 2e11), rel=0.01)
    laws = bootstrap(n, d, loss, fit, resamples=6)
    alphas = [x.alpha for x in laws]
    assert len(laws) == 6 and np.std(alphas) > 0 and all(abs(a - CHINCHILLA.alpha) < 0.05 for a in alphas)


def test_a_bootstrap_refit_that_runs_away_is_dropped_not_raised(monkeypatch):
    from scripts.ladder import fit as fitting

    n, d = (v.ravel() for v in np.meshgrid(np.geomspace(1e7, 1e9, 3), np.geomspace(2e8, 2e10, 3)))
    loss = CHINCHILLA.loss(n, d)
    full = fit_law(n, d, loss)
    minimise = fitting._minimise

    def one_runs_away(theta, weights, data):
        theta, value = minimise(theta, weights, data)
        theta[: len(theta) // 3] = 1e4  # every start of the first resample: e^(1e4) overflows a float
        return theta, value

    monkeypatch.setattr(fitting, "_minimise", one_runs_away)
    laws = bootstrap(n, d, loss, full, resamples=3, starts=2)
    assert len(laws) == 2 and all(x.alpha == pytest.approx(CHINCHILLA.alpha, abs=0.05) for x in laws)


def test_the_compute_optimal_size_minimises_the_law_at_fixed_compute():
    flops = 1e21
    n_opt, d_opt = CHINCHILLA.compute_optimal(flops)
    assert 6 * n_opt * d_opt == pytest.approx(flops)
    sizes = np.geomspace(n_opt / 10, n_opt * 10, 20001)
    best = sizes[np.argmin(CHINCHILLA.loss(sizes, flops / (6 * sizes)))]
    assert n_opt == pytest.approx(best, rel=0.002)


# --- Planning; bad input and the memory budget: nothing runs -----------------------------------------------


@pytest.mark.parametrize("name", ["debug.toml", "llama3_gpu.toml"])
def test_the_shipped_ladders_plan_growing_sizes_with_the_largest_held_out(name):
    ladder = read_ladder(REPO / "train_configs" / "ladders" / name)
    runs = plan_runs(ladder)
    sizes = list(dict.fromkeys(r.n_params for r in runs))
    assert len(runs) == 13 and len(sizes) == 5 and sizes == sorted(sizes)
    assert held_out(runs, ladder.holdout) == {runs[-1].name} and runs[-1].n_params == sizes[-1]
    per_step = [r.config.training.local_batch_size * r.config.training.seq_len * ladder.nproc_per_run for r in runs]
    assert all(r.tokens == r.steps * tokens for r, tokens in zip(runs, per_step))


def test_a_dry_run_prints_sizes_tokens_and_steps_and_writes_nothing(tmp_path, capsys, no_launch):
    path = write_ladder(tmp_path, TINY_LADDER.replace("tokens = [2560, 5120]", "compute = [1e10]\ntokens = [2560]")
                        + TARGET)
    assert main([str(path), "--output", str(tmp_path / "out"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "4 run(s) of 2 rung(s)" in out and "  d32_D2.56k  " in out and "  d64_C1e10  " in out
    assert "target: N 10M, D 1B, C 6e16" in out
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.replace("bootstrap", "bootstrp"), "unknown key 'bootstrp' (did you mean bootstrap?)"),
    (lambda t: t.replace('"model.dim" = 32\n', "").replace('"model.n_heads" = 2\n"model.n_kv_heads" = 1\n', ""),
     "rung 'd32' has no size: give it model.* keys"),
    (lambda t: t.replace("tokens = [2560, 5120]", ""), "rung 'd32' has no budget"),
    (lambda t: t.replace('name = "d64"', 'name = "d32"'), "rung names repeat: d32"),
    (lambda t: t.replace('name = "d64"\n', ""), "rung 2 needs a name"),
    (lambda t: t.replace('"model.dim" = 64', '"model.dimm" = 64'), "unknown config key 'model.dimm'"),
    (lambda t: t.replace('"validation.enable" = true', ""), 'loss = "validation" needs "validation.enable" = true'),
    (lambda t: t + '"training.steps" = 10\n', "training.steps is set by the ladder"),
    (lambda t: t.replace("[2560, 5120]", "[2560, 256]"), "has 1 steps (256 tokens each), not more than"),
    (lambda t: t.replace("[2560, 5120]", "[2560, 2600]"), "two budgets give the same run (10 steps)"),
    (lambda t: t + '[target]\nn_params = 1e7\n"model.dim" = 512\ntokens = 1e9\n', "n_params = N"),
    (lambda t: t.replace("bootstrap = 5", 'holdout = "d48"\nbootstrap = 5'),
     "holdout 'd48' is neither a rung nor a run of the ladder; rungs: d32, d64"),
    (lambda t: t.replace('base_config = "train_configs/debug_model.toml"', ""), "base_config"),
])
def test_a_bad_ladder_file_fails_in_one_line_and_runs_nothing(tmp_path, capsys, no_launch, edit, message):
    path = write_ladder(tmp_path, edit(TINY_LADDER))
    assert main([str(path), "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ladder error: ") and err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "out").exists()


def test_an_unknown_holdout_on_the_command_line_and_a_missing_file_fail_cleanly(tmp_path, capsys, no_launch):
    path = write_ladder(tmp_path, TINY_LADDER)
    assert main([str(path), "--output", str(tmp_path / "out"), "--holdout", "d1024"]) == 2
    assert "holdout 'd1024' is neither a rung nor a run" in capsys.readouterr().err
    assert main([str(tmp_path / "nope.toml")]) == 2
    assert "ladder file not found" in capsys.readouterr().err
    assert main([str(path), "--output", str(tmp_path / "out"), "--fit-only"]) == 2
    assert "run the ladder first" in capsys.readouterr().err


def test_rungs_over_the_memory_budget_are_all_named_before_anything_runs(tmp_path, capsys, no_launch, monkeypatch):
    # The estimate's CPU baseline is this process's peak resident memory: in a test process, whatever the tests
    # before it reached. A fresh ladder process's (0.3 GiB here) makes the figures those of the command.
    monkeypatch.setattr(plan, "cpu_baseline_bytes", lambda config: int(0.3 * 2**30))
    big = '[[rungs]]\nname = "{name}"\n"model.dim" = {dim}\n"model.n_heads" = 16\n"model.n_kv_heads" = 4\n'
    body = TINY_LADDER.replace("bootstrap = 5", "memory_budget_gib = 2\nbootstrap = 5")
    path = write_ladder(tmp_path, body + big.format(name="d3072", dim=3072) + big.format(name="d4096", dim=4096))
    assert main([str(path), "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ladder error: 2 rung(s) over memory_budget_gib = 2: d3072 (") and "d4096 (" in err, err
    assert "d32 (" not in err and "d64 (" not in err and "nothing was run" in err
    assert not (tmp_path / "out").exists()


# --- Fitting run folders: --fit-only and --holdout -----------------------------------------------------------


def fake_runs(path: Path, output: Path, law: Law) -> dict[str, float]:
    """Finished run folders whose final validation losses follow `law`, as the sweep leaves them."""
    losses = {}
    for run in plan_runs(read_ladder(path)):
        folder = output / "runs" / run.name
        folder.mkdir(parents=True)
        losses[run.name] = float(law.loss(run.n_params, run.tokens))
        train = {"step": run.steps, "loss": losses[run.name] + 0.1, "grad_norm": 1.0, "lr": 1e-3,
                 "tokens_per_second": 1000.0, "mfu": None, "memory_gib": 0.5}
        val = {"step": run.steps, "val_loss": losses[run.name], "val_perplexity": 1.0}
        (folder / "metrics.jsonl").write_text(json.dumps(train) + "\n" + json.dumps(val) + "\n")
        state = {"status": "done", "exit_code": 0, "attempts": [{"wall_time_s": 2.5}]}
        (folder / "sweep_run.json").write_text(json.dumps(state))
    return losses


def test_fit_only_with_a_held_out_rung_reports_its_prediction_against_its_measurement(tmp_path, capsys, no_launch):
    rung = '[[rungs]]\nname = "{name}"\n"model.dim" = {dim}\n"model.n_heads" = 4\n"model.n_kv_heads" = 2\n'
    body = TINY_LADDER.replace("[2560, 5120]", "[2560, 5120, 10240]") + rung.format(name="d96", dim=96)
    path = write_ladder(tmp_path, body + rung.format(name="d128", dim=128) + TARGET)
    output = tmp_path / "out"
    law = Law(E=2.0, A=300.0, alpha=0.35, B=200.0, beta=0.3)
    losses = fake_runs(path, output, law)
    assert main([str(path), "--output", str(output), "--fit-only", "--holdout", "d128"]) == 0
    out = capsys.readouterr().out
    fit = json.loads((output / "fit.json").read_text())
    assert len(fit["fitted_runs"]) == 9 and fit["held_out_runs"] == ["d128_D2.56k", "d128_D5.12k", "d128_D10.2k"]
    for held in fit["held_out"]:
        assert held["measured_loss"] == pytest.approx(losses[held["run"]])
        assert held["predicted_loss"]["value"] == pytest.approx(held["measured_loss"], rel=0.01)
        assert held["predicted_loss"]["p5"] <= held["predicted_loss"]["value"] <= held["predicted_loss"]["p95"]
        assert f"held out {held['run']} (N " in out and f"measured {held['measured_loss']:.4f}, predicted " in out
    assert fit["target"]["predicted_loss"]["value"] == pytest.approx(law.loss(1e7, 1e9), rel=0.05)
    assert fit["parameters"]["beta"]["value"] == pytest.approx(0.3, abs=0.02)
    assert fit["bootstrap_resamples"] == 5 and "validation" in fit["loss"]
    rows = {r["run"]: r for r in read_csv(output / "results.csv")}
    assert len(rows) == 12 and rows["d128_D2.56k"]["role"] == "holdout" and rows["d32_D2.56k"]["role"] == "fit"
    assert rows["d32_D2.56k"]["status"] == "done" and float(rows["d32_D2.56k"]["wall_time_s"]) == 2.5
    assert int(rows["d32_D2.56k"]["D"]) == 2560 and float(rows["d32_D2.56k"]["C"]) == pytest.approx(
        6 * int(rows["d32_D2.56k"]["N"]) * 2560, rel=1e-3)
    assert (output / "loss_vs_compute.png").stat().st_size > 10_000
    assert not (output / "runs" / "results.csv").exists()  # --fit-only never calls the sweep


# --- A real tiny ladder -----------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_tiny_ladder_runs_fits_plots_and_skips_its_finished_runs_on_a_rerun(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # two runs at a time on CPU even where there are GPUs
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    path = write_ladder(tmp_path, TINY_LADDER + TARGET)
    output = tmp_path / "ladder"
    assert main([str(path), "--output", str(output), "--parallel", "2"]) == 0
    rows = read_csv(output / "results.csv")
    assert [(r["run"], r["status"], r["role"], r["steps"]) for r in rows] == [
        ("d32_D2.56k", "done", "fit", "10"), ("d32_D5.12k", "done", "fit", "20"),
        ("d64_D2.56k", "done", "fit", "10"), ("d64_D5.12k", "done", "fit", "20")]
    assert all(0 < float(r["final_loss"]) < 9 and float(r["tokens_per_second"]) > 0 for r in rows)
    assert all(float(r["final_loss"]) == float(r["final_val_loss"]) for r in rows)
    fit = json.loads((output / "fit.json").read_text())
    assert set(fit["parameters"]) == {"E", "A", "alpha", "B", "beta"} and fit["target"]["predicted_loss"]["value"] > 0
    assert (output / "loss_vs_compute.png").stat().st_size > 10_000
    assert (output / "runs" / "d64_D5.12k" / "sweep_run.json").is_file()
    mtimes = {r["run"]: (output / "runs" / r["run"] / "metrics.jsonl").stat().st_mtime_ns for r in rows}
    capsys.readouterr()

    assert main([str(path), "--output", str(output), "--parallel", "2"]) == 0
    out = capsys.readouterr().out
    assert all(f"skip    {name} (done)" in out for name in mtimes) and "start " not in out
    assert all((output / "runs" / n / "metrics.jsonl").stat().st_mtime_ns == t for n, t in mtimes.items())
    assert [r["final_loss"] for r in read_csv(output / "results.csv")] == [r["final_loss"] for r in rows]
