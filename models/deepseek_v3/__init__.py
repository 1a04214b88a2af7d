"""DeepSeek-V3: multi-head latent attention and a mixture of experts with shared experts and group-limited,
bias-corrected sigmoid routing; its published sizes ("flavors"), how to parallelize it and its Hugging Face names.
`__all__` below is this package's side of the model-package contract (docs/models.md)."""


from components.config import Config
from models.decoder_config import flavor_args
from models.deepseek_v3.config import ModelConfig
from models.deepseek_v3.flavors import flavors
from models.deepseek_v3.hf_mapping import HF_CONFIG_KEYS, HF_MODEL_TYPES, from_hf, hf_config, model_args_from_hf, to_hf
from models.deepseek_v3.model import ModelArgs, Transformer
from models.deepseek_v3.parallelize import parallelize_deepseek_v3 as parallelize, tensor_parallel_plan
from models.moe import moe_args_from_config

# [model] keys that, when set, replace the flavor's value.
OVERRIDABLE = ("dim", "n_layers", "n_heads", "ffn_dim", "first_dense_layers", "q_lora_rank", "kv_lora_rank",
               "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "norm_eps", "rope_theta", "rope_factor",
               "vocab_size")


def build_model_args(config: Config, vocab_size: int) -> ModelArgs:
    """The flavor's dimensions, with the [model] overrides, the tokenizer's vocabulary and the [moe] section's
    settings applied, checked."""
    args = flavor_args(config, flavors, OVERRIDABLE, vocab_size)
    if args.qk_rope_head_dim % 2:
        raise ValueError(f"model.qk_rope_head_dim {args.qk_rope_head_dim} must be even for RoPE")
    if args.moe is not None:
        args.moe = moe_args_from_config(args.moe, config.moe)
    args.num_mtp_layers, args.mtp_loss_weight = config.model.num_mtp_layers, config.model.mtp_loss_weight
    return args


__all__ = [
    # the model and its [model] keys
    "ModelConfig", "ModelArgs", "Transformer", "flavors", "build_model_args",
    # parallelism
    "parallelize", "tensor_parallel_plan",
    # Hugging Face interop
    "HF_MODEL_TYPES", "HF_CONFIG_KEYS", "from_hf", "hf_config", "model_args_from_hf", "to_hf",
]
