"""Context parallelism: the ranks of the `cp` mesh dimension split every sample's sequence, and
attention sees all of it by one of three methods (parallelism.context_parallel_method; docs/parallelisms.md says
when to pick which). The other ways a model declares it mixes tokens, causal convolutions and recurrent layers,
see whole sequences by an all-to-all whatever the method (parallelisms/sequence_mixers.py).

Zigzag sharding. Under a causal mask a query attends to the keys before it, so a contiguous split
would leave the first rank almost idle and the last one with most of the work. The sequence is
instead cut into 2 * cp chunks and rank r takes chunks r and 2*cp-1-r: one early, one late. Each
rank's two query chunks then see (r + 1) + (2*cp - r) = 2*cp + 1 chunks of keys in all, the same
on every rank. Under document masking each row's chunks go to the ranks by its documents instead
(parallelisms/context_parallel_documents.py).

allgather (what Llama 3 used for long context). Before attention every rank all-gathers the keys and
values of the whole sequence (one all-gather per layer for both) and attends to them with its own
queries through `scaled_dot_product_attention`, causal from the bottom right (`zigzag_masks`). Keys and
values are small next to the activations (grouped-query attention has few KV heads), but every rank holds all
of them. The backward of the all-gather is a reduce-scatter: every rank's queries used every rank's keys and
values, so each rank's key/value gradient is the sum of all ranks' contributions to it.

ring: keys and values travel around the ranks, a block at a time (parallelisms/ring_attention.py).

alltoall (Ulysses). An all-to-all trades the sequence split for a split of the heads: each rank then
holds the whole sequence for cp-th of the heads, attends causally with the fused kernel, and a second
all-to-all trades back. Needs the heads each rank holds (after tensor parallelism) to divide by cp;
key/value heads that do not are repeated up to the query heads first.

All three run the same code on CPU/gloo and CUDA/NCCL (torch's experimental context_parallel has no
CPU attention), and honour the mask each attention module declares (components/model/attention.py's AttentionMask: a
sliding window, with or without documents); allgather and ring, which replace the module's kernel, refuse one whose
`sdpa` is the model's own function (`check_declared_attention`).
"""
from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from components.config import ConfigError
from components.model.attention import (
    CAUSAL,
    AttentionLayer,
    AttentionMask,
    attention_by_chunks,
    attention_layers,
    causal_attention,
    masked_attention,
    visible_keys,
)
from components.training.qk_clip import largest_logits
from parallelisms.context_parallel_documents import (
    ChunkFacts,
    LastChunkFacts,
    ShardedDocuments,
    allgather_documents,
    alltoall_documents,
    chunk_facts,
    rank_positions,
    ring_documents,
    take,
)
from parallelisms.ring_attention import Ring, ring_attention
from parallelisms.sequence_mixers import carry_over_context
from parallelisms.sequence_shares import heads_for_sequence, rank_order, sequence_for_heads, zigzag_positions

if TYPE_CHECKING:
    from torch.nn.attention.bias import CausalBias


def shard_sequence(tensor: torch.Tensor, cp_mesh: DeviceMesh, dim: int = 1,
                   document_ids: torch.Tensor | None = None) -> torch.Tensor:
    """This rank's share of `tensor` along `dim` (the sequence of a (batch, seq, ...) tensor): zigzag, or under
    document masking (given the rows' `document_ids`) each row's by its documents."""
    zigzag = zigzag_positions(tensor.shape[dim], cp_mesh.size(), cp_mesh.get_local_rank())  # checks the split too
    if document_ids is None:
        return tensor.index_select(dim, zigzag.to(tensor.device))
    return take(tensor, rank_positions(document_ids, cp_mesh.size(), cp_mesh.get_local_rank()), dim)


def local_positions(document_ids: torch.Tensor | None, *, zigzag: torch.Tensor, cp_size: int,
                    cp_rank: int, facts: ChunkFacts = chunk_facts) -> torch.Tensor:
    """The model's `local_positions` under context parallelism: the positions of this rank's share, (local,)
    zigzag, or (batch, local) under document masking."""
    return zigzag if document_ids is None else rank_positions(document_ids, cp_size, cp_rank, facts)


