"""DeepSeek-V3 as a plain nn.Module: multi-head latent attention (MLA, `Attention`), YaRN RoPE, and after the
first `first_dense_layers` dense blocks a mixture of experts (models/moe.py) with shared experts and sigmoid,
group-limited, bias-corrected routing.

MLA compresses what attention reads into small latents. Queries go through a low-rank projection
(`wq_a`, q_lora_rank wide, its RMSNorm, then `wq_b`) or, with q_lora_rank 0, one plain `wq`. Keys and values are
rebuilt per head (`wkv_b`) from one latent of kv_lora_rank per token (`wkv_a`, then `kv_norm`). A head's query and
key are qk_nope_head_dim features without position plus qk_rope_head_dim features rotated by RoPE; the rotated key
part is one per token, shared by all heads, straight from `wkv_a`. Values are v_head_dim wide, which may differ
from the query/key size. The softmax scale is 1/sqrt(query/key size) times YaRN's mscale squared; it is folded
into the queries, so every attention kernel (context parallelism's too) keeps its default scale.

RoPE follows the Hugging Face config: `rope_interleave` rotates the pairs (x0, x1), (x2, x3)... as DeepSeek's
weights are laid out, otherwise the rotate-half pairs (x[i], x[i + d/2]). With `rope_factor` > 1 the
frequencies are YaRN's (transformers' arithmetic), otherwise plain.

The decoder around the blocks (embedding, norm, output, document masking, the meta-device build and `init_weights`)
is every family's, models/decoder.py; `sdpa` works as in models/llama3/model.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.attention.flex_attention import BlockMask

from components.model.attention import CAUSAL, apply_rope, causal_attention, scale_rows
from components.training.loss import MultiTokenLogits
from models.decoder import Decoder, DecoderBlock
from models.moe import MoEArgs, dense_or_moe
from parallelisms.tensor_parallel import local_for_own_heads


@dataclass
class ModelArgs:
    dim: int = 7168
    n_layers: int = 61
    n_heads: int = 128
    ffn_dim: int = 18432
    """The dense blocks' feed-forward hidden size (intermediate_size)."""
    vocab_size: int = 129280
    norm_eps: float = 1e-6
    q_lora_rank: int = 1536
    """The queries' low-rank width; 0: one plain projection."""
    kv_lora_rank: int = 512
    """The width of the latent the keys and values are rebuilt from."""
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    rope_theta: float = 10000.0
    rope_interleave: bool = True
    """RoPE on the pairs (x0, x1), (x2, x3)... (DeepSeek's layout); False: rotate-half pairs."""
    rope_factor: float = 40.0
    """YaRN's context extension factor; 1: plain RoPE."""
    rope_original_seq_len: int = 4096
    """YaRN: the context the frequencies were first trained at (original_max_position_embeddings)."""
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_mscale: float = 1.0
    rope_mscale_all_dim: float = 1.0
    max_seq_len: int = 4096
    first_dense_layers: int = 3
    """The first blocks keep a dense feed-forward (first_k_dense_replace); the others are MoE."""
    moe: MoEArgs | None = None
    hidden_act: str = "silu"
    tie_embeddings: bool = False
    depth_init: bool = True
    """Scale each block's output projections by its depth (1/sqrt(2*(layer+1))) rather than by the
    total number of layers."""
    rope_per_document: bool = False
    """When the forward is given document_ids: RoPE positions restart at 0 at each document."""
    num_mtp_layers: int = 0
    """Multi-token prediction: extra depths, each a block predicting one token further ahead (`MultiTokenPrediction`);
    0: none."""
    mtp_loss_weight: float = 0.3
    """What multiplies the mean loss of the extra depths in the training loss (DeepSeek-V3's lambda)."""

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def is_moe_layer(self, layer_id: int) -> bool:
        return self.moe is not None and layer_id >= self.first_dense_layers

    @property
    def softmax_scale_factor(self) -> float:
        """What multiplies the default 1/sqrt(qk_head_dim): YaRN's mscale squared (transformers' yarn_apply_mscale)."""
        if self.rope_factor <= 1 or not self.rope_mscale_all_dim:
            return 1.0
        return yarn_mscale(self.rope_factor, self.rope_mscale_all_dim) ** 2

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 per weight a token goes through (forward + backward: the router and the
        top_k and shared experts of an MoE block, not all experts) plus attention's scores and weighted values."""
        heads = self.n_heads
        q = self.dim * heads * self.qk_head_dim if not self.q_lora_rank else \
            self.q_lora_rank * (self.dim + heads * self.qk_head_dim)
        kv = self.dim * (self.kv_lora_rank + self.qk_rope_head_dim)
        kv += self.kv_lora_rank * heads * (self.qk_nope_head_dim + self.v_head_dim)
        attention = q + kv + heads * self.v_head_dim * self.dim
        blocks = self.n_layers + self.num_mtp_layers
        # Each extra depth: a block, its projection of two hidden states into one and another pass through the output.
        weights = blocks * attention + self.dim * self.vocab_size * (1 + self.num_mtp_layers)
        weights += self.num_mtp_layers * 2 * self.dim * self.dim
        for layer in range(blocks):
            if self.is_moe_layer(layer):
                active = self.moe.top_k + self.moe.num_shared_experts
                weights += self.dim * self.moe.num_experts + 3 * self.dim * self.moe.hidden_dim * active
            else:
                weights += 3 * self.dim * self.ffn_dim
        return 6 * weights + 6 * blocks * heads * (self.qk_head_dim + self.v_head_dim) * seq_len


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_frequencies(args: ModelArgs) -> torch.Tensor:
    """cos/sin of every position's rotation angles, (max_seq_len, qk_rope_head_dim // 2, 2), in fp32 with the
    operations of transformers' default and YaRN RoPE (its attention factor multiplies cos and sin)."""
    dim, base = args.qk_rope_head_dim, args.rope_theta
    wavelengths = base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    freqs, scale = 1.0 / wavelengths, 1.0
    if args.rope_factor > 1:  # YaRN: interpolated low frequencies, extrapolated high ones, a ramp between
        factor = args.rope_factor

        def correction_dim(rotations: float) -> float:
            return dim * math.log(args.rope_original_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(correction_dim(args.rope_beta_fast)), 0)
        high = min(math.ceil(correction_dim(args.rope_beta_slow)), dim - 1)
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low if high > low else 0.001)).clamp(0, 1)
        extrapolated = 1 - ramp
        freqs = 1.0 / (factor * wavelengths) * (1 - extrapolated) + freqs * extrapolated
        if args.rope_mscale and args.rope_mscale_all_dim:
            scale = yarn_mscale(factor, args.rope_mscale) / yarn_mscale(factor, args.rope_mscale_all_dim)
        else:
            scale = yarn_mscale(factor)
    angles = torch.outer(torch.arange(args.max_seq_len, dtype=torch.float32), freqs)
    return torch.stack([angles.cos() * scale, angles.sin() * scale], dim=-1)


