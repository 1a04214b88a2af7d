"""Qwen3 as a plain nn.Module, dense or mixture-of-experts: Llama 3's block (RMSNorm, grouped-query
attention, SwiGLU) with an RMSNorm over each head's queries and keys before RoPE (QK-norm), a head
size set on its own rather than dim / n_heads, plain RoPE with theta 1e6 and, in Qwen3-MoE, a
mixture of experts (models/moe.py) as the feed-forward of the blocks `ModelArgs.is_moe_layer` picks.

The decoder around the blocks (embedding, norm, output, document masking, the meta-device build and
`init_weights`) is every family's, models/decoder.py; `sdpa` works as in models/llama3/model.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.attention.flex_attention import BlockMask

from components.model.attention import CAUSAL, apply_rope, causal_attention
from models.decoder import Decoder, DecoderBlock
from models.moe import MoEArgs, dense_or_moe


@dataclass
class ModelArgs:
    dim: int = 1024
    n_layers: int = 28
    n_heads: int = 16
    n_kv_heads: int | None = 8
    head_dim: int = 128
    """The size of each head; Qwen3 keeps 128 whatever dim / n_heads is."""
    ffn_dim: int = 3072
    """The dense feed-forward's hidden size (intermediate_size)."""
    hidden_act: str = "silu"
    """The activation of the feed-forwards, dense and experts', by Hugging Face's name (models/activations.py)."""
    vocab_size: int = 151936
    norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    max_seq_len: int = 2048
    tie_embeddings: bool = False
    """Share one matrix between the token embedding and the output projection (0.6B, 1.7B, 4B)."""
    depth_init: bool = True
    """Scale each block's output projections by its depth (1/sqrt(2*(layer+1))) rather than by the
    total number of layers."""
    rope_per_document: bool = False
    """When the forward is given document_ids: RoPE positions restart at 0 at each document."""
    moe: MoEArgs | None = None
    """The mixture of experts of the MoE blocks; None: a dense model."""
    moe_layer_step: int = 1
    """With `moe`: every moe_layer_step-th block is MoE (Qwen3-MoE's decoder_sparse_step)..."""
    dense_layers: tuple[int, ...] = ()
    """...except these, which keep the dense feed-forward (mlp_only_layers)."""

    def is_moe_layer(self, layer_id: int) -> bool:
        return self.moe is not None and layer_id not in self.dense_layers and (layer_id + 1) % self.moe_layer_step == 0

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 per weight a token goes through (forward + backward) plus
        attention scores. An MoE block counts its router and the top_k (and shared) experts a token
        is sent to, not all of them; the embedding lookup does no matmul."""
        q_dim, kv_dim = self.n_heads * self.head_dim, (self.n_kv_heads or self.n_heads) * self.head_dim
        attention = self.dim * (q_dim + 2 * kv_dim) + q_dim * self.dim
        feed_forward = {False: 3 * self.dim * self.ffn_dim}
        if self.moe is not None:  # the router, and the experts each token goes through
            moe = self.moe
            active = moe.top_k + moe.num_shared_experts
            feed_forward[True] = self.dim * moe.num_experts + 3 * self.dim * moe.hidden_dim * active
        weights = self.n_layers * attention + self.dim * self.vocab_size
        weights += sum(feed_forward[self.is_moe_layer(layer)] for layer in range(self.n_layers))
        return 6 * weights + 12 * self.n_layers * self.n_heads * self.head_dim * seq_len


def rope_frequencies(args: ModelArgs) -> torch.Tensor:
    """cos/sin of every position's rotation angles, shape (max_seq_len, head_dim // 2, 2), in fp32
    with the operations of transformers' default RoPE."""
    dim = args.head_dim
    freqs = 1.0 / (args.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    angles = torch.outer(torch.arange(args.max_seq_len, dtype=torch.float32), freqs)
    return torch.stack([angles.cos(), angles.sin()], dim=-1)


class Attention(nn.Module):
    """Grouped-query attention with QK-norm. `sdpa` computes causal attention from q, k, v under the declared
    `attention_mask`, within documents given a document `mask`, and may be swapped (context parallelism), as in
    models/llama3/model.py.

    q_norm and k_norm act on whole heads, so tensor parallelism, which splits the heads, leaves them
    whole on every rank; each rank's gradient of their weights then comes from its own heads only and
    the TP plan has them summed over the ranks (parallelize.py)."""

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
        self.q_norm = nn.RMSNorm(self.head_dim, eps=args.norm_eps)
        self.k_norm = nn.RMSNorm(self.head_dim, eps=args.norm_eps)

    def init_weights(self, std: float, out_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=std)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=out_std)
        self.q_norm.reset_parameters()
        self.k_norm.reset_parameters()

    def forward(self, x: torch.Tensor, rope: torch.Tensor,
                mask: torch.Tensor | BlockMask | None = None) -> torch.Tensor:
        batch, seq, _ = x.shape
        # -1 rather than n_heads: under tensor parallelism each rank holds a slice of the heads.
        q = self.q_norm(self.wq(x).view(batch, seq, -1, self.head_dim))
        k = self.k_norm(self.wk(x).view(batch, seq, -1, self.head_dim))
        v = self.wv(x).view(batch, seq, -1, self.head_dim)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = self.sdpa(q, k, v, mask, self.attention_mask)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class TransformerBlock(DecoderBlock):
    """Qwen3's block: its attention, and a SwiGLU feed-forward (models/decoder.py) or, in the blocks
    `ModelArgs.is_moe_layer` picks, a mixture of experts."""

    def __init__(self, layer_id: int, args: ModelArgs):
        attention = Attention(args)
        super().__init__(attention, dense_or_moe(layer_id, args), layer_id, args)


class Transformer(Decoder):
    """Token ids (batch, seq) in, logits (batch, seq, vocab) out: models/decoder.py's Decoder of Qwen3's blocks. RoPE
    is in Hugging Face's rotate-half layout, so an HF checkpoint's weights are used as they are."""

    def __init__(self, args: ModelArgs):
        super().__init__(args, TransformerBlock, rope_frequencies, tied=args.tie_embeddings,
                         output_std=args.dim**-0.5)