def _gather_shares(x: torch.Tensor, cp_mesh: DeviceMesh) -> torch.Tensor:
    """Every rank's x (..., local_seq, head_dim) joined along the sequence, in rank order.

    The all-gather goes through DTensor: Shard -> Replicate is the all-gather, and declaring the
    gathered tensor's gradient Partial (a sum still to be taken over the ranks) makes the backward
    the reduce-scatter that sums every rank's contribution and hands each rank its share."""
    seq_dim = x.dim() - 2
    gathered = DTensor.from_local(x.contiguous(), cp_mesh, [Shard(seq_dim)]).redistribute(cp_mesh, [Replicate()])
    return gathered.to_local(grad_placements=[Partial()])


def _gather_kv(k: torch.Tensor, v: torch.Tensor, cp_mesh: DeviceMesh) -> torch.Tensor:
    """Every rank's keys and values in one all-gather, joined along the head size (which may differ: multi-head
    latent attention's values are narrower than its keys); `_split_kv` parts them."""
    return _gather_shares(torch.cat([k, v], dim=-1), cp_mesh)


def _split_kv(joined: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return joined.split([k.shape[-1], joined.shape[-1] - k.shape[-1]], dim=-1)


def zigzag_to_sequence_order(gathered: torch.Tensor, cp_size: int) -> torch.Tensor:
    """The ranks' zigzag shares (..., cp_size * local_seq, head_dim), concatenated in rank order,
    put in sequence order.

    Rank order is [chunk 0, chunk 2cp-1, chunk 1, chunk 2cp-2, ...]: the ranks' first chunks are the
    first half of the sequence, their second chunks the second half reversed."""
    seq_dim = gathered.dim() - 2
    pairs = gathered.unflatten(seq_dim, (cp_size, 2, -1))  # (..., rank, first/second, chunk, head_dim)
    first_half, second_half = pairs.select(seq_dim + 1, 0), pairs.select(seq_dim + 1, 1).flip(seq_dim)
    return torch.cat([first_half, second_half], dim=seq_dim).flatten(seq_dim, seq_dim + 1)


def allgather_kv_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: ShardedDocuments | None = None,
                           spec: AttentionMask = CAUSAL, sink_logits: torch.Tensor | None = None, *,
                           cp_mesh: DeviceMesh, masks: tuple[CausalBias, CausalBias]) -> torch.Tensor:
    """Causal attention of this rank's queries to the keys and values of the whole sequence, under the layer's
    declared `spec`, within documents given a `mask` of `allgather_documents` (else under the rank's
    `zigzag_masks`, or under the spec's window, sinks or mask_mod), with learned `sink_logits` if given (each query
    has all its keys here, so they apply as without context parallelism).

    q: (batch, n_heads, local_seq, head_dim) and k, v: (batch, n_kv_heads, local_seq, head_dim),
    plain tensors holding this rank's share of the tokens; n_kv_heads may divide n_heads (grouped-query
    attention). Returns a tensor shaped like q, but for the head size, v's."""
    if mask is not None:
        return _allgather_documents_attention(q, k, v, mask, cp_mesh, spec, sink_logits)
    k, v = _split_kv(zigzag_to_sequence_order(_gather_kv(k, v, cp_mesh), cp_mesh.size()), k)
    if spec != CAUSAL or sink_logits is not None:
        return zigzag_declared_attention(q, k, v, cp_mesh.size(), cp_mesh.get_local_rank(), spec, sink_logits)
    return zigzag_attention(q, k, v, masks)


def _allgather_documents_attention(q, k, v, documents: ShardedDocuments, cp_mesh: DeviceMesh,
                                   spec: AttentionMask, sink_logits: torch.Tensor | None) -> torch.Tensor:
    """allgather under document masking: the gathered keys and values put in sequence order, row by row."""
    shares = documents.shares.flatten(1)  # (batch, seq): the positions of the gathered keys, in rank order
    k, v = _split_kv(take(_gather_kv(k, v, cp_mesh), shares.argsort(dim=1), dim=2), k)
    return documents_attention(q, k, v, documents, cp_mesh.get_local_rank(), spec, sink_logits)


