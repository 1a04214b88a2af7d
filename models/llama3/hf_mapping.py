"""Hugging Face interop for Llama 3: ingot's state-dict names <-> transformers' LlamaForCausalLM
names, and ModelArgs <-> the fields of its config.json (LlamaConfig). Every field is derived from the
model's arguments; a Llama with QK-norm (model.qk_norm) is Qwen3's architecture for transformers and is
written as a Qwen3ForCausalLM; a µP model (model.mup) has no form and is refused.

The weight mapping is a pure renaming. ingot's RoPE uses HF's rotate-half layout (see
model.Transformer), so q and k need no permutation, and any shard of a weight (an FSDP row block,
a TP slice) is the same shard of the HF tensor: a rank can load its own piece of an HF file.

config.json is written in the long-standing form (`rope_theta`, `rope_scaling`) that every
transformers release from 4.45 on reads, as do vLLM and lm-eval-harness; `model_args_from_hf` also
reads the newer `rope_parameters` form that transformers 5 writes.
"""

from __future__ import annotations

from models.activations import ACTIVATIONS
from models.hf_mapping import HFNames, as_flavor
from models.llama3.flavors import flavors
from models.llama3.model import ModelArgs

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
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attention.q_norm.weight": "self_attn.q_norm.weight",  # with qk_norm (the Qwen3 form)
    "attention.k_norm.weight": "self_attn.k_norm.weight",
}
NAMES = HFNames("Llama", _TOP_LEVEL, _IN_BLOCK, blocks="layers")

LLAMA3_LONG_CONTEXT = 131072
"""max_position_embeddings written for a model with Llama 3.1 RoPE scaling: the context that Llama
3.1, 3.2 and 3.3 advertise with it. Without scaling, the training sequence length is written."""

HF_CONFIG_KEYS = {
    "vocab_size": "model.vocab_size",
    "hidden_size": "model.dim",
    "intermediate_size": "model.ffn_dim (or model.multiple_of / model.ffn_dim_multiplier)",
    "num_hidden_layers": "model.n_layers",
    "num_attention_heads": "model.n_heads",
    "num_key_value_heads": "model.n_kv_heads",
    "head_dim": "model.dim / model.n_heads",
    "hidden_act": "the model's hidden_act (silu)",
    "rms_norm_eps": "model.norm_eps",
    "rope_theta": "model.rope_theta",
    "rope_scaling": "model.use_rope_scaling / model.rope_scaling_factor",
    "tie_word_embeddings": "model.tie_embeddings",
}
"""The config.json fields that fix the shape and the function of the model, each with the ingot
config key(s) that set it: an HF checkpoint loads into an ingot config only if all of them agree."""


def hf_name(name: str) -> str:
    """The HF name of an ingot parameter, e.g. layers.3.feed_forward.w1.weight ->
    model.layers.3.mlp.gate_proj.weight."""
    return NAMES.hf_name(name)


def ingot_name(name: str) -> str:
    """The ingot name of an HF LlamaForCausalLM parameter (the inverse of hf_name)."""
    return NAMES.ingot_name(name)


def check_llama_form(args: ModelArgs) -> None:
    """Refuse a model that no Hugging Face Llama form can express: one with µP's output multiplier (model.mup)."""
    if args.mup_base_dim:
        raise ValueError("model.mup: Hugging Face's LlamaForCausalLM has no output multiplier, so a µP model cannot "
                         "be exported to or loaded from a Llama folder")


def to_hf(state_dict: dict, args: ModelArgs) -> dict:
    """An ingot (full or partial, e.g. one pipeline stage's) state dict under HF names. With tied
    embeddings, output.weight is the embedding matrix itself, which HF files hold once, as
    model.embed_tokens.weight."""
    check_llama_form(args)
    return {hf_name(k): v for k, v in state_dict.items() if not (args.tie_embeddings and k == "output.weight")}


def from_hf(state_dict: dict, args: ModelArgs) -> dict:
    """An HF state dict under ingot names. With tied embeddings, output.weight is added as the
    embedding (ingot's state dict lists both names of the shared matrix) and an HF lm_head.weight,
    which some tied checkpoints store as a copy, is dropped. Old checkpoints' rotary inv_freq
    buffers are skipped."""
    renamed = {
        ingot_name(k): v
        for k, v in state_dict.items()
        if not k.endswith("rotary_emb.inv_freq") and not (args.tie_embeddings and k == "lm_head.weight")
    }
    if args.tie_embeddings and "tok_embeddings.weight" in renamed:
        renamed["output.weight"] = renamed["tok_embeddings.weight"]
    return renamed


