"""The memory estimator: exact persistent state, simulated activations, and agreement with real runs."""

import json
import re
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
from conftest import REPO

import scripts.memory_estimate as me
from components.config import load_config
from components.metrics.reporting import peak_rss_bytes
from components.model.moe_layer import moe_layers
from models.families import model_config_class
from scripts.memory_estimate.__main__ import main as estimate_main

GiB = 2**30
# The debug model cut down: a real run of it takes seconds, and its tensors are still a good part of
# the process's memory.
SMALL = ["--job.config_file", "debug_model.toml", "--model.n_layers", "2", "--training.seq_len", "256",
         "--training.local_batch_size", "8", "--checkpoint.enable", "false", "--metrics.enable_tensorboard", "false"]


def estimate(*overrides, world_size=None, target="cpu"):
    config = load_config(["--job.config_file", "debug_model.toml", *overrides], model_config_class)
    return me.estimate(config, world_size, target, baseline_bytes=0 if target == "cpu" else None)


def debug_param_count() -> int:
    from models.llama3 import Transformer, build_model_args

    config = load_config(["--job.config_file", "debug_model.toml"], model_config_class)
    with torch.device("meta"):
        model = Transformer(build_model_args(config, 4096))
    return sum(p.numel() for p in model.parameters())


def test_breakdown_adds_up_and_persistent_state_is_exact():
    est = estimate()
    n = debug_param_count()
    assert est.total == sum(est.parts.values())
    assert set(est.parts) == set(me.PARTS)
    assert est.n_params == est.params_on_rank == n
    assert est.parts["parameters"] == 4 * n  # fp32 master weights
    assert est.parts["optimizer"] == 8 * n  # AdamW: two fp32 states
    assert 0 <= est.parts["gradients"] <= 4 * n
    assert est.parts["baseline"] == me.CPU_TRAINER_STATE  # the measured part was given as 0
    assert est.parts["fsdp_buffers"] == 0  # one fp32 process: no FSDP
    assert est.parts["activations"] > est.parts["parameters"]
    text = est.format()
    for label in me.LABELS.values():
        assert label in text
    assert f"{est.total / GiB:9.3f} GiB" in text


def test_sharded_state_is_params_over_shard_degree():
    """FSDP over 4 in bf16 (GPU-style): fp32 state / 4 per rank (every debug-model dim 0 divides by 4)."""
    n = debug_param_count()
    est = estimate("--training.mixed_precision_param", "bfloat16", world_size=4, target="cuda")
    assert est.params_on_rank == n // 4
    assert est.parts["parameters"] == 4 * n // 4
    assert est.parts["optimizer"] == 8 * n // 4
    assert est.parts["fsdp_buffers"] > 0 and est.parts["baseline"] == 0 and est.parts["allocator"] == 0



def test_cpu_offload_moves_the_sharded_state_off_the_gpu():
    """With parallelism.fsdp_cpu_offload the fp32 parameters, gradient shards and AdamW state (16 bytes
    a parameter) are host memory: the GPU estimate drops them and says where they went."""
    n = debug_param_count()
    args = ("--training.mixed_precision_param", "bfloat16")
    on_gpu = estimate(*args, world_size=4, target="cuda")
    offloaded = estimate(*args, "--parallelism.fsdp_cpu_offload", "true", world_size=4, target="cuda")
    assert offloaded.parts["parameters"] == offloaded.parts["optimizer"] == 0
    assert offloaded.total <= on_gpu.total - 12 * n // 4
    assert any(f"{16 * n // 4 / 2**30:.3f} GiB of fp32 parameters" in r for r in offloaded.remarks)

