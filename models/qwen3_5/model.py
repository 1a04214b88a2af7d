"""Qwen3.5 (and Qwen3-Next) as a plain nn.Module, dense or mixture-of-experts: a hybrid decoder whose blocks mix
tokens either by Gated DeltaNet, a linear attention whose state follows the gated delta rule, or by gated full
attention, three of the first to one of the second (`ModelArgs.layer_types`).

- `GatedDeltaNet`, the linear layers: q, k and v projected and passed through a short causal convolution (window 4)
  and silu; q and k L2-normalized per head; per head and token a decay exp(-exp(A_log) softplus(a + dt_bias)) and
  a write strength beta = sigmoid(b); the delta rule (components/model/token_mixing.py's `gated_delta_rule`, the
  state carried over the sequence, restarted at each document); an RMSNorm of each head's output gated by
  silu(z); the output projection. Key heads may serve several value heads each (grouped like GQA). It declares
  its convolution (`conv_window`, `conv`) and its recurrence (`recurrence`), which is how context and sequence
  parallelism find and carry them (parallelisms/sequence_mixers.py).
- `Attention`, the full layers: grouped-query attention with QK-norm whose query projection also gives a gate per
  channel, sigmoid(gate) multiplying the attention output, and RoPE on the first quarter of each head's channels.
- Every RMSNorm outside DeltaNet's gated one is zero-centered, scale 1 + weight with the weight initialized to 0,
  as Hugging Face's checkpoints store it.

The decoder around the blocks (embedding, norm, output, document masking, the meta-device build and `init_weights`)
is every family's, models/decoder.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.attention.flex_attention import BlockMask

from components.model.attention import CAUSAL, apply_rope, causal_attention
from components.model.token_mixing import causal_conv, gated_delta_rule
from models.decoder import Decoder, DecoderBlock
from models.moe import MoEArgs, dense_or_moe

LINEAR, FULL = "linear_attention", "full_attention"
"""The two kinds of layer, by Hugging Face's names (config.json's layer_types)."""


@dataclass
class ModelArgs:
    dim: int = 2048
    n_layers: int = 24
    n_heads: int = 8
    """The full-attention layers' query heads."""
    n_kv_heads: int | None = 2
    head_dim: int = 256
    rotary_fraction: float = 0.25
    """The share of each head's channels that RoPE rotates (Hugging Face's partial_rotary_factor)."""
    full_attention_interval: int = 4
    """Every full_attention_interval-th layer is full attention, the others Gated DeltaNet."""
    linear_n_key_heads: int = 16
    linear_n_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    conv_window: int = 4
    """The kernel size of DeltaNet's short convolution."""
    ffn_dim: int = 6144
    hidden_act: str = "silu"
    vocab_size: int = 248320
    norm_eps: float = 1e-6
    rope_theta: float = 10_000_000.0
    max_seq_len: int = 2048
    tie_embeddings: bool = False
    depth_init: bool = True
    rope_per_document: bool = False
    moe: MoEArgs | None = None
    """The mixture of experts of every block's feed-forward (Qwen3.5-MoE: a sigmoid-gated shared expert besides the
    routed ones); None: a dense model."""
    layer_types: tuple[str, ...] = ()
    """Each layer's kind, LINEAR or FULL (Hugging Face's layer_types); (): by `full_attention_interval`."""

    def layer_type(self, layer_id: int) -> str:
        if self.layer_types:
            return self.layer_types[layer_id]
        return FULL if (layer_id + 1) % self.full_attention_interval == 0 else LINEAR

    def is_moe_layer(self, layer_id: int) -> bool:
        return self.moe is not None

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.rotary_fraction)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward and backward, 3 x 2 per multiply-add) as each layer kind computes it:
        a full-attention layer its projections and its attention scores, which grow with the context; a DeltaNet
        layer its projections, its convolution and its chunked delta rule, which do not (the state read and
        written, d_k x d_v per head, and products within a chunk of RECURRENCE_CHUNK tokens). An MoE block counts
        its router and the top_k and shared experts a token goes through; the embedding lookup does no matmul."""
        from components.model.token_mixing import RECURRENCE_CHUNK as chunk

        q_dim, kv_dim = self.n_heads * self.head_dim, (self.n_kv_heads or self.n_heads) * self.head_dim
        full = self.dim * (2 * q_dim + 2 * kv_dim) + q_dim * self.dim  # the query projection gives the gate too
        nv, dk, dv = self.linear_n_value_heads, self.linear_key_head_dim, self.linear_value_head_dim
        key_dim, value_dim = self.linear_n_key_heads * dk, nv * dv
        conv_dim = 2 * key_dim + value_dim
        linear = self.dim * (conv_dim + value_dim + 2 * nv) + value_dim * self.dim + conv_dim * self.conv_window
        # Per value head and token: the state read by q and by k and written (3 d_k d_v), and within its chunk
        # q k^T and beta k k^T (2 chunk d_k), the triangular solve (chunk (d_k + d_v) / 2) and the scores times
        # the written values (chunk d_v); multiply-adds.
        linear += nv * (3 * dk * dv + chunk * (2 * dk + dv) + chunk * (dk + dv) // 2)
        if self.moe is not None:
            moe = self.moe
            feed_forward = self.dim * moe.num_experts + 3 * self.dim * moe.hidden_dim * (
                moe.top_k + moe.num_shared_experts) + self.dim * moe.shared_gate
        else:
            feed_forward = 3 * self.dim * self.ffn_dim
        kinds = [self.layer_type(i) for i in range(self.n_layers)]
        weights = kinds.count(FULL) * full + kinds.count(LINEAR) * linear + self.n_layers * feed_forward
        weights += self.dim * self.vocab_size
        return 6 * weights + 12 * kinds.count(FULL) * self.n_heads * self.head_dim * seq_len


def rope_frequencies(args: ModelArgs) -> torch.Tensor:
    """cos/sin of every position's angles for the rotated channels, (max_seq_len, rotary_dim // 2, 2), in fp32
    with the operations of transformers' default RoPE."""
    dim = args.rotary_dim
    freqs = 1.0 / (args.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    angles = torch.outer(torch.arange(args.max_seq_len, dtype=torch.float32), freqs)
    return torch.stack([angles.cos(), angles.sin()], dim=-1)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter that tensor parallelism shards by heads (a DTensor), else the tensor."""
    return t.to_local() if isinstance(t, DTensor) else t


class ZeroCenteredRMSNorm(nn.Module):
    """RMSNorm scaling by 1 + weight, the weight initialized to 0, computed in fp32 (Hugging Face's
    Qwen3_5RMSNorm): weight decay then pulls the scale towards 1, not 0."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).type_as(x)


class GatedRMSNorm(nn.Module):
    """RMSNorm of each head's output (batch, seq, heads, head_dim), then times silu(gate): DeltaNet's output norm,
    one weight shared by the heads."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * normed.to(x.dtype) * F.silu(gate.float())).to(x.dtype)


def l2_normalized(x: torch.Tensor) -> torch.Tensor:
    """x / |x| over the last dimension, in fp32, as flash-linear-attention and transformers compute it."""
    x = x.float()
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + 1e-6)


class GatedDeltaNet(nn.Module):
    """The linear-attention layer (the module docstring says what it computes). Its projections are one per part
    (q, k, v; z, b, a), so that tensor parallelism splits each by heads; Hugging Face stores q, k and v as one
    matrix, and their convolutions as one, which hf_mapping.py joins and splits. Under tensor parallelism the
    convolution weights, dt_bias and A_log are DTensors sharded by heads and the forward takes this rank's part."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.conv_window = args.conv_window
        self.conv = causal_conv
        self.recurrence = gated_delta_rule
        self.key_head_dim, self.value_head_dim = args.linear_key_head_dim, args.linear_value_head_dim
        self.heads_per_key = args.linear_n_value_heads // args.linear_n_key_heads
        key_dim = args.linear_n_key_heads * self.key_head_dim
        value_dim = args.linear_n_value_heads * self.value_head_dim
        self.wq = nn.Linear(args.dim, key_dim, bias=False)
        self.wk = nn.Linear(args.dim, key_dim, bias=False)
        self.wv = nn.Linear(args.dim, value_dim, bias=False)
        self.wz = nn.Linear(args.dim, value_dim, bias=False)
        self.wb = nn.Linear(args.dim, args.linear_n_value_heads, bias=False)
        self.wa = nn.Linear(args.dim, args.linear_n_value_heads, bias=False)
        self.conv_q = nn.Parameter(torch.empty(key_dim, args.conv_window))
        self.conv_k = nn.Parameter(torch.empty(key_dim, args.conv_window))
        self.conv_v = nn.Parameter(torch.empty(value_dim, args.conv_window))
        self.dt_bias = nn.Parameter(torch.empty(args.linear_n_value_heads))
        self.A_log = nn.Parameter(torch.empty(args.linear_n_value_heads))
        self.norm = GatedRMSNorm(self.value_head_dim, args.norm_eps)
        self.wo = nn.Linear(value_dim, args.dim, bias=False)

    @torch.no_grad()
    def init_weights(self, std: float, out_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv, self.wz, self.wb, self.wa):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=std)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=out_std)
        bound = 1 / math.sqrt(self.conv_window)  # torch's Conv1d default for a depthwise kernel
        for weight in (self.conv_q, self.conv_k, self.conv_v):
            nn.init.uniform_(weight, -bound, bound)
        nn.init.ones_(self.dt_bias)
        self.A_log.uniform_(0.01, 16).log_()  # decay rates exp(A_log) spread over (0.01, 16), as Hugging Face's
        self.norm.reset_parameters()

    def forward(self, x: torch.Tensor, document_ids: torch.Tensor | None = None) -> torch.Tensor:
        batch, seq, _ = x.shape
        weights = torch.cat([local(self.conv_q), local(self.conv_k), local(self.conv_v)])
        q, k, v = (w(x) for w in (self.wq, self.wk, self.wv))
        mixed = F.silu(self.conv(torch.cat([q, k, v], dim=-1), weights, document_ids))
        q, k, v = mixed.split([q.shape[-1], k.shape[-1], v.shape[-1]], dim=-1)
        # -1 rather than the head counts: under tensor parallelism each rank holds a slice of the heads.
        q, k = (l2_normalized(t.view(batch, seq, -1, self.key_head_dim)) for t in (q, k))
        q = q * self.key_head_dim**-0.5
        q, k = (t.repeat_interleave(self.heads_per_key, dim=2) for t in (q, k))  # each key head's value heads
        v = v.view(batch, seq, -1, self.value_head_dim)
        beta = self.wb(x).sigmoid()
        log_decay = -local(self.A_log).float().exp() * F.softplus(self.wa(x).float() + local(self.dt_bias))
        out = self.recurrence(q, k, v.float(), log_decay, beta.float(), document_ids=document_ids).to(x.dtype)
        out = self.norm(out, self.wz(x).view(batch, seq, -1, self.value_head_dim))
        return self.wo(out.flatten(2))