LATENT_NORM_EPS = 1e-6
"""The latents' RMSNorms keep DeepSeek's own epsilon, whatever norm_eps (rms_norm_eps) says."""


class Attention(nn.Module):
    """Multi-head latent attention (the module docstring describes it). `sdpa` computes causal attention under
    the declared `attention_mask`, within documents given a document `mask`, and may be swapped (context
    parallelism), as in models/llama3/model.py.

    Under tensor parallelism each rank computes the latents whole and rebuilds its own heads from them
    (parallelize.py): the rotated key part, shared by the heads, is used as this rank's plain tensor whose
    gradient is summed over the ranks (`local_for_own_heads`)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.sdpa = causal_attention
        self.attention_mask = CAUSAL
        self.args = args
        heads = args.n_heads
        if args.q_lora_rank:
            self.wq_a = nn.Linear(args.dim, args.q_lora_rank, bias=False)
            self.q_norm = nn.RMSNorm(args.q_lora_rank, eps=LATENT_NORM_EPS)
            self.wq_b = nn.Linear(args.q_lora_rank, heads * args.qk_head_dim, bias=False)
        else:
            self.wq = nn.Linear(args.dim, heads * args.qk_head_dim, bias=False)
        self.wkv_a = nn.Linear(args.dim, args.kv_lora_rank + args.qk_rope_head_dim, bias=False)
        self.kv_norm = nn.RMSNorm(args.kv_lora_rank, eps=LATENT_NORM_EPS)
        self.wkv_b = nn.Linear(args.kv_lora_rank, heads * (args.qk_nope_head_dim + args.v_head_dim), bias=False)
        self.wo = nn.Linear(heads * args.v_head_dim, args.dim, bias=False)
        self.softmax_scale_factor = args.softmax_scale_factor  # once, not at every forward

    def init_weights(self, std: float, out_std: float) -> None:
        projections = (self.wq_a, self.wq_b) if self.args.q_lora_rank else (self.wq,)
        for linear in (*projections, self.wkv_a, self.wkv_b):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=std)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=out_std)
        self.kv_norm.reset_parameters()
        if self.args.q_lora_rank:
            self.q_norm.reset_parameters()

    def scale_query_key(self, factors: torch.Tensor) -> None:
        """QK-clip (components/model/attention.py's ClippableAttention), as Kimi K2's MuonClip does under MLA: each
        head's own query and key parts (q_nope, k_nope) take the square root of its factor, its rotated query part
        the whole factor; the rotated key part, which every head shares, is left alone."""
        args = self.args
        root = factors.sqrt()[:, None]
        query = torch.cat([root.expand(-1, args.qk_nope_head_dim), factors[:, None].expand(-1, args.qk_rope_head_dim)],
                          dim=1)
        key_value = torch.cat([root.expand(-1, args.qk_nope_head_dim), torch.ones_like(root).expand(
            -1, args.v_head_dim)], dim=1)
        scale_rows((self.wq_b if args.q_lora_rank else self.wq).weight, query.flatten())
        scale_rows(self.wkv_b.weight, key_value.flatten())

    def rotate(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        if self.args.rope_interleave:  # the pairs (x0, x1), (x2, x3)... as rotate-half pairs, as transformers does
            x = torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)
        return apply_rope(x, rope)

    def forward(self, x: torch.Tensor, rope: torch.Tensor,
                mask: torch.Tensor | BlockMask | None = None) -> torch.Tensor:
        args = self.args
        batch, seq, _ = x.shape
        q = self.wq_b(self.q_norm(self.wq_a(x))) if args.q_lora_rank else self.wq(x)
        # -1 rather than n_heads: under tensor parallelism each rank holds a slice of the heads.
        q_nope, q_rope = q.view(batch, seq, -1, args.qk_head_dim).split(
            [args.qk_nope_head_dim, args.qk_rope_head_dim], dim=-1)
        latent, k_rope = self.wkv_a(x).split([args.kv_lora_rank, args.qk_rope_head_dim], dim=-1)
        kv = self.wkv_b(self.kv_norm(latent)).view(batch, seq, -1, args.qk_nope_head_dim + args.v_head_dim)
        k_nope, v = kv.split([args.qk_nope_head_dim, args.v_head_dim], dim=-1)
        k_rope = self.rotate(local_for_own_heads(k_rope).unsqueeze(2), rope)
        q = torch.cat([q_nope, self.rotate(q_rope, rope)], dim=-1)
        if self.softmax_scale_factor != 1.0:
            q = q * self.softmax_scale_factor
        k = torch.cat([k_nope, k_rope.expand(-1, -1, k_nope.shape[2], -1)], dim=-1)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = self.sdpa(q, k, v, mask, self.attention_mask)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class TransformerBlock(DecoderBlock):
    """DeepSeek-V3's block: multi-head latent attention, and a SwiGLU feed-forward (models/decoder.py) or, in the
    blocks `ModelArgs.is_moe_layer` picks, a mixture of experts with shared experts."""

    def __init__(self, layer_id: int, args: ModelArgs):
        attention = Attention(args)
        super().__init__(attention, dense_or_moe(layer_id, args), layer_id, args)


class MultiTokenPrediction(nn.Module):
    """One extra depth of multi-token prediction (DeepSeek-V3's MTP module). At each position it joins the previous
    depth's output `h` (at depth 1 the model's final hidden states) and the embedding of the input token k places
    ahead, `eh_proj([enorm(embedding); hnorm(h)])`, runs a block on that and normalizes: what the model's output
    layer turns into logits of the token k + 1 places ahead, and the next depth's `h`."""

    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__()
        self.enorm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.hnorm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.eh_proj = nn.Linear(2 * args.dim, args.dim, bias=False)
        self.block = TransformerBlock(layer_id, args)
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)

    def init_weights(self) -> None:
        for norm in (self.enorm, self.hnorm, self.norm):
            norm.reset_parameters()
        nn.init.trunc_normal_(self.eh_proj.weight, mean=0.0, std=0.02)
        self.block.init_weights()

    def forward(self, h: torch.Tensor, embedded: torch.Tensor, rope: torch.Tensor,
                mask: torch.Tensor | BlockMask | None = None) -> torch.Tensor:
        x = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(h)], dim=-1))
        return self.norm(self.block(x, rope, mask=mask))