@pytest.mark.parametrize("config_file,layout", [
    ("debug_model.toml", {"data_parallel_shard_degree": 4, "tensor_parallel_degree": 2}),
    ("debug_model.toml", {"data_parallel_shard_degree": 2, "context_parallel_degree": 2, "tensor_parallel_degree": 2}),
    ("debug_model.toml", {"data_parallel_replicate_degree": 2, "data_parallel_shard_degree": 2,
                          "tensor_parallel_degree": 2}),
    ("debug_moe.toml", {"data_parallel_shard_degree": 4, "expert_parallel_degree": 4, "tensor_parallel_degree": 2}),
    ("debug_moe.toml", {"data_parallel_replicate_degree": 2, "data_parallel_shard_degree": 2,
                        "expert_parallel_degree": 2, "tensor_parallel_degree": 2}),
    ("debug_moe.toml", {"data_parallel_shard_degree": 8, "expert_parallel_degree": 2}),
    ("debug_deepseek_v3.toml", {"data_parallel_shard_degree": 4, "expert_parallel_degree": 4,
                                "tensor_parallel_degree": 2}),
])
def test_parameters_per_rank_match_the_real_parallelized_model(config_file, layout):
    """The estimator's count equals what train.py's parallelize leaves on rank 0, built on the meta
    device over a fake 8-rank process group (mixture-of-experts layers and expert parallelism included)."""
    from torch.distributed.tensor import DTensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from components.distributed.mesh import ParallelDims
    from models.families import import_model_package

    overrides = ["--training.mixed_precision_param", "bfloat16", "--model.vocab_size", "4100"]  # 4100: uneven shards
    for key, value in layout.items():
        overrides += [f"--parallelism.{key}", str(value)]
    config = load_config(["--job.config_file", config_file, *overrides], model_config_class)
    package = import_model_package(config.model.name)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    try:
        dims = ParallelDims.from_config(config.parallelism, 8)
        mesh = dims.build_mesh("cpu")
        with torch.device("meta"):
            model = package.Transformer(package.build_model_args(config, 4096))
        model = package.parallelize(model, dims, mesh, config, torch.device("cpu"))
        local = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in model.parameters())
    finally:
        dist.destroy_process_group()
    est = me.estimate(config, 8, "cuda")
    assert est.params_on_rank == local
    assert est.parts["parameters"] == 4 * local and est.parts["optimizer"] == 8 * local


def test_activations_grow_linearly_with_batch_and_drop_with_checkpointing():
    acts = {b: estimate("--training.local_batch_size", str(b), "--training.seq_len", "128").saved_activations
            for b in (2, 4, 8)}
    assert acts[4] == pytest.approx(2 * acts[2], rel=1e-3)
    assert acts[8] == pytest.approx(2 * acts[4], rel=1e-3)
    by_mode = {
        mode: estimate("--training.seq_len", "128", *args).saved_activations
        for mode, args in {
            "none": [],
            "op": ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"],
            "full": ["--activation_checkpoint.mode", "full"],
        }.items()
    }
    assert by_mode["full"] < by_mode["op"] < by_mode["none"]
    assert by_mode["full"] < 0.3 * by_mode["none"]


@pytest.mark.parametrize("ac", [("none", "2"), ("full", "2"), ("selective", "op"), ("selective", "2"),
                                ("selective", "3")])
@pytest.mark.parametrize("stage", [{}, {"first": False}, {"last": False}])
def test_simulating_a_few_blocks_gives_the_whole_model(ac, stage):
    """The blocks left out of the simulation are added exactly (identical blocks)."""
    from models import llama3

    config = load_config(["--job.config_file", "debug_model.toml", "--model.n_layers", "11"], model_config_class)
    args = llama3.build_model_args(config, 4096)
    kwargs = dict(batch=2, seq=32, dtype=torch.float32, ac_mode=ac[0], ac_option=ac[1], **stage)
    whole = me.simulate_micro_batch(llama3, args, simulate_blocks=11, **kwargs)
    few = me.simulate_micro_batch(llama3, args, **kwargs)
    assert me.blocks_to_simulate(11, *ac) < 11
    assert few.saved == whole.saved
    assert few.block_grad_bytes == whole.block_grad_bytes
    for weights in ((1, 1, 1), (1, 0, 0), (1, 1, 0.25)):
        def peak(sim, weights=weights):
            return max(o * weights[0] + r * weights[1] + b * weights[2] for o, r, b in sim.samples)

        assert peak(few) == peak(whole)


