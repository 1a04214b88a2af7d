"""Context parallelism: the ranks of the `cp` mesh dimension split every sample's sequence, and
attention, the one layer that mixes positions, sees all of it by one of three methods
(parallelism.context_parallel_method; docs/parallelisms.md says when to pick which).

Zigzag sharding. Under a causal mask a query attends to the keys before it, so a contiguous split
would leave the first rank almost idle and the last one with most of the work. The sequence is
instead cut into 2 * cp chunks and rank r takes chunks r and 2*cp-1-r: one early, one late. Each
rank's two query chunks then see (r + 1) + (2*cp - r) = 2*cp + 1 chunks of keys in all, the same
on every rank.

allgather (what Llama 3 used for long context). Before attention every rank all-gathers the keys and
values of the whole sequence (one all-gather per layer for both) and attends to them with its own
queries through a plain `scaled_dot_product_attention` with a mask. Keys and values are small next to
the activations (grouped-query attention has few KV heads), but every rank holds all of them. The
backward of the all-gather is a reduce-scatter: every rank's queries used every rank's keys and values,
so each rank's key/value gradient is the sum of all ranks' contributions to it.

ring: keys and values travel around the ranks, a block at a time (parallelisms/ring_attention.py).

alltoall (Ulysses). An all-to-all trades the sequence split for a split of the heads: each rank then
holds the whole sequence for cp-th of the heads, attends causally with the fused kernel, and a second
all-to-all trades back. Needs the heads each rank holds (after tensor parallelism) to divide by cp;
key/value heads that do not are repeated up to the query heads first.

All three run the same code on CPU/gloo and CUDA/NCCL (torch's experimental context_parallel has no
CPU attention).
"""
from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from components.config import ConfigError
from parallelisms.ring_attention import ring_attention, ring_document_ids


def zigzag_positions(seq_len: int, cp_size: int, cp_rank: int) -> torch.LongTensor:
    """The sequence positions rank `cp_rank` owns: chunks cp_rank and 2*cp_size-1-cp_rank of
    2*cp_size equal chunks, in that order."""
    if seq_len % (2 * cp_size):
        raise ValueError(
            f"training.seq_len {seq_len} must be divisible by 2 x parallelism.context_parallel_degree "
            f"= {2 * cp_size} (context parallelism cuts each sequence into that many equal chunks)"
        )
    chunks = torch.arange(seq_len).view(2 * cp_size, -1)
    return torch.cat([chunks[cp_rank], chunks[2 * cp_size - 1 - cp_rank]])


def shard_sequence(tensor: torch.Tensor, cp_mesh: DeviceMesh, dim: int = 1) -> torch.Tensor:
    """This rank's zigzag share of `tensor` along `dim` (the sequence of a (batch, seq, ...) tensor)."""
    positions = zigzag_positions(tensor.shape[dim], cp_mesh.size(), cp_mesh.get_local_rank())
    return tensor.index_select(dim, positions.to(tensor.device))


def _gather_sequence(x: torch.Tensor, cp_mesh: DeviceMesh) -> torch.Tensor:
    """Every rank's x (..., local_seq, head_dim) joined along the sequence, in sequence order.

    The all-gather goes through DTensor: Shard -> Replicate is the all-gather, and declaring the
    gathered tensor's gradient Partial (a sum still to be taken over the ranks) makes the backward
    the reduce-scatter that sums every rank's contribution and hands each rank its share."""
    seq_dim = x.dim() - 2
    gathered = DTensor.from_local(x.contiguous(), cp_mesh, [Shard(seq_dim)]).redistribute(cp_mesh, [Replicate()])
    return zigzag_to_sequence_order(gathered.to_local(grad_placements=[Partial()]), cp_mesh.size())


