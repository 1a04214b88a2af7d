"""Hugging Face interop for DeepSeek-V3: ingot's state-dict names <-> those of transformers' DeepseekV3ForCausalLM,
and ModelArgs <-> the fields of its config.json (model_type deepseek_v3).

Weights are only renamed: the model applies RoPE in the layout the config states (`rope_interleave`), the routing
bias is `mlp.gate.e_score_correction_bias`, and the routed experts are one tensor per expert in HF files
(models/hf_experts.py). DeepseekV3ForCausalLM always routes by sigmoid over groups with the correction bias: a
softmax-routed model (the 16B flavor, DeepSeek-V2-Lite's routing) has no such form and its export is refused.
Multi-token prediction's depths are HF's layers past num_hidden_layers (`model.layers.61` of the 671B), as
DeepSeek publishes them; transformers does not run them. They are read into a model with model.num_mtp_layers,
otherwise left out.
"""

from __future__ import annotations

import re

from models.activations import ACTIVATIONS
from models.deepseek_v3.flavors import flavors
from models.deepseek_v3.model import ModelArgs
from models.hf_experts import experts_from_hf, experts_to_hf
from models.hf_mapping import HFNames, as_flavor
from models.moe import MoEArgs

_TOP_LEVEL = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_IN_BLOCK = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wq_a.weight": "self_attn.q_a_proj.weight",
    "attention.q_norm.weight": "self_attn.q_a_layernorm.weight",
    "attention.wq_b.weight": "self_attn.q_b_proj.weight",
    "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attention.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.router.gate.weight": "mlp.gate.weight",
    "feed_forward.expert_bias": "mlp.gate.e_score_correction_bias",
    "feed_forward.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "feed_forward.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
    "feed_forward.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
NAMES = HFNames("DeepSeek-V3", _TOP_LEVEL, _IN_BLOCK, blocks="layers")

HF_MODEL_TYPES = ("deepseek_v3", "kimi_k2")
"""The Hugging Face model_types whose folders this family reads (components/hf/load.py): DeepSeek-V3's, and Kimi K2's,
whose release is a DeepseekV3ForCausalLM under a model_type of its own (its config.json's auto_map names DeepSeek-V3's
configuration and modeling code). An export writes deepseek_v3, the model_type transformers itself knows."""

HF_CONFIG_KEYS = {
    "model_type": "model.name",
    "vocab_size": "model.vocab_size",
    "hidden_size": "model.dim",
    "intermediate_size": "model.ffn_dim",
    "num_hidden_layers": "model.n_layers",
    "num_attention_heads": "model.n_heads",
    "first_k_dense_replace": "model.first_dense_layers",
    "q_lora_rank": "model.q_lora_rank",
    "kv_lora_rank": "model.kv_lora_rank",
    "qk_nope_head_dim": "model.qk_nope_head_dim",
    "qk_rope_head_dim": "model.qk_rope_head_dim",
    "v_head_dim": "model.v_head_dim",
    "hidden_act": "the model's hidden_act (silu)",
    "rms_norm_eps": "model.norm_eps",
    "rope_theta": "model.rope_theta",
    "rope_scaling": "model.rope_factor (and the flavor's YaRN settings)",
    "rope_interleave": "model.flavor (its rope_interleave)",
    "tie_word_embeddings": "model.flavor (its tie_embeddings)",
    "n_routed_experts": "moe.num_experts",
    "num_experts_per_tok": "moe.top_k",
    "moe_intermediate_size": "moe.hidden_dim",
    "n_shared_experts": "moe.num_shared_experts",
    "n_group": "moe.n_groups",
    "topk_group": "moe.topk_groups",
    "norm_topk_prob": "model.flavor (its norm_topk_prob)",
    "routed_scaling_factor": "model.flavor (its route_scale)",
}
"""The config.json fields that fix the shape and the function of the model, each with the ingot config key(s) that
set it: an HF checkpoint loads into an ingot config only if all of them agree."""


_MTP = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
        "norm.weight": "shared_head.norm.weight"}
"""A multi-token prediction depth's own weights; its block's are a block's, all under model.layers.{n_layers + k}."""
_FROM_HF_MTP = {hf: ours for ours, hf in _MTP.items()}
_MTP_COPIES = {"tok_embeddings.weight": "embed_tokens.weight", "output.weight": "shared_head.head.weight"}
"""What a depth shares with the model, which DeepSeek's checkpoints also hold under each MTP layer (export only)."""


def hf_name(name: str, n_layers: int) -> str:
    """The HF name of an ingot parameter or buffer other than the routed experts'; a multi-token prediction depth k
    is HF's layer n_layers + k."""
    match = re.fullmatch(r"mtp\.(\d+)\.(block\.)?(.+)", name)
    if match and (_IN_BLOCK if match[2] else _MTP).get(match[3]):
        return f"model.layers.{n_layers + int(match[1])}.{(_IN_BLOCK if match[2] else _MTP)[match[3]]}"
    return NAMES.hf_name(name)


