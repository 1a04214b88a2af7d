"""Qwen3.5, dense and mixture-of-experts, a hybrid of Gated DeltaNet and gated attention layers: the model, its
published sizes ("flavors"), how to parallelize it and its Hugging Face names. `__all__` below is this package's
side of the model-package contract (docs/models.md): the only names train.py, components/ and scripts/ use."""

from components.config import Config
from models.decoder_config import check_grouped_query_heads, flavor_args
from models.moe import moe_args_from_config
from models.qwen3_5.config import ModelConfig
from models.qwen3_5.flavors import flavors
from models.qwen3_5.hf_mapping import HF_CONFIG_KEYS, from_hf, hf_config, model_args_from_hf, to_hf
from models.qwen3_5.model import ModelArgs, Transformer
from models.qwen3_5.parallelize import parallelize_qwen3_5 as parallelize, tensor_parallel_plan

HF_MODEL_TYPES = ("qwen3_5_text", "qwen3_5_moe_text")
"""The Hugging Face model_types whose folders this family reads when nothing else names the family
(components/hf/load.py): the text decoders (Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM)."""

# [model] keys that, when set, replace the flavor's value.
OVERRIDABLE = ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "norm_eps", "rope_theta", "tie_embeddings",
               "vocab_size", "full_attention_interval", "linear_n_key_heads", "linear_n_value_heads")


def build_model_args(config: Config, vocab_size: int) -> ModelArgs:
    """The flavor's dimensions, with the [model] overrides and the tokenizer's vocabulary applied, and
    for an MoE flavor the [moe] section's settings."""
    args = flavor_args(config, flavors, OVERRIDABLE, vocab_size)
    check_grouped_query_heads(args)
    if args.linear_n_value_heads % args.linear_n_key_heads:
        raise ValueError(f"model.linear_n_value_heads {args.linear_n_value_heads} is not a multiple of "
                         f"model.linear_n_key_heads {args.linear_n_key_heads}")
    if args.layer_types and len(args.layer_types) != args.n_layers:
        raise ValueError(f"model.n_layers {args.n_layers} does not match the flavor's {len(args.layer_types)} "
                         "layer_types: leave model.n_layers unset, or pick a flavor without explicit layer types")
    if args.moe is not None:
        args.moe = moe_args_from_config(args.moe, config.moe)
    return args


__all__ = [
    # the model and its [model] keys
    "ModelConfig", "ModelArgs", "Transformer", "flavors", "build_model_args",
    # parallelism
    "parallelize", "tensor_parallel_plan",
    # Hugging Face interop
    "HF_MODEL_TYPES", "HF_CONFIG_KEYS", "from_hf", "hf_config", "model_args_from_hf", "to_hf",
]
