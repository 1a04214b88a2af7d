"""Qwen3 as a plain nn.Module, dense or mixture-of-experts: Llama 3's block (RMSNorm, grouped-query
attention, SwiGLU) with an RMSNorm over each head's queries and keys before RoPE (QK-norm), a head
size set on its own rather than dim / n_heads, plain RoPE with theta 1e6 and, in Qwen3-MoE, a
mixture of experts (models/moe.py) as the feed-forward of the blocks `ModelArgs.is_moe_layer` picks.

Document masking, the meta-device build, `local_positions` and `sdpa` work as in models/llama3/model.py
(see its docstrings); every method here works on plain tensors and on DTensors alike.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import nn
from torch.nn.attention.flex_attention import BlockMask

from components.model.attention import CAUSAL, apply_rope, causal_attention, document_mask
from models.activations import activation
from models.decoder_init import init_decoder_ends
from models.decoder_inputs import rope_and_masks
from models.moe import MoE, MoEArgs


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

    def init_weights(self, out_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=0.02)
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


class FeedForward(nn.Module):
    """Gated: w2(act(w1 x) * w3 x), SwiGLU with act = silu."""

    def __init__(self, dim: int, hidden_dim: int, hidden_act: str = "silu"):
        super().__init__()
        self.act = activation(hidden_act)
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def init_weights(self, out_std: float) -> None:
        nn.init.trunc_normal_(self.w1.weight, mean=0.0, std=0.02)
        for linear in (self.w2, self.w3):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=out_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.act(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__()
        self.attention = Attention(args)
        if args.is_moe_layer(layer_id):  # its experts take the model's activation
            self.feed_forward = MoE(args.dim, replace(args.moe, hidden_act=args.hidden_act))
        else:
            self.feed_forward = FeedForward(args.dim, args.ffn_dim, args.hidden_act)
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        depth = layer_id + 1 if args.depth_init else args.n_layers
        self.out_std = 0.02 / math.sqrt(2 * depth)

    def init_weights(self) -> None:
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(self.out_std)
        self.feed_forward.init_weights(self.out_std)

    def forward(self, x: torch.Tensor, rope: torch.Tensor,
                mask: torch.Tensor | BlockMask | None = None) -> torch.Tensor:
        # mask by keyword: tensor parallelism's input hook on `attention` lays out (x, rope) only.
        x = x + self.attention(self.attention_norm(x), rope, mask=mask)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    """Token ids (batch, seq) in, logits (batch, seq, vocab) out; the same structure, attributes and
    document masking as models.llama3.model.Transformer (whose docstring explains them). RoPE is in
    Hugging Face's rotate-half layout, so an HF checkpoint's weights are used as they are."""

    pipeline_ends = (("tok_embeddings",), ("norm", "output"))
    """The modules before and after the blocks (components/model/contract.py)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.register_buffer("rope", rope_frequencies(args), persistent=False)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, args) for i in range(args.n_layers)})
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.local_positions: Callable[[torch.Tensor | None], torch.Tensor] | None = None
        self.document_mask = document_mask

    def transformer_blocks(self) -> nn.ModuleDict:
        return self.layers

    @torch.no_grad()
    def init_weights(self) -> None:
        """Fill every parameter and buffer; works after `to_empty()` on a meta-built model, and on a
        pipeline stage that holds only some of the modules."""
        self.rope.copy_(rope_frequencies(self.args))
        for block in self.layers.values():
            block.init_weights()
        init_decoder_ends(self, "tok_embeddings", "norm", "output", tied=self.args.tie_embeddings,
                          output_std=self.args.dim**-0.5)

    def forward(self, tokens: torch.Tensor, document_ids: torch.Tensor | None = None) -> torch.Tensor:
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        rope, masks = rope_and_masks(self, self.rope, document_ids)
        for block in self.layers.values():
            h = block(h, rope, mask=masks.get(block.attention.attention_mask))
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h
