"""Llama 3 as a plain nn.Module: RMSNorm, RoPE with Llama 3.1 frequency scaling (in Hugging Face's
rotate-half layout, see Transformer), grouped-query attention through scaled_dot_product_attention,
SwiGLU feed-forward; optionally QK-norm (`ModelArgs.qk_norm`) and the maximal-update
parametrization (`ModelArgs.mup_base_dim`, docs/mup.md).

The decoder around the blocks (embedding, norm, output, document masking, the meta-device build and
`init_weights`) is every family's, models/decoder.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.attention.flex_attention import BlockMask

from components.model.attention import CAUSAL, apply_rope, causal_attention, grouped_query_rows, scale_rows
from models.decoder import Decoder, DecoderBlock, FeedForward


@dataclass
class ModelArgs:
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None
    vocab_size: int = 128256
    multiple_of: int = 256
    ffn_dim_multiplier: float | None = None
    ffn_dim: int | None = None
    """The feed-forward hidden size, when set; unset: computed from dim, multiple_of and
    ffn_dim_multiplier as Llama does (for imported models whose size that rule does not give)."""
    hidden_act: str = "silu"
    """The feed-forward's activation, by Hugging Face's name (models/activations.py): SwiGLU with silu."""
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    use_rope_scaling: bool = False
    rope_scaling_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_seq_len: int = 8192
    max_seq_len: int = 2048
    tie_embeddings: bool = False
    """Share one matrix between the token embedding and the output projection (Llama 3.2 1B/3B)."""
    depth_init: bool = True
    """Scale each block's output projections by its depth (1/sqrt(2*(layer+1))) rather than by the
    total number of layers."""
    rope_per_document: bool = False
    """When the forward is given document_ids: RoPE positions restart at 0 at each document."""
    qk_norm: bool = False
    """An RMSNorm over each head's queries and keys before RoPE (QK-norm, as in Qwen3)."""
    mup_base_dim: int | None = None
    """µP relative to a model of this width (docs/mup.md); None: the standard parametrization."""

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def mup_width(self) -> float:
        """µP's width multiplier m = dim / mup_base_dim; 1 without µP. The block matrices' init std is
        divided by sqrt(m) (here) and their lr by m (components/training/optimizers.py), the logits by m (Transformer).
        All of them grow with dim (the feed-forward size too), so one m serves them all."""
        return self.dim / self.mup_base_dim if self.mup_base_dim else 1.0

    @property
    def ffn_hidden_dim(self) -> int:
        if self.ffn_dim is not None:
            return self.ffn_dim
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 per weight (forward + backward) plus attention scores.

        The embedding lookup does no matmul, so its weights are left out."""
        head_dim, kv_dim = self.head_dim, (self.n_kv_heads or self.n_heads) * self.head_dim
        per_layer = self.dim * (self.dim + 2 * kv_dim) + self.dim * self.dim + 3 * self.dim * self.ffn_hidden_dim
        weights = self.n_layers * per_layer + self.dim * self.vocab_size
        return 6 * weights + 12 * self.n_layers * self.n_heads * head_dim * seq_len


def rope_frequencies(args: ModelArgs) -> torch.Tensor:
    """cos/sin of every position's rotation angles, shape (max_seq_len, head_dim // 2, 2).

    With Llama 3.1 scaling, low frequencies (long wavelengths) are slowed by `rope_scaling_factor`,
    high ones are kept, and the band between is interpolated smoothly. Computed in fp32 with the
    same operations as Meta's reference and transformers' `rope_type="llama3"`, so that imported
    weights see the very angles they were trained with."""
    dim = args.head_dim
    freqs = 1.0 / (args.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if args.use_rope_scaling:
        wavelen = 2 * math.pi / freqs
        low_freq_wavelen = args.rope_original_max_seq_len / args.rope_low_freq_factor
        high_freq_wavelen = args.rope_original_max_seq_len / args.rope_high_freq_factor
        smooth = (args.rope_original_max_seq_len / wavelen - args.rope_low_freq_factor) / (
            args.rope_high_freq_factor - args.rope_low_freq_factor
        )
        scaled = freqs / args.rope_scaling_factor
        between = (1 - smooth) * freqs / args.rope_scaling_factor + smooth * freqs  # transformers' order: same bits
        freqs = torch.where(wavelen > low_freq_wavelen, scaled,
                            torch.where(wavelen < high_freq_wavelen, freqs, between))
    angles = torch.outer(torch.arange(args.max_seq_len, dtype=torch.float32), freqs)
    return torch.stack([angles.cos(), angles.sin()], dim=-1)


class Attention(nn.Module):
    """Grouped-query attention. `sdpa` computes causal attention from q, k, v under the mask the module declares,
    `attention_mask` (components/model/attention.py: full causal here; a fork sets a sliding window there), within
    documents given a document `mask` (whatever the model's `document_mask` built for that declaration). Context
    parallelism swaps `sdpa` for one that sees the keys and values of the whole sequence, reading the same
    declaration.

    With `qk_norm`, q_norm and k_norm normalize each head's queries and keys before RoPE; they exist
    only then, so that the state dict of a model without them is unchanged. They act on whole heads,
    which tensor parallelism keeps whole; parallelize.py has their gradients summed over the tp ranks."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.sdpa = causal_attention
        self.attention_mask = CAUSAL  # full causal attention in every layer
        self.n_heads = args.n_heads
        self.n_kv_heads = args.n_kv_heads or args.n_heads
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(self.n_heads * self.head_dim, args.dim, bias=False)
        self.qk_norm = args.qk_norm
        if self.qk_norm:
            self.q_norm = nn.RMSNorm(self.head_dim, eps=args.norm_eps)
            self.k_norm = nn.RMSNorm(self.head_dim, eps=args.norm_eps)

    def init_weights(self, std: float, out_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=std)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=out_std)
        if self.qk_norm:
            self.q_norm.reset_parameters()
            self.k_norm.reset_parameters()

    def scale_query_key(self, factors: torch.Tensor) -> None:
        """QK-clip (components/model/attention.py's ClippableAttention), split between the grouped-query heads by
        `grouped_query_rows`."""
        query, key = grouped_query_rows(factors, self.n_kv_heads, self.head_dim)
        scale_rows(self.wq.weight, query)
        scale_rows(self.wk.weight, key)

    def forward(self, x: torch.Tensor, rope: torch.Tensor,
                mask: torch.Tensor | BlockMask | None = None) -> torch.Tensor:
        batch, seq, _ = x.shape
        # -1 rather than n_heads: under tensor parallelism each rank holds a slice of the heads.
        q = self.wq(x).view(batch, seq, -1, self.head_dim)
        k = self.wk(x).view(batch, seq, -1, self.head_dim)
        v = self.wv(x).view(batch, seq, -1, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = self.sdpa(q, k, v, mask, self.attention_mask)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class TransformerBlock(DecoderBlock):
    """Llama 3's block: its attention and a SwiGLU feed-forward (models/decoder.py), with µP's init std."""

    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__(Attention(args), FeedForward(args.dim, args.ffn_hidden_dim, args.hidden_act), layer_id, args,
                         width_scale=args.mup_width**-0.5)  # 1 without µP


class Transformer(Decoder):
    """Token ids (batch, seq) in, logits (batch, seq, vocab) out: models/decoder.py's Decoder of Llama 3's blocks,
    with µP's output multiplier.

    RoPE layout: each head's dimension i is rotated together with dimension i + head_dim/2
    ("rotate-half"), as in Hugging Face's LlamaForCausalLM, rather than with dimension i ^ 1 as in
    Meta's interleaved-complex reference. The two layouts are the same model up to a permutation
    of the rows of wq and wk within each head; with HF's layout the weights of an HF checkpoint are
    used as they are (models/llama3/hf_mapping.py only renames them), so that even a sharded rank whose
    shard cuts through a head can load its own piece directly."""

    def __init__(self, args: ModelArgs):
        # µP: the output layer's std is the base width's, whatever the width.
        super().__init__(args, TransformerBlock, rope_frequencies, tied=args.tie_embeddings,
                         output_std=(args.mup_base_dim or args.dim) ** -0.5)

    def forward(self, tokens: torch.Tensor, document_ids: torch.Tensor | None = None) -> torch.Tensor:
        h, _, _ = self.hidden_states(tokens, document_ids)
        if self.output is None:
            return h
        if self.args.mup_base_dim:  # µP's output multiplier 1/m, on the (smaller) input of the projection
            h = h / self.args.mup_width
        return self.output(h)
