"""Qwen3.5, dense and mixture-of-experts, a hybrid of Gated DeltaNet and gated attention: the same logits as
transformers' Qwen3_5ForCausalLM and Qwen3_5MoeForCausalLM through the converter (import and export) and
load_hf_weights, tied and untied; the published sizes; honest FLOPs; one-line refusals; and every layout against one
process on the shipped corpus: FSDP, HSDP, TP with and without sequence parallelism (both layer kinds split by
heads), PP, EP, CP by each method for attention, the DeltaNet layers' state passed between the ranks in sequence
order or their heads shared out by all-to-all, also on documents and at degree 4, activation checkpointing and
compile.

Every comparison of logits prints its relative error and largest absolute difference (run with -s)."""

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import TINY, layout, losses, metric_lines, torchrun_runs
from test_qwen3 import VOCAB, relative_error, report, run_hf, token_ids, transformers_module

import models.qwen3_5 as qwen3_5
from components.checkpoint.dcp import ModelState
from components.config import ConfigError, load_config
from components.hf.load import load_hf_weights
from models.families import load_hf_model, model_config_class
from models.qwen3_5.model import FULL, LINEAR
from models.qwen3_5.parallelize import check_tp_fits
from scripts import hf as converter

DENSE = [*TINY, "--job.config_file", "debug_qwen3_5.toml"]  # the last config file is the one read
MOE = [*TINY, "--job.config_file", "debug_qwen3_5_moe.toml"]
# Two blocks, one of each kind: DeltaNet then full attention.
HYBRID = ["--model.full_attention_interval", "2"]
SHAPE = [*HYBRID, "--model.dim", "64", "--model.ffn_dim", "96", "--training.seq_len", "160"]
SMALL = {"dense": [*DENSE, *SHAPE], "moe": [*MOE, *SHAPE, "--moe.num_experts", "4", "--moe.hidden_dim", "32"]}
SMALL_HF = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=64, linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=32,
    linear_value_head_dim=32, layer_types=[LINEAR, FULL], rms_norm_eps=1e-6, max_position_embeddings=160,
    rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
)
SMALL_MOE_HF = {k: v for k, v in SMALL_HF.items() if k != "intermediate_size"} | dict(
    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
MULTIMODAL = "multimodal"
"""In an HF config of CASES: save it as the published checkpoints are, the text decoder of a multimodal model."""
CASES = {  # ingot config, HF config
    "dense": (SMALL["dense"], SMALL_HF),
    "dense-tied": ([*SMALL["dense"], "--model.tie_embeddings", "true"], SMALL_HF | {"tie_word_embeddings": True}),
    "moe": (SMALL["moe"], SMALL_MOE_HF),
    "dense-multimodal-tied": ([*SMALL["dense"], "--model.tie_embeddings", "true"],
                              SMALL_HF | {"tie_word_embeddings": True, MULTIMODAL: True}),
    "moe-multimodal": (SMALL["moe"], SMALL_MOE_HF | {MULTIMODAL: True}),
}
TINY_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                   num_position_embeddings=16)


@torch.no_grad()
def randomize(model: torch.nn.Module) -> None:
    """Weights larger than either initialization, so that every part shapes the logits (the gates, the convolution,
    the decay, the routers' choices); norms away from their initial scale."""
    for name, p in model.named_parameters():
        if "norm" in name:
            p.add_(0.1 * torch.randn_like(p))
        elif not name.endswith(("A_log", "dt_bias")):
            p.normal_(0, 1.0 if "embed" in name else 1.5 * p.shape[-1] ** -0.5)


def hf_qwen3_5(folder: Path, config: dict) -> tuple[Path, torch.Tensor]:
    """A random Qwen3_5ForCausalLM (Qwen3_5MoeForCausalLM with num_experts) saved with save_pretrained, and its
    logits on token_ids. With MULTIMODAL, a Qwen3_5(Moe)ForConditionalGeneration laid out as the published
    checkpoints are: the decoder under model.language_model., a tiny vision tower beside it, and a multi-token
    prediction layer's tensors in a file of their own (which transformers leaves out, and so must ingot)."""
    assert transformers_module()  # imported for its version check
    moe = "num_experts" in config
    qwen = pytest.importorskip("transformers.models.qwen3_5_moe" if moe else "transformers.models.qwen3_5")
    text = {k: v for k, v in config.items() if k != MULTIMODAL}
    text_config = qwen.Qwen3_5MoeTextConfig(**text) if moe else qwen.Qwen3_5TextConfig(**text)
    torch.manual_seed(0)
    if MULTIMODAL in config:
        vision = (qwen.Qwen3_5MoeVisionConfig if moe else qwen.Qwen3_5VisionConfig)(**TINY_VISION)
        whole = (qwen.Qwen3_5MoeConfig if moe else qwen.Qwen3_5Config)(
            text_config=text_config, vision_config=vision, tie_word_embeddings=text_config.tie_word_embeddings)
        model = (qwen.Qwen3_5MoeForConditionalGeneration if moe else qwen.Qwen3_5ForConditionalGeneration)(whole)
    else:
        model = (qwen.Qwen3_5MoeForCausalLM if moe else qwen.Qwen3_5ForCausalLM)(text_config)
    randomize(model)
    model.save_pretrained(folder)
    if MULTIMODAL in config:
        from safetensors import safe_open
        from safetensors.torch import save_file

        with safe_open(folder / "model.safetensors", framework="pt") as f:
            assert {n.split(".")[1] for n in f.keys() if n.startswith("model.")} == {"language_model", "visual"}
        save_file({"mtp.fc.weight": torch.randn(64, 128), "mtp.norm.weight": torch.ones(64)},
                  folder / "mtp.safetensors")
    with torch.no_grad():
        return folder, model.eval()(token_ids(seq=150)).logits


