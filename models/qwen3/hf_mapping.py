"""Hugging Face interop for Qwen3: ingot's state-dict names <-> those of transformers'
Qwen3ForCausalLM and Qwen3MoeForCausalLM, and ModelArgs <-> the fields of their config.json
(model_type qwen3 and qwen3_moe).

Dense weights are only renamed: RoPE is in HF's rotate-half layout (see model.Transformer). The
experts of an MoE layer are one tensor per projection in ingot and one per expert in HF files
(models/hf_experts.py, which reads transformers' fused in-memory form too); to_hf's are views of ingot's, so
that loading into them fills the model (components/hf/load.py). The routing bias of auxiliary-loss-free balancing
(`expert_bias`) has no HF counterpart: it is exported without, and imported as zeros.
"""

from __future__ import annotations

import re

from models.activations import ACTIVATIONS
from models.hf_experts import experts_from_hf, experts_to_hf
from models.hf_mapping import HFNames, as_flavor, complete_import, has_hf_form, is_imported
from models.moe import MoEArgs
from models.qwen3.flavors import flavors
from models.qwen3.model import ModelArgs

_TOP_LEVEL = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_IN_BLOCK = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.router.gate.weight": "mlp.gate.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
NAMES = HFNames("Qwen3", _TOP_LEVEL, _IN_BLOCK, blocks="layers")

HF_CONFIG_KEYS = {
    "model_type": "model.flavor (a dense or a mixture-of-experts one)",
    "vocab_size": "model.vocab_size",
    "hidden_size": "model.dim",
    "intermediate_size": "model.ffn_dim",
    "num_hidden_layers": "model.n_layers",
    "num_attention_heads": "model.n_heads",
    "num_key_value_heads": "model.n_kv_heads",
    "head_dim": "model.flavor (its head_dim)",
    "hidden_act": "the model's hidden_act (silu)",
    "rms_norm_eps": "model.norm_eps",
    "rope_theta": "model.rope_theta",
    "tie_word_embeddings": "model.tie_embeddings",
    "num_experts": "moe.num_experts",
    "num_experts_per_tok": "moe.top_k",
    "moe_intermediate_size": "moe.hidden_dim",
    "norm_topk_prob": "model.flavor (its norm_topk_prob)",
    "decoder_sparse_step": "model.flavor (its moe_layer_step)",
    "mlp_only_layers": "model.flavor (its dense_layers)",
}
"""The config.json fields that fix the shape and the function of the model, each with the ingot
config key(s) that set it: an HF checkpoint loads into an ingot config only if all of them agree
(the MoE fields are absent from a dense model's config.json)."""


def hf_name(name: str) -> str:
    """The HF name of an ingot parameter other than the experts', e.g. layers.3.attention.q_norm.weight
    -> model.layers.3.self_attn.q_norm.weight."""
    return NAMES.hf_name(name)


def ingot_name(name: str) -> str:
    """The ingot name of an HF Qwen3 parameter other than the experts' (the inverse of hf_name)."""
    return NAMES.ingot_name(name)


def to_hf(state_dict: dict, args: ModelArgs) -> dict:
    """An ingot (full or partial, e.g. one pipeline stage's) state dict under HF names. With tied
    embeddings, output.weight is the embedding matrix itself, which HF files hold once, as
    model.embed_tokens.weight. Experts are split into per-expert views; expert_bias is left out."""
    hf = {}
    for name, tensor in state_dict.items():
        experts = re.fullmatch(r"layers\.(\d+)\.feed_forward\.experts\.(w[123])", name)
        if experts:
            hf |= experts_to_hf(experts[1], experts[2], tensor)
        elif has_hf_form(name, args.tie_embeddings):
            hf[hf_name(name)] = tensor
    return hf


def from_hf(state_dict: dict, args: ModelArgs) -> dict:
    """An HF state dict (experts one per tensor, or fused as transformers holds them) under ingot
    names, with a zero routing bias for each MoE layer. With tied embeddings, output.weight is added
    as the embedding and an HF lm_head.weight, which some tied checkpoints store as a copy, is dropped."""
    rest, experts = experts_from_hf(state_dict)
    renamed = {f"layers.{block}.feed_forward.experts.{projection}": tensor
               for (block, projection), tensor in experts.items()}
    for name, tensor in rest.items():
        if is_imported(name, args.tie_embeddings):
            renamed[ingot_name(name)] = tensor
    return complete_import(renamed, args.tie_embeddings)


