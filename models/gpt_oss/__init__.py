"""gpt-oss: alternating sliding-window and full attention with learned sinks, and a mixture of experts with biased
routing and clamped SwiGLU experts; its published sizes ("flavors"), how to parallelize it and its Hugging Face
names. `__all__` below is this package's side of the model-package contract (docs/models.md)."""


from components.config import Config
from models.decoder_config import check_grouped_query_heads, flavor_args
from models.gpt_oss.config import ModelConfig
from models.gpt_oss.flavors import flavors
from models.gpt_oss.hf_mapping import HF_CONFIG_KEYS, from_hf, hf_config, model_args_from_hf, to_hf
from models.gpt_oss.model import ModelArgs, Transformer
from models.gpt_oss.parallelize import parallelize_gpt_oss as parallelize, tensor_parallel_plan
from models.moe import moe_args_from_config

HF_MODEL_TYPES = ("gpt_oss",)
"""The Hugging Face model_types whose folders this family reads when nothing else names the family
(components/hf/load.py)."""

# [model] keys that, when set, replace the flavor's value.
OVERRIDABLE = ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "sliding_window", "norm_eps", "rope_theta",
               "rope_factor", "vocab_size")


def build_model_args(config: Config, vocab_size: int) -> ModelArgs:
    """The flavor's dimensions, with the [model] overrides, the tokenizer's vocabulary and the [moe] section's
    settings applied, checked."""
    args = flavor_args(config, flavors, OVERRIDABLE, vocab_size)
    check_grouped_query_heads(args)
    if args.head_dim % 2:
        raise ValueError(f"model.head_dim {args.head_dim} must be even for RoPE")
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
