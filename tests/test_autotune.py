"""The throughput autotuner: candidates, pruning by the memory budget, metrics, ranking, a real pick."""

import json
import re

import pytest

from components.config import load_config
from components.metrics.reporting import read_metrics
from models.families import model_config_class
from scripts import autotune as at

MODES = ["none", "op", "full"]
MEMORY = {"none": 1.0, "op": 0.6, "full": 0.3}  # fake GiB per sequence of batch
SPEED = {"none": 1.0, "op": 0.9, "full": 0.7}  # fake relative throughput


def space(batches=(1, 2, 4, 8), modes=MODES, compile_=(False,), global_batch=8, dp=1):
    return at.SearchSpace(list(batches), list(modes), list(compile_), [False], global_batch, dp)


def fake_estimate(c: at.Candidate) -> float:
    return 0.5 + MEMORY[c.ac] * c.local_batch


class FakeRunner:
    """Throughput grows with the batch (less per-step overhead), falls with recomputation."""

    def __init__(self, peak_extra=0.0, fail=()):
        self.ran, self.peak_extra, self.fail = [], peak_extra, set(fail)

    def __call__(self, c: at.Candidate) -> at.Result:
        self.ran.append(c)
        if c in self.fail:
            return at.Result(c, "failed: out of memory")
        tps = 1000 * SPEED[c.ac] * c.local_batch / (c.local_batch + 1) * (1.5 if c.compile else 1)
        return at.Result(c, "ok", tokens_per_second=tps, peak_gib=fake_estimate(c) + self.peak_extra, measured_steps=4)


def test_candidates_cover_the_space_and_pin_the_global_batch():
    config = load_config(["--job.config_file", "debug_model.toml"], model_config_class)
    opts, rest = at.parse_args(["--memory-budget-gib", "2", "--job.config_file", "debug_model.toml",
                                "--training.seq_len", "128"])
    assert rest == ["--job.config_file", "debug_model.toml", "--training.seq_len", "128"]
    s = at.build_space(config, opts, world_size=1)
    assert s.batch_sizes == [1, 2, 4] and s.ac_modes == MODES and s.compile == [False, True]
    assert s.float8 in ([False], [False, True])
    assert len(s.all()) == 3 * 3 * 2 * len(s.float8)
    assert {c.global_batch for c in s.all()} == {4}  # the configured global batch, only accumulation changes
    opts, _ = at.parse_args(["--memory-budget-gib", "2", "--max-batch", "16", "--ac-modes", "none,2",
                             "--compile", "off"])
    s = at.build_space(config, opts, world_size=1)
    assert s.batch_sizes == [1, 2, 4, 8, 16] and s.ac_modes == ["none", "2"] and s.compile == [False]
    b16 = s.candidate(16, "2", False, False)
    assert b16.global_batch == -1 and "changes the optimization" in b16.describe(1)
    assert b16.overrides() == [
        "--training.local_batch_size", "16", "--training.global_batch_size", "-1",
        "--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "2",
        "--compile.enable", "false",
    ]
    # Two data-parallel ranks: the global batch 16 pins local batches whose x2 divides it.
    s2 = space(batches=(1, 2, 4, 8, 16), global_batch=16, dp=2)
    assert [s2.candidate(b, "none", False, False).global_batch for b in (1, 2, 4, 8, 16)] == [16, 16, 16, 16, -1]
    # The candidate's overrides are valid config keys and load.
    b16_config = load_config(["--job.config_file", "debug_model.toml", *b16.overrides()], model_config_class)
    assert b16_config.training.local_batch_size == 16
    with pytest.raises(Exception):
        at._parse_modes("none,sometimes")


