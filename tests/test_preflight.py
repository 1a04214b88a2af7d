"""scripts/preflight: a rank of a layout at its full world size, on one CPU over torch's fake process group, stepped
on fake tensors: its share of the model and optimizer state, the collectives of its step by mesh dimension, and
train.py's own errors for a layout that does not compose."""

import json
import multiprocessing
import os
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest
import torch.distributed as dist
from conftest import REPO, on_ranks

from components.config import load_config
from scripts.preflight.rank import RankReport, preflight_rank, step_report

FSDP4_TP2 = ["--job.config_file", "debug_model.toml", "--parallelism.data_parallel_shard_degree", "4",
             "--parallelism.tensor_parallel_degree", "2"]


def fake_step(config_args: list[str], world_size: int, rank: int) -> RankReport:
    """preflight_rank in a process of its own, as the command runs it."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as process:
        return process.submit(preflight_rank, load_config(config_args), world_size, rank).result()


def collectives(report: RankReport) -> dict[str, list[int]]:
    return {f"{op} over {dim}": [c.count, c.bytes, c.group_size] for (op, dim), c in report.collectives.items()}


def _real_step(rank: int, world_size: int, store: str, config_args: list[str]) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(store, world_size), rank=rank, world_size=world_size)
    try:
        report = step_report(load_config(config_args), fake=False)
        (Path(store).parent / f"rank{rank}.json").write_text(json.dumps(collectives(report)))
    finally:
        dist.destroy_process_group()


def test_the_fake_step_records_the_collectives_of_a_real_step_over_gloo(tmp_path):
    """FSDP 2 x TP 2 at 4 processes: each rank's collectives of one step (count, bytes put in, group size, by
    mesh dimension), recorded on 4 real gloo processes with real tensors, equal what preflight records for that
    rank alone over the fake process group on fake tensors."""
    args = ["--job.config_file", "debug_model.toml", "--parallelism.data_parallel_shard_degree", "2",
            "--parallelism.tensor_parallel_degree", "2", "--training.seq_len", "64", "--training.local_batch_size", "2"]
    on_ranks(_real_step, 4, 4, str(tmp_path / "store"), args)
    for rank in (0, 3):
        real = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert collectives(fake_step(args, 4, rank)) == real, rank
        assert {"_allgather_base over dp_shard", "all_gather_into_tensor over tp"} <= set(real)


def preflight(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "scripts.preflight", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))


def test_a_rank_of_fsdp_4_by_tp_2_holds_its_share_and_sends_what_fsdp_and_tp_send():
    """The debug model (fp32, 6 blocks) at 8 ranks, rank 5 (dp_shard 2, tp 1): an eighth of its block and output
    weights (the embedding shards over FSDP only, its norms likewise), AdamW's two moments of each (fp32); FSDP gathers
    each block's shard in forward and again in backward (the root's once: never resharded) and reduce-scatters
    every unit's gradients once, over the 4 shard ranks; TP's collectives go over the 2 TP ranks."""
    report = fake_step(FSDP4_TP2, 8, 5)
    assert report.coordinates == {"dp_shard": 2, "tp": 1}
    assert report.param_bytes == 4 * report.params
    assert 0 < report.optimizer_bytes - 2 * report.param_bytes <= 4 * 100  # and a 4-byte step count per tensor
    gather, scatter = report.collectives[("_allgather_base", "dp_shard")], report.collectives[
        ("_reduce_scatter_base", "dp_shard")]
    assert (gather.count, gather.group_size) == (2 * 6 + 1, 4) and (scatter.count, scatter.group_size) == (6 + 1, 4)
    # Each gather puts in this rank's shard of a unit; the blocks' twice, the root's once.
    block_bytes = report.param_bytes - report.root_param_bytes
    assert gather.bytes == 2 * block_bytes + report.root_param_bytes
    assert scatter.bytes == 4 * report.param_bytes  # a reduce-scatter puts in the whole gradient of its unit
    assert {dim for _, dim in report.collectives} == {"dp_shard", "tp"}
    assert all(c.group_size == 2 for (_, dim), c in report.collectives.items() if dim == "tp")
    assert report.flops is None and report.model_flops > 0  # not counted under TP yet


@pytest.mark.parametrize("args, error", [
    (["--world-size", "6", "--parallelism.tensor_parallel_degree", "3"],
     "error: parallelism.tensor_parallel_degree 3 must divide model.n_heads (16)"),
    (["--world-size", "4", "--parallelism.pipeline_parallel_degree", "2"],
     "error: not available yet in preflight: pipeline parallelism; python -m scripts.memory_estimate estimates their "
     "memory"),
    (["--world-size", "2", "--ranks", "2"], "error: --ranks 2: [2] not in 0 to 1"),
], ids=["tp_does_not_divide_heads", "pipeline", "rank_outside"])
def test_what_does_not_compose_or_is_not_covered_yet_is_one_line_and_exit_2(args, error):
    result = preflight(*args)
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1] == error


def test_fsdp_over_4_counts_the_step_s_flops_near_the_model_s_formula():
    """Without tensor parallelism torch's FLOP counter sees this rank's operations once: the step's count (attention
    counted as the GPU kernels are, every query against every key, as flops_per_token does) is within 10% of the
    formula MFU uses (its backward of attention counts 2 forward's, the kernels' 2.5)."""
    result = preflight("--world-size", "4", "--ranks", "3")
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(line for line in result.stdout.splitlines() if "FLOPs of one step" in line)
    counted, formula = (float(part.split(" T")[0].split()[-1]) for part in line.split(";"))
    assert formula < counted < 1.1 * formula, line
