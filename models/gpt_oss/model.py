"""gpt-oss as a plain nn.Module: Qwen3-MoE's block without QK-norm, with biases on the attention's projections,
a learned sink logit per head, sliding-window layers alternating with full ones (`layer_types`), YaRN RoPE, and a
mixture of experts whose router and experts have biases and whose experts apply gpt-oss's clamped SwiGLU.

The window is declared on each attention module (`attention_mask`, components/model/attention.py's AttentionMask), the
sinks are passed to its `sdpa` (`sink_logits`): every kernel, context parallelism's included, honours both.
The decoder around the blocks (embedding, norm, output, document masking, the meta-device build and `init_weights`)
is every family's, models/decoder.py; `sdpa` works as in models/llama3/model.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.attention.flex_attention import BlockMask

from components.model.attention import (
    CAUSAL,
    AttentionMask,
    apply_rope,
    causal_attention,
    grouped_query_rows,
    scale_rows,
)
from components.torch_private import grouped_mm
from models.decoder import Decoder, DecoderBlock
from models.moe import MoE, MoEArgs, use_grouped_mm

SLIDING, FULL = "sliding_attention", "full_attention"
"""The layer types of Hugging Face's config (layer_types)."""


@dataclass
class ModelArgs:
    dim: int = 2880
    n_layers: int = 24
    n_heads: int = 64
    n_kv_heads: int = 8
    head_dim: int = 64
    vocab_size: int = 201088
    norm_eps: float = 1e-5
    sliding_window: int = 128
    """The keys a sliding-window layer's queries see: the last `sliding_window`, their own included."""
    layer_types: tuple[str, ...] | None = None
    """sliding_attention or full_attention per block; None: sliding first, then alternating (as published)."""
    rope_theta: float = 150000.0
    rope_factor: float = 32.0
    """YaRN's context extension factor; 1: plain RoPE."""
    rope_original_seq_len: int = 4096
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    swiglu_limit: float = 7.0
    """The experts' clamp: the gate at most this, the up projection within +-this."""
    swiglu_alpha: float = 1.702
    """The experts' gate is gate * sigmoid(alpha * gate)."""
    max_seq_len: int = 4096
    depth_init: bool = True
    """Scale each block's output projections by its depth (1/sqrt(2*(layer+1))) rather than by the number of layers."""
    rope_per_document: bool = False
    """When the forward is given document_ids: RoPE positions restart at 0 at each document."""
    moe: MoEArgs = field(default_factory=lambda: MoEArgs(num_experts=32, top_k=4, hidden_dim=2880,
                                                         norm_topk_prob=True, router_bias=True))
    """Every block's feed-forward (gpt-oss has no dense one)."""

    def layer_type(self, layer_id: int) -> str:
        return self.layer_types[layer_id] if self.layer_types is not None else (SLIDING if layer_id % 2 == 0 else FULL)

    def attention_mask(self, layer_id: int) -> AttentionMask:
        return AttentionMask(window=self.sliding_window) if self.layer_type(layer_id) == SLIDING else CAUSAL

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 per weight a token goes through (forward + backward; the router and its top_k
        experts, not all of them) plus the attention scores, over the window only in sliding-window layers."""
        q_dim, kv_dim = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        attention = self.dim * (q_dim + 2 * kv_dim) + q_dim * self.dim
        feed_forward = self.dim * self.moe.num_experts + 3 * self.dim * self.moe.hidden_dim * self.moe.top_k
        weights = self.n_layers * (attention + feed_forward) + self.dim * self.vocab_size
        keys = sum(min(seq_len, self.sliding_window) if self.layer_type(i) == SLIDING else seq_len
                   for i in range(self.n_layers))
        return 6 * weights + 12 * self.n_heads * self.head_dim * keys


def rope_frequencies(args: ModelArgs) -> torch.Tensor:
    """cos/sin of every position's rotation angles, (max_seq_len, head_dim // 2, 2), in fp32 with the operations of
    transformers' YaRN RoPE as gpt-oss configures it: the correction range not truncated to whole dimensions, the
    attention factor 0.1 ln(factor) + 1 on cos and sin."""
    dim, base = args.head_dim, args.rope_theta
    wavelengths = base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    freqs, scale = 1.0 / wavelengths, 1.0
    if args.rope_factor > 1:  # interpolated low frequencies, extrapolated high ones, a linear ramp between

        def correction_dim(rotations: float) -> float:
            return dim * math.log(args.rope_original_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low, high = max(correction_dim(args.rope_beta_fast), 0), min(correction_dim(args.rope_beta_slow), dim - 1)
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low if high > low else 0.001)).clamp(0, 1)
        extrapolated = 1 - ramp
        freqs = 1.0 / (args.rope_factor * wavelengths) * (1 - extrapolated) + freqs * extrapolated
        scale = 0.1 * math.log(args.rope_factor) + 1.0
    angles = torch.outer(torch.arange(args.max_seq_len, dtype=torch.float32), freqs)
    return torch.stack([angles.cos() * scale, angles.sin() * scale], dim=-1)


class Attention(nn.Module):
    """Grouped-query attention with biased projections and a learned sink logit per head, under the window its layer
    declares. Under tensor parallelism the sinks are sharded by heads like the queries (parallelize.py)."""

    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__()
        self.sdpa = causal_attention
        self.attention_mask = args.attention_mask(layer_id)
        self.head_dim, self.n_kv_heads = args.head_dim, args.n_kv_heads
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=True)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=True)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=True)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=True)
        self.sink_logits = nn.Parameter(torch.empty(args.n_heads))

    def init_weights(self, std: float, out_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=std)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=out_std)
        for linear in (self.wq, self.wk, self.wv, self.wo):
            nn.init.zeros_(linear.bias)
        nn.init.zeros_(self.sink_logits)

    def scale_query_key(self, factors: torch.Tensor) -> None:
        """QK-clip (components/model/attention.py's ClippableAttention), split between the grouped-query heads by
        `grouped_query_rows`, the projections' biases with their rows. The learned sinks are not logits of a key:
        left alone."""
        query, key = grouped_query_rows(factors, self.n_kv_heads, self.head_dim)
        for linear, rows in ((self.wq, query), (self.wk, key)):
            scale_rows(linear.weight, rows)
            scale_rows(linear.bias, rows)

    def forward(self, x: torch.Tensor, rope: torch.Tensor,
                mask: torch.Tensor | BlockMask | None = None) -> torch.Tensor:
        batch, seq, _ = x.shape
        # -1 rather than n_heads: under tensor parallelism each rank holds a slice of the heads.
        q = self.wq(x).view(batch, seq, -1, self.head_dim)
        k = self.wk(x).view(batch, seq, -1, self.head_dim)
        v = self.wv(x).view(batch, seq, -1, self.head_dim)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        sinks = self.sink_logits.to_local() if isinstance(self.sink_logits, DTensor) else self.sink_logits
        out = self.sdpa(q, k, v, mask, self.attention_mask, sink_logits=sinks)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class Experts(nn.Module):
    """gpt-oss's routed experts, stacked over dim 0 in Hugging Face's layout (so its weights load in place): gate_up
    (experts, dim, 2 x hidden), the gate and up columns interleaved, down (experts, hidden, dim), each with a bias.
    An expert computes down((up + 1) * gate * sigmoid(alpha * gate)) with the gate clamped above at `limit` and up
    within +-limit. Called as models/moe.py's GroupedExperts is (tokens sorted by expert, their counts)."""

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, limit: float, alpha: float):
        super().__init__()
        self.limit, self.alpha = limit, alpha
        self.gate_up = nn.Parameter(torch.empty(num_experts, dim, 2 * hidden_dim))
        self.gate_up_bias = nn.Parameter(torch.empty(num_experts, 2 * hidden_dim))
        self.down = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.down_bias = nn.Parameter(torch.empty(num_experts, dim))

    def init_weights(self, std: float, out_std: float) -> None:
        nn.init.trunc_normal_(self.gate_up, mean=0.0, std=std)
        nn.init.trunc_normal_(self.down, mean=0.0, std=out_std)
        nn.init.zeros_(self.gate_up_bias)
        nn.init.zeros_(self.down_bias)

    def glu(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate = gate_up[..., ::2].clamp(max=self.limit)
        up = gate_up[..., 1::2].clamp(-self.limit, self.limit)
        return (up + 1) * gate * torch.sigmoid(self.alpha * gate)

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """x: (tokens, dim), sorted by expert, counts[i] of them for this rank's expert i."""
        gate_up, gate_up_bias, down, down_bias = (w.to_local() if isinstance(w, DTensor) else w
                                                  for w in (self.gate_up, self.gate_up_bias, self.down, self.down_bias))
        if use_grouped_mm(x):
            sizes = torch.tensor(counts, device=x.device)
            offsets = sizes.cumsum(0).to(torch.int32)
            expert = torch.repeat_interleave(torch.arange(len(counts), device=x.device), sizes)
            h = self.glu(grouped_mm(x, gate_up, offsets) + gate_up_bias[expert])
            return grouped_mm(h, down, offsets) + down_bias[expert]
        outputs = [self.glu(chunk @ gate_up[i] + gate_up_bias[i]) @ down[i] + down_bias[i]
                   for i, chunk in enumerate(x.split(counts))]
        return torch.cat(outputs) if outputs else x.new_zeros(0, down.shape[2])


class TransformerBlock(DecoderBlock):
    """gpt-oss's block: its attention, under the window of its layer, and a mixture of its experts."""

    def __init__(self, layer_id: int, args: ModelArgs):
        attention = Attention(layer_id, args)
        experts = Experts(args.dim, args.moe.hidden_dim, args.moe.num_experts, args.swiglu_limit, args.swiglu_alpha)
        super().__init__(attention, MoE(args.dim, args.moe, experts), layer_id, args)


class Transformer(Decoder):
    """Token ids (batch, seq) in, logits (batch, seq, vocab) out: models/decoder.py's Decoder of gpt-oss's blocks.
    RoPE is in Hugging Face's rotate-half layout, so an HF checkpoint's weights are used as they are."""

    def __init__(self, args: ModelArgs):
        super().__init__(args, TransformerBlock, rope_frequencies, tied=False, output_std=args.dim**-0.5)
