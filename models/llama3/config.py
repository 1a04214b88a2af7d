"""The `[model]` keys of Llama 3 (beyond name, flavor and tokenizer_path, which every family has): each set
key replaces the flavor's value (handy for ablations). A fork adds its own knobs here and reads them in
build_model_args (models/llama3/__init__.py); docs/configuration.md lists them under this family."""

from __future__ import annotations

import typing
from dataclasses import dataclass

from components.config import COUNT, POSITIVE, Model, Range


@dataclass
class ModelConfig(Model):
    n_layers: int | None = None
    """This and the keys below override the flavor's value when set."""
    dim: int | None = None
    n_heads: int | None = None
    n_kv_heads: int | None = None
    multiple_of: int | None = None
    ffn_dim_multiplier: float | None = None
    ffn_dim: int | None = None
    """The feed-forward hidden size, replacing the multiple_of / ffn_dim_multiplier rule (e.g. for
    a Hugging Face checkpoint whose intermediate_size that rule does not give)."""
    norm_eps: float | None = None
    rope_theta: float | None = None
    use_rope_scaling: bool | None = None
    """Llama 3.1 RoPE frequency scaling for long context."""
    rope_scaling_factor: float | None = None
    """How much Llama 3.1 scaling slows the low frequencies (8 for Llama 3.1, 32 for Llama 3.2)."""
    tie_embeddings: bool | None = None
    """One matrix for the token embedding and the output projection (Llama 3.2 1B and 3B)."""
    vocab_size: int | None = None
    """Defaults to the tokenizer's vocabulary; may be set larger (e.g. padded to a multiple of 64)."""
    rope_per_document: bool = False
    """With training.document_masking: RoPE positions restart at 0 at each document."""
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

    ranges: typing.ClassVar[dict[str, Range]] = {
        "n_layers": COUNT, "dim": COUNT, "n_heads": COUNT, "n_kv_heads": COUNT, "multiple_of": COUNT,
        "ffn_dim_multiplier": POSITIVE, "ffn_dim": COUNT, "norm_eps": POSITIVE, "rope_theta": POSITIVE,
        "rope_scaling_factor": Range(1), "vocab_size": COUNT, "mup_base_dim": COUNT,
    }
