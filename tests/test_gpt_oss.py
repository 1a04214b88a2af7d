"""gpt-oss: the same logits as transformers' GptOssForCausalLM through load_hf_model and the converter (both
directions: a window shorter than the sequence, both layer types, nonzero sinks and biases, YaRN), exact round trips,
the published shapes; learned sinks equal to transformers' softmax with a sink column, gradients included; and
training under every layout on 2 and 4 gloo processes as one process does: losses to 1e-5, gradient norms and the
routing tally (CPU fp32; on the default config's data, the packed corpus and its documents).

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

import models.gpt_oss as gpt_oss
from components.checkpoint.dcp import ModelState
from components.hf.load import read_hf_weights
from components.model.attention import AttentionMask, causal_attention, document_mask
from models.families import load_hf_model
from scripts import hf as converter

VOCAB = 4096  # the shipped tokenizer's
# One small model as an ingot config and as an HF config: a window of 16 keys, sequences of 64, sliding first.
SMALL = ["--job.config_file", "debug_gpt_oss.toml", *ON_PACKED, "--training.seq_len", "64",
         "--model.n_layers", "3", "--model.dim", "64", "--model.n_heads", "4", "--model.n_kv_heads", "2",
         "--model.head_dim", "16", "--model.sliding_window", "16", "--moe.num_experts", "4", "--moe.top_k", "2",
         "--moe.hidden_dim", "48"]
SMALL_HF = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, sliding_window=16, num_local_experts=4, num_experts_per_tok=2,
    max_position_embeddings=131072, bos_token_id=1, eos_token_id=2,
)


def hf_gpt_oss(folder, config: dict):
    """A random GptOssForCausalLM (biases and sinks nonzero) saved with save_pretrained."""
    transformers = transformers_module()
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(transformers.GptOssConfig(**config))
    randomize(model)
    model.save_pretrained(folder)
    return folder


def transformers_logits(folder, ids: torch.Tensor) -> torch.Tensor:
    model = transformers_module().AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    with torch.no_grad():
        return model(ids).logits


ingot_model = partial(family_model, package=gpt_oss)


def test_random_hf_gpt_oss_imports_with_the_same_logits(tmp_path):
    source = hf_gpt_oss(tmp_path / "hf", SMALL_HF)
    reference = transformers_logits(source, token_ids())
    with torch.no_grad():
        loaded = load_hf_model(source)
        assert report("HF gpt-oss -> ingot, load_hf_model", loaded(token_ids()), reference) < 1e-5
        # The comparison sees the sinks and the window: without either the logits move.
        sinks = {name: block.attention.sink_logits.clone() for name, block in loaded.layers.items()}
        for block in loaded.layers.values():
            block.attention.sink_logits.fill_(-1e9)
        assert relative_error(loaded(token_ids()), reference) > 1e-3
        for name, block in loaded.layers.items():
            block.attention.sink_logits.copy_(sinks[name])
            block.attention.attention_mask = AttentionMask()
        assert relative_error(loaded(token_ids()), reference) > 1e-3
    run_hf("import", *SMALL, "--hf", source, "--output", tmp_path / "dcp")
    with torch.no_grad():
        imported = ingot_model(SMALL, tmp_path / "dcp")
        assert report("HF gpt-oss -> ingot, import", imported(token_ids()), reference) < 1e-5
        plain_rope = ingot_model([*SMALL, "--model.rope_factor", "1"], tmp_path / "dcp")
        assert relative_error(plain_rope(token_ids()), reference) > 1e-3


def test_export_gives_transformers_the_same_logits_and_round_trips_bit_exact(tmp_path):
    """Random ingot weights (biases and sinks included) exported and read by transformers; then HF -> ingot -> HF
    gives back the files' tensors and config."""
    model = ingot_model(SMALL)
    torch.manual_seed(1)
    randomize(model)
    with converter.one_process():
        dcp.save({"model": ModelState([model])}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    run_hf("export", *SMALL, "--checkpoint", tmp_path / "dcp", "--output", tmp_path / "hf")
    with torch.no_grad():
        ours = model(token_ids())
    assert report("ingot gpt-oss -> HF export", ours, transformers_logits(tmp_path / "hf", token_ids())) < 1e-5

    run_hf("import", *SMALL, "--hf", tmp_path / "hf", "--output", tmp_path / "dcp2")
    run_hf("export", *SMALL, "--checkpoint", tmp_path / "dcp2", "--output", tmp_path / "back")
    before, after = read_hf_weights(tmp_path / "hf"), read_hf_weights(tmp_path / "back")
    assert "model.layers.2.self_attn.sinks" in after and "model.layers.1.mlp.experts.gate_up_proj_bias" in after
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert config["ingot_model"] == "gpt_oss" and config["rope_scaling"]["factor"] == 32.0
    assert config["layer_types"] == ["sliding_attention", "full_attention", "sliding_attention"]


def test_published_shapes_and_their_configs():
    """20B and 120B count their published parameters; gpt-oss-20b's config.json maps onto the 20B flavor; the
    quantized experts of the published files are named in one line."""
    counts = {}
    for name in ("20B", "120B"):
        with torch.device("meta"):
            model = gpt_oss.Transformer(gpt_oss.flavors[name])
        counts[name] = sum(p.numel() for p in model.parameters())
    assert counts == {"20B": 20_914_757_184, "120B": 116_829_156_672}  # as transformers counts them
    published = {  # gpt-oss-20b's config.json, as published (quantization_config aside)
        "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
        "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880,
        "initial_context_length": 4096, "initializer_range": 0.02, "intermediate_size": 2880,
        "layer_types": ["sliding_attention", "full_attention"] * 12, "max_position_embeddings": 131072,
        "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24,
        "num_key_value_heads": 8, "num_local_experts": 32, "output_router_logits": False, "pad_token_id": 199999,
        "rms_norm_eps": 1e-05, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                                "original_max_position_embeddings": 4096, "rope_type": "yarn",
                                                "truncate": False},
        "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
        "tie_word_embeddings": False, "use_cache": True, "vocab_size": 201088,
    }
    args = gpt_oss.model_args_from_hf(published)
    assert vars(args) == vars(gpt_oss.flavors["20B"]) | {"max_seq_len": 131072}
    with pytest.raises(ValueError, match=r"^model.layers.0.mlp.experts.gate_up_proj_blocks: the experts are "
                                         r"quantized \(MXFP4\); save the model dequantized"):
        gpt_oss.from_hf({"model.layers.0.mlp.experts.gate_up_proj_blocks": torch.zeros(1)}, args)


