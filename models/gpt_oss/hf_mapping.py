"""Hugging Face interop for gpt-oss: ingot's state-dict names <-> those of transformers' GptOssForCausalLM, and
ModelArgs <-> the fields of its config.json (model_type gpt_oss).

Every weight is only renamed: the experts are held in HF's own layout (gate and up columns interleaved, stacked over
the experts, x @ W), so to_hf's tensors are the parameters themselves and loading into them fills the model
(components/hf/load.py). The published checkpoints store the experts quantized (MXFP4: `*_blocks` and `*_scales`); ingot
reads them in the dequantized form transformers saves (`GptOssForCausalLM.from_pretrained(...,
quantization_config=Mxfp4Config(dequantize=True))`, then save_pretrained). The routing bias of auxiliary-loss-free
balancing (`expert_bias`) has no HF counterpart: it is exported without, and imported as zeros.
"""

from __future__ import annotations

from models.gpt_oss.flavors import flavors
from models.gpt_oss.model import FULL, SLIDING, ModelArgs
from models.hf_mapping import HFNames, as_flavor, complete_import, has_hf_form, is_imported
from models.moe import MoEArgs

_TOP_LEVEL = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_IN_BLOCK = {
    **{f"attention.{ours}.{kind}": f"self_attn.{theirs}.{kind}"
       for ours, theirs in (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj"), ("wo", "o_proj"))
       for kind in ("weight", "bias")},
    "attention.sink_logits": "self_attn.sinks",
    "feed_forward.router.gate.weight": "mlp.router.weight",
    "feed_forward.router.gate.bias": "mlp.router.bias",
    "feed_forward.experts.gate_up": "mlp.experts.gate_up_proj",
    "feed_forward.experts.gate_up_bias": "mlp.experts.gate_up_proj_bias",
    "feed_forward.experts.down": "mlp.experts.down_proj",
    "feed_forward.experts.down_bias": "mlp.experts.down_proj_bias",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
NAMES = HFNames("gpt-oss", _TOP_LEVEL, _IN_BLOCK, blocks="layers")

HF_CONFIG_KEYS = {
    "model_type": "model.name gpt_oss",
    "vocab_size": "model.vocab_size",
    "hidden_size": "model.dim",
    "intermediate_size": "moe.hidden_dim",
    "num_hidden_layers": "model.n_layers",
    "num_attention_heads": "model.n_heads",
    "num_key_value_heads": "model.n_kv_heads",
    "head_dim": "model.head_dim",
    "rms_norm_eps": "model.norm_eps",
    "sliding_window": "model.sliding_window",
    "layer_types": "model.flavor (its layer_types)",
    "rope_theta": "model.rope_theta",
    "rope_scaling": "model.rope_factor (YaRN's; 1: none)",
    "num_local_experts": "moe.num_experts",
    "num_experts_per_tok": "moe.top_k",
    "swiglu_limit": "model.flavor (its swiglu_limit)",
    "swiglu_alpha": "model.flavor (its swiglu_alpha)",
    "tie_word_embeddings": "(gpt-oss does not tie them)",
}
"""The config.json fields that fix the shape and the function of the model, each with the ingot config key(s) that
set it: an HF checkpoint loads into an ingot config only if all of them agree."""


def hf_name(name: str) -> str:
    """The HF name of an ingot parameter, e.g. layers.3.attention.sink_logits -> model.layers.3.self_attn.sinks."""
    return NAMES.hf_name(name)


def ingot_name(name: str) -> str:
    """The ingot name of an HF gpt-oss parameter (the inverse of hf_name)."""
    if name.endswith(("_blocks", "_scales")):
        raise ValueError(f"{name}: the experts are quantized (MXFP4); save the model dequantized with transformers "
                         "first (Mxfp4Config(dequantize=True), then save_pretrained)")
    return NAMES.ingot_name(name)


def to_hf(state_dict: dict, args: ModelArgs) -> dict:
    """An ingot (full or partial, e.g. one pipeline stage's) state dict under HF names, the tensors themselves;
    expert_bias is left out."""
    return {hf_name(name): tensor for name, tensor in state_dict.items() if has_hf_form(name, tied=False)}


def from_hf(state_dict: dict, args: ModelArgs) -> dict:
    """An HF state dict under ingot names, with a zero routing bias for each MoE layer."""
    return complete_import({ingot_name(name): tensor for name, tensor in state_dict.items()
                            if is_imported(name, tied=False)}, tied=False)


def check_gpt_oss_form(args: ModelArgs) -> None:
    """Refuse experts GptOssForCausalLM cannot express: a softmax over the chosen experts' biased logits, unscaled,
    without shared experts or groups."""
    moe = args.moe
    if (moe.score_func != "softmax" or not moe.norm_topk_prob or moe.route_scale != 1.0 or moe.num_shared_experts
            or moe.n_groups > 1 or not moe.router_bias):
        raise ValueError(f"GptOssForCausalLM routes by a softmax over the chosen experts' biased logits, unscaled, "
                         f"without shared experts or groups: this model's experts (score_func {moe.score_func}, "
                         f"norm_topk_prob {moe.norm_topk_prob}, route_scale {moe.route_scale}, num_shared_experts "
                         f"{moe.num_shared_experts}, n_groups {moe.n_groups}) have no Hugging Face form")


def hf_config(args: ModelArgs, bos_id: int | None = None, eos_id: int | None = None, dtype: str = "float32") -> dict:
    """config.json of the GptOssForCausalLM equal to an ingot model with these args."""
    check_gpt_oss_form(args)
    yarn = args.rope_factor > 1
    # As the published config.json writes them (rope_scaling, which transformers 4.55 and later read), and the
    # context YaRN extends to as max_position_embeddings (else transformers warns that the two disagree).
    rope_scaling = {"rope_type": "yarn", "factor": args.rope_factor, "beta_fast": args.rope_beta_fast,
                    "beta_slow": args.rope_beta_slow, "truncate": False,
                    "original_max_position_embeddings": args.rope_original_seq_len} if yarn else None
    return {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "vocab_size": args.vocab_size,
        "hidden_size": args.dim,
        "intermediate_size": args.moe.hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "rms_norm_eps": args.norm_eps,
        "sliding_window": args.sliding_window,
        "layer_types": [args.layer_type(i) for i in range(args.n_layers)],
        "rope_theta": args.rope_theta,
        "rope_scaling": rope_scaling,
        "max_position_embeddings": int(args.rope_original_seq_len * args.rope_factor) if yarn else args.max_seq_len,
        "num_local_experts": args.moe.num_experts,
        "num_experts_per_tok": args.moe.top_k,
        "swiglu_limit": args.swiglu_limit,
        "swiglu_alpha": args.swiglu_alpha,
        "router_aux_loss_coef": 0.0,
        "output_router_logits": False,
        "attention_bias": True,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "torch_dtype": dtype,
    }


def _rope(config: dict) -> dict:
    """The RoPE fields of either config.json form (transformers 5's rope_parameters, or rope_scaling and a
    top-level rope_theta), with transformers' defaults."""
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    rope.setdefault("rope_theta", config.get("rope_theta", 150000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "yarn"):
        raise ValueError(f"RoPE type {rope_type!r} is not supported (ingot's gpt-oss has plain and YaRN RoPE)")
    if rope_type == "yarn" and (rope.get("truncate", True) or rope.get("attention_factor") or rope.get("mscale")):
        raise ValueError("only gpt-oss's YaRN (truncate false, the default attention factor) is supported")
    return rope if rope_type == "yarn" else {"rope_theta": rope["rope_theta"], "factor": 1.0}


def model_args_from_hf(config: dict) -> ModelArgs:
    """ModelArgs of the ingot model equal to the GptOssForCausalLM of an HF config.json (transformers' defaults for
    absent fields). Where the shape is one of ingot's flavors, that flavor's args are returned, with the vocabulary
    and context of the checkpoint."""
    if config.get("model_type") != "gpt_oss":
        raise ValueError(f"model_type {config.get('model_type')!r} is not gpt_oss")
    if config.get("attention_bias") is False or config.get("tie_word_embeddings"):
        raise ValueError("only gpt-oss models with attention biases and untied embeddings are supported "
                         "(attention_bias, tie_word_embeddings)")
    rope = _rope(config)
    n_layers = config.get("num_hidden_layers", 36)
    layer_types = tuple(config.get("layer_types") or (SLIDING if i % 2 == 0 else FULL for i in range(n_layers)))
    unknown = set(layer_types) - {SLIDING, FULL}
    if unknown:
        raise ValueError(f"layer_types {sorted(unknown)}: gpt-oss layers are {SLIDING} or {FULL}")
    args = ModelArgs(
        dim=config.get("hidden_size", 2880),
        n_layers=n_layers,
        n_heads=config.get("num_attention_heads", 64),
        n_kv_heads=config.get("num_key_value_heads", 8),
        head_dim=config.get("head_dim", 64),
        vocab_size=config.get("vocab_size", 201088),
        norm_eps=config.get("rms_norm_eps", 1e-5),
        sliding_window=config.get("sliding_window") or 128,
        layer_types=layer_types,
        rope_theta=rope["rope_theta"],
        rope_factor=rope.get("factor", 1.0),
        rope_original_seq_len=rope.get("original_max_position_embeddings", 4096),
        rope_beta_fast=rope.get("beta_fast", 32.0),
        rope_beta_slow=rope.get("beta_slow", 1.0),
        swiglu_limit=config.get("swiglu_limit", 7.0),
        swiglu_alpha=config.get("swiglu_alpha", 1.702),
        max_seq_len=config.get("max_position_embeddings", 131072),
        moe=MoEArgs(num_experts=config.get("num_local_experts", config.get("num_experts", 128)),
                    top_k=config.get("num_experts_per_tok", 4), hidden_dim=config.get("intermediate_size", 2880),
                    norm_topk_prob=True, router_bias=True),
    )
    return as_flavor(args, flavors, hf_config, HF_CONFIG_KEYS, "moe")