class Attention(nn.Module):
    """Gated grouped-query attention with QK-norm and partial RoPE. The query projection gives, per head, the
    head's queries then its gate, so tensor parallelism's column split keeps both of a head on one rank. `sdpa`
    and `attention_mask` as in models/qwen3/model.py."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.sdpa = causal_attention
        self.attention_mask = CAUSAL
        self.head_dim = args.head_dim
        n_kv_heads = args.n_kv_heads or args.n_heads
        self.wq = nn.Linear(args.dim, 2 * args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)
        self.q_norm = ZeroCenteredRMSNorm(self.head_dim, args.norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(self.head_dim, args.norm_eps)

    def init_weights(self, std: float, out_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=std)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=out_std)
        self.q_norm.reset_parameters()
        self.k_norm.reset_parameters()

    def forward(self, x: torch.Tensor, rope: torch.Tensor,
                mask: torch.Tensor | BlockMask | None = None) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, gate = self.wq(x).view(batch, seq, -1, 2 * self.head_dim).chunk(2, dim=-1)
        q = self.q_norm(q)
        k = self.k_norm(self.wk(x).view(batch, seq, -1, self.head_dim))
        v = self.wv(x).view(batch, seq, -1, self.head_dim)
        rotated = 2 * rope.shape[-2]
        q, k = (torch.cat([apply_rope(t[..., :rotated], rope), t[..., rotated:]], dim=-1) for t in (q, k))
        out = self.sdpa(*(t.transpose(1, 2) for t in (q, k, v)), mask, self.attention_mask).transpose(1, 2)
        return self.wo((out * gate.sigmoid()).reshape(batch, seq, -1))


class TransformerBlock(DecoderBlock):
    """Qwen3.5's block: Gated DeltaNet or gated attention as its token mixer (`attention`), a SwiGLU or MoE
    feed-forward, zero-centered norms. DeltaNet takes the document ids; attention the RoPE angles and mask."""

    def __init__(self, layer_id: int, args: ModelArgs):
        mixer = GatedDeltaNet(args) if args.layer_type(layer_id) == LINEAR else Attention(args)
        super().__init__(mixer, dense_or_moe(layer_id, args), layer_id, args)
        self.attention_norm = ZeroCenteredRMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = ZeroCenteredRMSNorm(args.dim, args.norm_eps)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask: torch.Tensor | BlockMask | None = None,
                document_ids: torch.Tensor | None = None) -> torch.Tensor:
        if isinstance(self.attention, GatedDeltaNet):
            x = x + self.attention(self.attention_norm(x), document_ids=document_ids)
        else:  # mask by keyword: tensor parallelism's input hook on `attention` lays out (x, rope) only.
            x = x + self.attention(self.attention_norm(x), rope, mask=mask)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(Decoder):
    """Token ids (batch, seq) in, logits (batch, seq, vocab) out: models/decoder.py's Decoder of Qwen3.5's blocks,
    its final norm zero-centered. RoPE is in Hugging Face's rotate-half layout."""

    def __init__(self, args: ModelArgs):
        super().__init__(args, TransformerBlock, rope_frequencies, tied=args.tie_embeddings,
                         output_std=args.dim**-0.5)
        self.norm = ZeroCenteredRMSNorm(args.dim, args.norm_eps)
