"""The `[model]` keys of Qwen3: those every decoder family here has (models/decoder_config.py), and no more. The
experts of the MoE flavors are set in the shared `[moe]` section."""

from __future__ import annotations

from dataclasses import dataclass

from models.decoder_config import DecoderConfig


@dataclass
class ModelConfig(DecoderConfig):
    pass
