"""Where the documents of a packed window begin and end.

A packed training window holds several documents back to back, each stored as BOS + tokens + EOS,
and may start or end in the middle of one. These helpers turn a window's token ids into, for each
position, the number of the document it belongs to and its position inside that document: what
document masking (attention never crosses a document boundary) and per-document RoPE (positions
restart at 0 at each document) need. Both work on whole batches at once, without Python loops.
"""

from __future__ import annotations

import torch


def document_ids(tokens: torch.Tensor, eos_id: int) -> torch.Tensor:
    """The document number of every position of `tokens` (batch, seq) within its window.

    0 for the window's first document (possibly the tail of one that began in an earlier window),
    then +1 after every EOS; an EOS belongs to the document it ends. E.g. with eos_id 2:
    [5, 2, 1, 7, 2, 1] -> [0, 0, 1, 1, 1, 2]."""
    is_eos = (tokens == eos_id).long()
    # The EOS seen strictly before each position (an exclusive cumulative sum).
    return is_eos.cumsum(dim=-1) - is_eos


def document_positions(document_ids: torch.Tensor) -> torch.Tensor:
    """The position of every token within its document: 0 at each document's first token in the
    window, counting up from there. document_ids: (batch, seq), non-decreasing along each row."""
    seq = document_ids.shape[-1]
    index = torch.arange(seq, device=document_ids.device).expand_as(document_ids)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[..., 1:] = document_ids[..., 1:] != document_ids[..., :-1]
    # Each position's document start: the latest start at or before it.
    start_index = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=-1).values
    return index - start_index
