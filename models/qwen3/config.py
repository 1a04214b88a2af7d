"""The `[model]` keys of Qwen3 (beyond name, flavor and tokenizer_path, which every family has): each set
key replaces the flavor's value. The experts of the MoE flavors are set in the shared `[moe]` section."""

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
    ffn_dim: int | None = None
    """The dense feed-forward's hidden size (intermediate_size)."""
    norm_eps: float | None = None
    rope_theta: float | None = None
    tie_embeddings: bool | None = None
    """One matrix for the token embedding and the output projection (the 0.6B, 1.7B and 4B flavors)."""
    vocab_size: int | None = None
    """Defaults to the tokenizer's vocabulary; may be set larger (e.g. padded to a multiple of 64)."""
    rope_per_document: bool = False
    """With training.document_masking: RoPE positions restart at 0 at each document."""

    ranges: typing.ClassVar[dict[str, Range]] = {
        "n_layers": COUNT, "dim": COUNT, "n_heads": COUNT, "n_kv_heads": COUNT, "ffn_dim": COUNT,
        "norm_eps": POSITIVE, "rope_theta": POSITIVE, "vocab_size": COUNT,
    }
