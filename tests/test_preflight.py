"""scripts/preflight: a rank of a layout at its full world size, on one CPU over torch's fake process group, stepped
on fake tensors: its share of the model and optimizer state, the collectives of its step by mesh dimension, and
train.py's own errors for a layout that does not compose."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import REPO, on_ranks

from components.config import load_config
from models.families import model_config_class
from scripts.preflight.collectives import Collective
from scripts.preflight.predict import CLUSTERS, Step, load_cluster, predict
from scripts.preflight.rank import RankReport, run_rank, step_report

FSDP4_TP2 = ["--job.config_file", "debug_model.toml", "--parallelism.data_parallel_shard_degree", "4",
             "--parallelism.tensor_parallel_degree", "2"]


def fake_step(config_args: list[str], world_size: int, rank: int) -> RankReport:
    """preflight_rank in a process of its own, as the command runs it."""
    return run_rank(load_config(config_args, model_config_class), world_size, rank)


def collectives(report: RankReport) -> dict[str, list[int]]:
    return {f"{op} over {dim}": [c.count, c.bytes, c.group_size] for (op, dim), c in report.collectives.items()}


def _real_step(rank: int, world_size: int, store: str, config_args: list[str]) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(store, world_size), rank=rank, world_size=world_size)
    try:
        report = step_report(load_config(config_args, model_config_class), fake=False)
        (Path(store).parent / f"rank{rank}.json").write_text(json.dumps(collectives(report)))
        (Path(store).parent / f"peak{rank}.json").write_text(json.dumps(report.peak_bytes))
    finally:
        dist.destroy_process_group()


def test_the_fake_step_records_the_collectives_of_a_real_step_over_gloo(tmp_path):
    """FSDP 2 x TP 2 at 4 processes: each rank's collectives of one step (count, bytes put in, group size, by
    mesh dimension), recorded on 4 real gloo processes with real tensors, equal what preflight records for that
    rank alone over the fake process group on fake tensors; so does the most its step's tensors held at once, or
    a little more on gloo (1.7% more for rank 3 on a loaded machine), whose threads hold a collective's buffers
    until it ends, where the fake process group ends each at once."""
    args = ["--job.config_file", "debug_model.toml", "--parallelism.data_parallel_shard_degree", "2",
            "--parallelism.tensor_parallel_degree", "2", "--training.seq_len", "64", "--training.local_batch_size", "2"]
    on_ranks(_real_step, 4, 4, str(tmp_path / "store"), args)
    for rank in (0, 3):
        real = json.loads((tmp_path / f"rank{rank}.json").read_text())
        fake = fake_step(args, 4, rank)
        assert collectives(fake) == real, rank
        assert {"all_gather_into_tensor over dp_shard", "all_gather_into_tensor over tp"} <= set(real)
        real_peak = json.loads((tmp_path / f"peak{rank}.json").read_text())
        assert fake.peak_bytes <= real_peak <= 1.03 * fake.peak_bytes


@pytest.mark.parametrize("layout, tp, sends", [
    (["--parallelism.data_parallel_shard_degree", "2", "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"],
     1, 3),
    (["--parallelism.tensor_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble",
      "--training.document_masking", "true"], 2, 2),
], ids=["fsdp2_interleaved", "tp2_zero_bubble_v_documents"])
def test_a_pipeline_rank_given_its_stages_shapes_records_the_collectives_of_a_real_step_over_gloo(
        tmp_path, layout, tp, sends):
    """Pipeline 2 x FSDP 2 (interleaved 1F1B) and pipeline 2 x TP 2 (the V-shaped zero-bubble schedule, the last
    stage's logits a DTensor, document masking) at 4 processes, 4 micro-batches, two stages a rank: preflight gives
    each stage its shapes (a rank alone cannot learn them from its neighbours), and the first and the last rank's
    collectives, the pipeline's sends and receives among them, equal those of 4 real gloo processes stepped
    likewise."""
    args = ["--job.config_file", "debug_model.toml", "--parallelism.pipeline_parallel_degree", "2", *layout,
            "--training.seq_len", "64", "--training.local_batch_size", "4"]
    on_ranks(_real_step, 4, 4, str(tmp_path / "store"), args)
    for rank in (0, 3):
        real = json.loads((tmp_path / f"rank{rank}.json").read_text())
        report = fake_step(args, 4, rank)
        assert collectives(report) == real, rank
        # Each stage boundary the rank sends across (interleaved: 3, V: 2) carries the 4 micro-batches'
        # activations (1 x 64 tokens, a TP rank's share of them, x 256 fp32 values) or their gradients, beside
        # torch's few bytes of warm-up (torch 2.13: a vote a boundary on whether every stage was given its shapes).
        activation = 64 // tp * 256 * 4
        count, sent = real["send over pp"][:2]
        assert count >= sends * 4 and sent // activation == sends * 4
        assert report.pipeline_bubble == 1 / (2 * 4)


def test_a_mixture_of_experts_rank_routes_evenly_and_calls_the_collectives_of_a_real_step_over_gloo(tmp_path):
    """The debug MoE model, FSDP 4 x EP 2 at 4 processes: preflight routes each expert an equal share of the slots
    (fake tensors have no values to route by); the step calls the same collectives, as often, over the same groups,
    as a real step over gloo, and puts in the same bytes but for the all-to-alls of the routed slots, whose sizes
    follow the routing."""
    args = ["--job.config_file", "debug_moe.toml", "--parallelism.expert_parallel_degree", "2", "--training.seq_len",
            "64", "--training.local_batch_size", "2"]
    on_ranks(_real_step, 4, 4, str(tmp_path / "store"), args)
    real = json.loads((tmp_path / "rank1.json").read_text())
    fake = fake_step(args, 4, 1)
    assert "routing assumed balanced" in fake.note
    assert {k: v[::2] for k, v in collectives(fake).items()} == {k: v[::2] for k, v in real.items()}  # counts, groups
    routed = "all_to_all_single over ep"
    assert {k: v for k, v in collectives(fake).items() if k != routed} == {k: v for k, v in real.items() if k != routed}
    # 4 MoE blocks, each sending this rank's slots (2 x 64 tokens x 2 choices, of 256 fp32 values) to the experts'
    # ranks and back, forward and backward: 16 all-to-alls, each putting in all of them; and before each block's, the
    # exchange of the slot counts (c10d's alltoall_base, the same operation: 8 experts' int64 counts), 4 more.
    assert collectives(fake)[routed] == [16 + 4, 16 * (2 * 64 * 2) * 256 * 4 + 4 * 8 * 8, 2]


def test_experts_that_fsdp_shards_route_the_same_slots_when_a_pipeline_stage_recomputes_them():
    """FSDP 4 x EP 2 within each of 2 pipeline stages, blocks checkpointed: the balanced routing counts a rank's
    experts from the layer (its stacks are FSDP's shards in one forward and whole in the other: the recomputation
    then disagreed with its forward)."""
    args = ["--job.config_file", "debug_moe.toml", "--parallelism.expert_parallel_degree", "2", "--training.seq_len",
            "64", "--training.local_batch_size", "2", "--activation_checkpoint.mode", "full",
            "--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size", "1"]
    report = fake_step(args, 8, 1)
    assert report.collectives[("all_to_all_single", "ep")].count > 0 and report.peak_bytes > 0


def test_kimi_k2_s_config_for_256_gpus_fits_an_80_gib_gpu_by_the_memory_estimate_and_preflight():
    """train_configs/kimi_k2.toml: 4 GiB left for the CUDA context and NCCL's buffers, by both counts (preflight's
    of the first stage, the larger by the estimate)."""
    from scripts.memory_estimate import estimate

    config_args = ["--job.config_file", "kimi_k2.toml"]
    expected = estimate(load_config(config_args, model_config_class), 256, "cuda")
    assert expected.pp_rank == 0 and expected.total < 76 * 2**30
    assert fake_step(config_args, 256, 0).peak_bytes < 76 * 2**30


@pytest.mark.parametrize("config_args, world_size", [
    (["--job.config_file", "debug_model.toml"], 2),
    (["--job.config_file", "llama3_8b.toml"], 8),
    (["--job.config_file", "debug_deepseek_v3.toml", "--parallelism.expert_parallel_degree", "2"], 2),
    (["--job.config_file", "debug_gpt_oss.toml", "--parallelism.expert_parallel_degree", "2"], 2),
], ids=["debug_fsdp2", "llama3_8b_fsdp8", "deepseek_v3_ep2", "gpt_oss_ep2"])
def test_the_step_s_peak_memory_is_within_5_percent_of_the_memory_estimate_s_tensors(config_args, world_size):
    """The peak of the fake step's tensors (preflight counts each storage from the operator that makes it until its
    last tensor goes, FSDP's resized ones read again), plus the optimizer state a later step holds, against what
    scripts.memory_estimate counts of tensors for the same rank (all but the process baseline and the allocator's
    slack): the debug model's shipped config on 2 processes, Llama 3.1 8B (bf16, selective AC, 8192 tokens) on 8
    GPUs, and the mixture-of-experts families with expert parallelism (their attention kept as CUDA's kernels keep
    it: the CPU's learned sinks' scores made gpt-oss's 33% more)."""
    from scripts.memory_estimate import estimate

    config = load_config(config_args, model_config_class)
    expected = estimate(config, world_size, "cuda")
    tensors = expected.total - expected.parts["baseline"] - expected.parts["allocator"]
    assert fake_step(config_args, world_size, 0).peak_bytes == pytest.approx(tensors, rel=0.05)


def _gathers_float8(rank: int, store: str, result: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from components.config import Float8
    from parallelisms.float8 import gathers_float8

    dist.init_process_group("gloo", store=dist.FileStore(store, 1), rank=rank, world_size=1)
    try:
        tp = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))["tp"]
        float8 = [Float8(enable=True, recipe_name=recipe) for recipe in ("tensorwise", "rowwise")]
        Path(result).write_text(json.dumps([gathers_float8(f8, tp, torch.device("cpu")) for f8 in float8]))
    finally:
        dist.destroy_process_group()


