"""DeepSeek-V3: the same logits as transformers' DeepseekV3ForCausalLM through load_hf_model and the converter (both
directions: q and kv LoRA or a plain query projection, YaRN, interleaved or rotate-half RoPE, groups, a dense first
block, shared experts, nonzero correction biases), exact round trips, the published shapes and one-line refusals;
and training under every layout on 2 and 4 gloo processes as one process does: losses to 1e-5, gradient norms and
the routing tally (CPU fp32; on the default config's data, the packed corpus and its documents).

Every comparison of logits prints its relative error and largest absolute difference (run with -s)."""

import json
from functools import partial

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import ON_HF, ON_PACKED, layout, reference_runs, step_figures, torchrun_runs
from test_qwen3 import (
    ingot_model as family_model,
    randomize,
    relative_error,
    report,
    run_hf,
    token_ids,
    transformers_module,
)

import models.deepseek_v3 as deepseek_v3
from components.checkpoint.dcp import ModelState
from components.config import load_config
from components.hf.load import read_hf_weights
from models.families import load_hf_model, model_config_class
from scripts import hf as converter

VOCAB = 4096  # the shipped tokenizer's
# One small model as an ingot config and as an HF config: values narrower than queries/keys, 8 experts in 4 groups.
SMALL = ["--job.config_file", "debug_deepseek_v3.toml", *ON_PACKED, "--training.seq_len", "64",
         "--model.n_layers", "3", "--model.dim", "64", "--model.n_heads", "4", "--model.ffn_dim", "128",
         "--model.q_lora_rank", "48", "--model.kv_lora_rank", "32", "--model.qk_nope_head_dim", "32",
         "--model.qk_rope_head_dim", "16", "--model.v_head_dim", "24", "--model.rope_factor", "4",
         "--moe.num_experts", "8", "--moe.top_k", "3", "--moe.hidden_dim", "32"]
SMALL_HF = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, routed_scaling_factor=2.5,
    kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16, v_head_dim=24, qk_nope_head_dim=32, n_group=4,
    topk_group=2, num_experts_per_tok=3, first_k_dense_replace=1, norm_topk_prob=True, max_position_embeddings=256,
    rope_theta=10000.0, rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096,
                                      "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1},
    bos_token_id=1, eos_token_id=2,
)
CASES = {  # HF config; an ingot config to import it into (None: only through load_hf_model)
    "q_lora-interleaved": (SMALL_HF, SMALL),
    "plain_q-rotate_half-mscales": (SMALL_HF | dict(
        q_lora_rank=None, rope_interleave=False,
        rope_scaling=SMALL_HF["rope_scaling"] | {"mscale": 0.9, "mscale_all_dim": 0.7}), None),
}


def hf_deepseek_v3(folder, config: dict):
    """A random DeepseekV3ForCausalLM with nonzero routing correction biases, saved with save_pretrained."""
    transformers = transformers_module()
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**config))
    randomize(model)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.1 * torch.randn_like(buffer))
    model.save_pretrained(folder)
    return folder


def transformers_logits(folder, ids: torch.Tensor) -> torch.Tensor:
    model = transformers_module().AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        return model(ids).logits


ingot_model = partial(family_model, package=deepseek_v3)


@pytest.mark.parametrize("case", CASES)
def test_random_hf_deepseek_v3_imports_with_the_same_logits(tmp_path, case):
    hf, argv = CASES[case]
    source = hf_deepseek_v3(tmp_path / "hf", hf)
    reference = transformers_logits(source, token_ids())
    with torch.no_grad():
        loaded = load_hf_model(source)
        assert report(f"HF DeepSeek-V3 {case} -> ingot, load_hf_model", loaded(token_ids()), reference) < 1e-5
        # The comparison sees the routing biases and YaRN's softmax scale: without either the logits move.
        for block in list(loaded.layers.values())[1:]:
            block.feed_forward.expert_bias.zero_()
        assert relative_error(loaded(token_ids()), reference) > 1e-3
    if argv is not None:
        run_hf("import", *argv, "--hf", source, "--output", tmp_path / "dcp")
        with torch.no_grad():
            imported = ingot_model(argv, tmp_path / "dcp")
            assert report(f"HF DeepSeek-V3 {case} -> ingot, import", imported(token_ids()), reference) < 1e-5
            plain_rope = ingot_model([*argv, "--model.rope_factor", "1"], tmp_path / "dcp")
            assert relative_error(plain_rope(token_ids()), reference) > 1e-3


