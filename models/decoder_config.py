"""The `[model]` keys that the decoder families here share (models/llama3, models/qwen3): a family's ModelConfig
extends this class with its own keys (models/<name>/config.py), and leaves out what it has no use for by not
extending it. Each set key replaces the flavor's value (handy for ablations)."""

from __future__ import annotations

import typing
from collections.abc import Sequence
from dataclasses import dataclass, replace

from components.config import COUNT, POSITIVE, Config, Model, Range


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


def flavor_args(config: Config, flavors: dict, overridable: Sequence[str], vocab_size: int):
    """What every family's build_model_args starts from: the flavor `model.flavor` names, with the tokenizer's
    vocabulary, the [model] keys of `overridable` that are set, the training's sequence length and
    model.rope_per_document; the vocabulary checked."""
    if config.model.flavor not in flavors:
        raise ValueError(f"model.flavor '{config.model.flavor}' is not one of: {', '.join(flavors)}")
    args = replace(flavors[config.model.flavor], vocab_size=vocab_size)
    for key in overridable:
        value = getattr(config.model, key)
        if value is not None:
            setattr(args, key, value)
    if args.vocab_size < vocab_size:
        raise ValueError(f"model.vocab_size {args.vocab_size} is smaller "
                         f"than the tokenizer's vocabulary ({vocab_size})")
    args.max_seq_len = config.training.seq_len
    args.rope_per_document = config.model.rope_per_document
    return args


def check_grouped_query_heads(args) -> None:
    """The query heads must split evenly over the key/value heads (`n_kv_heads`; None: as many as the queries)."""
    if args.n_heads % (args.n_kv_heads or args.n_heads):
        raise ValueError(f"model.n_heads {args.n_heads} is not divisible by model.n_kv_heads {args.n_kv_heads}")