def test_tensor_parallel_gathers_float8_activations_over_the_fake_group_as_over_nccl_and_not_over_gloo(tmp_path):
    """float8 tensorwise under TP 2 (the debug model in fp32, every linear layer converted): the blocks' all-gathers
    move float8 (a byte an element: the inputs of attention and the feed-forward in forward, their gradients in
    backward), as torchao's float8 TP plan does over NCCL; the output layer's stay in fp32. Over gloo, which cannot
    all-gather float8, train.py's TP gathers in high precision, as it does with rowwise scales anywhere."""
    args = ["--job.config_file", "debug_model.toml", "--parallelism.tensor_parallel_degree", "2", "--float8.enable",
            "true", "--float8.skip_small_layers", "false"]
    gathers = fake_step(args, 2, 0).collectives[("all_gather_into_tensor", "tp")]
    share = 4 * 128 * 256  # elements of a rank's share of the activations: local batch x half the sequence x dim
    assert (gathers.count, gathers.bytes) == (2 * 6 * 2 + 2, 2 * 6 * 2 * share + 2 * 4 * share)
    on_ranks(_gathers_float8, 1, str(tmp_path / "store"), str(tmp_path / "gloo.json"))
    assert json.loads((tmp_path / "gloo.json").read_text()) == [False, False]