def test_export_gives_transformers_the_same_logits_and_round_trips_bit_exact(tmp_path):
    """Random ingot weights (routing biases included) exported and read by transformers; then HF -> ingot -> HF
    gives back the files' tensors and config."""
    model = ingot_model(SMALL)
    torch.manual_seed(1)
    randomize(model)
    with torch.no_grad():
        for block in list(model.layers.values())[1:]:
            block.feed_forward.expert_bias.normal_(0, 0.1)
    with converter.one_process():
        dcp.save({"model": ModelState([model])}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    run_hf("export", *SMALL, "--checkpoint", tmp_path / "dcp", "--output", tmp_path / "hf")
    with torch.no_grad():
        ours = model(token_ids())
    assert report("ingot DeepSeek-V3 -> HF export", ours, transformers_logits(tmp_path / "hf", token_ids())) < 1e-5

    run_hf("import", *SMALL, "--hf", tmp_path / "hf", "--output", tmp_path / "dcp2")
    run_hf("export", *SMALL, "--checkpoint", tmp_path / "dcp2", "--output", tmp_path / "back")
    before, after = read_hf_weights(tmp_path / "hf"), read_hf_weights(tmp_path / "back")
    assert "model.layers.2.mlp.gate.e_score_correction_bias" in after
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in after
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert config["ingot_model"] == "deepseek_v3" and config["rope_scaling"]["factor"] == 4.0


def test_published_shapes_and_their_configs():
    """671B and the 16B (DeepSeek-V2-Lite's shape) count their published parameters; DeepSeek-V3's config.json maps
    onto the 671B flavor, with its YaRN settings."""
    counts = {}
    for name in ("16B", "671B"):
        with torch.device("meta"):
            model = deepseek_v3.Transformer(deepseek_v3.flavors[name])
        counts[name] = sum(p.numel() for p in model.parameters())
    with torch.device("meta"):
        counts["kimi_k2"] = sum(p.numel() for p in deepseek_v3.Transformer(deepseek_v3.flavors["kimi_k2"]).parameters())
    assert counts == {"16B": 15_706_484_224, "671B": 671_026_404_352, "kimi_k2": 1_026_408_209_408}
    published = {  # DeepSeek-V3's config.json, as published
        "model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
        "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_nextn_predict_layers": 1,
        "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
        "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
        "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4,
        "num_experts_per_tok": 8, "first_k_dense_replace": 3, "norm_topk_prob": True, "scoring_func": "sigmoid",
        "hidden_act": "silu", "max_position_embeddings": 163840, "rms_norm_eps": 1e-06, "rope_theta": 10000,
        "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "original_max_position_embeddings": 4096, "type": "yarn"},
        "tie_word_embeddings": False, "attention_bias": False,
    }
    args = deepseek_v3.model_args_from_hf(published)
    assert args == deepseek_v3.flavors["671B"].__class__(**{**vars(deepseek_v3.flavors["671B"]),
                                                               "max_seq_len": 163840})
    assert args.softmax_scale_factor == pytest.approx((0.1 * torch.tensor(40.0).log().item() + 1) ** 2)
    kimi_k2 = published | {  # Kimi K2's config.json, as released (its fields that differ from DeepSeek-V3's)
        "model_type": "kimi_k2", "vocab_size": 163840, "num_nextn_predict_layers": 0, "num_attention_heads": 64,
        "num_key_value_heads": 64, "n_routed_experts": 384, "routed_scaling_factor": 2.827, "n_group": 1,
        "topk_group": 1, "first_k_dense_replace": 1, "max_position_embeddings": 131072, "rope_theta": 50000.0,
        "rope_scaling": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "original_max_position_embeddings": 4096, "type": "yarn"},
    }
    assert deepseek_v3.model_args_from_hf(kimi_k2) == deepseek_v3.flavors["kimi_k2"].__class__(
        **{**vars(deepseek_v3.flavors["kimi_k2"]), "max_seq_len": 131072})


# Kimi K2's shape, small: its flavor's YaRN (beta 1 and 1 over RoPE base 50000) and routing (one group, scale 2.827,
# one dense block), the dimensions cut; as an HF config.json the way its release writes it.
KIMI = ["--job.config_file", "debug_deepseek_v3.toml", *ON_PACKED, "--model.flavor", "kimi_k2", "--model.n_layers",
        "3", "--model.dim", "64", "--model.n_heads", "4", "--model.ffn_dim", "128", "--model.q_lora_rank", "48",
        "--model.kv_lora_rank", "32", "--model.qk_nope_head_dim", "32", "--model.qk_rope_head_dim", "16",
        "--model.v_head_dim", "24", "--model.vocab_size", str(VOCAB), "--moe.num_experts", "8", "--moe.top_k", "3",
        "--moe.hidden_dim", "32"]
