"""The `[model]` keys that the decoder families here share (models/llama3, models/qwen3): a family's ModelConfig
extends this class with its own keys (models/<name>/config.py), and leaves out what it has no use for by not
extending it. Each set key replaces the flavor's value (handy for ablations)."""

from __future__ import annotations

import typing
from dataclasses import dataclass

from components.config import COUNT, POSITIVE, Model, Range


@dataclass
class DecoderConfig(Model):
    n_layers: int | None = None
    """This and the keys below override the flavor's value when set."""
    dim: int | None = None
    n_heads: int | None = None
    n_kv_heads: int | None = None
    ffn_dim: int | None = None
    """The feed-forward hidden size (Hugging Face's intermediate_size)."""
    norm_eps: float | None = None
    rope_theta: float | None = None
    tie_embeddings: bool | None = None
    """One matrix for the token embedding and the output projection."""
    vocab_size: int | None = None
    """Defaults to the tokenizer's vocabulary; may be set larger (e.g. padded to a multiple of 64)."""
    rope_per_document: bool = False
    """With training.document_masking: RoPE positions restart at 0 at each document."""

    ranges: typing.ClassVar[dict[str, Range]] = {
        "n_layers": COUNT, "dim": COUNT, "n_heads": COUNT, "n_kv_heads": COUNT, "ffn_dim": COUNT, "norm_eps": POSITIVE,
        "rope_theta": POSITIVE, "vocab_size": COUNT,
    }
