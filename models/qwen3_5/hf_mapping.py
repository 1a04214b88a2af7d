"""Hugging Face interop for Qwen3.5: ingot's state-dict names <-> those of transformers' Qwen3_5ForCausalLM and
Qwen3_5MoeForCausalLM (the text decoders, model_type qwen3_5_text and qwen3_5_moe_text), and ModelArgs <-> the
fields of their config.json.

A block's token mixer is `attention` in ingot whatever its kind, `self_attn` (full attention) or `linear_attn`
(Gated DeltaNet) in Hugging Face, so the names within a block depend on its layer type. Hugging Face keeps
DeltaNet's q, k and v projections as one matrix (`in_proj_qkv`) and their convolutions as one (`conv1d.weight`,
channels x 1 x window), which ingot holds one per part so that tensor parallelism splits each by heads: to_hf
joins them (a copy, not a view: components/hf/load.py writes such tensors back through from_hf after loading),
from_hf splits them. The experts of an MoE layer are as Qwen3-MoE's (models/hf_experts.py); the shared expert and
its gate are renamed.
"""

from __future__ import annotations

import re

import torch

from models.activations import ACTIVATIONS
from models.hf_experts import experts_from_hf, experts_to_hf
from models.hf_mapping import HFNames, as_flavor, complete_import, has_hf_form, is_imported
from models.moe import MoEArgs
from models.qwen3_5.flavors import flavors
from models.qwen3_5.model import FULL, LINEAR, ModelArgs

