"""Context parallelism under document masking: which positions each rank takes, and what each method's attention
is given so that it skips the keys no query of it needs.

Under document masking a query sees the keys before it in its own document only. Each rank's queries come in
two chunks of the 2*cp equal chunks of the sequence (as with zigzag), and a chunk's queries need no key before
the start of its first query's document: the attention is given the keys from there to the chunk's end only
(allgather), or skips the blocks of keys that hold none of them (ring). A chunk's work is then its length times
that range, which depends on where the documents fall: zigzag, which balances causal work over one document,
can leave a rank with half as much again as the others on packed documents. So the ranks take the chunks of
each row by that work instead: the heaviest first, each to the rank with least work so far among those that
hold fewer than two (for one document spanning the row, that is zigzag exactly).

Every rank computes the same assignment from the row's document ids (each has the whole sequence's), and so
does the model on each pipeline stage for the rows of its micro-batch: it is a function of each row alone.
Without document masking every row is zigzag (parallelisms/context_parallel.py)."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch.nn.attention.flex_attention import BlockMask

from components.data.documents import document_positions
from components.model.attention import CAUSAL, AttentionMask, flex_block_mask, use_flex_attention


class ShardedDocuments(NamedTuple):
    """What the model's `document_mask` builder gives each attention under context parallelism."""

    document_ids: torch.Tensor
    """(batch, seq), of the whole sequence."""
    shares: torch.Tensor
    """(batch, cp, local): the positions of every rank's share of each row, each rank's two chunks in order."""
    plan: object
    """What this rank's attention needs besides, by method: allgather a `KeyRange` for each of its two query
    chunks; ring which blocks hold keys its queries see, (2 query chunks, cp owners, 2 key chunks) booleans on the
    CPU; alltoall the model's own mask of the whole sequence."""


class KeyRange(NamedTuple):
    """allgather's plan for one of a rank's query chunks: the keys [start, end) its queries may see, and on CUDA
    the FlexAttention mask of those queries against them (None elsewhere: the attention builds a boolean one)."""

    start: int
    end: int
    block_mask: BlockMask | None = None


def chunk_facts(document_ids: torch.Tensor, chunks: int) -> tuple[list, list, list]:
    """Per row and chunk, on the host: the start of its first token's document, its first token's document and
    its last token's."""
    size = document_ids.shape[1] // chunks
    starts = torch.arange(0, document_ids.shape[1], size, device=document_ids.device)
    stacked = torch.stack([starts - document_positions(document_ids)[:, starts], document_ids[:, starts],
                           document_ids[:, starts + size - 1]]).cpu()
    return stacked[0].tolist(), stacked[1].tolist(), stacked[2].tolist()


class LastChunkFacts:
    """`chunk_facts` of the ids asked about last, copied from the device once per ids tensor: a forward asks for
    its positions and for its masks of the same ids. apply_context_parallel gives one to each model it attaches to;
    without one, each call copies."""

    def __init__(self):
        self.ids: Callable[[], torch.Tensor | None] = lambda: None
        self.chunks, self.facts = 0, ([], [], [])

    def __call__(self, document_ids: torch.Tensor, chunks: int) -> tuple[list, list, list]:
        if self.ids() is not document_ids or self.chunks != chunks:
            self.ids, self.chunks, self.facts = weakref.ref(document_ids), chunks, chunk_facts(document_ids, chunks)
        return self.facts


ChunkFacts = Callable[[torch.Tensor, int], tuple[list, list, list]]
"""`chunk_facts`, or a LastChunkFacts."""