class Transformer(Decoder):
    """Token ids (batch, seq) in, logits (batch, seq, vocab) out: models/decoder.py's Decoder of DeepSeek-V3's blocks.

    With num_mtp_layers, a training forward also runs the extra depths (`mtp`, after the final norm) and returns
    a MultiTokenLogits (components/training/loss.py): each depth's input tokens are the inputs rolled k places
    left, whose last k positions wrap around; causal attention keeps them from the positions before, and the loss
    leaves their predictions out. The depths share the embedding and the output layer with the model. An eval-mode
    forward (validation, evaluation, generation) returns the next token's logits alone."""

    def __init__(self, args: ModelArgs):
        mtp = nn.ModuleDict({str(k): MultiTokenPrediction(args.n_layers + k, args) for k in range(args.num_mtp_layers)})
        super().__init__(args, TransformerBlock, rope_frequencies, tied=args.tie_embeddings, output_std=args.dim**-0.5,
                         before_output={"mtp": mtp})

    @torch.no_grad()
    def init_weights(self) -> None:
        super().init_weights()
        for depth in self.mtp.values():  # last: the rest starts as it does without them
            depth.init_weights()

    def forward(self, tokens: torch.Tensor,
                document_ids: torch.Tensor | None = None) -> torch.Tensor | MultiTokenLogits:
        h, rope, masks = self.hidden_states(tokens, document_ids)
        if self.output is None:
            return h
        logits = self.output(h)
        if not (self.training and self.mtp):
            return logits
        depths = []
        for k, depth in enumerate(self.mtp.values(), 1):
            h = depth(h, self.tok_embeddings(tokens.roll(-k, dims=1)), rope,
                      mask=masks.get(depth.block.attention.attention_mask))
            depths.append(self.output(h))
        return MultiTokenLogits(logits, depths, self.args.mtp_loss_weight)
