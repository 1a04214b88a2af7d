"""The `[model]` keys of DeepSeek-V3: its own set (multi-head latent attention has no n_kv_heads); each set key
replaces the flavor's value. The experts are set in the shared `[moe]` section."""

from __future__ import annotations

import typing
from dataclasses import dataclass

from components.config import COUNT, NON_NEGATIVE, OFF_AT_0, POSITIVE, Model, Range


@dataclass
class ModelConfig(Model):
    n_layers: int | None = None
    """This and the keys below override the flavor's value when set."""
    dim: int | None = None
    n_heads: int | None = None
    ffn_dim: int | None = None
    """The dense blocks' feed-forward hidden size (Hugging Face's intermediate_size)."""
    first_dense_layers: int | None = None
    """How many blocks, from the first, keep a dense feed-forward (first_k_dense_replace); the rest are MoE."""
    q_lora_rank: int | None = None
    """The queries' low-rank width; 0: one plain projection (the 16B flavor)."""
    kv_lora_rank: int | None = None
    """The width of the latent that keys and values are rebuilt from."""
    qk_nope_head_dim: int | None = None
    """Each head's query/key features without position..."""
    qk_rope_head_dim: int | None = None
    """...and those rotated by RoPE (one such key part per token, shared by the heads)."""
    v_head_dim: int | None = None
    """Each head's value size, which may differ from its query/key size (qk_nope_head_dim + qk_rope_head_dim)."""
    norm_eps: float | None = None
    rope_theta: float | None = None
    rope_factor: float | None = None
    """YaRN's context extension factor (the published weights': 40); 1: plain RoPE, as in pretraining."""
    vocab_size: int | None = None
    """Defaults to the tokenizer's vocabulary; may be set larger."""
    rope_per_document: bool = False
    """With training.document_masking: RoPE positions restart at 0 at each document."""
    num_mtp_layers: int = 0
    """Multi-token prediction: extra depths trained to predict 2, 3... tokens ahead, each one block (the published
    671B has 1); their loss is logged as mtp_loss."""
    mtp_loss_weight: float = 0.3
    """What multiplies the extra depths' mean loss in the training loss (DeepSeek-V3: 0.3, later 0.1)."""

    ranges: typing.ClassVar[dict[str, Range]] = {
        "n_layers": COUNT, "dim": COUNT, "n_heads": COUNT, "ffn_dim": COUNT, "first_dense_layers": Range(0),
        "q_lora_rank": Range(0), "kv_lora_rank": COUNT, "qk_nope_head_dim": Range(0), "qk_rope_head_dim": COUNT,
        "v_head_dim": COUNT, "norm_eps": POSITIVE, "rope_theta": POSITIVE, "rope_factor": Range(1),
        "vocab_size": COUNT, "num_mtp_layers": OFF_AT_0, "mtp_loss_weight": NON_NEGATIVE,
    }
