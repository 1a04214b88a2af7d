"""The benchmark matrix (scripts/benchmark/): the tiny preset end to end, a failing case among working
ones, the refusals that need no run, and the torchtitan mapping and log parsing (no torchtitan needed)."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import REPO

from components.config import load_config
from models.families import model_config_class
from scripts.benchmark.cases import PRESETS
from scripts.benchmark.torchtitan_run import parse_log, settings


def benchmark(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """The benchmark's command line, one thread per process: on a busy machine, processes with several
    threads each crawl (they wait for each other at every operation), and speed is not tested here."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "scripts.benchmark", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.slow
def test_tiny_preset_reports_every_case_and_a_failing_one(tmp_path):
    """One run of the tiny preset with its middle case broken (a model shape train.py rejects), traced: the
    table and the JSON agree, the working cases have real figures, the broken one its error line,
    the case after it still ran, and the exit status says a case failed. Each working case left a chrome
    trace of one step after the measured ones (FSDP's: rank 0's), summarized in summary.md."""
    out, traces = tmp_path / "benchmark.json", tmp_path / "traces"
    result = benchmark("--preset", "tiny", "--json", str(out), "--case-flags", "debug AC full=--model.n_heads 7",
                       "--traces", str(traces))
    assert result.returncode == 1, result.stdout + result.stderr[-3000:]
    header, *table = result.stdout.strip().splitlines()
    report = json.loads(out.read_text())
    assert header.startswith("ingot benchmark, preset tiny: ")
    assert report["device"] in header and f"torch {torch.__version__}" in header and report["commit"] in header
    assert table[0] == "| case | tokens/s per device | MFU | peak GiB | step s | status |"

    cases = report["cases"]
    assert [c["case"] for c in cases] == [case.name for case in PRESETS["tiny"].cases]
    default, broken, fsdp = cases
    assert broken["status"] == "failed: error: model.dim 256 is not divisible by model.n_heads 7"
    assert broken["tokens_per_second"] is None
    assert fsdp["processes"] == 2
    for case in (default, fsdp):
        assert case["status"] == "ok"
        assert case["tokens_per_second"] > 0 and case["peak_memory_gib"] > 0 and case["step_seconds"] > 0
        # 4 x 64 tokens per process per step
        assert case["step_seconds"] == pytest.approx(4 * 64 / case["tokens_per_second"])
        assert case["mfu"] is None if not torch.cuda.is_available() else 0 < case["mfu"] <= 100

    rows = table[2:]
    assert len(rows) == len(cases)
    for row, case in zip(rows, cases):
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        tps = "-" if case["tokens_per_second"] is None else f"{case['tokens_per_second']:,.0f}"
        peak = "-" if case["peak_memory_gib"] is None else f"{case['peak_memory_gib']:.2f}"
        assert cells[0].startswith(case["case"]) and cells[1] == tps and cells[3] == peak
        assert cells[2] == "-" and cells[5] == case["status"]

    assert broken["trace"] is None and sorted(p.name for p in traces.iterdir()) == [
        "debug_FSDP.json", "debug_default.json", "summary.md"]
    for case in (default, fsdp):
        events = json.loads((traces / case["trace"].split("/")[-1]).read_text())["traceEvents"]
        assert [e["name"] for e in events if e["name"].startswith("ProfilerStep#")]  # the recorded step
    summary = (traces / "summary.md").read_text()
    assert summary.startswith(f"# Where a step's time goes: {report['device']}, torch {torch.__version__}")
    assert "### debug default\n\nstep " in summary and "### debug FSDP\n\nstep " in summary
    assert "| CPU operator (inclusive time) | calls | ms | % of the step |" in summary and "aten::mm" in summary