def ingot_name(name: str, n_layers: int) -> str:
    """The ingot name of an HF DeepSeek-V3 tensor other than the routed experts' (the inverse of hf_name)."""
    match = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
    if match and int(match[1]) >= n_layers and match[2] in NAMES.from_hf_in_block:
        return f"mtp.{int(match[1]) - n_layers}.block.{NAMES.from_hf_in_block[match[2]]}"
    if match and match[2] in _FROM_HF_MTP:
        return f"mtp.{int(match[1]) - n_layers}.{_FROM_HF_MTP[match[2]]}"
    return NAMES.ingot_name(name)


def _block_index(name: str, n_layers: int) -> str:
    """ingot's prefix of HF block `name` (a string index): layers.i, or a multi-token prediction depth's block."""
    return f"layers.{name}" if int(name) < n_layers else f"mtp.{int(name) - n_layers}.block"


def to_hf(state_dict: dict, args: ModelArgs) -> dict:
    """An ingot (full or partial, e.g. one pipeline stage's) state dict under HF names; the routed experts as
    per-expert views; each multi-token prediction depth with the copies of the embedding and output layer that
    DeepSeek's checkpoints hold."""
    hf = {}
    for name, tensor in state_dict.items():
        experts = re.fullmatch(r"(layers\.(\d+)|mtp\.(\d+)\.block)\.feed_forward\.experts\.(w[123])", name)
        if experts:
            block = int(experts[2]) if experts[2] is not None else args.n_layers + int(experts[3])
            hf |= experts_to_hf(block, experts[4], tensor)
        elif not (args.tie_embeddings and name == "output.weight"):
            hf[hf_name(name, args.n_layers)] = tensor
        if name in _MTP_COPIES:
            hf |= {f"model.layers.{args.n_layers + k}.{_MTP_COPIES[name]}": tensor for k in range(args.num_mtp_layers)}
    return hf


def from_hf(state_dict: dict, args: ModelArgs) -> dict:
    """An HF state dict (experts one per tensor, or fused as transformers holds them) under ingot names; the
    layers past n_layers are the multi-token prediction depths, left out past the model's num_mtp_layers (all of
    them by default), and their copies of the embedding and output layer are not read."""
    rest, experts = experts_from_hf(state_dict)
    blocks = args.n_layers + args.num_mtp_layers
    renamed = {f"{_block_index(block, args.n_layers)}.feed_forward.experts.{projection}": tensor
               for (block, projection), tensor in experts.items() if int(block) < blocks}
    for name, tensor in rest.items():
        block = re.match(r"model\.layers\.(\d+)\.(.+)", name)
        if name.endswith("rotary_emb.inv_freq") or (block and (int(block[1]) >= blocks or (
                int(block[1]) >= args.n_layers and block[2] in _MTP_COPIES.values()))) or \
                (args.tie_embeddings and name == "lm_head.weight"):
            continue
        renamed[ingot_name(name, args.n_layers)] = tensor
    if args.tie_embeddings and "tok_embeddings.weight" in renamed:
        renamed["output.weight"] = renamed["tok_embeddings.weight"]
    return renamed


def check_deepseek_v3_form(args: ModelArgs) -> None:
    """Refuse experts that DeepseekV3ForCausalLM cannot express."""
    moe = args.moe
    if moe and moe.score_func != "sigmoid":
        raise ValueError(f"DeepseekV3ForCausalLM routes by sigmoid: this model's experts (score_func "
                         f"{moe.score_func}) have no Hugging Face form")
    if moe and moe.top_k == 1 and moe.norm_topk_prob:
        raise ValueError("DeepseekV3ForCausalLM normalizes a single expert's weight to 1, which ingot does not (the "
                         "router would get no gradient): top_k 1 with norm_topk_prob has no Hugging Face form")


def hf_config(args: ModelArgs, bos_id: int | None = None, eos_id: int | None = None, dtype: str = "float32") -> dict:
    """config.json of the DeepseekV3ForCausalLM equal to an ingot model with these args."""
    check_deepseek_v3_form(args)
    moe = args.moe or MoEArgs(score_func="sigmoid")
    rope_scaling = None
    if args.rope_factor > 1:
        rope_scaling = {"type": "yarn", "rope_type": "yarn", "factor": args.rope_factor,
                        "original_max_position_embeddings": args.rope_original_seq_len,
                        "beta_fast": args.rope_beta_fast, "beta_slow": args.rope_beta_slow,
                        "mscale": args.rope_mscale, "mscale_all_dim": args.rope_mscale_all_dim}
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": args.vocab_size,
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_heads,
        "first_k_dense_replace": args.first_dense_layers if args.moe else args.n_layers,
        "q_lora_rank": args.q_lora_rank or None,
        "kv_lora_rank": args.kv_lora_rank,
        "qk_nope_head_dim": args.qk_nope_head_dim,
        "qk_rope_head_dim": args.qk_rope_head_dim,
        "v_head_dim": args.v_head_dim,
        "hidden_act": args.hidden_act,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "rope_scaling": rope_scaling,
        "rope_interleave": args.rope_interleave,
        "max_position_embeddings": int(args.rope_original_seq_len * args.rope_factor) if rope_scaling
        else args.max_seq_len,
        "tie_word_embeddings": args.tie_embeddings,
        "n_routed_experts": moe.num_experts,
        "num_experts_per_tok": moe.top_k,
        "moe_intermediate_size": moe.hidden_dim,
        "n_shared_experts": moe.num_shared_experts,
        "n_group": moe.n_groups,
        "topk_group": moe.topk_groups,
        "norm_topk_prob": moe.norm_topk_prob,
        "routed_scaling_factor": moe.route_scale,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "num_nextn_predict_layers": args.num_mtp_layers,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "torch_dtype": dtype,
    }