KIMI_HF = SMALL_HF | dict(
    n_group=1, topk_group=1, routed_scaling_factor=2.827, rope_theta=50000.0, max_position_embeddings=131072,
    rms_norm_eps=1e-6, rope_scaling={"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
                                     "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 1.0, "beta_slow": 1.0})


def as_kimi_k2_release(folder):
    """config.json as Kimi K2's release has it: model_type kimi_k2, its auto_map naming DeepSeek-V3's code."""
    config = json.loads((folder / "config.json").read_text())
    config |= {"model_type": "kimi_k2", "auto_map": {
        "AutoConfig": "configuration_deepseek.DeepseekV3Config",
        "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"}}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_kimi_k2_s_release_form_imports_and_exports_with_transformers_logits(tmp_path):
    """A random DeepseekV3ForCausalLM of Kimi K2's shape (small) in the release's form reads into the kimi_k2 flavor
    with transformers' logits, through load_hf_model and the converter; exported, it is a deepseek_v3 folder
    (the model_type transformers knows) with the same logits, and HF -> ingot -> HF gives back its tensors."""
    source = hf_deepseek_v3(tmp_path / "hf", KIMI_HF)
    reference = transformers_logits(source, token_ids())
    as_kimi_k2_release(source)
    with torch.no_grad():
        loaded = load_hf_model(source)(token_ids())
        assert report("HF Kimi K2 (small) -> ingot, load_hf_model", loaded, reference) < 1e-5
    run_hf("import", *KIMI, "--hf", source, "--output", tmp_path / "dcp")
    with torch.no_grad():
        imported = ingot_model(KIMI, tmp_path / "dcp")
        assert report("HF Kimi K2 (small) -> ingot, import", imported(token_ids()), reference) < 1e-5
        # The flavor's own settings count: the debug model's YaRN betas (32 and 1), routing scale and groups.
        other = ingot_model([*KIMI, "--model.flavor", "debugmodel", "--model.rope_factor", "32", "--model.rope_theta",
                             "50000"], tmp_path / "dcp")
        assert relative_error(other(token_ids()), reference) > 1e-3
    run_hf("export", *KIMI, "--checkpoint", tmp_path / "dcp", "--output", tmp_path / "back")
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert (config["model_type"], config["routed_scaling_factor"], config["rope_scaling"]["beta_fast"]) == (
        "deepseek_v3", 2.827, 1.0)
    assert report("ingot Kimi K2 (small) -> HF export", transformers_logits(tmp_path / "back", token_ids()),
                  reference) < 1e-5
    before, after = read_hf_weights(source), read_hf_weights(tmp_path / "back")
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_a_model_without_a_hugging_face_form_is_refused_in_one_line(tmp_path):
    """The 16B flavor routes by softmax (DeepSeek-V2-Lite's rule), which DeepseekV3ForCausalLM cannot."""
    with pytest.raises(ValueError, match=r"^DeepseekV3ForCausalLM routes by sigmoid: this model's experts "
                                         r"\(score_func softmax\) have no Hugging Face form$"):
        deepseek_v3.hf_config(deepseek_v3.flavors["16B"])


STEPS = 3
# A tiny DeepSeek-V3: q LoRA, values narrower than queries/keys, two dense blocks then two MoE ones (8 experts in 4
# groups, a shared one); four blocks, for a V-shaped pipeline's two stages per rank; under 1F1B the first stage's
# ranks hold no MoE layer.
BASE = ["--job.config_file", "debug_deepseek_v3.toml", *ON_PACKED, "--training.seq_len", "64",
        "--model.n_layers", "4", "--model.first_dense_layers", "2", "--model.dim", "64", "--model.n_heads", "4",
        "--model.ffn_dim", "128",
        "--model.q_lora_rank", "32", "--model.kv_lora_rank", "32", "--model.qk_nope_head_dim", "16",
        "--model.qk_rope_head_dim", "16", "--model.v_head_dim", "8", "--moe.hidden_dim", "32",
        "--lr_scheduler.warmup_steps", "2", "--checkpoint.enable", "false", "--metrics.enable_tensorboard", "false",
        "--training.steps", str(STEPS), "--training.global_batch_size", "8", "--metrics.log_freq", "1"]


def schedule(name: str, microbatch: int = 1) -> list[str]:
    return ["--parallelism.pipeline_parallel_schedule", name,
            "--parallelism.pipeline_parallel_microbatch_size", str(microbatch)]


def method(name: str) -> list[str]:
    return ["--parallelism.context_parallel_method", name]


SELECTIVE_OP = ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"]
LAYOUTS = {  # name: (processes, arguments), data
    "hsdp_2x2_ep2": (layout(dp_replicate=2, dp_shard=2, ep=2), "hf"),
    "dp_shard2_tp2_ep2_mtp": (layout(dp_shard=2, tp=2, ep=2), "mtp"),
    "pp2_dp_shard2_ep2_dualpipev": (layout(pp=2, dp_shard=2, ep=2, extra=schedule("DualPipeV")), "hf"),
    "pp2_tp2_1f1b": (layout(pp=2, tp=2, extra=schedule("1F1B", 2)), "packed"),
    # The other schedules, on 2 stages (the generic checks of each: tests/test_pipeline.py).
    **{f"pp2_{name}": (layout(pp=2, extra=schedule(name, 2)), "packed")
       for name in ("GPipe", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble")},
    "cp2_tp2_ring_documents": (layout(cp=2, tp=2, extra=method("ring")), "documents"),
    "cp2_allgather_documents_full_ac": (layout(cp=2, extra=["--activation_checkpoint.mode", "full"]), "documents"),
    "cp2_alltoall": (layout(cp=2, extra=method("alltoall")), "hf"),
    "dp_shard2_ep2_compile_selective_op_mtp": (layout(dp_shard=2, ep=2, extra=["--compile.enable", "true",
                                                                              *SELECTIVE_OP]), "mtp"),
    "tp2_compile_selective_2": (layout(tp=2, extra=["--compile.enable", "true", "--activation_checkpoint.mode",
                                                     "selective"]), "hf"),
}
DATA = {"hf": ON_HF, "packed": [],
        "documents": ["--training.document_masking", "true", "--model.rope_per_document", "true"],
        "mtp": ["--model.num_mtp_layers", "1"]}
"""BASE reads the packed corpus; ON_HF, later on the command line, replaces it by the default config's data;
documents: the packed corpus with attention and RoPE positions kept within each document; mtp: the packed corpus, a
model with one depth of multi-token prediction."""


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    return reference_runs(tmp_path_factory, BASE, DATA)


@pytest.fixture(scope="module")
def layout_runs(tmp_path_factory):
    runs = {name: (nproc, [*BASE, *DATA[data], *args]) for name, ((nproc, args), data) in LAYOUTS.items()}
    return torchrun_runs(runs, tmp_path_factory.mktemp("layouts"))


@pytest.mark.slow
@pytest.mark.parametrize("name", LAYOUTS)
def test_deepseek_v3_layout_matches_one_process(name, references, layout_runs):
    """Losses to 1e-5, the same token ids, gradient norms, and the routing tally's figures (its biases moved by
    the counts of all ranks). The auxiliary loss, logged though its weight is 0 here, measures balance over what
    each rank's experts see: part of each sequence under tensor or context parallelism, where training with it is
    refused (components/model/layout_checks.py)."""
    dump, problem = layout_runs[name]
    assert not problem, problem
    got, expected = step_figures(dump), step_figures(references[LAYOUTS[name][1]])
    assert sorted(got) == list(range(1, STEPS + 1))
    for step, reference in expected.items():
        assert got[step]["data_hash"] == reference["data_hash"]
        assert got[step]["loss"] == pytest.approx(reference["loss"], rel=1e-5), (name, step)
        assert got[step]["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-4), (name, step)
        assert got[step]["moe_max_load"] == pytest.approx(reference["moe_max_load"], rel=1e-5), (name, step)
        if "mtp" in name:
            assert got[step]["mtp_loss"] == pytest.approx(reference["mtp_loss"], rel=1e-5), (name, step)
        if "tp" not in name and "cp" not in name:  # where each rank's experts see whole sequences
            assert got[step]["moe_aux_loss"] == pytest.approx(reference["moe_aux_loss"], rel=1e-4), (name, step)


def test_float8_converts_the_head_projections_and_keeps_the_latent_ones_and_the_routers():
    """Emulated on a CPU: the column- and row-wise projections of the heads and the experts' feed-forwards of the
    dense blocks become Float8Linear; the low-rank latent projections and the routers stay nn.Linear."""
    from models.deepseek_v3.parallelize import KEPT_IN_HIGH_PRECISION
    from parallelisms.float8 import convert_to_float8

    config = load_config([*SMALL, "--float8.enable", "true"], model_config_class)
    with torch.device("meta"):
        model = deepseek_v3.Transformer(deepseek_v3.build_model_args(config, VOCAB))
    convert_to_float8(model, "tensorwise", [*config.float8.filter_fqns, *KEPT_IN_HIGH_PRECISION], torch.device("cpu"))
    kinds = {name: type(module).__name__ for name, module in model.named_modules()}
    assert {kinds[f"layers.1.attention.{name}"] for name in ("wq_b", "wkv_b", "wo")} == {"Float8Linear"}
    assert kinds["layers.0.feed_forward.w1"] == "Float8Linear"
    assert {kinds["layers.1.attention.wq_a"], kinds["layers.1.attention.wkv_a"],
            kinds["layers.1.feed_forward.router.gate"], kinds["output"]} == {"Linear"}


def check_layout(argv: list[str]) -> None:
    """The start-up check of the model of `argv` (built on the meta device) for its layout on 2 ranks."""
    from components.distributed.mesh import ParallelDims
    from components.model.layout_checks import check_model_supported

    config = load_config(argv, model_config_class)
    with torch.device("meta"):
        model = deepseek_v3.Transformer(deepseek_v3.build_model_args(config, VOCAB))
    check_model_supported(config, ParallelDims.from_config(config.parallelism, 2), model)


def test_the_auxiliary_loss_under_tensor_parallelism_is_refused_in_one_line():
    """Each rank's experts see part of every sequence there: the loss would measure the balance of the parts."""
    from components.config import ConfigError

    with pytest.raises(ConfigError, match=r"^not available yet: moe.aux_loss_coef 0.001 with tensor or context "
                                          r"parallelism \(each rank would measure the balance of its part of every "
                                          r"sequence\); balance with moe.bias_update_speed instead$"):
        check_layout([*SMALL, "--moe.aux_loss_coef", "0.001", "--parallelism.tensor_parallel_degree", "2"])


MTP = ["--model.num_mtp_layers", "2"]


def test_each_multi_token_depth_reads_the_tokens_up_to_k_ahead_and_the_rolled_tail_reaches_no_other_position():
    """Depth k's output at position i, computed on the whole rolled sequence, equals the depths run on the sequence
    cut to its first seq - k positions (the k-th next inputs and the previous depth's output there): the tail that
    wraps around touches nothing before it. The next token's logits are the model's in eval mode."""
    model = ingot_model([*SMALL, *MTP]).train()
    tokens = token_ids()
    final = []
    model.norm.register_forward_hook(lambda module, args, out: final.append(out))
    with torch.no_grad():
        out = model(tokens)
        assert torch.equal(out.logits, model.eval()(tokens)) and out.weight == 0.3
        h, seq = final[0], tokens.shape[1]
        for k, (depth, logits) in enumerate(zip(model.mtp.values(), out.depths), 1):
            h = depth(h[:, :-1], model.tok_embeddings(tokens[:, k:]), model.rope[:seq - k])
            assert report(f"depth {k}, whole sequence rolled vs cut", logits[:, :seq - k], model.output(h)) < 1e-6


def test_the_multi_token_loss_trains_the_depths_and_keeps_the_logged_loss_the_next_token_s():
    """Its value is the next-token cross-entropy bit for bit; its gradient that of cross-entropy + weight x the mean
    of the depths' cross-entropies on the positions that have a label; step_mean gives that mean, once."""
    from components.training.loss import MultiTokenLogits, MultiTokenLoss, cross_entropy_loss

    torch.manual_seed(0)
    logits, *depths = (torch.randn(2, 8, 11, requires_grad=True) for _ in range(3))
    labels = torch.randint(0, 11, (2, 8))
    loss_fn = MultiTokenLoss(cross_entropy_loss, torch.device("cpu"))
    loss = loss_fn(MultiTokenLogits(logits, depths, 0.3), labels)
    assert loss.item() == cross_entropy_loss(logits, labels).item()
    extra = (cross_entropy_loss(depths[0][:, :-1], labels[:, 1:])
             + cross_entropy_loss(depths[1][:, :-2], labels[:, 2:])) / 2
    expected = cross_entropy_loss(logits, labels) + 0.3 * extra
    got = torch.autograd.grad(loss, [logits, *depths])
    for g, e in zip(got, torch.autograd.grad(expected, [logits, *depths])):
        torch.testing.assert_close(g, e)
    assert loss_fn.step_mean().item() == pytest.approx(extra.item()) and loss_fn.step_mean().item() == 0.0
    assert loss_fn(logits, labels).item() == loss.item()  # an eval-mode output: the next-token loss alone


def test_multi_token_prediction_adds_to_one_process_training_and_leaves_its_first_step(references):
    """One depth: the first step's loss is that of the model without it (the depth is drawn after the rest), the
    next ones differ (its gradient reaches the shared weights), and each step logs mtp_loss, near the initial loss."""
    with_mtp, without = step_figures(references["mtp"]), step_figures(references["packed"])
    assert with_mtp[1]["loss"] == without[1]["loss"] and with_mtp[2]["loss"] != without[2]["loss"]
    assert all(8 < figures["mtp_loss"] < 10 for figures in with_mtp.values()), with_mtp
    assert "mtp_loss" not in without[1]


def test_multi_token_prediction_is_refused_with_pipeline_and_context_parallelism():
    from components.config import ConfigError

    for key in ("pipeline_parallel_degree", "context_parallel_degree"):
        with pytest.raises(ConfigError, match=r"^not available yet: multi-token prediction \(2 extra depths: "
                                              r"model.num_mtp_layers\) with pipeline or context parallelism; set "
                                              r"model.num_mtp_layers 0 for such a layout$"):
            check_layout([*SMALL, *MTP, f"--parallelism.{key}", "2"])


def test_the_routing_tally_moves_the_biases_of_the_depths_experts_too():
    from components.training.routing import RoutingTally

    model = ingot_model([*SMALL, *MTP]).train()
    tally = RoutingTally([model], model.args.n_layers, micro_batches_per_step=1)
    model(token_ids())
    figures, load = tally.end_step(torch.tensor(False), metrics=True)
    moes = [depth.block.feed_forward for depth in model.mtp.values()]
    assert sorted(load) == [1, 2, 3, 4] and all(moe.expert_bias.abs().sum() > 0 for moe in moes)
    assert all(moe.tokens_per_expert.sum() == 0 for moe in moes)  # the tally took them


def test_the_depths_export_under_the_layers_after_the_model_s_and_round_trip(tmp_path):
    """As DeepSeek publishes them: layer n_layers + k with enorm, hnorm, eh_proj, shared_head.norm, a block and the
    copies of the embedding and output layer; transformers loads the export (without running them) to the same
    logits; read back into a model with the depths, the weights are the same, a model without them skips them, and
    one with more depths than the files hold is refused at load in one line."""
    from components.hf.export import save_safetensors

    model = ingot_model([*SMALL, *MTP])
    torch.manual_seed(1)
    randomize(model)
    state = model.state_dict()
    hf = deepseek_v3.to_hf(state, model.args)
    n = model.args.n_layers
    assert {f"model.layers.{n + 1}.{name}" for name in ("enorm.weight", "hnorm.weight", "eh_proj.weight",
                                                         "shared_head.norm.weight", "embed_tokens.weight",
                                                         "shared_head.head.weight", "mlp.experts.7.up_proj.weight",
                                                         "mlp.gate.e_score_correction_bias")} <= hf.keys()
    back = deepseek_v3.from_hf(hf, model.args)
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)
    without = deepseek_v3.from_hf(hf, deepseek_v3.build_model_args(load_config(SMALL, model_config_class), VOCAB))
    assert not any(k.startswith("mtp.") for k in without) and without.keys() < state.keys()

    config = deepseek_v3.hf_config(model.args, bos_id=1, eos_id=2)
    assert config["num_nextn_predict_layers"] == 2
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_safetensors(hf, tmp_path / "model.safetensors")
    with torch.no_grad():
        assert report("ingot DeepSeek-V3 with MTP -> HF", model.eval()(token_ids()),
                      transformers_logits(tmp_path, token_ids())) < 1e-5
    from components.config import ConfigError
    from components.hf.load import load_hf_weights

    deeper = ingot_model([*SMALL, "--model.num_mtp_layers", "3"])  # its third depth is not in the files
    with pytest.raises(ConfigError, match=rf"^the Hugging Face model in {tmp_path} lacks \d+ weight\(s\) of this "
                                          rf"model, first model.layers.{n + 2}\."):
        load_hf_weights(tmp_path, [deeper], deepseek_v3, deeper.args)