def transformers_logits(folder: Path, ids: torch.Tensor) -> torch.Tensor:
    model = transformers_module().AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        return model(ids).logits


def ingot_model(argv: list[str], checkpoint: Path | None = None) -> torch.nn.Module:
    torch.manual_seed(0)
    with torch.device("meta"):
        model = qwen3_5.Transformer(qwen3_5.build_model_args(load_config(argv, model_config_class), VOCAB))
    model.to_empty(device="cpu")
    model.init_weights()
    if checkpoint is not None:
        with converter.one_process():
            dcp.load({"model": ModelState([model])}, checkpoint_id=str(checkpoint), no_dist=True)
    return model.eval()


@pytest.mark.parametrize("case", CASES)
def test_hf_qwen3_5_imports_and_exports_with_the_same_logits(tmp_path, case):
    """A random transformers model: load_hf_model, the import command, load_hf_weights (as a training run loads an
    HF folder: DeltaNet's joined q, k, v and convolution written back into their parts), and the export of the
    imported checkpoint read back by transformers, all with its logits."""
    argv, hf = CASES[case]
    source, reference = hf_qwen3_5(tmp_path / "hf", hf)
    ids = token_ids(seq=150)  # more than one chunk of the delta rule
    run_hf("import", *argv, "--hf", source, "--output", tmp_path / "dcp")
    run_hf("export", *argv, "--checkpoint", tmp_path / "dcp", "--output", tmp_path / "back")
    in_place = ingot_model(argv)
    with converter.one_process():
        load_hf_weights(source, [in_place], qwen3_5, in_place.args)
    with torch.no_grad():
        errors = (report(f"HF Qwen3.5 {case} -> ingot, load_hf_model", load_hf_model(source)(ids), reference),
                  report(f"HF Qwen3.5 {case} -> ingot, import", ingot_model(argv, tmp_path / "dcp")(ids), reference),
                  report(f"HF Qwen3.5 {case} -> ingot, load_hf_weights", in_place(ids), reference),
                  report(f"HF Qwen3.5 {case} -> ingot -> HF", transformers_logits(tmp_path / "back", ids), reference))
    assert max(errors) < 1e-4
    assert json.loads((tmp_path / "back" / "config.json").read_text())["ingot_model"] == "qwen3_5"

    # The test sees the DeltaNet layer's convolution: without it the logits move far more.
    plain = load_hf_model(source)
    plain.layers["0"].attention.conv_v.data.zero_()
    with torch.no_grad():
        assert relative_error(plain(ids), reference) > 1e-3


def test_published_flavors_are_shapes_transformers_accepts():
    """hf_config of every published flavor builds the HF model (on the meta device), whose weights map onto the
    ingot model's shapes; the parameter count is the name's; config.json's fields map back to the flavor."""
    transformers = transformers_module()
    for flavor in ("27B", "35B-A3B"):
        args = qwen3_5.flavors[flavor]
        with torch.device("meta"):
            ours = qwen3_5.Transformer(args)
            theirs = transformers.AutoModelForCausalLM.from_config(
                transformers.AutoConfig.for_model(**qwen3_5.hf_config(args)))
        mapped = qwen3_5.from_hf(theirs.state_dict(), args)
        assert {k: v.shape for k, v in mapped.items()} == {k: v.shape for k, v in ours.state_dict().items()}
        billions = sum(p.numel() for p in ours.parameters()) / 1e9
        print(f"\nQwen3.5 {flavor}: {billions:.2f}B parameters")
        assert billions == pytest.approx(float(flavor.split("B")[0]), rel=0.1), billions
        assert qwen3_5.model_args_from_hf(qwen3_5.hf_config(args)) == args