def _rope(config: dict) -> dict:
    """The RoPE settings from either config.json form (top-level rope_theta and rope_scaling, or transformers 5's
    rope_parameters), as ModelArgs fields."""
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
    if rope_type == "default":
        return {"rope_theta": theta, "rope_factor": 1.0}
    if rope_type != "yarn":
        raise ValueError(f"RoPE type {rope_type!r} is not supported (ingot's DeepSeek-V3 has plain RoPE or YaRN)")
    original = rope["original_max_position_embeddings"]
    factor = rope.get("factor") or config["max_position_embeddings"] / original
    if rope.get("attention_factor") is not None or not rope.get("truncate", True):
        raise ValueError("YaRN with attention_factor or truncate false is not supported (DeepSeek-V3's has neither)")
    return {"rope_theta": theta, "rope_factor": factor, "rope_original_seq_len": original,
            "rope_beta_fast": rope.get("beta_fast") or 32.0, "rope_beta_slow": rope.get("beta_slow") or 1.0,
            "rope_mscale": rope.get("mscale") or 0.0, "rope_mscale_all_dim": rope.get("mscale_all_dim") or 0.0}


def model_args_from_hf(config: dict) -> ModelArgs:
    """ModelArgs of the ingot model equal to the DeepseekV3ForCausalLM of an HF config.json (transformers'
    defaults for absent fields). Where the shape is one of ingot's flavors, that flavor's args are returned, with
    the vocabulary and context of the checkpoint."""
    if config.get("model_type") not in HF_MODEL_TYPES:
        raise ValueError(f"model_type {config.get('model_type')!r} is not one of {', '.join(HF_MODEL_TYPES)}")
    if config.get("hidden_act", "silu") not in ACTIVATIONS or config.get("attention_bias") or \
            config.get("scoring_func", "sigmoid") != "sigmoid":
        raise ValueError(f"only DeepSeek-V3 models with no attention bias, sigmoid routing and one of the activations "
                         f"{', '.join(ACTIVATIONS)} are supported (attention_bias, scoring_func, hidden_act)")
    heads = config.get("num_attention_heads", 128)
    if config.get("num_key_value_heads", heads) != heads:
        raise ValueError(f"num_key_value_heads {config['num_key_value_heads']} differs from num_attention_heads "
                         f"{heads}: multi-head latent attention rebuilds every head's key and value")
    args = ModelArgs(
        dim=config.get("hidden_size", 7168),
        n_layers=config.get("num_hidden_layers", 61),
        n_heads=heads,
        ffn_dim=config.get("intermediate_size", 18432),
        vocab_size=config.get("vocab_size", 129280),
        norm_eps=config.get("rms_norm_eps", 1e-6),
        q_lora_rank=config.get("q_lora_rank", 1536) or 0,
        kv_lora_rank=config.get("kv_lora_rank", 512),
        qk_nope_head_dim=config.get("qk_nope_head_dim", 128),
        qk_rope_head_dim=config.get("qk_rope_head_dim", 64),
        v_head_dim=config.get("v_head_dim", 128),
        rope_interleave=config.get("rope_interleave", True),
        max_seq_len=config.get("max_position_embeddings", 4096),
        first_dense_layers=config.get("first_k_dense_replace", 3),
        hidden_act=config.get("hidden_act", "silu"),
        tie_embeddings=config.get("tie_word_embeddings", False),
        moe=MoEArgs(num_experts=config.get("n_routed_experts", 256), top_k=config.get("num_experts_per_tok", 8),
                    hidden_dim=config.get("moe_intermediate_size", 2048),
                    num_shared_experts=config.get("n_shared_experts", 1), score_func="sigmoid",
                    norm_topk_prob=config.get("norm_topk_prob", True),
                    route_scale=config.get("routed_scaling_factor", 2.5), n_groups=config.get("n_group", 8),
                    topk_groups=config.get("topk_group", 4)),
        **_rope(config),
    )
    return as_flavor(args, flavors, hf_config, HF_CONFIG_KEYS)