def zigzag_to_sequence_order(gathered: torch.Tensor, cp_size: int) -> torch.Tensor:
    """The ranks' zigzag shares (..., cp_size * local_seq, head_dim), concatenated in rank order,
    put in sequence order.

    Rank order is [chunk 0, chunk 2cp-1, chunk 1, chunk 2cp-2, ...]: the ranks' first chunks are the
    first half of the sequence, their second chunks the second half reversed."""
    seq_dim = gathered.dim() - 2
    pairs = gathered.unflatten(seq_dim, (cp_size, 2, -1))  # (..., rank, first/second, chunk, head_dim)
    first_half, second_half = pairs.select(seq_dim + 1, 0), pairs.select(seq_dim + 1, 1).flip(seq_dim)
    return torch.cat([first_half, second_half], dim=seq_dim).flatten(seq_dim, seq_dim + 1)


def allgather_kv_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None, *, cp_mesh: DeviceMesh,
    positions: torch.Tensor
) -> torch.Tensor:
    """Causal attention of this rank's queries to the keys and values of the whole sequence, within
    documents given a `mask` of `allgather_document_mask`.

    q: (batch, n_heads, local_seq, head_dim) and k, v: (batch, n_kv_heads, local_seq, head_dim),
    plain tensors holding the tokens at `positions` (this rank's `zigzag_positions`); n_kv_heads
    may divide n_heads (grouped-query attention). Returns a tensor shaped like q."""
    k, v = _gather_sequence(torch.stack([k, v]), cp_mesh)  # one all-gather for both
    return zigzag_attention(q, k, v, positions, cp_mesh.size(), cp_mesh.get_local_rank(), mask)


def allgather_document_mask(document_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """allgather's document mask: (batch, 1, local_seq, seq), True where this rank's query at `positions` may
    see a key: at or before it, in the same document. document_ids: (batch, seq), of the whole sequence."""
    seq = document_ids.shape[1]
    causal = positions[:, None] >= torch.arange(seq, device=document_ids.device)
    return ((document_ids[:, positions, None] == document_ids[:, None, :]) & causal)[:, None]


def zigzag_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, cp_size: int, cp_rank: int,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The attention of `allgather_kv_attention` once the keys and values are gathered: rank
    `cp_rank`'s queries q (batch, n_heads, local_seq, head_dim), at `positions`, to k and v of the
    whole sequence (batch, n_kv_heads, seq, head_dim). No process group: the memory estimator runs
    it on fake tensors.

    Each of the rank's two query chunks attends only to the keys up to its own end, which is what
    makes the zigzag split balance the work; a boolean mask lets position p see positions <= p (and,
    given the document `mask`, in its document)."""
    chunk = q.shape[2] // 2
    outputs = []
    for i, (q_chunk, q_positions, index) in enumerate(zip(
        q.split(chunk, dim=2), positions.split(chunk), (cp_rank, 2 * cp_size - 1 - cp_rank)
    )):
        end = (index + 1) * chunk  # the chunk's last position + 1: the keys it can see
        if mask is None:
            chunk_mask = q_positions[:, None] >= torch.arange(end, device=q.device)
        else:
            chunk_mask = mask[:, :, i * chunk:(i + 1) * chunk, :end]
        outputs.append(
            F.scaled_dot_product_attention(
                q_chunk, k[:, :, :end], v[:, :, :end], attn_mask=chunk_mask, enable_gqa=q.shape[1] != k.shape[1]
            )
        )
    return torch.cat(outputs, dim=2)


def rank_order(seq_len: int, cp_size: int) -> torch.LongTensor:
    """The sequence positions of the ranks' zigzag shares concatenated in rank order."""
    return torch.cat([zigzag_positions(seq_len, cp_size, rank) for rank in range(cp_size)])


def _heads_for_sequence(x: torch.Tensor, cp_mesh: DeviceMesh) -> torch.Tensor:
    """All-to-all: (batch, heads, local_seq, d), this rank's share of the sequence, becomes (batch, heads / cp,
    cp * local_seq, d), cp-th of the heads for every rank's share (in rank order). (DTensor's Shard -> Shard
    falls back to an all-gather on gloo; this is an all-to-all everywhere.)"""
    cp = cp_mesh.size()
    send = x.unflatten(1, (cp, -1)).movedim(1, 0).contiguous()  # (cp: the rank the heads go to, batch, ...)
    received = all_to_all_single_autograd(send.flatten(0, 1), None, None, cp_mesh.get_group())
    return received.view_as(send).movedim(0, 2).flatten(2, 3)  # (batch, heads / cp, cp: from rank, local_seq, d)


def _sequence_for_heads(x: torch.Tensor, cp_mesh: DeviceMesh) -> torch.Tensor:
    """The all-to-all back: (batch, heads / cp, cp * local_seq, d) to (batch, heads, local_seq, d)."""
    cp = cp_mesh.size()
    send = x.unflatten(2, (cp, -1)).movedim(2, 0).contiguous()  # (cp: the rank the sequence share goes to, ...)
    received = all_to_all_single_autograd(send.flatten(0, 1), None, None, cp_mesh.get_group())
    return received.view_as(send).movedim(0, 1).flatten(1, 2)  # (batch, cp: from rank, heads / cp, ...)


def check_heads_divide(n_heads: int, cp_size: int) -> None:
    if n_heads % cp_size:
        raise ConfigError(
            f"parallelism.context_parallel_method alltoall splits the {n_heads} query heads each rank holds (after "
            f"tensor parallelism) over parallelism.context_parallel_degree {cp_size} ranks, which does not divide "
            "them: pick ring or allgather, or a degree that divides the heads")


def alltoall_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask=None, *, cp_mesh: DeviceMesh,
                       attend) -> torch.Tensor:
    """Ulysses: the attention of `allgather_kv_attention`, computed by whole sequences of cp-th of the heads
    with the model's own kernel `attend(q, k, v, mask)` (its attention modules' `sdpa`: causal, fused, no
    mask; or within documents, given the model's document mask of the whole sequence)."""
    cp_size = cp_mesh.size()
    check_heads_divide(q.shape[1], cp_size)
    if k.shape[1] % cp_size:  # grouped-query attention with fewer key/value heads than ranks
        k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    q, k, v = (zigzag_to_sequence_order(_heads_for_sequence(t, cp_mesh), cp_size) for t in (q, k, v))
    out = attend(q, k, v, mask).index_select(2, rank_order(q.shape[2], cp_size).to(q.device))
    return _sequence_for_heads(out, cp_mesh)