def test_deepseek_v3_steps_under_float8_tensor_parallelism_its_latent_projections_fed_in_high_precision():
    """Multi-head latent attention under float8 TP (tensorwise, every eligible layer converted), as on GPUs: the
    attention's input is gathered in high precision for the latent projections kept out of float8 (gathered in
    float8 it reached them as a float8 tensor, and their matmul failed), the heads' layers casting their own."""
    args = ["--job.config_file", "debug_deepseek_v3.toml", "--parallelism.tensor_parallel_degree", "2",
            "--float8.enable", "true", "--float8.skip_small_layers", "false"]
    report = fake_step(args, 2, 0)
    assert report.flops > 0 and report.collectives


def test_the_float8_share_counts_the_layers_that_would_compute_in_float8_on_a_gpu():
    """The debug model's linear layers, all converted when emulated here: on a GPU, skip_small_layers keeps every one
    of them in bf16 (too small for float8 to pay), so none of the step's FLOPs are float8's; without it, the blocks'
    share of the linear layers' weights (the output projection stays in high precision), of the matmuls' FLOPs."""
    args = ["--job.config_file", "debug_model.toml", "--float8.enable", "true", "--training.seq_len", "64"]
    assert fake_step(args, 1, 0).float8_flops == 0
    report = fake_step([*args, "--float8.skip_small_layers", "false"], 1, 0)
    dim, hidden, kv, vocab, layers = 256, 768, 64, 4096, 6
    blocks = layers * (2 * dim * dim + 2 * dim * kv + 3 * dim * hidden)
    matmuls = 6 * config_tokens(args) * (blocks + dim * vocab)  # forward and backward of every linear layer
    assert report.float8_flops == pytest.approx(matmuls * blocks / (blocks + dim * vocab), rel=1e-6)