def test_float8_converts_the_projections_and_keeps_the_gates_and_the_router():
    """Emulated on a CPU, at the published 27B-A3B's head counts (a DeltaNet layer's wa and wb, one row per value head,
    are float8-sized there): both layer kinds' projections and the experts' feed-forwards become Float8Linear; the
    router, the shared expert's gate and DeltaNet's decay and write-strength inputs (wa, wb) stay nn.Linear."""
    from models.qwen3_5.parallelize import KEPT_IN_HIGH_PRECISION
    from parallelisms.float8 import convert_to_float8

    config = load_config([*SMALL["moe"], "--float8.enable", "true", "--model.linear_n_key_heads", "16",
                          "--model.linear_n_value_heads", "32"], model_config_class)
    with torch.device("meta"):
        model = qwen3_5.Transformer(qwen3_5.build_model_args(config, VOCAB))
    convert_to_float8(model, "tensorwise", [*config.float8.filter_fqns, *KEPT_IN_HIGH_PRECISION], torch.device("cpu"))
    kinds = {name: type(module).__name__ for name, module in model.named_modules()}
    converted = [f"layers.0.attention.{p}" for p in ("wq", "wk", "wv", "wz", "wo")] + \
        [f"layers.1.attention.{p}" for p in ("wq", "wk", "wv", "wo")] + \
        [f"layers.0.feed_forward.shared_experts.{p}" for p in ("w1", "w2", "w3")]
    assert {kinds[name] for name in converted} == {"Float8Linear"}
    assert model.layers["0"].attention.wa.out_features % 16 == 0  # float8-sized, kept all the same
    kept = ["layers.0.attention.wa", "layers.0.attention.wb", "layers.0.feed_forward.router.gate",
            "layers.0.feed_forward.shared_gate", "output"]
    assert {kinds[name] for name in kept} == {"Linear"}


def test_flops_grow_with_the_context_in_the_full_attention_layers_only():
    """MFU's count: a DeltaNet layer costs the same per token at any context, a full-attention layer 12 x heads x
    head_dim more per token of context; the 35B-A3B activates about 3B parameters a token."""
    for args in (qwen3_5.flavors["27B"], qwen3_5.flavors["35B-A3B"]):
        full = sum(args.layer_type(i) == FULL for i in range(args.n_layers))
        assert full == args.n_layers // 4
        grows = args.flops_per_token(32768) - args.flops_per_token(4096)
        assert grows == 12 * full * args.n_heads * args.head_dim * (32768 - 4096)
    moe = qwen3_5.flavors["35B-A3B"]
    active = (moe.flops_per_token(0) - 6 * moe.dim * moe.vocab_size) / 6
    assert 2.5e9 < active + moe.dim * moe.vocab_size < 3.6e9, active


def test_a_degree_that_does_not_split_the_delta_net_heads_is_refused(train_in_process, tmp_path, capsys):
    """The heads' check that parallelize runs before tensor parallelism (multi-process runs show it as this one
    line), and a value-head count that the key heads do not divide, at start-up."""
    argv = [*DENSE, *HYBRID, "--model.linear_n_value_heads", "6", "--model.linear_n_key_heads", "3"]
    with torch.device("meta"):
        model = qwen3_5.Transformer(qwen3_5.build_model_args(load_config(argv, model_config_class), VOCAB))
    with pytest.raises(ConfigError, match=r"^parallelism.tensor_parallel_degree 2 must divide "
                                          r"model.linear_n_key_heads \(3\)$"):
        check_tp_fits(model, 2)
    assert train_in_process([*DENSE, "--model.linear_n_value_heads", "6", "--job.dump_folder", str(tmp_path)]) == 2
    assert "model.linear_n_value_heads 6 is not a multiple of model.linear_n_key_heads 4" in capsys.readouterr().err