_TOP_LEVEL = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_FEED_FORWARD_AND_NORMS = {
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.router.gate.weight": "mlp.gate.weight",
    "feed_forward.shared_experts.w1.weight": "mlp.shared_expert.gate_proj.weight",
    "feed_forward.shared_experts.w2.weight": "mlp.shared_expert.down_proj.weight",
    "feed_forward.shared_experts.w3.weight": "mlp.shared_expert.up_proj.weight",
    "feed_forward.shared_gate.weight": "mlp.shared_expert_gate.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
NAMES = {
    FULL: HFNames("Qwen3.5", _TOP_LEVEL, _FEED_FORWARD_AND_NORMS | {
        "attention.wq.weight": "self_attn.q_proj.weight",
        "attention.wk.weight": "self_attn.k_proj.weight",
        "attention.wv.weight": "self_attn.v_proj.weight",
        "attention.wo.weight": "self_attn.o_proj.weight",
        "attention.q_norm.weight": "self_attn.q_norm.weight",
        "attention.k_norm.weight": "self_attn.k_norm.weight",
    }),
    LINEAR: HFNames("Qwen3.5", _TOP_LEVEL, _FEED_FORWARD_AND_NORMS | {
        "attention.wz.weight": "linear_attn.in_proj_z.weight",
        "attention.wb.weight": "linear_attn.in_proj_b.weight",
        "attention.wa.weight": "linear_attn.in_proj_a.weight",
        "attention.wo.weight": "linear_attn.out_proj.weight",
        "attention.dt_bias": "linear_attn.dt_bias",
        "attention.A_log": "linear_attn.A_log",
        "attention.norm.weight": "linear_attn.norm.weight",
    }),
}
JOINED = {"linear_attn.in_proj_qkv.weight": ("wq.weight", "wk.weight", "wv.weight"),
          "linear_attn.conv1d.weight": ("conv_q", "conv_k", "conv_v")}
"""The DeltaNet tensors Hugging Face keeps as one, and ingot's parts of each (in `attention.`), in order."""

HF_CONFIG_KEYS = {
    "model_type": "model.flavor (a dense or a mixture-of-experts one)",
    "vocab_size": "model.vocab_size",
    "hidden_size": "model.dim",
    "intermediate_size": "model.ffn_dim",
    "num_hidden_layers": "model.n_layers",
    "num_attention_heads": "model.n_heads",
    "num_key_value_heads": "model.n_kv_heads",
    "head_dim": "model.flavor (its head_dim)",
    "layer_types": "model.full_attention_interval",
    "linear_num_key_heads": "model.linear_n_key_heads",
    "linear_num_value_heads": "model.linear_n_value_heads",
    "linear_key_head_dim": "model.flavor (its linear_key_head_dim)",
    "linear_value_head_dim": "model.flavor (its linear_value_head_dim)",
    "linear_conv_kernel_dim": "model.flavor (its conv_window)",
    "hidden_act": "the model's hidden_act (silu)",
    "rms_norm_eps": "model.norm_eps",
    "rope_parameters": "model.rope_theta (and the flavor's rotary_fraction)",
    "tie_word_embeddings": "model.tie_embeddings",
    "num_experts": "moe.num_experts",
    "num_experts_per_tok": "moe.top_k",
    "moe_intermediate_size": "moe.hidden_dim",
    "shared_expert_intermediate_size": "moe.num_shared_experts",
}
"""The config.json fields that fix the shape and the function of the model, each with the ingot config key(s) that
set it: an HF checkpoint loads into an ingot config only if all of them agree."""


def _kind(name: str, args: ModelArgs) -> str:
    block = re.match(r"layers\.(\d+)\.", name) or re.match(r"model\.layers\.(\d+)\.", name)
    return args.layer_type(int(block[1])) if block else FULL


def to_hf(state_dict: dict, args: ModelArgs) -> dict:
    """An ingot (full or partial, e.g. one pipeline stage's) state dict under HF names. With tied embeddings,
    output.weight is the embedding matrix itself, which HF files hold once. Experts are split into per-expert
    views; expert_bias is left out; DeltaNet's q, k, v projections and convolutions are joined (JOINED): the parts
    present, so that a part alone gives the joined tensor's name (the export keeps the parts in one file)."""
    hf = {}
    for name, tensor in state_dict.items():
        experts = re.fullmatch(r"layers\.(\d+)\.feed_forward\.experts\.(w[123])", name)
        part = re.fullmatch(r"layers\.(\d+)\.attention\.(w[qkv]\.weight|conv_[qkv])", name)
        if experts:
            hf |= experts_to_hf(experts[1], experts[2], tensor)
        elif part and args.layer_type(int(part[1])) == LINEAR:
            joined = next(hf_name for hf_name, parts in JOINED.items() if part[2] in parts)
            present = [state_dict[p] for p in (f"layers.{part[1]}.attention.{p}" for p in JOINED[joined])
                       if p in state_dict]
            if tensor is present[0]:  # the first part present joins them (all three in a whole state dict)
                hf[f"model.layers.{part[1]}.{joined}"] = torch.cat(present) if joined.endswith("qkv.weight") else \
                    torch.cat(present)[:, None]
        elif has_hf_form(name, args.tie_embeddings):
            hf[NAMES[_kind(name, args)].hf_name(name)] = tensor
    return hf


def from_hf(state_dict: dict, args: ModelArgs) -> dict:
    """An HF state dict (experts one per tensor, or fused as transformers holds them) under ingot names, with a zero
    routing bias for each MoE layer and DeltaNet's joined tensors split, without the multi-token prediction layer
    (`mtp.`) that the published checkpoints hold and transformers' models leave out too. With tied embeddings,
    output.weight is the embedding, and an HF lm_head.weight, which some tied checkpoints store as a copy, is
    dropped."""
    rest, experts = experts_from_hf(state_dict)
    renamed = {f"layers.{block}.feed_forward.experts.{projection}": tensor
               for (block, projection), tensor in experts.items()}
    key_dim = args.linear_n_key_heads * args.linear_key_head_dim
    sizes = [key_dim, key_dim, args.linear_n_value_heads * args.linear_value_head_dim]
    for name, tensor in rest.items():
        joined = re.fullmatch(r"model\.layers\.(\d+)\.(linear_attn\.(in_proj_qkv|conv1d)\.weight)", name)
        if name.startswith("mtp."):  # the published checkpoints' multi-token prediction layer: not built (as in HF)
            continue
        if joined:
            parts = tensor.split(sizes) if joined[3] == "in_proj_qkv" else tensor[:, 0].split(sizes)
            renamed |= {f"layers.{joined[1]}.attention.{p}": t for p, t in zip(JOINED[joined[2]], parts)}
        elif is_imported(name, args.tie_embeddings):
            renamed[NAMES[_kind(name, args)].ingot_name(name)] = tensor
    return complete_import(renamed, args.tie_embeddings)


def check_qwen3_5_form(args: ModelArgs) -> None:
    """Refuse a mixture of experts that Qwen3_5MoeForCausalLM cannot express: a softmax router over all the
    experts, unscaled, its top-k weights renormalized, one sigmoid-gated shared expert."""
    moe = args.moe
    if moe and (moe.score_func != "softmax" or moe.route_scale != 1.0 or moe.n_groups > 1 or not moe.norm_topk_prob
                or moe.num_shared_experts < 1 or not moe.shared_gate):
        raise ValueError(f"Qwen3_5MoeForCausalLM routes by softmax over all experts, unscaled and renormalized, with "
                         f"one gated shared expert: this model's experts (score_func {moe.score_func}, route_scale "
                         f"{moe.route_scale}, n_groups {moe.n_groups}, norm_topk_prob {moe.norm_topk_prob}, "
                         f"num_shared_experts {moe.num_shared_experts}, shared_gate {moe.shared_gate}) have no "
                         "Hugging Face form")


def hf_config(args: ModelArgs, bos_id: int | None = None, eos_id: int | None = None, dtype: str = "float32") -> dict:
    """config.json of the Qwen3_5ForCausalLM (or, with MoE, Qwen3_5MoeForCausalLM) equal to an ingot model with
    these args."""
    check_qwen3_5_form(args)
    config = {
        "architectures": ["Qwen3_5MoeForCausalLM" if args.moe else "Qwen3_5ForCausalLM"],
        "model_type": "qwen3_5_moe_text" if args.moe else "qwen3_5_text",
        "vocab_size": args.vocab_size,
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads or args.n_heads,
        "head_dim": args.head_dim,
        "layer_types": [args.layer_type(i) for i in range(args.n_layers)],
        "linear_num_key_heads": args.linear_n_key_heads,
        "linear_num_value_heads": args.linear_n_value_heads,
        "linear_key_head_dim": args.linear_key_head_dim,
        "linear_value_head_dim": args.linear_value_head_dim,
        "linear_conv_kernel_dim": args.conv_window,
        "hidden_act": args.hidden_act,
        "rms_norm_eps": args.norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": args.rope_theta,
                            "partial_rotary_factor": args.rotary_fraction},
        "max_position_embeddings": args.max_seq_len,
        "tie_word_embeddings": args.tie_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
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
            "shared_expert_intermediate_size": args.moe.hidden_dim * args.moe.num_shared_experts,
        }
        del config["intermediate_size"]
    return config


