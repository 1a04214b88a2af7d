"""The token mixers a model declares besides attention (components/model/token_mixing.py: causal convolutions and
recurrent layers) under the layouts that split the sequence.

Context parallelism (`carry_over_context`): each rank holds its share of every sequence (zigzag chunks, or chunks
by documents), in an order that puts a rank's chunks far apart. Two methods (parallelism.context_parallel_mixers).
"pass_state", the default: each rank computes its own chunks; a recurrence's state is passed between the ranks in
sequence order (`recurrence_passing_state`: every rank gathers each chunk's final state and transition, a few
key_dim x value_dim matrices a head, and composes the state each of its chunks starts from), and a convolution gets
the k - 1 tokens before each chunk (`conv_with_halo`); the ranks send states and a few tokens, whatever the
sequence's length, and need not split the heads. "alltoall": a declared kernel treats each channel or head
alone, so an all-to-all trades the sequence split for a split of the channels (convolution) or heads (recurrence),
as alltoall attention does: each rank runs the model's own kernel on whole sequences, in sequence order, of cp-th
of them, with the whole sequence's document ids, and a second all-to-all trades back. Exact on every
context-parallel method (attention's method is its own) and under document masking; the channels or heads a rank
holds must divide by the degree.

Sequence parallelism (`sequence_parallel_mixers`): between blocks each tp rank holds a slice of the sequence. A
declared module that the tensor-parallel plan does not place (a convolution on the residual stream, say) is given
the whole sequence and computed whole by every tp rank, each keeping its slice of the output, so its weights get
the same gradients on every rank. One the plan places (inside attention, after the column-wise projections) sees
whole sequences already."""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import PrepareModuleInputOutput, parallelize_module

from components.config import ConfigError
from components.model.token_mixing import convolution_layers, recurrent_layers
from components.torch_private import all_gather_autograd
from parallelisms.context_parallel_documents import ChunkFacts, chunk_facts, share_positions, take
from parallelisms.sequence_shares import heads_for_sequence, rank_order, sequence_for_heads


def has_token_mixers(module: nn.Module) -> bool:
    """Whether `module` holds a declared convolution or recurrent layer."""
    return any(True for _ in convolution_layers(module)) or any(True for _ in recurrent_layers(module))


MIXER_METHODS = ("pass_state", "alltoall")
"""parallelism.context_parallel_mixers: how the declared convolutions and recurrences see the sequence."""


def carry_over_context(model: nn.Module, cp_mesh: DeviceMesh, facts: ChunkFacts = chunk_facts,
                       method: str = "pass_state") -> None:
    """Give every declared convolution and recurrent layer of `model` what it needs of the sequence under context
    parallelism, by `method`: "alltoall", whole sequences of a share of its channels or heads; "pass_state", its
    rank's share of the sequence with the state the earlier positions leave (a recurrence's, passed between the ranks
    in sequence order; the last tokens before each chunk for a convolution). `facts`: the model's LastChunkFacts,
    so that every layer of a forward reads the document chunks its positions and masks read, without copying them
    from the device again."""
    for name, layer in convolution_layers(model):
        carried = conv_over_shares if method == "alltoall" else conv_with_halo
        layer.conv = partial(carried, kernel=layer.conv, cp_mesh=cp_mesh, name=name, facts=facts)
    for name, layer in recurrent_layers(model):
        if method == "pass_state" and not getattr(layer.recurrence, "passes_state", False):
            raise ConfigError(f"{name}'s recurrence cannot start from a given state (components/model/token_mixing.py"
                              "'s RecurrentLayer): set parallelism.context_parallel_mixers to alltoall")
        carried = recurrence_over_shares if method == "alltoall" else recurrence_passing_state
        layer.recurrence = partial(carried, kernel=layer.recurrence, cp_mesh=cp_mesh, name=name, facts=facts)


def sequence_parallel_mixers(model: nn.Module, tp_mesh: DeviceMesh, plan: dict) -> None:
    """Under sequence parallelism, every declared convolution or recurrent module that neither the `plan` nor a
    module above it in the plan places takes its (one positional) input gathered whole along the sequence and
    hands on this rank's slice of its output; what it takes by keyword (document ids) passes as it is."""
    placed = set(plan)
    for name, _ in [*convolution_layers(model), *recurrent_layers(model)]:
        parts = name.split(".")
        if any(".".join(parts[:i]) in placed for i in range(1, len(parts) + 1)):
            continue
        parallelize_module(model.get_submodule(name), tp_mesh, PrepareModuleInputOutput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_input=True,
            output_layouts=(Replicate(),), desired_output_layouts=(Shard(1),), use_local_output=True))


def _order(seq: int, cp_size: int, document_ids: torch.Tensor | None, device: torch.device,
           facts: ChunkFacts) -> torch.Tensor:
    """(rows, seq): the positions of the ranks' shares concatenated in rank order (zigzag, or by documents)."""
    if document_ids is None:
        return rank_order(seq, cp_size).to(device)[None]
    return share_positions(document_ids, cp_size, facts=facts).flatten(1)