STEPS = 4
DOCUMENTS = ["--training.document_masking", "true"]
METHOD = "--parallelism.context_parallel_method"
MIXERS = ["--parallelism.context_parallel_mixers", "alltoall"]  # the DeltaNet layers' heads shared out, not the state
LAYOUTS = {
    "dense": {
        "one_process": layout(), "one_process_documents": layout(extra=DOCUMENTS),
        "fsdp2": layout(dp_shard=2), "hsdp_2x2": layout(dp_replicate=2, dp_shard=2),
        "tp2": layout(tp=2),
        "tp2_no_sequence_parallel": layout(tp=2, extra=["--parallelism.sequence_parallel", "false"]),
        "cp2_allgather": layout(cp=2), "cp2_ring_mixers_alltoall": layout(cp=2, extra=[METHOD, "ring", *MIXERS]),
        "cp2_alltoall_documents": layout(cp=2, extra=[METHOD, "alltoall", *DOCUMENTS]),
        "cp2_documents_mixers_alltoall": layout(cp=2, extra=[*MIXERS, *DOCUMENTS]),
        "cp4_ring_documents": layout(cp=4, extra=[METHOD, "ring", *DOCUMENTS]),
        "cp2_tp2_documents": layout(cp=2, tp=2, extra=DOCUMENTS),
        "pp2_documents": layout(pp=2, extra=DOCUMENTS),
        "ac_by_op": layout(extra=["--activation_checkpoint.mode", "selective",
                                  "--activation_checkpoint.selective_ac_option", "op"]),
        "compiled_cp2": layout(cp=2, extra=["--compile.enable", "true"]),
    },
    "moe": {
        "one_process": layout(), "ep2": layout(dp_shard=2, ep=2), "tp2": layout(tp=2),
        "cp2_alltoall": layout(cp=2, extra=[METHOD, "alltoall"]),
    },
}
FROM_HF = {  # runs that start from a random HF folder laid out as the published checkpoints: its case of CASES
    "dense-multimodal-tied": {"one_process": layout(), "fsdp2": layout(dp_shard=2), "tp2": layout(tp=2)},
    "moe-multimodal": {"one_process": layout(), "ep2": layout(dp_shard=2, ep=2)},
}


@pytest.fixture(scope="module")
def layout_runs(tmp_path_factory):
    runs = {}
    for model, layouts in LAYOUTS.items():
        common = [*(DENSE if model == "dense" else MOE), *HYBRID, "--training.steps", str(STEPS),
                  "--training.global_batch_size", "8"]
        runs |= {f"{model}_{name}": (nproc, [*common, *args]) for name, (nproc, args) in layouts.items()}
    for case, layouts in FROM_HF.items():
        argv, config = CASES[case]
        source, _ = hf_qwen3_5(tmp_path_factory.mktemp(case), config)
        common = [*argv, "--training.steps", str(STEPS), "--training.global_batch_size", "8",
                  "--checkpoint.initial_load_path", str(source)]
        runs |= {f"{case}_{name}": (nproc, [*common, *args]) for name, (nproc, args) in layouts.items()}
    return torchrun_runs(runs, tmp_path_factory.mktemp("qwen3_5_layouts"))


@pytest.mark.slow
@pytest.mark.parametrize("run", [f"{model}_{name}" for model, layouts in LAYOUTS.items() for name in layouts
                                 if not name.startswith("one_process")])
def test_every_layout_trains_the_losses_of_one_process(layout_runs, run):
    folder, problem = layout_runs[run]
    assert not problem, problem
    reference = "one_process_documents" if "documents" in run else "one_process"
    one, parallel = losses(layout_runs[f"{run.split('_')[0]}_{reference}"][0]), losses(folder)
    print(f"\nQwen3.5 {run}: " + ", ".join(f"{one[s]:.6f}/{parallel[s]:.6f}" for s in sorted(one)))
    assert sorted(parallel) == list(range(1, STEPS + 1)) and parallel == pytest.approx(one, rel=1e-5)
    if run.startswith("moe"):  # the same tokens went to the same experts
        tallies = [[r["moe_max_load"] for r in metric_lines(f)] for f in (layout_runs["moe_one_process"][0], folder)]
        assert tallies[0] == pytest.approx(tallies[1], rel=1e-6)
    if "documents" in run:  # the documents changed the losses: the state and the convolution restart
        assert one != pytest.approx(losses(layout_runs["dense_one_process"][0]), rel=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize(("case", "name"), [(case, name) for case, layouts in FROM_HF.items() for name in layouts
                                            if name != "one_process"])
def test_training_from_a_published_style_hf_folder_trains_the_losses_of_one_process(layout_runs, case, name):
    """--checkpoint.initial_load_path HFDIR of a multimodal folder: each rank reads its part of the text decoder
    (DeltaNet's joined q, k, v and convolutions split into their TP shards), and trains as one process does."""
    (folder, problem), (alone, alone_problem) = layout_runs[f"{case}_{name}"], layout_runs[f"{case}_one_process"]
    assert not problem and not alone_problem, problem or alone_problem
    one, parallel = losses(alone), losses(folder)
    print(f"\nQwen3.5 from an HF {case} folder, {name}: " + ", ".join(f"{one[s]:.6f}/{parallel[s]:.6f}"
                                                                       for s in sorted(one)))
    assert sorted(parallel) == list(range(1, STEPS + 1)) and parallel == pytest.approx(one, rel=1e-5)
    initialized = losses(layout_runs[f"{case.split('-')[0]}_one_process"][0])  # ingot's initialization: 8.8
    assert one[1] > initialized[1] + 0.5  # the random HF weights (larger than an initialization's) gave it