def config_tokens(args: list[str]) -> int:
    training = load_config(args, model_config_class).training
    return training.local_batch_size * training.seq_len


def preflight(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "scripts.preflight", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))


def test_a_rank_of_fsdp_4_by_tp_2_holds_its_share_and_sends_what_fsdp_and_tp_send():
    """The debug model (fp32, 6 blocks) at 8 ranks, rank 5 (dp_shard 2, tp 1): an eighth of its block and output
    weights (the embedding shards over FSDP only, its norms likewise), AdamW's two moments of each (fp32); FSDP gathers
    each block's shard in forward and again in backward (the root's once: never resharded) and reduce-scatters
    every unit's gradients once, over the 4 shard ranks; TP's collectives go over the 2 TP ranks, and the gradient
    norm's over all of them."""
    report = fake_step(FSDP4_TP2, 8, 5)
    assert report.coordinates == {"dp_shard": 2, "tp": 1}
    assert report.param_bytes == 4 * report.params
    assert 0 < report.optimizer_bytes - 2 * report.param_bytes <= 4 * 100  # and a 4-byte step count per tensor
    gather, scatter = report.collectives[("all_gather_into_tensor", "dp_shard")], report.collectives[
        ("reduce_scatter_tensor", "dp_shard")]
    assert (gather.count, gather.group_size) == (2 * 6 + 1, 4) and (scatter.count, scatter.group_size) == (6 + 1, 4)
    # Each gather puts in this rank's shard of a unit; the blocks' twice, the root's once.
    block_bytes = report.param_bytes - report.root_param_bytes
    assert gather.bytes == 2 * block_bytes + report.root_param_bytes
    assert scatter.bytes == 4 * report.param_bytes  # a reduce-scatter puts in the whole gradient of its unit
    assert {dim for _, dim in report.collectives} == {"dp_shard", "tp", "dp_shard+tp"}
    # The gradient norm, a sum over all 8 ranks that DTensor reduces inside the clipping's operators.
    assert report.collectives[("all_reduce", "dp_shard+tp")].count == 1
    assert all(c.group_size == 2 for (_, dim), c in report.collectives.items() if dim == "tp")
    # This rank's FLOPs: its matmuls on its TP shards (DTensor's, counted on the local shards), near the formula.
    assert report.model_flops < report.flops < 1.1 * report.model_flops


@pytest.mark.parametrize("args, error", [
    (["--world-size", "6", "--parallelism.tensor_parallel_degree", "3"],
     "error: parallelism.tensor_parallel_degree 3 must divide model.n_heads (16)"),
    (["--world-size", "2", "--parallelism.context_parallel_degree", "2", "--training.document_masking", "true"],
     "error: not available yet in preflight: training.document_masking with context parallelism; python -m "
     "scripts.memory_estimate estimates its memory"),
    (["--world-size", "2", "--ranks", "2"], "error: --ranks 2: [2] not in 0 to 1"),
], ids=["tp_does_not_divide_heads", "document_masking_under_cp", "rank_outside"])
def test_what_does_not_compose_or_is_not_covered_yet_is_one_line_and_exit_2(args, error):
    result = preflight(*args)
    assert result.returncode == 2, result.stderr[-3000:]
    assert (result.stdout, result.stderr) == ("", f"{error}\n")  # the refusal alone


