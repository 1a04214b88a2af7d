"""Attention kernels shared by the model families: RoPE in the rotate-half layout, causal attention
through scaled_dot_product_attention (grouped-query when k and v have fewer heads than q), and
document masking (FlexAttention on CUDA, a dense boolean mask elsewhere); and the tensor-parallel plan
of QK-norm. A family's Attention module projects q, k, v and calls these; a fork that changes them for
every family edits this file."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.distributed.tensor.parallel import SequenceParallel
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate the pairs (x[i], x[i + head_dim/2]) of each head by the angles in `rope` (the
    "rotate-half" layout of Hugging Face's Llama, see the class docstring of models.llama3.model.Transformer).

    x: (batch, seq, heads, head_dim). rope is either shared by the batch rows, (at least seq,
    head_dim // 2, 2), of which the first seq rows are used, or one per row, (batch, seq,
    head_dim // 2, 2) (per-document positions). For the shared form the attention's own input
    decides the length because a pipeline stage's input may be a sequence shard (tensor + sequence
    parallel) that attention gathers whole."""
    if rope.dim() == 3:
        rope = rope[: x.shape[1]][None]
    cos, sin = rope[:, :, None, :, 0], rope[:, :, None, :, 1]
    first, second = x.float().chunk(2, dim=-1)
    rotated = torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)
    return rotated.type_as(x)


def qk_norm_tensor_parallel_plan(attention: str) -> dict:
    """Tensor-parallel plan entries for the q_norm and k_norm of the attention module named `attention`:
    RMSNorms over each head of the (batch, seq, local heads, head_dim) output of the column-wise wq / wk.
    SequenceParallel over dim 2 (the heads) makes their weights Replicate DTensors, whose gradients
    DTensor sums over the tp ranks; left out of the plan, each rank would update its own copy from its
    own heads and the copies would drift apart."""
    return {f"{attention}.{norm}": SequenceParallel(sequence_dim=2, use_local_output=True)
            for norm in ("q_norm", "k_norm")}


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     mask: torch.Tensor | BlockMask | None = None) -> torch.Tensor:
    """Causal scaled dot-product attention over (batch, heads, seq, head_dim), within documents given a
    `document_mask`; k/v may have fewer heads. The attention modules' default `sdpa`."""
    if mask is not None:
        return masked_attention(q, k, v, mask)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])


@functools.cache
def _compiled_flex_attention():
    return torch.compile(flex_attention)


def compiled_flex_attention(*args, **kwargs):
    """flex_attention, compiled on its first call: eager, it materializes the whole score matrix; compiled, it is
    a fused kernel that skips masked blocks. (Compiling at import would import torch's compiler into every
    process, about two seconds of its start-up.)"""
    return _compiled_flex_attention()(*args, **kwargs)


def use_flex_attention(device: torch.device) -> bool:
    """Document masking runs FlexAttention on CUDA and a dense boolean mask through SDPA elsewhere.

    torch 2.13's flex_attention runs forward on CPU, eager or compiled, but has no backward there
    (and its compiled CPU kernel fails to lower inside a compiled block), so CPU training takes the
    dense mask. Tests patch this function to run the flex path on CPU."""
    return device.type == "cuda"


def document_mask(document_ids: torch.Tensor, flex: bool | None = None) -> torch.Tensor | BlockMask:
    """The mask letting each query see the keys at or before it in the same document.

    document_ids: (batch, seq). Returns a FlexAttention BlockMask if `flex` (default:
    `use_flex_attention` on the ids' device), else a boolean (batch, 1, seq, seq) mask (True:
    attend) that broadcasts over the heads, however many a tensor-parallel rank holds."""
    batch, seq = document_ids.shape
    if flex is None:
        flex = use_flex_attention(document_ids.device)
    if flex:

        def same_document_causal(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (document_ids[b, q_idx] == document_ids[b, kv_idx])

        # Compiled on CUDA: eager, the mask is built from a dense (batch, seq, seq) evaluation of
        # mask_mod, gigabytes at seq 8192.
        return create_block_mask(same_document_causal, B=batch, H=None, Q_LEN=seq, KV_LEN=seq,
                                 device=document_ids.device, _compile=document_ids.device.type == "cuda")
    causal = torch.ones(seq, seq, dtype=torch.bool, device=document_ids.device).tril()
    return ((document_ids[:, :, None] == document_ids[:, None, :]) & causal)[:, None]


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | BlockMask) -> torch.Tensor:
    """Attention over (batch, heads, seq, head_dim) under a `document_mask`; k/v may have fewer heads."""
    gqa = q.shape[1] != k.shape[1]
    if isinstance(mask, BlockMask):
        return compiled_flex_attention(q, k, v, block_mask=mask, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