def hf_config(args: ModelArgs, bos_id: int | None = None, eos_id: int | None = None, dtype: str = "float32") -> dict:
    """config.json of the LlamaForCausalLM (with QK-norm: Qwen3ForCausalLM, which is Llama with QK-norm) equal
    to an ingot model with these args."""
    check_llama_form(args)
    rope_scaling = None
    if args.use_rope_scaling:
        rope_scaling = {
            "rope_type": "llama3",
            "factor": args.rope_scaling_factor,
            "low_freq_factor": args.rope_low_freq_factor,
            "high_freq_factor": args.rope_high_freq_factor,
            "original_max_position_embeddings": args.rope_original_max_seq_len,
        }
    form = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "use_sliding_window": False,
            "sliding_window": None} if args.qk_norm else {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    return form | {
        "vocab_size": args.vocab_size,
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads or args.n_heads,
        "head_dim": args.head_dim,
        "hidden_act": args.hidden_act,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "rope_scaling": rope_scaling,
        "max_position_embeddings": (
            max(args.max_seq_len, LLAMA3_LONG_CONTEXT) if args.use_rope_scaling else args.max_seq_len
        ),
        "tie_word_embeddings": args.tie_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "use_cache": True,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "torch_dtype": dtype,
    }


def _rope_fields(config: dict) -> tuple[float, dict]:
    """rope_theta and the scaling parameters ({} without scaling) from either config.json form."""
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    theta = rope.pop("rope_theta", config.get("rope_theta", 10000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise ValueError(f"RoPE type {rope_type!r} is not supported "
                         "(ingot has plain RoPE and Llama 3.1's 'llama3' scaling)")
    return theta, rope if rope_type == "llama3" else {}


def model_args_from_hf(config: dict) -> ModelArgs:
    """ModelArgs of the ingot model equal to the LlamaForCausalLM of an HF config.json.

    Where the shape is one of ingot's flavors, that flavor's args are returned (with the vocabulary
    and context of the checkpoint). Otherwise the FFN size is kept through `ffn_dim` when Llama's
    sizing rule (multiple_of 256, no multiplier) does not give intermediate_size."""
    if config.get("hidden_act", "silu") not in ACTIVATIONS or config.get("attention_bias") or config.get("mlp_bias"):
        raise ValueError(f"only Llama models with no biases and one of the activations {', '.join(ACTIVATIONS)} are "
                         "supported (attention_bias, mlp_bias, hidden_act)")
    heads = config["num_attention_heads"]
    if config.get("head_dim") not in (None, config["hidden_size"] // heads):
        raise ValueError(f"head_dim {config['head_dim']} is not hidden_size / num_attention_heads, which ingot assumes")
    theta, scaling = _rope_fields(config)
    args = ModelArgs(
        dim=config["hidden_size"],
        n_layers=config["num_hidden_layers"],
        n_heads=heads,
        n_kv_heads=config.get("num_key_value_heads") or heads,
        vocab_size=config["vocab_size"],
        norm_eps=config.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        max_seq_len=config.get("max_position_embeddings", 2048),
        tie_embeddings=config.get("tie_word_embeddings", False),
        hidden_act=config.get("hidden_act", "silu"),
        qk_norm=config.get("model_type") == "qwen3",
    )
    if scaling:
        args.use_rope_scaling = True
        args.rope_scaling_factor = scaling["factor"]
        args.rope_low_freq_factor = scaling["low_freq_factor"]
        args.rope_high_freq_factor = scaling["high_freq_factor"]
        # transformers falls back to max_position_embeddings too
        args.rope_original_max_seq_len = scaling.get("original_max_position_embeddings", args.max_seq_len)
    if args.ffn_hidden_dim != config["intermediate_size"]:
        args.ffn_dim = config["intermediate_size"]
    return as_flavor(args, flavors, hf_config, HF_CONFIG_KEYS)