def test_fsdp_over_4_counts_the_step_s_flops_near_the_model_s_formula_and_predicts_its_time_from_them():
    """The step's count (attention counted as the GPU kernels are, every query against every key, as
    flops_per_token does) is within 10% of the formula MFU uses (its backward of attention counts 2 forward's, the
    kernels' 2.5). The prediction on an H200 node: compute at 45% of 989 TFLOP/s (bf16, compiled), then what waits:
    over dp_shard only, this tiny model's FSDP collectives being too small to hide (under 1 MiB a call) and the loss's
    all-reduce; MFU the formula's share of the peak."""
    result = preflight("--world-size", "4", "--ranks", "3", "--cluster", "h200", "--training.mixed_precision_param",
                       "bfloat16", "--compile.enable", "true")
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert "  cluster h200: H200 SXM nodes, NVLink 4, 400 Gb/s InfiniBand a GPU; 8 GPUs a node" in lines
    assert lines[9] == "rank 3 (dp_shard 3), its start-up and one step checked in " + lines[9].split(" in ")[-1]
    header = lines.index("    mesh dimension collective                       calls bytes put in  group")
    rows = [line.split()[:2] for line in lines[header + 1:] if line.startswith("    dp_shard")]
    # torch.distributed's public names, one row per operation (FSDP's c10d all-reduce and DTensor's merged).
    assert sorted(rows) == [["dp_shard", "all_gather_into_tensor"], ["dp_shard", "all_reduce"],
                            ["dp_shard", "reduce_scatter_tensor"]], lines
    line = next(line for line in lines if "FLOPs of one step" in line)
    counted, formula = (float(part.split(" T")[0].split()[-1]) for part in line.split(";"))
    assert formula < counted < 1.1 * formula, line
    step = next(line for line in lines if "predicted step" in line)
    seconds = float(step.split("predicted step ")[1].split(" ms")[0]) / 1e3
    compute = float(step.split("compute ")[1].split(" ms")[0]) / 1e3
    assert compute == pytest.approx(counted * 1e12 / (0.45 * 989e12), rel=1e-2) and compute < seconds
    assert step.endswith("waiting (dp_shard " + step.split("waiting (dp_shard ")[-1]), step
    mfu = float(next(line for line in lines if "tokens/s per GPU" in line).split("MFU ")[1].rstrip("%"))
    assert mfu == pytest.approx(100 * formula * 1e12 / seconds / 989e12, rel=2e-2)


def test_the_prediction_hides_fsdp_s_bulk_collectives_behind_compute_and_adds_what_waits():
    """By hand, on an H100 node pair: 445 TFLOP/s of a compiled bf16 step (45% of 989); FSDP's gather of 1 GiB
    shards over 8 ranks of one node receives 7 GiB at 360 GB/s (80% of NVLink's 450) plus 10 us a call, hidden
    behind compute; TP's all-reduce of 1 GiB over 2 ranks on two nodes moves 1 GiB at 40 GB/s plus 25 us a call,
    waited for (unless async TP); a pipeline's bubble and sends add to the step."""
    h100 = CLUSTERS["h100"]
    gib = 2**30
    collectives = {("all_gather_into_tensor", "dp_shard"): Collective(2, 2 * gib, 8, tuple(range(8))),
                   ("all_reduce", "tp"): Collective(4, gib, 2, (0, 8))}
    step = Step("bfloat16", compiled=True, async_tp=False, tokens=8 * 4096, world_size=16)
    one_second = 0.45 * 989e12
    p = predict(one_second, 0, 3.56e14, collectives, step, h100)
    gather = 7 * 2 * gib / 360e9 + 2 * 10e-6
    tp = 2 * gib * 1 / 2 / 40e9 + 4 * 25e-6
    assert p.compute_s == pytest.approx(1.0) and p.overlapped_s == pytest.approx(gather)
    assert p.exposed_by_dim == {"tp": pytest.approx(tp)} and p.step_s == pytest.approx(1.0 + tp)
    assert p.tokens_per_gpu_s == pytest.approx(8 * 4096 / 16 / p.step_s)
    assert p.mfu == pytest.approx(3.56e14 / p.step_s / 989e12)
    # Half the FLOPs in float8 linear layers, at 31% of 1,979; async TP hides TP's all-reduce too.
    async_tp = predict(one_second, one_second / 2, 3.56e14, collectives, Step("bfloat16", True, True, 8 * 4096, 16),
                       h100)
    assert async_tp.compute_s == pytest.approx(0.5 + one_second / 2 / (0.31 * 1979e12))
    assert async_tp.exposed_s == 0 and async_tp.step_s == pytest.approx(async_tp.compute_s)
    # A pipeline of 4 with 2 stages a rank and 6 micro-batches idles (4 - 1) / (2 x 6) of the compute; its sends of
    # 64 MiB to a rank on another node wait, and its receives are priced on the sender.
    p2p = {("send", "pp"): Collective(12, 12 * 64 * 2**20, 4, (0, 8, 16, 24)),
           ("recv", "pp"): Collective(12, 12 * 64 * 2**20, 4, (0, 8, 16, 24))}
    piped = predict(one_second, 0, 3.56e14, p2p, step, h100, bubble=(4 - 1) / (2 * 6))
    send = 12 * 64 * 2**20 / 40e9 + 12 * 25e-6
    assert piped.bubble_s == pytest.approx(0.25) and piped.exposed_by_dim == {"pp": pytest.approx(send)}
    assert piped.step_s == pytest.approx(1.0 + 0.25 + send)