def model_args_from_hf(config: dict) -> ModelArgs:
    """ModelArgs of the ingot model equal to the Qwen3_5ForCausalLM or Qwen3_5MoeForCausalLM of an HF config.json
    (transformers' defaults for absent fields). Where the shape is one of ingot's flavors, that flavor's args are
    returned, with the vocabulary and context of the checkpoint."""
    model_type = config.get("model_type")
    if model_type not in ("qwen3_5_text", "qwen3_5_moe_text"):
        raise ValueError(f"model_type {model_type!r} is not a Qwen3.5 text decoder (qwen3_5_text, qwen3_5_moe_text); "
                         "a multimodal checkpoint's text_config is one")
    rope = dict(config.get("rope_parameters") or {})
    if rope.get("rope_type", "default") != "default" or config.get("attention_bias") or \
            config.get("hidden_act", "silu") not in ACTIVATIONS:
        raise ValueError(f"only Qwen3.5 models with plain RoPE, no attention bias and one of the activations "
                         f"{', '.join(ACTIVATIONS)} are supported (rope_parameters, attention_bias, hidden_act)")
    dense = model_type == "qwen3_5_text"
    heads = config.get("num_attention_heads", 16)
    args = ModelArgs(
        dim=config.get("hidden_size", 4096 if dense else 2048),
        n_layers=config.get("num_hidden_layers", 32 if dense else 40),
        n_heads=heads,
        n_kv_heads=config.get("num_key_value_heads", 4 if dense else 2),
        head_dim=config.get("head_dim", 256),
        rotary_fraction=rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 0.25)),
        linear_n_key_heads=config.get("linear_num_key_heads", 16),
        linear_n_value_heads=config.get("linear_num_value_heads", 32),
        linear_key_head_dim=config.get("linear_key_head_dim", 128),
        linear_value_head_dim=config.get("linear_value_head_dim", 128),
        conv_window=config.get("linear_conv_kernel_dim", 4),
        ffn_dim=config.get("intermediate_size", 12288) if dense else 0,
        hidden_act=config.get("hidden_act", "silu"),
        vocab_size=config.get("vocab_size", 248320),
        norm_eps=config.get("rms_norm_eps", 1e-6),
        rope_theta=rope.get("rope_theta", config.get("rope_theta", 10000.0)),
        max_seq_len=config.get("max_position_embeddings", 32768),
        tie_embeddings=config.get("tie_word_embeddings", False),
    )
    types = tuple(config.get("layer_types") or ())
    if types and types != tuple(args.layer_type(i) for i in range(args.n_layers)):
        if set(types) - {FULL, LINEAR} or len(types) != args.n_layers:
            raise ValueError(f"layer_types {list(types)} is not {args.n_layers} of {FULL!r} and {LINEAR!r}")
        args.layer_types = types
    if not dense:
        hidden, shared = config.get("moe_intermediate_size", 512), config.get("shared_expert_intermediate_size", 512)
        if shared % hidden:
            raise ValueError(f"shared_expert_intermediate_size {shared} is not a multiple of moe_intermediate_size "
                             f"{hidden}: ingot's shared experts are num_shared_experts x moe.hidden_dim wide")
        args.moe = MoEArgs(num_experts=config.get("num_experts", 256), top_k=config.get("num_experts_per_tok", 8),
                           hidden_dim=hidden, num_shared_experts=shared // hidden, shared_gate=True)
    return as_flavor(args, flavors, hf_config, HF_CONFIG_KEYS, "moe", "layer_types")