def whole_sequences(t: torch.Tensor, cp_mesh: DeviceMesh, order: torch.Tensor) -> torch.Tensor:
    """(batch, local, heads, ...), this rank's share of the sequence, to (batch, seq, heads / cp, ...): whole
    sequences, in order, of cp-th of the heads."""
    batch, local, heads, *rest = t.shape
    x = heads_for_sequence(t.reshape(batch, local, heads, -1).transpose(1, 2), cp_mesh)  # rank order
    x = take(x, order.argsort(dim=1), dim=2)
    return x.transpose(1, 2).reshape(batch, -1, heads // cp_mesh.size(), *rest)


def own_shares(t: torch.Tensor, cp_mesh: DeviceMesh, order: torch.Tensor) -> torch.Tensor:
    """`whole_sequences` back: (batch, seq, heads / cp, ...) to this rank's share, (batch, local, heads, ...)."""
    batch, seq, heads, *rest = t.shape
    x = sequence_for_heads(take(t.reshape(batch, seq, heads, -1).transpose(1, 2), order, dim=2), cp_mesh)
    return x.transpose(1, 2).reshape(batch, seq // cp_mesh.size(), heads * cp_mesh.size(), *rest)


def _check_divides(count: int, what: str, name: str, cp_mesh: DeviceMesh) -> None:
    if count % cp_mesh.size():
        raise ConfigError(f"parallelism.context_parallel_degree {cp_mesh.size()} does not divide the {count} {what} "
                          f"of {name}, which context parallelism shares out over the ranks: pick a degree that "
                          "divides them")


def conv_over_shares(x: torch.Tensor, weight: torch.Tensor, document_ids: torch.Tensor | None = None, *, kernel,
                     cp_mesh: DeviceMesh, name: str, facts: ChunkFacts = chunk_facts) -> torch.Tensor:
    """A `ConvolutionLayer`'s kernel on this rank's share x (batch, local, channels): computed by `kernel` on whole
    sequences of cp-th of the channels, with their share of the weight (channels, k)."""
    _check_divides(x.shape[-1], "channels", name, cp_mesh)
    order = _order(x.shape[1] * cp_mesh.size(), cp_mesh.size(), document_ids, x.device, facts)
    mine = weight.unflatten(0, (cp_mesh.size(), -1))[cp_mesh.get_local_rank()]
    out = kernel(whole_sequences(x[..., None], cp_mesh, order)[..., 0], mine, document_ids)
    return own_shares(out[..., None], cp_mesh, order)[..., 0]


def recurrence_over_shares(*inputs: torch.Tensor, document_ids: torch.Tensor | None = None, kernel,
                           cp_mesh: DeviceMesh, name: str, facts: ChunkFacts = chunk_facts) -> torch.Tensor:
    """A `RecurrentLayer`'s kernel on this rank's share of its inputs (batch, local, heads, ...): computed by
    `kernel` on whole sequences of cp-th of the heads."""
    for t in inputs:
        _check_divides(t.shape[2], "heads", name, cp_mesh)
    order = _order(inputs[0].shape[1] * cp_mesh.size(), cp_mesh.size(), document_ids, inputs[0].device, facts)
    out = kernel(*(whole_sequences(t, cp_mesh, order) for t in inputs), document_ids=document_ids)
    return own_shares(out, cp_mesh, order)


def _pieces(local: int, cp_mesh: DeviceMesh, document_ids: torch.Tensor | None, batch: int, device: torch.device,
            facts: ChunkFacts) -> tuple[torch.Tensor, torch.Tensor]:
    """(batch, cp, 2): the chunk numbers (of the sequence's 2 cp equal chunks) of every rank's two pieces of each row,
    in their order in its share; and (batch, seq): the rows' document ids (zeros without documents)."""
    cp = cp_mesh.size()
    seq, size = local * cp, local // 2
    order = _order(seq, cp, document_ids, device, facts).expand(batch, -1)
    ids = torch.zeros(batch, seq, dtype=torch.long, device=device) if document_ids is None else document_ids
    return (order[:, ::size] // size).view(batch, cp, 2), ids


def _by_chunk(gathered: torch.Tensor, chunks: torch.Tensor) -> torch.Tensor:
    """(cp, batch, 2, ...) gathered from every rank's pieces to (batch, 2 cp, ...) in sequence order."""
    batch = gathered.shape[1]
    flat = gathered.movedim(0, 1).flatten(1, 2)  # (batch, cp x 2, ...), rank order
    return take(flat, chunks.view(batch, -1).argsort(dim=1), dim=1)


def recurrence_passing_state(*inputs: torch.Tensor, document_ids: torch.Tensor | None = None, kernel,
                             cp_mesh: DeviceMesh, name: str, facts: ChunkFacts = chunk_facts) -> torch.Tensor:
    """A `RecurrentLayer`'s kernel on this rank's share (two chunks of each row, of the 2 cp the sequence is cut
    into), the state passed in sequence order (LASP-2's way, exact): each chunk runs from a state tracked
    symbolically, its values v extended by key_dim zero columns and its initial state [0 | I], so that its output and
    final state say, linearly, what any state it starts from adds (the kernel's output and state are linear in v and
    in the initial state); every rank gathers each chunk's final state from zero and its transition (key_dim x
    (value_dim + key_dim) a head), composes the state each of its chunks starts from, in order, and adds its part.
    The ranks send these states, not the activations; the heads are not split. The inputs are (q, k, v, ...), v the
    values, as the kernels of components/model/token_mixing.py take them."""
    q, k, v, *rest = inputs
    batch, local, heads, value_dim = v.shape
    key_dim, size = k.shape[-1], local // 2
    chunks, ids = _pieces(local, cp_mesh, document_ids, batch, v.device, facts)
    mine = chunks[:, cp_mesh.get_local_rank()]  # (batch, 2)
    starts = (mine * size).flatten()
    rows = torch.arange(batch, device=v.device).repeat_interleave(2)
    piece_ids = ids[rows[:, None], starts[:, None] + torch.arange(size, device=v.device)]  # (batch x 2, size)
    before = torch.where(starts > 0, ids[rows, (starts - 1).clamp(min=0)], -1)

    def pieces(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(batch * 2, size, *t.shape[2:])

    extended = torch.cat([v, v.new_zeros(*v.shape[:-1], key_dim)], dim=-1)
    identity = torch.cat([v.new_zeros(key_dim, value_dim), torch.eye(key_dim, dtype=v.dtype, device=v.device)], -1)
    out, final = kernel(pieces(q), pieces(k), pieces(extended), *map(pieces, rest), document_ids=piece_ids,
                        initial_state=identity.expand(batch * 2, heads, key_dim, value_dim + key_dim),
                        previous_document=before, final_state=True)
    final = final.to(v.dtype).reshape(batch, 2, heads, key_dim, value_dim + key_dim).contiguous()
    every = _by_chunk(all_gather_autograd(final, cp_mesh.get_group()).view(cp_mesh.size(), *final.shape),
                      chunks)  # (batch, 2 cp, heads, key_dim, value_dim + key_dim): [from zero | transition]
    state, starting = v.new_zeros(batch, heads, key_dim, value_dim), []
    for chunk in range(every.shape[1]):
        starting.append(state)
        state = every[:, chunk, ..., value_dim:] @ state + every[:, chunk, ..., :value_dim]
    starting = torch.stack(starting, dim=1)  # (batch, 2 cp, heads, key_dim, value_dim)
    mine_start = take(starting, mine, dim=1).flatten(0, 1)  # (batch x 2, heads, key_dim, value_dim)
    out = out[..., :value_dim] + torch.einsum("nshk,nhkv->nshv", out[..., value_dim:], mine_start)
    return out.reshape(batch, local, heads, value_dim)


def conv_with_halo(x: torch.Tensor, weight: torch.Tensor, document_ids: torch.Tensor | None = None, *, kernel,
                   cp_mesh: DeviceMesh, name: str, facts: ChunkFacts = chunk_facts) -> torch.Tensor:
    """A `ConvolutionLayer`'s kernel on this rank's share x (batch, local, channels), its two chunks each given the
    k - 1 tokens before it (gathered from the ranks that hold them), with their document ids, then cut off."""
    batch, local, channels = x.shape
    size, halo = local // 2, weight.shape[1] - 1
    if halo == 0:
        return kernel(x, weight, document_ids)
    if size < halo:
        raise ConfigError(f"{name}'s convolution reads {halo} tokens back, more than a context-parallel chunk holds "
                          f"({size}): raise training.seq_len or lower parallelism.context_parallel_degree")
    chunks, ids = _pieces(local, cp_mesh, document_ids, batch, x.device, facts)
    tails = x.view(batch, 2, size, channels)[:, :, -halo:].contiguous()
    every = _by_chunk(all_gather_autograd(tails, cp_mesh.get_group()).view(cp_mesh.size(), *tails.shape),
                      chunks)  # (batch, 2 cp, halo, channels)
    every = torch.cat([torch.zeros_like(every[:, :1]), every[:, :-1]], dim=1)  # what comes before each chunk
    mine = chunks[:, cp_mesh.get_local_rank()]
    before = take(every, mine, dim=1)  # (batch, 2, halo, channels)
    positions = (mine * size)[..., None] + torch.arange(-halo, size, device=x.device)  # (batch, 2, halo + size)
    piece_ids = torch.where(positions >= 0, take(ids, positions.clamp(min=0).flatten(1), dim=1).view_as(positions),
                            -1)
    extended = torch.cat([before, x.view(batch, 2, size, channels)], dim=2).flatten(0, 1)
    out = kernel(extended, weight, piece_ids.flatten(0, 1))[:, halo:]
    return out.reshape(batch, local, channels)
