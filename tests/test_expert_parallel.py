"""Expert parallelism in training: the debug Qwen3-MoE model on 2 and 4 gloo processes, with ep combined with
FSDP, activation checkpointing and CPU offload, and under tensor parallelism, trains like one process (the same
global batches, per-step losses, gradient norms and routing tally at the same global batch and seed, CPU fp32; on
the default config's data and on the packed corpus); a checkpoint saved at one ep degree resumes at another and
exports like one process's. With HSDP, tensor and pipeline parallelism and compile: tests/test_deepseek_v3.py."""

import shutil

import pytest
import torch
from conftest import ON_HF, ON_PACKED, layout, losses, metric_lines, reference_runs, torchrun, torchrun_runs

pytestmark = pytest.mark.slow

STEPS = 4
BASE = [
    "--job.config_file", "debug_moe.toml", *ON_PACKED, "--model.n_layers", "2", "--training.seq_len", "64",
    "--lr_scheduler.warmup_steps", "2", "--checkpoint.enable", "false", "--metrics.enable_tensorboard", "false",
    "--training.steps", str(STEPS), "--training.global_batch_size", "8", "--metrics.log_freq", "1",
]


# Expert parallelism with tensor and pipeline parallelism, HSDP and compile runs on DeepSeek-V3, whose blocks hold
# the same MoE layer (tests/test_deepseek_v3.py); here on Qwen3-MoE, every block an MoE one.
LAYOUTS = {  # name: (processes, arguments), data (half on the default config's data, half on the packed corpus)
    "dp_shard4_ep4": (layout(dp_shard=4, ep=4), "hf"),
    "tp2": (layout(tp=2), "packed"),
    "dp_shard2_ep2_full_ac": (layout(dp_shard=2, ep=2, extra=["--activation_checkpoint.mode", "full"]), "hf"),
    "dp_shard2_ep2_cpu_offload": (layout(dp_shard=2, ep=2, extra=["--parallelism.fsdp_cpu_offload", "true"]), "packed"),
}
DATA = {"hf": ON_HF, "packed": []}
"""BASE reads the packed corpus; ON_HF, later on the command line, replaces it by the default config's data."""


def grad_norms(dump) -> dict[int, float]:
    return {m["step"]: m["grad_norm"] for m in metric_lines(dump) if "loss" in m}


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """The single-process runs the layouts are compared with, by data."""
    return reference_runs(tmp_path_factory, BASE, DATA)


@pytest.fixture(scope="module")
def reference(references):
    return references["packed"]


@pytest.fixture(scope="module")
def layout_runs(tmp_path_factory):
    """Every layout's dump folder and what went wrong ("" if nothing), by name."""
    runs = {name: (nproc, [*BASE, *DATA[data], *args]) for name, ((nproc, args), data) in LAYOUTS.items()}
    return torchrun_runs(runs, tmp_path_factory.mktemp("layouts"))


@pytest.mark.parametrize("name", LAYOUTS)
def test_expert_parallel_layout_matches_one_process(name, references, layout_runs):
    dump, problem = layout_runs[name]
    assert not problem, problem
    reference = references[LAYOUTS[name][1]]
    got, expected = losses(dump), losses(reference)
    assert sorted(got) == list(range(1, STEPS + 1))
    assert [m["data_hash"] for m in metric_lines(dump) if "loss" in m] == \
        [m["data_hash"] for m in metric_lines(reference) if "loss" in m]
    for step, loss in expected.items():
        assert got[step] == pytest.approx(loss, rel=1e-3), (name, step, got[step], loss)
    for step, norm in grad_norms(reference).items():
        assert grad_norms(dump)[step] == pytest.approx(norm, rel=1e-3), (name, step)
    # The routing tally of the whole model (every pipeline stage's layers), as one process counts it.
    loads = {m["step"]: m["moe_max_load"] for m in metric_lines(dump) if "loss" in m}
    assert loads == pytest.approx({m["step"]: m["moe_max_load"] for m in metric_lines(reference) if "loss" in m})


