"""The `[model]` keys of gpt-oss: each set key replaces the flavor's value. The experts are set in the shared
`[moe]` section."""

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
    head_dim: int | None = None
    sliding_window: int | None = None
    """The keys a sliding-window layer's queries see (the published models: 128); the other layers see all."""
    norm_eps: float | None = None
    rope_theta: float | None = None
    rope_factor: float | None = None
    """YaRN's context extension factor (the published weights': 32); 1: plain RoPE."""
    vocab_size: int | None = None
    """Defaults to the tokenizer's vocabulary; may be set larger."""
    rope_per_document: bool = False
    """With training.document_masking: RoPE positions restart at 0 at each document."""

    ranges: typing.ClassVar[dict[str, Range]] = {
        "n_layers": COUNT, "dim": COUNT, "n_heads": COUNT, "n_kv_heads": COUNT, "head_dim": COUNT,
        "sliding_window": COUNT, "norm_eps": POSITIVE, "rope_theta": POSITIVE, "rope_factor": Range(1),
        "vocab_size": COUNT,
    }