def test_a_cluster_file_changes_the_named_cluster_and_names_a_key_it_does_not_know(tmp_path):
    (tmp_path / "slow_network.toml").write_text('base = "h200"\ninter_node_gbps = 25.0\n')
    cluster = load_cluster(str(tmp_path / "slow_network.toml"))
    assert cluster.inter_node_gbps == 25.0 and cluster.peak_tflops == CLUSTERS["h200"].peak_tflops
    (tmp_path / "typo.toml").write_text("inter_node_gbs = 25.0\n")
    with pytest.raises(ValueError, match=r"unknown key 'inter_node_gbs'; the keys: base, bandwidth_fraction"):
        load_cluster(str(tmp_path / "typo.toml"))
    with pytest.raises(ValueError, match="neither a cluster .h100, h200. nor a TOML file"):
        load_cluster("a100")


def test_autotune_predict_ranks_the_layouts_that_fit_by_preflight_s_predicted_tokens_per_second():
    """At 2 ranks of the debug model: TP 1, 2 and PP 2 x AC none, full; a budget of 0.12 GiB leaves out those the
    memory estimator puts over it (no checkpointing); the others come fastest first, the first with the tokens/s
    preflight itself predicts for that layout."""
    base = ["--job.config_file", "debug_model.toml", "--batch-sizes", "4", "--ac-modes", "none,full",
            "--pp-degrees", "1,2"]
    result = subprocess.run([sys.executable, "-m", "scripts.autotune", "--predict", "--world-size", "2",
                             "--memory-budget-gib", "0.12", *base], cwd=REPO, capture_output=True, text=True,
                            timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [[cell.strip() for cell in line.split("|")[1:-1]] for line in result.stdout.splitlines()
            if line.startswith("| tp ")]
    assert {row[0] for row in rows} == {f"tp {tp}, {pp}AC {ac}, batch 4" for tp, pp in ((1, ""), (2, ""), (1, "pp 2, "))
                                        for ac in ("none", "full")}
    predicted = [row for row in rows if row[3]]
    assert {row[0] for row in rows if not row[3]} >= {"tp 1, AC none, batch 4", "tp 2, AC none, batch 4"}
    assert all(float(row[1]) > 0.12 and "over the budget" in row[5] for row in rows if not row[3])
    assert any("pp 2" in row[0] for row in predicted)
    speeds = [int(row[3].replace(",", "")) for row in predicted]
    assert len(speeds) >= 3 and speeds == sorted(speeds, reverse=True)
    assert all(float(row[1]) <= 0.12 for row in predicted)
    best = predicted[0][0]
    tp, pp = int(best.split(",")[0].split()[1]), int(best.split("pp ")[1].split(",")[0]) if "pp " in best else 1
    alone = preflight("--world-size", "2", "--job.config_file", "debug_model.toml",
                      "--parallelism.tensor_parallel_degree", str(tp),
                      "--parallelism.pipeline_parallel_degree", str(pp),
                      "--parallelism.data_parallel_shard_degree", str(2 // tp // pp),
                      "--training.local_batch_size", "4", "--activation_checkpoint.mode",
                      best.split("AC ")[1].split(",")[0], *(["--ranks", "0"] if pp == 1 else []))
    # A pipeline layout goes as fast as its slower end: the rank of the first stage or of the last.
    speeds = [int(line.split("predicted ")[1].split(" tokens/s")[0].replace(",", ""))
              for line in alone.stdout.splitlines() if "tokens/s per GPU" in line]
    assert f"{min(speeds):,}" == predicted[0][3]