def test_a_stage_is_simulated_with_its_own_blocks_and_the_share_of_the_experts_its_rank_holds():
    """DeepSeek-V3's dense first blocks: a later stage's blocks are all mixtures of experts, and its simulation is the
    same whatever the number of dense blocks before it (the estimate of DeepSeek-V3 671B's last stage once simulated
    three dense blocks); under expert parallelism each stack of experts is the rank's share."""
    from models import deepseek_v3

    def simulation(dense_blocks: int, ep: int = 1):
        config = load_config(["--job.config_file", "debug_deepseek_v3.toml", "--model.n_layers", "6",
                              "--model.first_dense_layers", str(dense_blocks)], model_config_class)
        args = deepseek_v3.build_model_args(config, 4096)
        return me.simulate_micro_batch(deepseek_v3, args, batch=2, seq=32, dtype=torch.float32, ac_mode="full",
                                       n_blocks=3, layer_ids=[3, 4, 5], first=False, ep=ep)

    dense, after_one, after_three = simulation(6), simulation(1), simulation(3)
    assert (after_one.saved, after_one.samples) == (after_three.saved, after_three.samples)
    assert after_one.block_grad_bytes == after_three.block_grad_bytes > dense.block_grad_bytes
    config = load_config(["--job.config_file", "debug_deepseek_v3.toml"], model_config_class)
    with torch.device("meta"):
        model = deepseek_v3.Transformer(deepseek_v3.build_model_args(config, 4096))
    stacks = sum(p.numel() for _, layer in moe_layers(model.layers["3"]) for p in layer.experts.parameters())
    assert after_one.block_grad_bytes - simulation(1, ep=2).block_grad_bytes == 3 * stacks // 2 * 4


def test_parallel_layouts_shrink_what_they_split():
    base = ["--training.mixed_precision_param", "bfloat16", "--training.seq_len", "256"]
    one = estimate(*base, target="cuda")
    tp = estimate(*base, "--parallelism.tensor_parallel_degree", "2", target="cuda")
    cp = estimate(*base, "--parallelism.context_parallel_degree", "2", target="cuda")
    pp = estimate(*base, "--parallelism.pipeline_parallel_degree", "2", "--training.local_batch_size", "4",
                  "--parallelism.pipeline_parallel_microbatch_size", "1", target="cuda")
    assert tp.saved_activations < one.saved_activations and tp.params_on_rank < one.params_on_rank
    assert cp.saved_activations < one.saved_activations
    assert cp.params_on_rank < one.params_on_rank  # FSDP shards over dp_shard x cp
    assert pp.params_on_rank < one.params_on_rank
    for est in (one, tp, cp, pp):
        assert est.total == sum(est.parts.values())


@pytest.mark.parametrize("method", ["allgather", "ring", "alltoall"])
def test_document_masking_under_context_parallelism_adds_its_masks_to_each_method(method):
    base = ["--training.seq_len", "256", "--parallelism.context_parallel_degree", "2",
            "--parallelism.context_parallel_method", method]
    causal = estimate(*base, world_size=2)
    documents = estimate(*base, "--training.document_masking", "true", world_size=2)
    assert documents.saved_activations > causal.saved_activations and documents.total > causal.total
    assert documents.total == sum(documents.parts.values())


