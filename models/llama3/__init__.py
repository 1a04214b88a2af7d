"""Llama 3 / 3.1 / 3.2: the model, its published sizes ("flavors"), how to parallelize it and its
Hugging Face names. `__all__` below is this package's side of the model-package contract
(docs/models.md): the only names train.py, components/ and scripts/ use. A forked model exports the same."""

from components.config import Config
from models.decoder_config import check_grouped_query_heads, flavor_args
from models.llama3.config import ModelConfig
from models.llama3.flavors import flavors
from models.llama3.hf_mapping import HF_CONFIG_KEYS, from_hf, hf_config, model_args_from_hf, to_hf
from models.llama3.model import ModelArgs, Transformer
from models.llama3.parallelize import parallelize_llama as parallelize, tensor_parallel_plan

HF_MODEL_TYPES = ("llama",)
"""The Hugging Face model_types whose folders this family reads when nothing else names the family
(components/hf/load.py;
its exports, Qwen3's form under model.qk_norm included, name it in config.json). A fork that should not read them
empties it."""

# [model] keys that, when set, replace the flavor's value.
OVERRIDABLE = (
    "dim", "n_layers", "n_heads", "n_kv_heads", "multiple_of", "ffn_dim_multiplier", "ffn_dim", "norm_eps",
    "rope_theta", "use_rope_scaling", "rope_scaling_factor", "tie_embeddings", "vocab_size",
)


def build_model_args(config: Config, vocab_size: int) -> ModelArgs:
    """The flavor's dimensions, with the [model] overrides and the tokenizer's vocabulary applied."""
    args = flavor_args(config, flavors, OVERRIDABLE, vocab_size)
    if args.dim % args.n_heads:
        raise ValueError(f"model.dim {args.dim} is not divisible by model.n_heads {args.n_heads}")
    check_grouped_query_heads(args)
    if args.head_dim % 2:
        raise ValueError(f"head dim {args.head_dim} (model.dim / model.n_heads) must be even for RoPE")
    args.qk_norm = config.model.qk_norm
    if config.model.mup:
        args.mup_base_dim = config.model.mup_base_dim
    return args


__all__ = [
    # the model and its [model] keys
    "ModelConfig", "ModelArgs", "Transformer", "flavors", "build_model_args",
    # parallelism
    "parallelize", "tensor_parallel_plan",
    # Hugging Face interop
    "HF_MODEL_TYPES", "HF_CONFIG_KEYS", "from_hf", "hf_config", "model_args_from_hf", "to_hf",
]