def check_qwen3_form(args: ModelArgs) -> None:
    """Refuse a mixture of experts that Qwen3MoeForCausalLM cannot express: its router is a softmax over all the
    experts, unscaled, and it has no shared experts."""
    moe = args.moe
    if moe and (moe.score_func != "softmax" or moe.route_scale != 1.0 or moe.num_shared_experts or moe.n_groups > 1):
        raise ValueError(f"Qwen3MoeForCausalLM routes by softmax over all experts, unscaled, without shared experts: "
                         f"this model's experts (score_func {moe.score_func}, route_scale {moe.route_scale}, "
                         f"num_shared_experts {moe.num_shared_experts}, n_groups {moe.n_groups}) have no Hugging "
                         f"Face form")


def hf_config(args: ModelArgs, bos_id: int | None = None, eos_id: int | None = None, dtype: str = "float32") -> dict:
    """config.json of the Qwen3ForCausalLM (or, with MoE, Qwen3MoeForCausalLM) equal to an ingot
    model with these args."""
    check_qwen3_form(args)
    config = {
        "architectures": ["Qwen3MoeForCausalLM" if args.moe else "Qwen3ForCausalLM"],
        "model_type": "qwen3_moe" if args.moe else "qwen3",
        "vocab_size": args.vocab_size,
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads or args.n_heads,
        "head_dim": args.head_dim,
        "hidden_act": args.hidden_act,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": args.max_seq_len,
        "tie_word_embeddings": args.tie_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "torch_dtype": dtype,
    }
    if args.moe:
        config |= {
            "num_experts": args.moe.num_experts,
            "num_experts_per_tok": args.moe.top_k,
            "moe_intermediate_size": args.moe.hidden_dim,
            "norm_topk_prob": args.moe.norm_topk_prob,
            "decoder_sparse_step": args.moe_layer_step,
            "mlp_only_layers": list(args.dense_layers),
        }
    return config


def _rope_theta(config: dict) -> float:
    """rope_theta from either config.json form (top-level, or in transformers 5's rope_parameters)."""
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"RoPE type {rope_type!r} is not supported (ingot's Qwen3 has plain RoPE)")
    return rope.get("rope_theta", config.get("rope_theta", 10000.0))


def model_args_from_hf(config: dict) -> ModelArgs:
    """ModelArgs of the ingot model equal to the Qwen3ForCausalLM or Qwen3MoeForCausalLM of an HF
    config.json (transformers' defaults for absent fields). Where the shape is one of ingot's
    flavors, that flavor's args are returned, with the vocabulary and context of the checkpoint."""
    model_type = config.get("model_type")
    if model_type not in ("qwen3", "qwen3_moe"):
        raise ValueError(f"model_type {model_type!r} is not a Qwen3 one (qwen3, qwen3_moe)")
    if config.get("hidden_act", "silu") not in ACTIVATIONS or config.get("attention_bias") or \
            config.get("use_sliding_window"):
        raise ValueError(f"only Qwen3 models with no attention bias, no sliding window and one of the activations "
                         f"{', '.join(ACTIVATIONS)} are supported (attention_bias, use_sliding_window, hidden_act)")
    heads = config["num_attention_heads"]
    dense = model_type == "qwen3"
    args = ModelArgs(
        dim=config["hidden_size"],
        n_layers=config["num_hidden_layers"],
        n_heads=heads,
        n_kv_heads=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim") or (128 if dense else config["hidden_size"] // heads),
        ffn_dim=config["intermediate_size"],
        vocab_size=config["vocab_size"],
        norm_eps=config.get("rms_norm_eps", 1e-6),
        rope_theta=_rope_theta(config),
        max_seq_len=config.get("max_position_embeddings", 32768),
        tie_embeddings=config.get("tie_word_embeddings", False),
        hidden_act=config.get("hidden_act", "silu"),
    )
    num_experts = config.get("num_experts", config.get("num_local_experts", 128))
    if not dense and num_experts > 0:
        args.moe = MoEArgs(num_experts=num_experts, top_k=config.get("num_experts_per_tok", 8),
                           hidden_dim=config.get("moe_intermediate_size", 768),
                           norm_topk_prob=config.get("norm_topk_prob", False))
        args.moe_layer_step = config.get("decoder_sparse_step", 1)
        args.dense_layers = tuple(config.get("mlp_only_layers") or ())
    return as_flavor(args, flavors, hf_config, HF_CONFIG_KEYS, "moe")