def test_search_never_runs_what_the_estimate_rules_out_and_keeps_the_least_recomputation():
    runner = FakeRunner()
    results = at.search(space(), 3.0, fake_estimate, runner, log=lambda _: None)
    assert all(fake_estimate(c) <= 3.0 for c in runner.ran)
    # batch 1, 2: none fits (1.5, 2.5); batch 4: none (4.5) and op (2.9)... op fits; batch 8: op 5.3, full 2.9.
    assert [(c.local_batch, c.ac) for c in runner.ran] == [(1, "none"), (2, "none"), (4, "op"), (8, "full")]
    statuses = {(r.candidate.local_batch, r.candidate.ac): r.status for r in results}
    assert statuses[(4, "none")].startswith("skipped: estimate 4.50 GiB")
    assert statuses[(8, "op")].startswith("skipped")
    best = at.rank(results)[0]  # 900 x 4/5 tokens/s beats 1000 x 2/3 (batch 2, none) and 700 x 8/9 (batch 8, full)
    assert best.ok and best.candidate.local_batch == 4 and best.candidate.ac == "op"


def test_search_stops_growing_the_batch_when_nothing_fits():
    runner = FakeRunner()
    results = at.search(space(batches=(1, 2, 4, 8, 16)), 1.6, fake_estimate, runner, log=lambda _: None)
    # batch 2: none 2.5 and op 1.7 are over, full 1.1 fits; batch 4: full 1.7 is over, and nothing
    # with less recomputation can fit a larger batch.
    assert [(c.local_batch, c.ac) for c in runner.ran] == [(1, "none"), (2, "full")]
    pruned = [r for r in results if r.status.startswith("pruned: no mode fit")]
    assert sorted(r.candidate.local_batch for r in pruned) == [8, 16]
    # Every candidate announced is named once in the results, the ones never tried as pruned.
    assert sorted(r.candidate.name for r in results) == sorted(c.name for c in space(batches=(1, 2, 4, 8, 16)).all())
    assert {r.status for r in results if r.candidate.local_batch == 1 and r.candidate.ac != "none"} == {
        "pruned: ruled out by a tried setting"}
    assert not any(r.ok for r in results if r.candidate.local_batch >= 4)


def test_search_discards_runs_over_budget_or_failed():
    runner = FakeRunner(peak_extra=1.0, fail=[space().candidate(2, "none", False, False)])
    results = at.search(space(batches=(1, 2)), 2.6, fake_estimate, runner, log=lambda _: None)
    statuses = {(r.candidate.local_batch, r.candidate.ac): r.status for r in results}
    assert statuses[(1, "none")] == "ok"  # measured 1.5 + 1.0
    assert statuses[(2, "none")] == "failed: out of memory"
    assert statuses[(2, "op")] == "over budget: measured 2.70 GiB"  # estimated 1.7, measured 2.7
    assert statuses[(2, "full")] == "ok"
    assert [r.candidate.local_batch for r in at.rank(results) if r.ok] == [1, 2]  # 500 vs 467 tokens/s


def test_exhaustive_search_runs_every_mode():
    runner = FakeRunner()
    at.search(space(batches=(1, 2), compile_=(False, True)), 10.0, fake_estimate, runner, exhaustive=True,
              log=lambda _: None)
    assert len(runner.ran) == 2 * 3 * 2


def test_metrics_summary_drops_warmup_and_takes_the_median(tmp_path):
    lines = [{"step": s, "loss": 1.0, "tokens_per_second": tps, "memory_gib": mem}
             for s, tps, mem in [(1, 10, 0.5), (2, 50, 0.7), (3, 100, 0.8), (4, 120, 0.8), (5, 90, 0.9), (6, 110, 0.8)]]
    lines.insert(3, {"step": 3, "val_loss": 2.0, "val_perplexity": 7.4})
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    records, val = read_metrics(tmp_path / "metrics.jsonl")
    assert len(records) == 6 and len(val) == 1
    assert at.summarize(records, warmup=2) == (105, 0.9, 4)
    assert at.summarize(records, warmup=3) == (110, 0.9, 3)
    assert at.summarize(records, warmup=10) == (110, 0.9, 1)  # nothing past warm-up: the last step
    assert at.summarize([], warmup=2) == (None, None, 0)


