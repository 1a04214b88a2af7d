"""The `[model]` keys of Llama 3: those every decoder family here has (models/decoder_config.py), and its own
below. A fork adds its knobs here and reads them in build_model_args (models/llama3/__init__.py);
docs/configuration.md lists them under the family."""

from __future__ import annotations

import typing
from dataclasses import dataclass

from components.config import COUNT, POSITIVE, Range
from models.decoder_config import DecoderConfig


@dataclass
class ModelConfig(DecoderConfig):
    multiple_of: int | None = None
    """The feed-forward size is rounded up to a multiple of this (Llama's rule, with ffn_dim_multiplier), unless
    model.ffn_dim sets it."""
    ffn_dim_multiplier: float | None = None
    use_rope_scaling: bool | None = None
    """Llama 3.1 RoPE frequency scaling for long context."""
    rope_scaling_factor: float | None = None
    """How much Llama 3.1 scaling slows the low frequencies (8 for Llama 3.1, 32 for Llama 3.2)."""
    qk_norm: bool = False
    """An RMSNorm over each head's queries and keys before RoPE, as in Qwen3: bounds the attention logits,
    against loss spikes in long runs. Such a model's Hugging Face form is Qwen3ForCausalLM."""
    mup: bool = False
    """The maximal-update parametrization (µP, docs/mup.md), so that an lr tuned at width mup_base_dim
    carries over to wider models: with m = dim / mup_base_dim, the block matrices' init std is divided by
    sqrt(m) and their AdamW lr by m, and the logits by m. Such a model has no Hugging Face form."""
    mup_base_dim: int = 256
    """Under mup: the width (model.dim) at which µP is the standard parametrization, the width whose
    tuned lr is reused."""

    ranges: typing.ClassVar[dict[str, Range]] = DecoderConfig.ranges | {
        "multiple_of": COUNT, "ffn_dim_multiplier": POSITIVE, "rope_scaling_factor": Range(1), "mup_base_dim": COUNT,
    }