@pytest.mark.slow
def test_the_device_check_script_leaves_its_results_in_out(tmp_path):
    """scripts/benchmark/device_check.sh as a GPU slot runs it, on the tiny preset without the lane: two passes of
    one case, the second under an extra flag; bench.json holds both reports, summary.md and the traces both runs."""
    out = tmp_path / "out"
    env = dict(os.environ, OUT=str(out), PRESET="tiny", LANE_S="0", STEPS="3", WARMUP="1", OMP_NUM_THREADS="1",
               PASSES="|debug default\n--training.local_batch_size 2|debug default")
    result = subprocess.run(["bash", "scripts/benchmark/device_check.sh"], cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert sorted(p.name for p in out.iterdir()) == ["bench.json", "bench.log", "env.txt", "summary.md",
                                                     "traces.tar.gz"]
    reports = json.loads((out / "bench.json").read_text())
    assert [r["extra_flags"] for r in reports] == [[], ["--training.local_batch_size", "2"]]
    assert all(r["cases"][0]["status"] == "ok" for r in reports)
    summary = (out / "summary.md").read_text()
    assert summary.count("### debug default\n\nstep ") == 2 and "## pass 2: --training.local_batch_size 2" in summary
    listed = subprocess.run(["tar", "tzf", str(out / "traces.tar.gz")], capture_output=True, text=True).stdout
    assert listed.split() == ["trace-1_debug_default.json", "trace-2_debug_default.json"]


def test_a_trace_summary_names_the_busy_time_the_gaps_and_the_kernels_by_kind():
    """A GPU trace made by hand: one step of 1 ms, three kernels (a matmul, a compiled Triton kernel, flash
    attention) with one gap of 90 µs and one of 5 µs (too short to name), 2 GiB allocated at most."""
    from scripts.benchmark.trace_summary import summarize

    step = {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#7", "ts": 0, "dur": 1000}
    kernels = [("nvjet_tst_128x256", 10, 300), ("triton_poi_fused_add_0", 400, 100), ("flash_fwd_kernel", 505, 200)]
    memory = [{"ph": "i", "name": "[memory]", "ts": t, "args": {"Total Allocated": gib * 2**30, "Device Type": 1}}
              for t, gib in ((5, 2), (600, 1))]
    events = [step, *({"ph": "X", "cat": "kernel", "name": n, "ts": t, "dur": d} for n, t, d in kernels), *memory]
    text = summarize({"traceEvents": events}, "by hand")
    assert text.startswith("### by hand\n\nstep 1.0 ms; GPU busy 0.6 ms (60%); 1 gaps of 10 µs or more between "
                           "kernels, 0.1 ms in all; first kernel 0.0 ms after the step began; peak allocated 2.00 GiB")
    assert "| matmul | 0.3 | 30.0 |\n| attention | 0.2 | 20.0 |\n| Triton (compiled) | 0.1 | 10.0 |" in text
    assert "| nvjet_tst_128x256 | 1 | 0.30 | 30.0 |" in text
    assert "- 0.09 ms after `nvjet_tst_128x256`, before `triton_poi_fused_add_0`" in text


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_case_of_every_preset_is_a_valid_config(preset):
    """The cpu and h100 presets are too long for CI: their flags are checked to load instead."""
    for case in PRESETS[preset].cases:
        load_config(list(case.flags), model_config_class)


@pytest.mark.slow
def test_refusals_without_a_run():
    result = benchmark("--preset", "tiny", "--training.stepz", "3")
    assert result.returncode == 2 and "training.stepz" in result.stderr
    result = benchmark("--preset", "tiny", "--cases", "debug nothing")
    assert result.returncode == 2 and "no case debug nothing" in result.stderr
    if not torch.cuda.is_available():
        result = benchmark("--preset", "h100")
        assert result.returncode == 2 and "needs a CUDA GPU" in result.stderr
    if importlib.util.find_spec("torchtitan") is None:
        result = benchmark("--preset", "tiny", "--torchtitan")
        assert result.returncode == 2 and "pip install torchtitan" in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1


def test_torchtitan_settings_follow_the_resolved_config(tmp_path):
    flags = {case.name: list(case.flags) for case in PRESETS["cpu"].cases}
    mapped = settings(load_config(flags["debug AC op"], model_config_class), tmp_path / "tok", tmp_path / "dump")
    assert (mapped["dim"], mapped["n_layers"], mapped["n_heads"], mapped["n_kv_heads"]) == (256, 6, 16, 4)
    assert (mapped["vocab_size"], mapped["seq_len"], mapped["local_batch_size"]) == (4096, 256, 4)
    assert (mapped["ac"], mapped["compile"], mapped["float8"]) == ("op", False, None)
    assert mapped["data_files"][0].endswith("tests/assets/shakespeare/train.jsonl")
    selective = load_config(flags["debug AC selective 2"], model_config_class)
    assert settings(selective, tmp_path, tmp_path).startswith("no counterpart")
    tensorwise = load_config(flags["debug default"] + ["--float8.enable", "true", "--float8.recipe_name", "tensorwise"],
                             model_config_class)
    assert "rowwise" in settings(tensorwise, tmp_path, tmp_path)


def test_torchtitan_log_lines_are_read():
    log = "\n".join(
        f"[titan] 2026-01-01 00:00:0{step},000 - root - INFO - \x1b[31mstep: {step:2}  \x1b[32mloss:  8.12345  "
        f"grad_norm:  1.2345  memory: {step:5.2f}GiB(10.00%)  tps: {1000 * step:,}  tflops: 1.00  mfu: {mfu}"
        for step, mfu in [(1, "0.50%"), (2, "1.00%"), (3, "2.00%")]
    )
    figures = parse_log(log, warmup=1)
    assert figures["tokens_per_second"] == pytest.approx(2 / (1 / 2000 + 1 / 3000))
    assert figures["mfu"] == pytest.approx(2 / (1 / 1.0 + 1 / 2.0))
    assert figures["peak_memory_gib"] == 3.0
    assert parse_log(log.replace("2.00%", "N/A"), warmup=1)["mfu"] is None
    assert parse_log(log, warmup=3) is None


@pytest.mark.slow
@pytest.mark.parametrize("module, args, line", [
    ("framework_overhead", ["--steps", "4", "--warmup", "1", "--repeats", "1", "--training.seq_len", "64",
                            "--training.local_batch_size", "2"], "ratio          : "),
    ("packed_loader_throughput", ["--tokens", "1000000", "--seconds", "0.1"], "8B (seq 8192, batch 1)             2"),
    ("preprocess_throughput", ["--mb", "0.1", "--workers", "1"], "      1 "),
])
def test_the_narrow_benchmarks_print_their_figures(module, args, line):
    """The commands of docs/benchmarks.md, cut short: each finishes and prints its last table row."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, "-m", f"scripts.benchmark.{module}", *args], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    last = result.stdout.strip().splitlines()[-1]
    assert last.startswith(line), result.stdout
    assert float(last.split()[-1].replace(",", "")) > 0