def sink_column_attention(q, k, v, allowed, sinks):
    """transformers' eager gpt-oss attention: the sink as one more column of the scores, dropped after the softmax."""
    k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    scores = (q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5).masked_fill(~allowed, float("-inf"))
    column = sinks[None, :, None, None].expand(*scores.shape[:-1], 1)
    return torch.cat([scores, column], dim=-1).softmax(-1)[..., :-1] @ v


@pytest.mark.parametrize("window, documents", [(None, False), (5, False), (5, True)])
def test_learned_sinks_equal_a_softmax_with_a_sink_column_in_value_and_gradient(window, documents):
    """causal_attention with sink logits (chunked under a window; under a document mask) against the sink column,
    for the output and the gradients of q, k, v and the sinks."""
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 20, 8), torch.randn(2, 2, 20, 8), torch.randn(2, 2, 20, 8)
    sinks = torch.randn(4)
    spec = AttentionMask(window=window)
    ids = torch.tensor([[0] * 7 + [1] * 13, [0] * 20])
    mask = document_mask(ids, spec, flex=False) if documents else None
    positions = torch.arange(20)
    allowed = spec.allows(positions[:, None], positions[None])
    if documents:
        allowed = allowed & (ids[:, None, :, None] == ids[:, None, None, :])
    results = []
    for attend in (lambda *t: causal_attention(*t[:3], mask, spec, sink_logits=t[3]),
                   lambda *t: sink_column_attention(*t[:3], allowed, t[3])):
        inputs = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
        out = attend(*inputs)
        out.square().sum().backward()
        results.append([out, *(t.grad for t in inputs)])
    for ours, theirs in zip(*results):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


