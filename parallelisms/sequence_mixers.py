"""The token mixers a model declares besides attention (components/model/token_mixing.py: causal convolutions and
recurrent layers) under the layouts that split the sequence.

Context parallelism (`carry_over_context`): each rank holds its share of every sequence (zigzag chunks, or chunks
by documents), in an order that puts a rank's chunks far apart. A declared kernel treats each channel or head
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
from parallelisms.context_parallel_documents import ChunkFacts, chunk_facts, share_positions, take
from parallelisms.sequence_shares import heads_for_sequence, rank_order, sequence_for_heads


def has_token_mixers(module: nn.Module) -> bool:
    """Whether `module` holds a declared convolution or recurrent layer."""
    return any(True for _ in convolution_layers(module)) or any(True for _ in recurrent_layers(module))


def carry_over_context(model: nn.Module, cp_mesh: DeviceMesh, facts: ChunkFacts = chunk_facts) -> None:
    """Give every declared convolution and recurrent layer of `model` whole sequences of a share of its channels or
    heads under context parallelism. `facts`: the model's LastChunkFacts, so that every layer of a forward reads the
    document chunks its positions and masks read, without copying them from the device again."""
    for name, layer in convolution_layers(model):
        layer.conv = partial(conv_over_shares, kernel=layer.conv, cp_mesh=cp_mesh, name=name, facts=facts)
    for name, layer in recurrent_layers(model):
        layer.recurrence = partial(recurrence_over_shares, kernel=layer.recurrence, cp_mesh=cp_mesh, name=name,
                                   facts=facts)


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
