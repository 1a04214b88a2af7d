"""The `[model]` keys of Qwen3.5: those every decoder family here has (models/decoder_config.py), and the linear
layers' own. The experts of the MoE flavors are set in the shared `[moe]` section."""

from __future__ import annotations

import typing
from dataclasses import dataclass

from components.config import COUNT, Range
from models.decoder_config import DecoderConfig


@dataclass
class ModelConfig(DecoderConfig):
    full_attention_interval: int | None = None
    """Every full_attention_interval-th layer is full attention, the others Gated DeltaNet (the flavor's: 4)."""
    linear_n_key_heads: int | None = None
    """The Gated DeltaNet layers' query/key heads."""
    linear_n_value_heads: int | None = None
    """The Gated DeltaNet layers' value heads, a multiple of linear_n_key_heads."""

    ranges: typing.ClassVar[dict[str, Range]] = DecoderConfig.ranges | {
        "full_attention_interval": COUNT, "linear_n_key_heads": COUNT, "linear_n_value_heads": COUNT,
    }
