"""Every parallel layout trains like one process: per-step losses of N gloo processes match the
single-process run at the same global batch and seed (CPU, fp32), on the same global batches (data_hash), half of
the layouts on the default config's data (the streaming hf loader), half on the packed corpus."""

import shutil

import pytest
import torch
from conftest import ON_HF, ON_PACKED, TINY, initial_weights, losses, metric_lines, torchrun, val_losses

pytestmark = pytest.mark.slow

STEPS = 5
# Four blocks so that an interleaved pipeline has two stages per rank; global batch 8 everywhere.
# The validation loss after the last step is compared too.
BASE = [*TINY, "--model.n_layers", "4", "--training.steps", str(STEPS), "--training.global_batch_size", "8",
        "--validation.enable", "true", "--validation.freq", str(STEPS), "--validation.steps", "1"]


def layout(dp_replicate=1, dp_shard=1, tp=1, pp=1, cp=1, local_batch=None, extra=()):
    dp = dp_replicate * dp_shard
    args = [
        "--parallelism.data_parallel_replicate_degree", str(dp_replicate),
        "--parallelism.data_parallel_shard_degree", str(dp_shard),
        "--parallelism.tensor_parallel_degree", str(tp),
        "--parallelism.pipeline_parallel_degree", str(pp),
        "--parallelism.context_parallel_degree", str(cp),
        "--training.local_batch_size", str(local_batch or 8 // dp),
        *extra,
    ]
    return dp_replicate * dp_shard * tp * pp * cp, args


COMPILE = ["--compile.enable", "true"]
SELECTIVE_OP = ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"]

LAYOUTS = {  # name: (processes, arguments), data
    "tp4": (layout(tp=4), "hf"),
    "dp_shard2_tp2": (layout(dp_shard=2, tp=2), "packed"),
    "hsdp_2x2": (layout(dp_replicate=2, dp_shard=2), "hf"),
    "dp_shard4_never_reshard": (layout(dp_shard=4, extra=["--parallelism.fsdp_reshard_after_forward", "never"]),
                                "packed"),
    "pp2_dp_shard2": (layout(pp=2, dp_shard=2, extra=["--parallelism.pipeline_parallel_microbatch_size", "1"]), "hf"),
    "pp2_dp_shard2_interleaved": (layout(pp=2, dp_shard=2,
                                         extra=["--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"]),
                                  "packed"),
    "pp2_tp2": (layout(pp=2, tp=2, extra=["--parallelism.pipeline_parallel_microbatch_size", "2"]), "packed"),
    "cp2_dp_shard2": (layout(cp=2, dp_shard=2), "hf"),
    "cp2_tp2": (layout(cp=2, tp=2), "packed"),
    "dp_shard2_tp2_pp2": (layout(dp_shard=2, tp=2, pp=2, extra=["--parallelism.pipeline_parallel_microbatch_size",
                                                                  "2"]), "hf"),
    "dp_shard2_tp2_cpu_offload": (layout(dp_shard=2, tp=2, extra=["--parallelism.fsdp_cpu_offload", "true"]),
                                  "packed"),
    "pp2_dp_shard2_cpu_offload": (layout(pp=2, dp_shard=2, extra=["--parallelism.fsdp_cpu_offload", "true"]), "hf"),
    # Compiled blocks under TP, whose first takes the eager embedding's output (parallelisms/tensor_parallel.py).
    "tp2_compile": (layout(tp=2, extra=COMPILE), "packed"),
    "dp_shard2_tp2_compile_selective_op": (layout(dp_shard=2, tp=2, extra=[*COMPILE, *SELECTIVE_OP]), "hf"),
}
DATA = {"hf": ON_HF, "packed": ON_PACKED}
"""TINY reads the packed corpus; ON_HF, later on the command line, replaces it by the default config's data."""


def test_tensor_parallel_degree_must_divide_the_heads():
    from components.config import ConfigError
    from models.llama3 import ModelArgs, Transformer
    from models.llama3.parallelize import check_tp_fits

    with torch.device("meta"):
        model = Transformer(ModelArgs(dim=64, n_layers=1, n_heads=8, n_kv_heads=2, vocab_size=32))
    check_tp_fits(model, 2)
    with pytest.raises(ConfigError, match=r"parallelism.tensor_parallel_degree 4 must divide model.n_kv_heads \(2\)"):
        check_tp_fits(model, 4)


@pytest.mark.parametrize("checkpointing", [["--activation_checkpoint.mode", "full"],
                                           ["--activation_checkpoint.mode", "selective"]], ids=["full", "layer"])
def test_compiled_tensor_parallel_that_recomputes_attention_is_refused_on_cpu(checkpointing):
    """torch's compiler misplaces the CPU generator state it saves for the recomputed attention next to
    the DTensor mesh (components/layout_checks.py); CUDA runs it (tests/test_cuda.py)."""
    from components.config import ConfigError, load_config
    from components.distributed import ParallelDims
    from components.layout_checks import check_supported

    config = load_config([*TINY, "--parallelism.tensor_parallel_degree", "2", *COMPILE, *checkpointing])
    dims = ParallelDims.from_config(config.parallelism, world_size=2)
    with pytest.raises(ConfigError, match=r"activation_checkpoint.mode .* with compile.enable and "
                                          r"parallelism.tensor_parallel_degree > 1 does not run on CPU"):
        check_supported(config, dims, torch.device("cpu"))
    check_supported(config, dims, torch.device("cuda"))
    config = load_config([*TINY, "--parallelism.tensor_parallel_degree", "2", *COMPILE, *SELECTIVE_OP])
    check_supported(config, dims, torch.device("cpu"))


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """The single-process runs the layouts are compared with, by data."""
    import train

    dumps = {}
    for data, source in DATA.items():
        dumps[data] = tmp_path_factory.mktemp(f"reference_{data}")
        assert train.main([*BASE, *source, "--training.local_batch_size", "8", "--job.dump_folder",
                           str(dumps[data])]) == 0
    return dumps


@pytest.fixture(scope="module")
def reference(references):
    return references["packed"]


@pytest.mark.parametrize("name", LAYOUTS)
def test_layout_matches_one_process(name, references, tmp_path):
    (nproc, args), data = LAYOUTS[name]
    reference = references[data]
    torchrun(nproc, [*BASE, *DATA[data], *args, "--job.dump_folder", str(tmp_path)])
    got, expected = losses(tmp_path), losses(reference)
    assert sorted(got) == list(range(1, STEPS + 1))
    assert data_hashes(tmp_path) == data_hashes(reference)  # the same token ids in every global batch
    for step, loss in expected.items():
        assert got[step] == pytest.approx(loss, rel=1e-3), (name, step, got[step], loss)
    assert val_losses(tmp_path)[STEPS] == pytest.approx(val_losses(reference)[STEPS], rel=1e-3)
    # The weights' norm is the whole model's whatever the layout: sharded, split into stages or offloaded.
    assert param_norms(tmp_path) == pytest.approx(param_norms(reference), rel=1e-5)


def data_hashes(dump) -> dict[int, int]:
    return {m["step"]: m["data_hash"] for m in metric_lines(dump) if "loss" in m}


def param_norms(dump) -> dict[int, float]:
    return {m["step"]: m["param_norm"] for m in metric_lines(dump) if "loss" in m}


def test_checkpoint_saved_under_fsdp4_resumes_under_tp2_pp2(reference, tmp_path):
    """DCP reshards on load and the data position is global: the loss curve continues."""
    nproc, fsdp4 = layout(dp_shard=4)
    torchrun(nproc, [*BASE, *fsdp4, "--checkpoint.enable", "true", "--checkpoint.interval", "3",
                     "--job.dump_folder", str(tmp_path)])
    shutil.rmtree(tmp_path / "checkpoint" / f"step-{STEPS}")
    (tmp_path / "metrics.jsonl").write_text("")
    nproc, tp2_pp2 = layout(tp=2, pp=2, extra=["--parallelism.pipeline_parallel_microbatch_size", "2"])
    torchrun(nproc, [*BASE, *tp2_pp2, "--checkpoint.enable", "true", "--checkpoint.interval", "3",
                     "--job.dump_folder", str(tmp_path)])
    got, expected = losses(tmp_path), losses(reference)
    assert sorted(got) == list(range(4, STEPS + 1))
    for step in got:
        assert got[step] == pytest.approx(expected[step], rel=1e-3), (step, got[step], expected[step])


def test_the_initial_weights_are_the_same_bits_under_every_layout_and_with_cpu_offload(tmp_path, train_in_process):
    """A function of the config and the seed alone: one process, FSDP 2 with CPU offload, TP 2 and PP 2 start from
    bitwise the same weights (a step at lr 0 leaves them as they were drawn, for its checkpoint to show)."""
    args = [*BASE, "--training.steps", "1", "--optimizer.lr", "0", "--checkpoint.enable", "true",
            "--checkpoint.interval", "1", "--validation.enable", "false"]
    one = tmp_path / "one"
    assert train_in_process([*args, "--training.local_batch_size", "8", "--job.dump_folder", str(one)]) == 0
    reference = initial_weights(one)
    for name, (nproc, extra) in {"fsdp2_offload": layout(dp_shard=2, extra=["--parallelism.fsdp_cpu_offload", "true"]),
                                 "tp2": layout(tp=2), "pp2": layout(pp=2)}.items():
        torchrun(nproc, [*args, *extra, "--job.dump_folder", str(tmp_path / name)])
        weights = initial_weights(tmp_path / name)
        assert weights.keys() == reference.keys()
        assert all(torch.equal(weights[k], reference[k]) for k in reference), name