def test_checkpoint_saved_at_ep4_resumes_at_ep2_with_tensor_parallel(reference, tmp_path):
    """The experts are saved as whole tensors (DTensors over the ep ranks): any ep degree loads them."""
    nproc, ep4 = layout(dp_shard=4, ep=4)
    saving = ["--checkpoint.enable", "true", "--checkpoint.interval", str(STEPS // 2), "--job.dump_folder",
              str(tmp_path)]
    torchrun(nproc, [*BASE, *ep4, *saving])
    shutil.rmtree(tmp_path / "checkpoint" / f"step-{STEPS}")
    (tmp_path / "metrics.jsonl").write_text("")
    nproc, tp2_ep2 = layout(dp_shard=2, tp=2, ep=2)
    torchrun(nproc, [*BASE, *tp2_ep2, *saving])
    got, expected = losses(tmp_path), losses(reference)
    assert sorted(got) == list(range(STEPS // 2 + 1, STEPS + 1))
    for step in got:
        assert got[step] == pytest.approx(expected[step], rel=1e-3), (step, got[step], expected[step])


def test_expert_parallel_degree_must_divide_the_experts_and_the_shard_degree(tmp_path):
    nproc, args = layout(dp_shard=2, ep=2)
    with pytest.raises(AssertionError, match=r"moe.num_experts 3 must be divisible by "
                                             r"parallelism.expert_parallel_degree 2"):
        torchrun(nproc, [*BASE, *args, "--moe.num_experts", "3", "--job.dump_folder", str(tmp_path)])
    import train

    code = train.main([*BASE, "--parallelism.expert_parallel_degree", "2", "--job.dump_folder", str(tmp_path)])
    assert code == 2  # one process: dp_shard 1 has no ranks to lend


def test_expert_parallelism_is_refused_for_a_model_without_experts(tmp_path):
    args = ["--job.config_file", "debug_model.toml", "--model.n_layers", "2", "--training.steps", "1",
            "--parallelism.expert_parallel_degree", "2", "--job.dump_folder", str(tmp_path)]
    with pytest.raises(AssertionError, match=r"parallelism.expert_parallel_degree 2 needs a mixture-of-experts "
                                             r"model; llama3 debugmodel has none"):
        torchrun(2, args)


def test_export_of_a_checkpoint_saved_under_expert_parallelism_equals_one_process(tmp_path):
    """A seed checkpoint (one process) and the checkpoint four ep ranks save from it after a step at lr 0
    (weights unchanged) export to the same Hugging Face tensors."""
    import train
    from components.hf.load import read_hf_weights
    from scripts import hf as converter

    small = [*BASE, "--moe.bias_update_speed", "0"]
    seed = tmp_path / "seed"
    assert train.main([*small, "--checkpoint.create_seed_checkpoint", "true", "--job.dump_folder", str(seed)]) == 0
    nproc, ep4 = layout(dp_shard=4, ep=4)
    torchrun(nproc, [*small, *ep4, "--training.steps", "1", "--optimizer.lr", "0", "--checkpoint.enable", "true",
                     "--checkpoint.initial_load_path", str(seed / "checkpoint" / "step-0"),
                     "--job.dump_folder", str(tmp_path / "ep4")])
    checkpoints = {"one": seed / "checkpoint" / "step-0", "ep4": tmp_path / "ep4" / "checkpoint" / "step-1"}
    for name, checkpoint in checkpoints.items():
        exported = ["export", *small, "--checkpoint", str(checkpoint), "--output", str(tmp_path / name)]
        assert converter.main(exported) == 0
    one, four = read_hf_weights(tmp_path / "one"), read_hf_weights(tmp_path / "ep4")
    assert any(".experts." in k for k in one)
    assert one.keys() == four.keys() and all(torch.equal(one[k], four[k]) for k in one)


@pytest.mark.parametrize("config_file", ["debug_moe.toml", "debug_qwen3.toml"])
def test_qwen3_resume_is_bitwise(config_file, tmp_path):
    """Stopping after step 2 and resuming gives steps 3 and 4 bit for bit (the routing biases are saved)."""
    import train

    args = ["--job.config_file", config_file, "--model.n_layers", "2", "--training.seq_len", "64",
            "--training.local_batch_size", "4", "--metrics.enable_tensorboard", "false", "--training.steps", "4",
            "--metrics.log_freq", "1", "--checkpoint.enable", "true", "--checkpoint.interval", "2",
            "--job.dump_folder", str(tmp_path)]
    assert train.main(args) == 0
    whole = {m["step"]: (m["loss"], m["grad_norm"]) for m in metric_lines(tmp_path) if "loss" in m}
    shutil.rmtree(tmp_path / "checkpoint" / "step-4")
    assert train.main(args) == 0
    resumed = {m["step"]: (m["loss"], m["grad_norm"]) for m in metric_lines(tmp_path) if "loss" in m}
    assert [resumed[s] for s in (3, 4)] == [whole[s] for s in (3, 4)]