def documents_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: ShardedDocuments,
                        cp_rank: int, spec: AttentionMask = CAUSAL,
                        sink_logits: torch.Tensor | None = None) -> torch.Tensor:
    """allgather's attention under document masking once the keys and values of the whole sequence are gathered:
    each of rank `cp_rank`'s two query chunks attends to the range of keys the mask's plan gives it
    (`allgather_documents`), those `spec` lets each query see in its document: under the plan's
    FlexAttention mask on CUDA, a boolean one built here elsewhere. No process group: the memory estimator runs
    it on fake tensors."""
    chunk = q.shape[2] // 2
    outputs = []
    for j, (start, end, mask) in enumerate(documents.plan):
        rows = slice(j * chunk, (j + 1) * chunk)
        if mask is None:
            keys = torch.arange(start, end, device=q.device)
            mask = visible_keys(documents.document_ids, documents.shares[:, cp_rank, rows], keys, spec)[:, None]
        outputs.append(masked_attention(q[:, :, rows], k[:, :, start:end], v[:, :, start:end], mask, sink_logits))
    return torch.cat(outputs, dim=2)


def zigzag_declared_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp_size: int, cp_rank: int,
                              spec: AttentionMask, sink_logits: torch.Tensor | None = None) -> torch.Tensor:
    """`zigzag_attention` under a window, sinks or a mask_mod, or with learned `sink_logits`: each of the rank's two
    query chunks attends by smaller chunks to the keys from the first their queries may see to their last
    (`attention_by_chunks`), so under a window the work and the scores' memory fall with it. No process group: the
    memory estimator runs it on fake tensors."""
    chunk = q.shape[2] // 2
    return torch.cat([attention_by_chunks(q_chunk, k, v, index * chunk, spec, sink_logits)
                      for q_chunk, index in zip(q.split(chunk, dim=2), (cp_rank, 2 * cp_size - 1 - cp_rank))], dim=2)


def zigzag_masks(seq_len: int, cp_size: int, cp_rank: int) -> tuple[CausalBias, CausalBias]:
    """The causal masks of rank `cp_rank`'s two zigzag query chunks against the keys up to each chunk's end: query
    i of chunk c sees the keys up to c * chunk + i, causal aligned at the bottom right. `causal_lower_right` says
    so without a mask: on CUDA SDPA runs the flash kernel on it (half precision); elsewhere torch builds the mask.
    Made once, outside compiled code (a compiled graph cannot construct one, but takes one)."""
    # Imported here: torch.nn.attention.bias imports torch's compiler (0.4 s and 30 MB of every process's start-up).
    from torch.nn.attention.bias import causal_lower_right

    chunk = seq_len // (2 * cp_size)
    return tuple(causal_lower_right(chunk, (index + 1) * chunk) for index in (cp_rank, 2 * cp_size - 1 - cp_rank))


