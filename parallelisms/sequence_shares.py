"""How context parallelism shares a sequence out over the ranks of the `cp` mesh dimension: zigzag positions, and
the all-to-all that trades a rank's share of the sequence for whole sequences of a share of the heads (alltoall
attention; the convolutions and recurrent layers of parallelisms/sequence_mixers.py)."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh

from components.torch_private import all_to_all_single_autograd


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


def rank_order(seq_len: int, cp_size: int) -> torch.LongTensor:
    """The sequence positions of the ranks' zigzag shares concatenated in rank order."""
    return torch.cat([zigzag_positions(seq_len, cp_size, rank) for rank in range(cp_size)])


def heads_for_sequence(x: torch.Tensor, cp_mesh: DeviceMesh) -> torch.Tensor:
    """All-to-all: (batch, heads, local_seq, d), this rank's share of the sequence, becomes (batch, heads / cp,
    cp * local_seq, d), cp-th of the heads for every rank's share (in rank order). (DTensor's Shard -> Shard
    falls back to an all-gather on gloo; this is an all-to-all everywhere.)"""
    cp = cp_mesh.size()
    send = x.unflatten(1, (cp, -1)).movedim(1, 0).contiguous()  # (cp: the rank the heads go to, batch, ...)
    received = all_to_all_single_autograd(send.flatten(0, 1), None, None, cp_mesh.get_group())
    return received.view_as(send).movedim(0, 2).flatten(2, 3)  # (batch, heads / cp, cp: from rank, local_seq, d)


def sequence_for_heads(x: torch.Tensor, cp_mesh: DeviceMesh) -> torch.Tensor:
    """The all-to-all back: (batch, heads / cp, cp * local_seq, d) to (batch, heads, local_seq, d)."""
    cp = cp_mesh.size()
    send = x.unflatten(2, (cp, -1)).movedim(2, 0).contiguous()  # (cp: the rank the sequence share goes to, ...)
    received = all_to_all_single_autograd(send.flatten(0, 1), None, None, cp_mesh.get_group())
    return received.view_as(send).movedim(0, 1).flatten(1, 2)  # (batch, cp: from rank, heads / cp, ...)