STEPS = 3
# A tiny gpt-oss: a window of 8 keys in sequences of 64 (cut by CP 2's chunks of 16 and CP 4's of 8), sliding and
# full layers, 4 query heads over 2 key/value heads, 4 experts.
BASE = [*SMALL, "--model.n_layers", "4", "--model.sliding_window", "8", "--moe.hidden_dim", "32",
        "--lr_scheduler.warmup_steps", "2", "--checkpoint.enable", "false", "--metrics.enable_tensorboard", "false",
        "--training.steps", str(STEPS), "--training.global_batch_size", "8", "--metrics.log_freq", "1"]


def method(name: str) -> list[str]:
    return ["--parallelism.context_parallel_method", name]


LAYOUTS = {  # name: (processes, arguments), data
    # TorchTitan's gpt_oss_fsdp+tp+ep+compile, checkpointed by op.
    "dp_shard2_tp2_ep2_compile_selective_op": (layout(dp_shard=2, tp=2, ep=2, extra=[
        "--compile.enable", "true", "--activation_checkpoint.mode", "selective",
        "--activation_checkpoint.selective_ac_option", "op"]), "hf"),
    "pp2_tp2_interleaved_1f1b": (layout(pp=2, tp=2, extra=["--parallelism.pipeline_parallel_schedule",
                                                            "Interleaved1F1B"]), "hf"),
    "cp2_ring_documents": (layout(cp=2, extra=method("ring")), "documents"),
    "cp2_tp2_allgather_documents_full_ac": (layout(cp=2, tp=2, extra=["--activation_checkpoint.mode", "full"]),
                                            "documents"),
    "cp4_alltoall_documents_selective_2": (layout(cp=4, extra=[*method("alltoall"), "--activation_checkpoint.mode",
                                                               "selective"]), "documents"),
}
"""HSDP with EP runs on DeepSeek-V3 (tests/test_deepseek_v3.py), whose MoE layer is the same; every method at CP 4
with the window and learned sinks, on the attention itself (tests/test_context_parallel.py)."""
DATA = {"hf": ON_HF, "documents": ["--training.document_masking", "true", "--model.rope_per_document", "true"]}
"""BASE reads the packed corpus; ON_HF, later on the command line, replaces it by the default config's data;
documents: the packed corpus with attention and RoPE positions kept within each document."""


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    return reference_runs(tmp_path_factory, BASE, DATA)


@pytest.fixture(scope="module")
def layout_runs(tmp_path_factory):
    runs = {name: (nproc, [*BASE, *DATA[data], *args]) for name, ((nproc, args), data) in LAYOUTS.items()}
    return torchrun_runs(runs, tmp_path_factory.mktemp("layouts"))


@pytest.mark.slow
@pytest.mark.parametrize("name", LAYOUTS)
def test_gpt_oss_layout_matches_one_process(name, references, layout_runs):
    """Losses to 1e-5, the same token ids, gradient norms and the routing tally's maximum load: the window and the
    learned sinks honoured by every context-parallel method, with and without documents, and the sinks sharded by
    heads under tensor parallelism."""
    dump, problem = layout_runs[name]
    assert not problem, problem
    got, expected = step_figures(dump), step_figures(references[LAYOUTS[name][1]])
    assert sorted(got) == list(range(1, STEPS + 1))
    for step, reference in expected.items():
        assert got[step]["data_hash"] == reference["data_hash"]
        assert got[step]["loss"] == pytest.approx(reference["loss"], rel=1e-5), (name, step)
        assert got[step]["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-4), (name, step)
        assert got[step]["moe_max_load"] == pytest.approx(reference["moe_max_load"], rel=1e-5), (name, step)