def balanced_chunks(document_ids: torch.Tensor, cp_size: int, facts: ChunkFacts = chunk_facts) -> torch.Tensor:
    """(batch, cp, 2) on the CPU: the two chunks (of 2*cp equal ones) each rank takes of each row, in order."""
    return _assign(facts(document_ids, 2 * cp_size)[0], cp_size, document_ids.shape[1] // (2 * cp_size))


def _assign(doc_starts: list[list[int]], cp_size: int, size: int) -> torch.Tensor:
    """balanced_chunks from each row's chunks' first documents' starts, chunks of `size`."""
    assignment = []
    for row in doc_starts:
        work = [size * ((chunk + 1) * size - start) for chunk, start in enumerate(row)]
        loads, taken = [0] * cp_size, [[] for _ in range(cp_size)]
        for chunk in sorted(range(2 * cp_size), key=lambda c: -work[c]):  # stable: equal work in sequence order
            rank = min((r for r in range(cp_size) if len(taken[r]) < 2), key=lambda r: loads[r])
            loads[rank] += work[chunk]
            taken[rank].append(chunk)
        assignment.append([sorted(share) for share in taken])
    return torch.tensor(assignment)


def share_positions(document_ids: torch.Tensor, cp_size: int, chunks: torch.Tensor | None = None,
                    facts: ChunkFacts = chunk_facts) -> torch.Tensor:
    """(batch, cp, local), on the ids' device: the positions each rank takes of each row (`balanced_chunks`)."""
    chunks = balanced_chunks(document_ids, cp_size, facts) if chunks is None else chunks
    size = document_ids.shape[1] // (2 * cp_size)
    return (chunks[..., None] * size + torch.arange(size)).flatten(2).to(document_ids.device)


def rank_positions(document_ids: torch.Tensor, cp_size: int, cp_rank: int,
                   facts: ChunkFacts = chunk_facts) -> torch.Tensor:
    """(batch, local): this rank's positions of each row."""
    return share_positions(document_ids, cp_size, facts=facts)[:, cp_rank]


def allgather_documents(document_ids: torch.Tensor, spec: AttentionMask = CAUSAL, *, cp_size: int,
                        cp_rank: int, facts: ChunkFacts = chunk_facts, flex: bool | None = None) -> ShardedDocuments:
    """allgather's mask for the layers declaring `spec`: each of this rank's query chunks sees the keys from the
    earliest start of its first query's document, or of its window (without sinks), over the rows, to its latest
    end; under a FlexAttention mask, built here once for every such layer, if `flex` (default: on CUDA,
    components/model/attention.py's `use_flex_attention`)."""
    size = document_ids.shape[1] // (2 * cp_size)
    doc_starts = facts(document_ids, 2 * cp_size)[0]
    chunks = _assign(doc_starts, cp_size, size)
    shares = share_positions(document_ids, cp_size, chunks)
    mine = chunks[:, cp_rank].tolist()
    flex = use_flex_attention(document_ids.device) if flex is None else flex
    plan = []
    for j in range(2):
        start = min(max(doc_starts[row][share[j]], spec.first_key(share[j] * size)) for row, share in enumerate(mine))
        end = max((share[j] + 1) * size for share in mine)
        queries = shares[:, cp_rank, j * size:(j + 1) * size]
        block_mask = chunk_block_mask(document_ids, queries, start, end, spec) if flex else None
        plan.append(KeyRange(start, end, block_mask))
    return ShardedDocuments(document_ids, shares, plan)


def chunk_block_mask(document_ids: torch.Tensor, queries: torch.Tensor, start: int, end: int,
                     spec: AttentionMask) -> BlockMask:
    """FlexAttention's mask of the queries at positions `queries` (batch, n) against the keys [start, end): those
    `spec` lets each query see, in its document. Compiled on CUDA, as
    components/model/attention.py's `document_mask`."""
    first_key = torch.tensor(start, device=document_ids.device)  # a tensor: a new start does not recompile
    within = document_positions(document_ids) if spec.sinks else None

    def same_document(b, h, q_idx, kv_idx):
        query, key = queries[b, q_idx], first_key + kv_idx
        key_in_document = None if within is None else within[b, key]
        return spec.allows(query, key, key_in_document) & (document_ids[b, query] == document_ids[b, key])

    return flex_block_mask(same_document, len(document_ids), queries.shape[1], end - start, document_ids.device)


def ring_documents(document_ids: torch.Tensor, spec: AttentionMask = CAUSAL, *, cp_size: int,
                   cp_rank: int, facts: ChunkFacts = chunk_facts) -> ShardedDocuments:
    """ring's mask for the layers declaring `spec`: whether this rank's query chunk a sees any key of chunk b of
    owner o's block, in any row. Documents are contiguous and in order, so a chunk of keys before the queries'
    chunk holds keys they see exactly when its last key is in the document of their first query, and within the
    window of that query or the layer keeps sinks (the first keys of that document). A mask_mod only takes keys
    away: the blocks it empties are attended, and give nothing."""
    doc_starts, first_doc, last_doc = facts(document_ids, 2 * cp_size)
    size = document_ids.shape[1] // (2 * cp_size)
    chunks = _assign(doc_starts, cp_size, size)

    def sees(row: int, query: int, key: int) -> bool:
        return key == query or (key < query and last_doc[row][key] == first_doc[row][query]
                                and (spec.sinks > 0 or chunk_in_window(query, key, size, spec.window)))

    rows = chunks.tolist()
    blocks = [[[any(sees(row, share[cp_rank][a], share[owner][b]) for row, share in enumerate(rows))
                for b in range(2)] for owner in range(cp_size)] for a in range(2)]
    return ShardedDocuments(document_ids, share_positions(document_ids, cp_size, chunks), torch.tensor(blocks))


def chunk_in_window(query: int, key: int, size: int, window: int | None) -> bool:
    """Whether a chunk of `size` keys, `key`, before the chunk of queries `query` (chunk numbers) holds a key within
    the `window` of one of them: the nearest pair, the queries' first and the keys' last, is (query - key - 1) *
    size + 1 apart."""
    return window is None or (query - key - 1) * size + 1 < window


def alltoall_documents(document_ids: torch.Tensor, spec: AttentionMask = CAUSAL, *, cp_size: int,
                       whole_mask: Callable[[torch.Tensor, AttentionMask], object]) -> ShardedDocuments:
    """alltoall's mask: the model's own (`whole_mask`) of the whole sequence for `spec`, which each rank attends
    whole for its heads (so its work does not depend on the assignment)."""
    return ShardedDocuments(document_ids, share_positions(document_ids, cp_size), whole_mask(document_ids, spec))


def take(tensor: torch.Tensor, positions: torch.Tensor, dim: int, batch_dim: int = 0) -> torch.Tensor:
    """`tensor` at `positions` (batch, n) along `dim`, each row of the batch (`batch_dim`) at its own."""
    shape = [1] * tensor.dim()
    shape[batch_dim], shape[dim] = positions.shape
    sizes = list(tensor.shape)
    sizes[dim] = positions.shape[1]
    return tensor.gather(dim, positions.view(shape).expand(sizes))