def test_table_ranks_and_winner_command():
    a, b, c = (at.Candidate(n, "none", False, False, 8) for n in (1, 2, 4))
    results = [at.Result(a, "ok", 0.6, 100.0, 0.6), at.Result(b, "failed: out of memory", 0.7),
               at.Result(c, "ok", 0.9, 300.0, 0.95)]
    ranked = at.rank(results)
    assert [r.candidate.local_batch for r in ranked] == [4, 1, 2]
    text = at.table(results, dp=1)
    rows = [line for line in text.splitlines()[2:]]
    assert rows[0].startswith("| 1 | batch 4") and "300" in rows[0]
    assert rows[2].startswith("|  | batch 2") and "out of memory" in rows[2]
    command = at.winner_command(["--job.config_file", "debug_model.toml", "--training.seq_len", "128"], c, world_size=2)
    assert command == ("NGPU=2 ./run_train.sh --job.config_file debug_model.toml --training.seq_len 128 "
                       "--training.local_batch_size 4 --training.global_batch_size 8 --activation_checkpoint.mode none "
                       "--compile.enable false")


def test_train_command_uses_torchrun_for_several_ranks(tmp_path):
    c = at.Candidate(2, "full", True, False, 8)
    one = at.train_command(["--job.config_file", "x.toml"], c, 6, tmp_path, world_size=1)
    assert one[1].endswith("train.py") and "torch.distributed.run" not in one
    assert one[one.index("--training.steps") + 1] == "6" and one[one.index("--job.dump_folder") + 1] == str(tmp_path)
    assert one[one.index("--checkpoint.enable") + 1] == "false" and one[one.index("--metrics.log_freq") + 1] == "1"
    four = at.train_command([], c, 6, tmp_path, world_size=4)
    assert four[1:6] == ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4"]


def test_dry_run_prints_estimates_without_running(capsys):
    code = at.main(["--job.config_file", "debug_model.toml", "--memory-budget-gib", "0.01", "--batch-sizes", "1,2",
                    "--ac-modes", "none", "--compile", "off", "--training.seq_len", "64", "--dry-run"])
    assert code == 0
    out = capsys.readouterr().out
    assert out.count("skipped: estimate over budget") == 2


@pytest.mark.slow
def test_autotune_picks_the_faster_of_two_real_runs(tmp_path, capsys):
    """Local batch 8 vs 1 on a tiny model on CPU, both really run. Which is faster is a measurement
    (batch 8 usually is, by far, but a loaded machine can blur it): the test checks that the report
    ranks the runs by their measured speed and that the winner's command is the fastest run's."""
    code = at.main([
        "--job.config_file", "debug_model.toml", "--model.n_layers", "2", "--training.seq_len", "64",
        "--training.local_batch_size", "1",
        "--metrics.enable_tensorboard", "false", "--memory-budget-gib", "8", "--steps", "4",
        "--batch-sizes", "1,8", "--ac-modes", "none", "--compile", "off", "--output", str(tmp_path),
    ])
    assert code == 0
    report = (tmp_path / "autotune.md").read_text()
    rows = [line for line in report.splitlines() if line.startswith("| 1 ") or line.startswith("| 2 ")]
    assert len(rows) == 2, report
    speeds = [float(re.split(r"\s*\|\s*", row)[3].replace(",", "")) for row in rows]
    assert speeds[0] >= speeds[1] > 0, report
    fastest_batch = re.search(r"\| 1 \| batch (\d+),", rows[0]).group(1)
    assert f"winner: batch {fastest_batch}, AC none" in report
    winner_batches = re.findall(r"--training.local_batch_size (\d+)", report.split("winner:")[1])
    assert winner_batches[-1] == fastest_batch  # the last one wins
    assert (tmp_path / "runs" / "b8_ac-none_compile-off" / "metrics.jsonl").exists()
