"""Profiler traces, per-layer metrics and the MFU peak table."""

import json
import math

import pytest
import torch
from conftest import TINY, metric_lines, torchrun_runs

from components.metrics.reporting import peak_flops

pytestmark = pytest.mark.slow


def layer_records(dump) -> dict[int, dict]:
    return {m["step"]: m["layers"] for m in metric_lines(dump) if "layers" in m}


def test_profiler_writes_a_chrome_trace_per_window(tmp_path, train_in_process, capsys):
    args = [*TINY, "--training.steps", "4", "--profiling.enable_profiling", "true", "--profiling.profile_freq", "2",
            "--profiling.profiler_warmup", "0", "--profiling.profiler_active", "1",
            "--profiling.enable_memory_snapshot", "true", "--job.dump_folder", str(tmp_path)]
    assert train_in_process(args) == 0
    for step in (2, 4):
        trace = json.loads((tmp_path / "profile_traces" / f"step-{step}" / "rank0_trace.json").read_text())
        assert any(event.get("name", "").startswith("aten::") for event in trace["traceEvents"])
    assert "enable_memory_snapshot needs CUDA" in capsys.readouterr().err


def test_a_resumed_run_traces_the_windows_a_straight_run_traces_and_says_which(tmp_path, train_in_process, capsys):
    args = [*TINY, "--profiling.enable_profiling", "true", "--profiling.profile_freq", "4",
            "--profiling.profiler_warmup", "0", "--profiling.profiler_active", "1", "--checkpoint.enable", "true",
            "--checkpoint.interval", "3", "--job.dump_folder", str(tmp_path)]
    assert train_in_process([*args, "--training.steps", "3"]) == 0
    assert "no trace in steps 1 to 3: the next window ends at step 4" in capsys.readouterr().err
    assert train_in_process([*args, "--training.steps", "8"]) == 0  # resumes after step 3
    assert "profiling: traces of steps ending at 4, 8" in capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "profile_traces").iterdir()) == ["step-4", "step-8"]


def test_impossible_profiler_window_is_refused(tmp_path, train_in_process, capsys):
    args = [*TINY, "--profiling.enable_profiling", "true", "--profiling.profile_freq", "2",
            "--profiling.profiler_warmup", "2", "--job.dump_folder", str(tmp_path)]
    assert train_in_process(args) == 2
    expected = "profiling.profile_freq (2) must be at least profiler_warmup (2) + profiler_active (1)"
    assert expected in capsys.readouterr().err


PER_LAYER = [*TINY, "--training.steps", "3", "--metrics.log_freq", "1", "--metrics.per_layer", "true"]


def test_per_layer_metrics_are_logged_and_layout_independent(tmp_path, train_in_process):
    one = tmp_path / "one"
    assert train_in_process([*PER_LAYER, "--job.dump_folder", str(one)]) == 0
    reference = layer_records(one)
    assert sorted(reference) == [1, 2, 3]
    for layers in reference.values():
        assert sorted(layers) == ["0", "1"]
        for stats in layers.values():
            assert all(math.isfinite(v) and v > 0 for v in stats.values())
            assert stats["output_max"] >= stats["output_rms"]
    layouts = {
        "fsdp2": ["--parallelism.data_parallel_shard_degree", "2", "--training.local_batch_size", "2"],
        "pp2": ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"],
    }
    for name, (dump, problem) in torchrun_runs({name: (2, [*PER_LAYER, *layout]) for name, layout in layouts.items()},
                                               tmp_path).items():
        assert not problem, problem
        got = layer_records(dump)
        # A pipeline's first step is not measured (see train.py).
        assert sorted(got) == ([2, 3] if name == "pp2" else [1, 2, 3])
        for step in got:
            for layer, stats in reference[step].items():
                for field, value in stats.items():
                    assert got[step][layer][field] == pytest.approx(value, rel=1e-4), (name, step, layer, field)


def test_peak_flops_comes_from_the_config_and_a_cpu_has_none_of_its_own():
    assert peak_flops(torch.device("cpu"), 5e12) == (5e12, "metrics.peak_flops")
    peak, reason = peak_flops(torch.device("cpu"), 0.0)
    assert peak is None and "set metrics.peak_flops" in reason


@pytest.mark.parametrize("configured_peak", [0.0, 2e12])
def test_a_cpu_logs_mfu_only_against_a_configured_peak(tmp_path, configured_peak):
    from components.config import Metrics
    from components.metrics.reporting import MetricsLogger, read_metrics

    cfg = Metrics(enable_tensorboard=False, peak_flops=configured_peak)
    metrics = MetricsLogger(tmp_path, cfg, torch.device("cpu"), flops_per_token=1e6, world_size=1, is_writer=True)
    metrics.count_tokens(1000)
    metrics.log(1, loss=2.0, grad_norm=1.0, lr=1e-3)
    metrics.close()
    (record,), _ = read_metrics(tmp_path / "metrics.jsonl")
    if configured_peak:
        assert record["mfu"] == pytest.approx(100 * record["tokens_per_second"] * 1e6 / configured_peak)
    else:
        assert record["mfu"] is None