def apply_context_parallel(model: nn.Module, cp_mesh: DeviceMesh, seq_len: int, method: str = "allgather",
                           heads_per_rank: int | None = None) -> nn.Module:
    """Make `model` (a whole Transformer or a pipeline stage) run on this rank's zigzag share of
    each sequence: it reads the RoPE angles at this rank's positions, and every module with an
    `sdpa` (the attention modules) attends through the `method`'s attention; allgather and ring replace the
    model's `document_mask` builder too (ring's attention takes the document ids themselves).
    `heads_per_rank`, the query heads of a rank after tensor parallelism, lets alltoall refuse at start-up what
    it cannot split.

    The positions live on the mesh's device: the model itself may still be on the meta device."""
    if method == "alltoall" and heads_per_rank is not None:
        check_heads_divide(heads_per_rank, cp_mesh.size())
    positions = zigzag_positions(seq_len, cp_mesh.size(), cp_mesh.get_local_rank())
    model.positions = positions.to(cp_mesh.device_type)
    if method == "allgather":
        model.document_mask = partial(allgather_document_mask, positions=model.positions)
    if method == "ring":
        model.document_mask = ring_document_ids
    for module in model.modules():
        if hasattr(module, "sdpa"):
            module.sdpa = {
                "allgather": partial(allgather_kv_attention, cp_mesh=cp_mesh, positions=model.positions),
                # Eager inside compiled blocks (its sends cannot be traced); wrapped here, not where it is
                # defined, so that only runs that use it import torch's compiler.
                "ring": partial(torch.compiler.disable(ring_attention), cp_mesh=cp_mesh),
                "alltoall": partial(alltoall_attention, cp_mesh=cp_mesh, attend=module.sdpa),
            }[method]
            module.sdpa_breaks_graph = method == "ring"  # parallelisms/compile.py
    return model
