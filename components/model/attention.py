"""Attention kernels shared by the model families, and the mask a model declares for each attention layer.

RoPE in the rotate-half layout; causal attention through scaled_dot_product_attention (grouped-query when k and v
have fewer heads than q), under the sliding window, attention sinks or mask_mod a layer declares (`AttentionMask`),
with learned sink logits where a layer passes them (`with_sink_logits`);
document masking (FlexAttention on CUDA, a dense boolean mask elsewhere); and the tensor-parallel plan of
QK-norm. A family's Attention module projects q, k, v, declares its `attention_mask` and calls `causal_attention` as
its `sdpa`; context parallelism (parallelisms/context_parallel.py) reads the same declaration. They live in
components/ because both models/ and parallelisms/ use them. A fork that changes them for every family edits this file.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import SequenceParallel
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, create_block_mask, flex_attention

from components.data.documents import document_positions
from components.model.protocols import provides


@dataclass(frozen=True)
class AttentionMask:
    """Which keys an attention layer's queries see, declared by the model on each attention module (its
    `attention_mask` attribute) and passed to its `sdpa` on every call: the keys at or before the query (causal),
    within its document under document masking, and

    - with `window`, only the last `window` of them, the query's own included (the sliding window of Mistral,
      Gemma 2/3 and gpt-oss; a per-layer choice gives their local/global patterns),
    - with `sinks` besides, also the first `sinks` keys of the sequence (of the query's document under document
      masking), which every query keeps seeing (StreamingLLM's attention sinks),
    - with `mask_mod`, only where mask_mod(q_idx, kv_idx) holds: a predicate of the query's and the key's positions
      in the whole sequence, written as for FlexAttention (tensors in, a boolean tensor out, broadcasting), that can
      only take keys away, and must leave each query its own key.

    Every context-parallel method honours it; a layer whose `sdpa` is not `causal_attention` has a mask context
    parallelism cannot see, and allgather and ring, which replace that kernel, refuse it."""

    window: int | None = None
    sinks: int = 0
    mask_mod: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None

    def __post_init__(self):
        if self.window is not None and self.window < 1:
            raise ValueError(f"AttentionMask window {self.window}: a query sees at least itself (window >= 1)")
        if self.sinks and (self.window is None or self.sinks < 0):
            raise ValueError(f"AttentionMask sinks {self.sinks}: sinks (>= 0) are the keys kept besides a window")

    def allows(self, q_idx: torch.Tensor, kv_idx: torch.Tensor,
               key_in_document: torch.Tensor | None = None) -> torch.Tensor:
        """Whether the query at position q_idx sees the key at kv_idx, documents aside (tensors that broadcast, or
        FlexAttention's mask_mod arguments): at or before it, within the window or among the sinks (by the key's
        position in its document, `key_in_document`, when given), and where mask_mod holds."""
        allowed = q_idx >= kv_idx
        if self.window is not None:
            near = q_idx - kv_idx < self.window
            if self.sinks:
                near = near | ((kv_idx if key_in_document is None else key_in_document) < self.sinks)
            allowed = allowed & near
        if self.mask_mod is not None:
            allowed = allowed & self.mask_mod(q_idx, kv_idx)
        return allowed

    def first_key(self, first_query: int) -> int:
        """The earliest key a query at `first_query` or after may see, documents aside."""
        return max(0, first_query - self.window + 1) if self.window is not None and not self.sinks else 0


CAUSAL = AttentionMask()


class AttentionLayer(Protocol):
    """What context parallelism and the Hugging Face export's check read of an attention module, found by these
    attributes, not by class or name: where every attention kernel attaches."""

    attention_mask: AttentionMask
    """The keys this layer's queries see."""
    sdpa: Callable[..., torch.Tensor]
    """sdpa(q, k, v, mask, attention_mask) -> attention over (batch, heads, seq, head_dim); `mask` is what the
    model's document_mask built for this layer's attention_mask (None without document masking). A layer with
    learned sink logits (gpt-oss) passes them as `sink_logits=` (heads,), one per head it holds (`with_sink_logits`).
    Context parallelism replaces it by its method's attention, which takes the same arguments."""


class ClippableAttention(Protocol):
    """An attention layer whose heads QK-clip can scale back (components/training/qk_clip.py, the optimizer's
    qk_clip_threshold), found by this method. A layer whose queries and keys a norm follows (QK-norm) must not
    declare it: the norm would undo the scaling."""

    def scale_query_key(self, factors: torch.Tensor) -> None:
        """Scale the query and key projections so that each head's pre-softmax logits scale by its factor (<= 1):
        `factors` (heads,) covers all the model's heads of this layer; a tensor-parallel rank scales the rows of
        those it holds (`scale_rows`)."""


def scale_rows(weight: nn.Parameter, factors: torch.Tensor) -> None:
    """weight[i, ...] *= factors[i], `factors` over all of weight's rows (a matrix's, or a bias's entries): a DTensor
    weight (FSDP, TP or both shard its rows) scales the rows it holds, DTensor matching the replicated factors to its
    shards without communicating."""
    column = factors.to(weight.device, weight.dtype)  # the host under FSDP's CPU offload
    column = column.view(-1, *[1] * (weight.dim() - 1))
    if isinstance(weight, DTensor):
        column = DTensor.from_local(column, weight.device_mesh, [Replicate()] * weight.device_mesh.ndim,
                                    run_check=False)
    with torch.no_grad():
        weight.mul_(column)


def grouped_query_rows(factors: torch.Tensor, n_kv_heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """QK-clip's factors (heads,) as those of a grouped-query attention's query and key projection rows: a key head
    is shared by a group of query heads, so it takes the square root of the group's largest factor and each query
    head the rest of its own; every factor stays <= 1, and with one query head per key head each side takes the
    square root, as Kimi K2's MuonClip does. (query rows, key rows), for `scale_rows`."""
    groups = factors.view(n_kv_heads, -1)
    key = groups.amax(1).sqrt()
    query = (groups / key[:, None]).flatten()
    return query.repeat_interleave(head_dim), key.repeat_interleave(head_dim)


def attention_layers(module: nn.Module) -> Iterator[tuple[str, AttentionLayer]]:
    """(name, layer) of every attention layer inside `module`."""
    return ((name, m) for name, m in module.named_modules() if provides(m, AttentionLayer))


def visible_keys(document_ids: torch.Tensor | None, q_positions: torch.Tensor, k_positions: torch.Tensor,
                 spec: AttentionMask = CAUSAL) -> torch.Tensor:
    """(batch, queries, keys) booleans ((queries, keys) without documents): whether the query at q_positions may
    see the key at k_positions under `spec`, in its document. document_ids: (batch, seq), of the whole sequence, or
    None; positions (batch, n) per row, or (n,) shared by the rows."""
    key_in_document = None
    if document_ids is not None:
        q_positions, k_positions = (p.expand(len(document_ids), -1) for p in (q_positions, k_positions))
        if spec.sinks:
            key_in_document = document_positions(document_ids).gather(1, k_positions)[..., None, :]
    allowed = spec.allows(q_positions[..., :, None], k_positions[..., None, :], key_in_document)
    if document_ids is not None:
        allowed = allowed & (document_ids.gather(1, q_positions)[:, :, None]
                             == document_ids.gather(1, k_positions)[:, None, :])
    return allowed


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
                     mask: torch.Tensor | BlockMask | None = None, spec: AttentionMask = CAUSAL,
                     sink_logits: torch.Tensor | None = None) -> torch.Tensor:
    """Causal scaled dot-product attention over (batch, heads, seq, head_dim) under the layer's declared `spec`;
    within documents given the `document_mask` built for that spec; k/v may have fewer heads; with `sink_logits`
    (heads,), learned sinks (`with_sink_logits`). The attention modules' `sdpa`."""
    if mask is not None:
        return masked_attention(q, k, v, mask, sink_logits)
    if spec == CAUSAL and sink_logits is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
    return declared_attention(q, k, v, spec, sink_logits)


@functools.cache
def _compiled_flex_attention():
    return torch.compile(flex_attention)


def compiled_flex_attention(q: torch.Tensor, *args, **kwargs):
    """flex_attention, compiled on its first call on CUDA: eager, it materializes the whole score matrix; compiled,
    it is a fused kernel that skips masked blocks. (Compiling at import would import torch's compiler into every
    process, about two seconds of its start-up.) Elsewhere eager: a CPU reaches FlexAttention only when asked to
    (`flex=True`), forward only, and compiling it there takes tens of seconds."""
    if q.device.type != "cuda":
        return flex_attention(q, *args, **kwargs)
    return _compiled_flex_attention()(q, *args, **kwargs)


def use_flex_attention(device: torch.device) -> bool:
    """Document masking runs FlexAttention on CUDA and a dense boolean mask through SDPA elsewhere.

    torch 2.13's flex_attention runs forward on CPU, eager or compiled, but has no backward there
    (and its compiled CPU kernel fails to lower inside a compiled block), so CPU training takes the
    dense mask. The builders of masks take `flex=` to choose otherwise."""
    return device.type == "cuda"


WINDOW_CHUNK = 256
"""The fewest queries `attention_by_chunks` attends at once (CPU, and context parallelism's allgather)."""


def declared_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionMask,
                       sink_logits: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention under a window, sinks or a mask_mod, or with learned `sink_logits`, over (batch, heads, seq,
    head_dim). Under FlexAttention (CUDA), one kernel that skips the blocks the spec masks whole; elsewhere by chunks
    of queries (`attention_by_chunks`)."""
    if use_flex_attention(q.device):
        return masked_attention(q, k, v, declared_block_mask(q.shape[2], spec, str(q.device)), sink_logits)
    return attention_by_chunks(q, k, v, 0, spec, sink_logits)


def attention_by_chunks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first: int, spec: AttentionMask,
                        sink_logits: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of the queries q (batch, heads, n, head_dim) at positions first to first + n - 1 to the keys and
    values k, v of the whole sequence (positions from 0) under `spec`, by chunks of max(window, WINDOW_CHUNK)
    queries, each attending to the keys from the first its queries may see to its last under a boolean mask of that
    size (`chunk_attention`): under a window without sinks, work and memory grow with the queries times the window,
    not with the queries times the sequence."""
    chunk = max(spec.window or 0, WINDOW_CHUNK)
    return torch.cat([chunk_attention(q[:, :, i:i + chunk], k, v, first + i, spec, sink_logits)
                      for i in range(0, q.shape[2], chunk)], dim=2)


def chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first: int, spec: AttentionMask,
                    sink_logits: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of the queries q (batch, heads, n, head_dim) at positions first to first + n - 1 to the keys and
    values k, v of the whole sequence (positions from 0) under `spec`, with `sink_logits` if given: only the keys
    from the first the queries may see (`AttentionMask.first_key`) to the last query are read, under a boolean mask
    of that size."""
    end = first + q.shape[2]
    start = spec.first_key(first)
    mask = visible_keys(None, torch.arange(first, end, device=q.device), torch.arange(start, end, device=q.device),
                        spec)
    return masked_attention(q, k[:, :, start:end], v[:, :, start:end], mask, sink_logits)


def with_sink_logits(out: torch.Tensor, lse: torch.Tensor, sink_logits: torch.Tensor) -> torch.Tensor:
    """Learned attention sinks (gpt-oss): each head's softmax denominator gains exp(sink_logits[h]), a share of
    every query's attention that goes to no value. Given the attention without them, out (batch, heads, n, head_dim),
    and the log-sum-exp of each query's scores, lse (batch, heads, n), that is out × exp(lse) / (exp(lse) +
    exp(sink)) = out × sigmoid(lse − sink): applied after any kernel, or any merge of partial attentions, that
    gives the log-sum-exp."""
    return out * torch.sigmoid(lse.float() - sink_logits.float()[:, None]).unsqueeze(-1).to(out.dtype)


def attention_and_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      allowed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q (batch, heads, n, head_dim) to k, v (batch, kv_heads, m, head_dim) where `allowed` (booleans
    broadcasting to (batch, heads, n, m)) holds, and the log-sum-exp of each query's scores (float32), both
    differentiable: the scores materialized, as autograd's operations. What learned sinks run where FlexAttention
    has no backward (CPU): SDPA's fused kernels return no log-sum-exp a gradient can flow through."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = (t.repeat_interleave(groups, dim=1) for t in (k, v))
    scores = (q.float() @ k.float().transpose(-2, -1)) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~allowed, float("-inf"))
    lse = scores.logsumexp(-1)
    probabilities = (scores - lse[..., None]).exp().nan_to_num(0.0)  # a query without keys (lse -inf) gets 0
    return (probabilities @ v.float()).to(v.dtype), lse


@functools.lru_cache(maxsize=8)
def declared_block_mask(seq: int, spec: AttentionMask, device: str) -> BlockMask:
    """FlexAttention's mask of a sequence of `seq` under `spec` alone (no documents), what `declared_attention`
    attends under on CUDA. Built once per shape and declaration: it depends on nothing else."""

    def declared(b, h, q_idx, kv_idx):
        return spec.allows(q_idx, kv_idx)

    return flex_block_mask(declared, None, seq, seq, torch.device(device))


def flex_block_mask(mask_mod: Callable, batch: int | None, q_len: int, kv_len: int, device: torch.device) -> BlockMask:
    """create_block_mask, compiled on CUDA: eager, it evaluates mask_mod on every (query, key) pair at once,
    gigabytes at seq 8192. Inside a compiled block it is traced as it is: its `_compile` flag warns (deprecated
    since torch 2.11), which breaks the graph."""
    compiled = device.type == "cuda" and not torch.compiler.is_compiling()
    return create_block_mask(mask_mod, B=batch, H=None, Q_LEN=q_len, KV_LEN=kv_len, device=device, _compile=compiled)


def document_mask(document_ids: torch.Tensor, spec: AttentionMask = CAUSAL,
                  flex: bool | None = None) -> torch.Tensor | BlockMask:
    """The mask letting each query see the keys `spec` allows (at or before it, within its window or among the
    sinks, where its mask_mod holds) in the same document.

    document_ids: (batch, seq). Returns a FlexAttention BlockMask if `flex` (default:
    `use_flex_attention` on the ids' device), else a boolean (batch, 1, seq, seq) mask (True:
    attend) that broadcasts over the heads, however many a tensor-parallel rank holds."""
    batch, seq = document_ids.shape
    if flex is None:
        flex = use_flex_attention(document_ids.device)
    if flex:
        within = document_positions(document_ids) if spec.sinks else None

        def same_document(b, h, q_idx, kv_idx):
            key_in_document = None if within is None else within[b, kv_idx]
            return spec.allows(q_idx, kv_idx, key_in_document) & (document_ids[b, q_idx] == document_ids[b, kv_idx])

        return flex_block_mask(same_document, batch, seq, seq, document_ids.device)
    positions = torch.arange(seq, device=document_ids.device)
    return visible_keys(document_ids, positions, positions, spec)[:, None]


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | BlockMask,
                     sink_logits: torch.Tensor | None = None) -> torch.Tensor:
    """Attention over (batch, heads, seq, head_dim) under a `document_mask` (or a boolean mask of these queries and
    keys), with `sink_logits` if given; k/v may have fewer heads."""
    gqa = q.shape[1] != k.shape[1]
    if isinstance(mask, BlockMask):
        if sink_logits is None:
            return compiled_flex_attention(q, k, v, block_mask=mask, enable_gqa=gqa)
        out, aux = compiled_flex_attention(q, k, v, block_mask=mask, enable_gqa=gqa, return_aux=AuxRequest(lse=True))
        return with_sink_logits(out, aux.lse, sink_logits)
    if sink_logits is not None:
        return with_sink_logits(*attention_and_lse(q, k, v, mask), sink_logits)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