def zigzag_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, masks: tuple[CausalBias, CausalBias]
                     ) -> torch.Tensor:
    """The causal attention of `allgather_kv_attention` once the keys and values are gathered: this rank's zigzag
    queries q (batch, n_heads, local_seq, head_dim) to k and v of the whole sequence (batch, n_kv_heads, seq,
    head_dim), under the rank's `zigzag_masks`. No process group: the memory estimator runs it on fake tensors.

    Each of the rank's two query chunks attends only to the keys up to its own end, which is what makes the
    zigzag split balance the work."""
    outputs = []
    for q_chunk, mask in zip(q.split(q.shape[2] // 2, dim=2), masks):
        end = mask.seq_len_kv  # the chunk's last position + 1
        outputs.append(F.scaled_dot_product_attention(q_chunk, k[:, :, :end], v[:, :, :end], attn_mask=mask,
                                                      enable_gqa=q.shape[1] != k.shape[1]))
    return torch.cat(outputs, dim=2)


def check_heads_divide(n_heads: int, cp_size: int) -> None:
    if n_heads % cp_size:
        raise ConfigError(
            f"parallelism.context_parallel_method alltoall splits the {n_heads} query heads each rank holds (after "
            f"tensor parallelism) over parallelism.context_parallel_degree {cp_size} ranks, which does not divide "
            "them: pick ring or allgather, or a degree that divides the heads")


def alltoall_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask=None, spec: AttentionMask = CAUSAL,
                       sink_logits: torch.Tensor | None = None, *, cp_mesh: DeviceMesh, attend) -> torch.Tensor:
    """Ulysses: the attention of `allgather_kv_attention`, computed by whole sequences of cp-th of the heads
    with the model's own kernel `attend(q, k, v, mask, spec)` (its attention modules' `sdpa`, under the layer's
    declared `spec`; within documents given `alltoall_documents`, which holds the model's mask of the whole
    sequence), given the `sink_logits` of those heads if the layer has any. Any kernel that treats the heads alone
    is right here, the model's own included."""
    cp_size = cp_mesh.size()
    if sink_logits is not None:  # the heads this rank attends with: its cp-th share, in order
        attend = partial(attend, sink_logits=sink_logits.unflatten(0, (cp_size, -1))[cp_mesh.get_local_rank()])
    check_heads_divide(q.shape[1], cp_size)
    if k.shape[1] % cp_size:  # grouped-query attention with fewer key/value heads than ranks
        k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    q, k, v = (heads_for_sequence(t, cp_mesh) for t in (q, k, v))  # in rank order
    if mask is None:
        q, k, v = (zigzag_to_sequence_order(t, cp_size) for t in (q, k, v))
        out = attend(q, k, v, None, spec).index_select(2, rank_order(q.shape[2], cp_size).to(q.device))
    else:
        shares = mask.shares.flatten(1)
        q, k, v = (take(t, shares.argsort(dim=1), dim=2) for t in (q, k, v))
        out = take(attend(q, k, v, mask.plan, spec), shares, dim=2)
    return sequence_for_heads(out, cp_mesh)


def attention_runs_eagerly(method: str, document_masking: bool, measures_logits: bool = False) -> bool:
    """Whether the `method`'s attention runs eagerly inside compiled blocks (which then compile in several graphs,
    parallelisms/compile.py): ring's point-to-point sends cannot be traced, nor can allgather's key ranges under
    document masking (values of the batch) without a recompile per batch, nor the ring of keys that measures the
    largest logits (`measures_logits`: QK-clip's, `sequence_largest_logits`)."""
    return method == "ring" or (method == "allgather" and document_masking) or measures_logits


def check_declared_attention(model: nn.Module, method: str) -> None:
    """Refuse what `method` cannot honour: allgather and ring compute attention themselves from each module's
    declared `attention_mask`, so a module whose `sdpa` is its own function (a fork's new mask) would silently
    lose it."""
    for name, module in model.named_modules():
        if not hasattr(module, "sdpa"):
            continue
        if not isinstance(getattr(module, "attention_mask", None), AttentionMask):
            raise ConfigError(f"context parallelism: {name} has an sdpa but declares no attention_mask (an "
                              "AttentionMask, components/model/attention.py; docs/models.md)")
        if method != "alltoall" and module.sdpa is not causal_attention:
            kernel = getattr(module.sdpa, "__qualname__", repr(module.sdpa))
            raise ConfigError(f"parallelism.context_parallel_method {method} replaces the attention of {name}, "
                              f"whose sdpa is the model's own ({kernel}), and would drop its mask: declare the mask "
                              "as the module's attention_mask with components.model.attention.causal_attention as its "
                              "sdpa, or use context_parallel_method alltoall, which runs the model's own kernel")


def apply_context_parallel(model: nn.Module, cp_mesh: DeviceMesh, seq_len: int, method: str = "allgather",
                           heads_per_rank: int | None = None, document_masking: bool = False,
                           mixers: str = "pass_state") -> nn.Module:
    """Make `model` (a whole Transformer or a pipeline stage) run on this rank's share of each sequence
    (zigzag, or by documents under `document_masking`: parallelisms/context_parallel_documents.py): its
    `local_positions` give the positions whose RoPE angles it reads, its `document_mask` builder what the
    attention needs of the documents, and every attention layer (an `sdpa` and its `attention_mask`) attends through
    the `method`'s attention, under the mask each declares (`attention_mask`, components/model/attention.py).
    allgather and ring replace the shared kernel (`causal_attention`) and refuse a module whose `sdpa` is the
    model's own: what it computes is not declared. `heads_per_rank`, the query heads of a rank after tensor
    parallelism, lets alltoall refuse at start-up what it cannot split. `mixers`: how the convolutions and recurrent
    layers the model declares see the sequence (parallelisms/sequence_mixers.py's MIXER_METHODS).

    The positions live on the mesh's device: the model itself may still be on the meta device."""
    cp_size, cp_rank = cp_mesh.size(), cp_mesh.get_local_rank()
    if method == "alltoall" and heads_per_rank is not None:
        check_heads_divide(heads_per_rank, cp_size)
    check_declared_attention(model, method)
    zigzag = zigzag_positions(seq_len, cp_size, cp_rank).to(cp_mesh.device_type)
    masks = zigzag_masks(seq_len, cp_size, cp_rank)
    eager = attention_runs_eagerly(method, document_masking)

    def attention(layer: AttentionLayer):
        kernel = {
            "allgather": partial(allgather_kv_attention, cp_mesh=cp_mesh, masks=masks),
            "ring": partial(ring_attention, cp_mesh=cp_mesh),
            "alltoall": partial(alltoall_attention, cp_mesh=cp_mesh, attend=layer.sdpa),
        }[method]
        # Wrapped here, not where they are defined, so that only runs that use them import torch's compiler.
        return torch.compiler.disable(kernel) if eager else kernel

    facts = LastChunkFacts()  # the model's positions and masks of a forward read the same ids
    attach_context_parallel(
        model,
        partial(local_positions, zigzag=zigzag, cp_size=cp_size, cp_rank=cp_rank, facts=facts),
        {
            "allgather": partial(allgather_documents, cp_size=cp_size, cp_rank=cp_rank, facts=facts),
            "ring": partial(ring_documents, cp_size=cp_size, cp_rank=cp_rank, facts=facts),
            "alltoall": partial(alltoall_documents, cp_size=cp_size, whole_mask=model.document_mask),
        }[method],
        attention,
    )
    carry_over_context(model, cp_mesh, facts, mixers)  # the convolutions and recurrences it declares besides attention
    return model


def attach_context_parallel(model: nn.Module, positions: Callable, document_mask: Callable,
                            attention: Callable[[AttentionLayer], Callable]) -> None:
    """Where context parallelism enters a model (components/model/contract.py): the positions of this rank's
    share of the sequence, the builder of what each attention layer gets of the documents, and each attention
    layer's kernel, `attention(layer)`. The memory estimator attaches its stand-ins here too."""
    model.local_positions = positions
    model.document_mask = document_mask
    for _, layer in attention_layers(model):
        layer.sdpa = attention(layer)


def whole_sequence_logits(cp_mesh: DeviceMesh) -> Callable:
    """`sequence_largest_logits` over the ring of `cp_mesh`'s ranks (its sends cannot be traced: the caller runs it
    eagerly)."""
    return partial(sequence_largest_logits, ring=Ring(cp_mesh))


def sequence_largest_logits(q: torch.Tensor, k: torch.Tensor, mask: ShardedDocuments | None = None,
                            spec: AttentionMask = CAUSAL, *, ring: Ring) -> torch.Tensor:
    """(heads,): the largest pre-softmax logit of each head of this rank's queries against the keys of the whole
    sequence they see under `spec` (in their documents given the `mask` of any method), whatever the method: each
    rank's keys travel the ring of context-parallel ranks in turn, so that no rank holds more than two shares of
    them. q, k: this rank's share (batch, heads, local_seq, head_dim), as the method's attention gets them."""
    if mask is None:
        seq = q.shape[2] * ring.size
        document_ids, positions = None, [zigzag_positions(seq, ring.size, r).to(q.device) for r in range(ring.size)]
    else:
        document_ids, positions = mask.document_ids, mask.shares.unbind(1)
    mine = positions[ring.rank]
    keys, largest = k.detach().contiguous(), None
    for step in range(ring.size):
        pending = ring.start(keys) if step < ring.size - 1 else None
        theirs = positions[(ring.rank - step) % ring.size]

        def visible(rows: slice) -> torch.Tensor:
            allowed = visible_keys(document_ids, mine[..., rows], theirs, spec)
            return allowed if document_ids is None else allowed[:, None]

        logits = largest_logits(q, keys, visible)
        largest = logits if largest is None else torch.maximum(largest, logits)
        if pending is not None:
            keys = ring.finish(pending)
    return largest