@pytest.mark.parametrize("documents", [False, True], ids=["causal", "documents"])
def test_attention_on_cuda_is_estimated_without_the_masks_its_kernels_do_without(documents):
    """On CUDA allgather's causal chunks run flash with no mask (half precision), and document masking runs
    FlexAttention (allgather's chunks; alltoall and one process over the whole sequence); the CPU attends under
    boolean masks, which each layer saves for its backward. Causal alltoall and one process need none on either."""
    args = ["--training.seq_len", "256", "--training.document_masking", str(documents).lower(),
            "--training.mixed_precision_param", "bfloat16"]
    for layout, differs in ((["--parallelism.context_parallel_degree", "2"], True),
                            (["--parallelism.context_parallel_degree", "2", "--parallelism.context_parallel_method",
                              "alltoall"], documents),
                            ([], documents)):
        cpu, cuda = (estimate(*args, *layout, target=target) for target in ("cpu", "cuda"))
        assert cuda.saved_activations <= cpu.saved_activations
        assert (cuda.saved_activations < cpu.saved_activations) == differs, layout


def test_cli_prints_the_breakdown(capsys):
    assert estimate_main(["--job.config_file", "debug_model.toml", "--model.n_layers", "2", "--target", "cuda",
                          "--training.mixed_precision_param", "bfloat16", "--world-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "dp_shard=2" in out and "total" in out and "activations (saved for backward)" in out


def test_the_commands_in_the_memory_estimate_doc_print_a_breakdown(capsys):
    doc = (REPO / "docs" / "memory_estimate.md").read_text()
    commands = re.findall(r"^python -m scripts\.memory_estimate (.+)$", doc, re.M)
    assert len(commands) == 2
    for command in commands:
        assert estimate_main(command.split()) == 0, command
        assert re.search(r"^\s+total\s+[0-9.]+ GiB", capsys.readouterr().out, re.M), command


def test_cli_rejects_a_layout_that_does_not_fit_the_world_size_and_a_bad_world_size(capsys):
    assert estimate_main(["--job.config_file", "debug_model.toml", "--parallelism.data_parallel_shard_degree", "3",
                          "--world-size", "2"]) == 2
    assert "error:" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        estimate_main(["--job.config_file", "debug_model.toml", "--world-size", "0"])
    assert exit_info.value.code == 2
    assert "--world-size: must be a positive integer, got '0'" in capsys.readouterr().err


def test_llama3_8b_estimate_is_fast_plausible_and_allocates_nothing():
    config = load_config(["--job.config_file", "llama3_8b.toml"], model_config_class)
    rss_before = peak_rss_bytes()
    start = time.perf_counter()
    est = me.estimate(config, world_size=8, target="cuda")
    seconds = time.perf_counter() - start
    growth = peak_rss_bytes() - rss_before
    assert seconds < 10, seconds
    assert growth < 1 * GiB, growth / GiB
    assert est.n_params == pytest.approx(8.03e9, rel=0.01)
    assert est.parts["parameters"] == pytest.approx(8.03e9 * 4 / 8, rel=0.01)
    assert 45 * GiB < est.total < 75 * GiB, est.format()  # published FSDP-8 bf16 selective-AC figures: 50-70 GiB


@pytest.mark.slow
@pytest.mark.parametrize("config_file", ["debug_model.toml", "debug_deepseek_v3.toml", "debug_gpt_oss.toml"])
def test_estimate_is_within_20_percent_of_a_real_cpu_run(tmp_path, config_file):
    """A real run in a fresh process (its peak resident memory is then its own), against the estimator's CLI,
    also in a fresh process (it measures its baseline in itself); Llama 3, DeepSeek-V3's latent attention and
    experts, and gpt-oss's sliding-window layers with learned sinks."""
    run = [*SMALL, "--job.config_file", config_file]
    train = subprocess.run(
        [sys.executable, "train.py", *run, "--training.steps", "4", "--job.dump_folder", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )
    assert train.returncode == 0, train.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    measured = max(r["memory_gib"] for r in records)
    cli = subprocess.run([sys.executable, "-m", "scripts.memory_estimate", *run], cwd=REPO, capture_output=True,
                         text=True, timeout=300)
    assert cli.returncode == 0, cli.stderr
    estimated = float(re.search(r"^\s+total\s+([0-9.]+) GiB", cli.stdout, re.M).group(1))
    assert "target cpu" in cli.stdout
    assert abs(estimated - measured) / measured < 0.2, (estimated, measured, cli.stdout)
