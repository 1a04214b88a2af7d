"""The ways a block mixes tokens besides attention, declared by the module that does it, as an attention layer
declares its mask (components/model/attention.py), and their shared kernels.

A module that mixes positions declares which kind it is by two attributes, found by them (not by class or name):

- a causal convolution along the sequence (`ConvolutionLayer`): `conv_window`, the kernel size k (position t
  reads t - k + 1 .. t), and `conv`, the kernel it calls, `causal_conv` by default;
- a recurrent layer (`RecurrentLayer`): `recurrence`, the kernel that carries a state along the sequence, one per
  head (linear attention, gated linear recurrences, the gated delta rule): `gated_linear_recurrence` and
  `gated_delta_rule` here.

Both kernels see whole sequences of their input, in order, and the whole sequence's document ids: a document's
first token starts the convolution's window and the recurrent state afresh. They treat each channel (conv) or head
(recurrence) alone, which is what lets the layouts that split the sequence carry them exactly:
parallelisms/sequence_mixers.py hands them whole sequences of a share of the channels or heads under context
parallelism (an all-to-all), and under sequence parallelism a declared module the tensor-parallel plan does not
place is computed on the whole sequence by every tp rank. Mixing that no module declares is found before the
first step and refused (components/model/undeclared_mixing.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Protocol

import torch
from torch import nn

from components.model.protocols import provides


class ConvolutionLayer(Protocol):
    """A module that convolves along the sequence, causally, each channel alone (Mamba's and Gated DeltaNet's short
    convolutions, Canon layers, a token shift)."""

    conv_window: int
    """The kernel size k: the output at a position reads the inputs at it and the k - 1 before it, in its document."""
    conv: Callable[..., torch.Tensor]
    """conv(x, weight, document_ids=None) -> shaped like x (batch, seq, channels): out[t, c] = sum over j < k of
    weight[c, k - 1 - j] * x[t - j, c], the terms from before t's document (or the sequence) left out. Context
    parallelism replaces it by one that hands this kernel whole sequences of a share of the channels."""


class RecurrentLayer(Protocol):
    """A module that carries a state along the sequence, one per head."""

    recurrence: Callable[..., torch.Tensor]
    """recurrence(*inputs, document_ids=None) -> (batch, seq, heads, value_dim): every input is per token, (batch,
    seq, heads, ...), and each head's state depends on that head's inputs alone; a document's first token starts
    from a zero state. Context parallelism replaces it by one that hands this kernel whole sequences of a share of
    the heads."""


def convolution_layers(module: nn.Module) -> Iterator[tuple[str, ConvolutionLayer]]:
    """(name, layer) of every declared convolution inside `module`."""
    return ((name, m) for name, m in module.named_modules() if provides(m, ConvolutionLayer))


def recurrent_layers(module: nn.Module) -> Iterator[tuple[str, RecurrentLayer]]:
    """(name, layer) of every declared recurrent layer inside `module`."""
    return ((name, m) for name, m in module.named_modules() if provides(m, RecurrentLayer))


def same_document(document_ids: torch.Tensor | None, shift: int, seq: int) -> torch.Tensor | None:
    """(batch, seq, 1) booleans: whether the token `shift` positions before each one is in its document (None
    without documents)."""
    if document_ids is None:
        return None
    earlier = torch.cat([document_ids.new_full((len(document_ids), shift), -1), document_ids[:, :seq - shift]], 1)
    return (earlier == document_ids)[..., None]


def causal_conv(x: torch.Tensor, weight: torch.Tensor, document_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Depthwise causal convolution of x (batch, seq, channels) with weight (channels, k), within documents given
    their ids (batch, seq): the `ConvolutionLayer`'s kernel."""
    seq, k = x.shape[1], weight.shape[1]
    out = x * weight[:, k - 1]
    for shift in range(1, min(k, seq)):
        earlier = torch.nn.functional.pad(x, (0, 0, shift, 0))[:, :seq]
        inside = same_document(document_ids, shift, seq)
        out = out + (earlier if inside is None else earlier * inside) * weight[:, k - 1 - shift]
    return out


def _starting_state(q: torch.Tensor, ids: torch.Tensor, value_dim: int, initial_state: torch.Tensor | None,
                    previous_document: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """A recurrence kernel's state before its first token, and the document of the token before it (-1: none)."""
    batch, heads, key_dim = q.shape[0], q.shape[1], q.shape[-1]
    if initial_state is None:
        return q.new_zeros(batch, heads, key_dim, value_dim), ids.new_full((batch,), -1)
    return initial_state.to(q.dtype), ids[:, 0] if previous_document is None else previous_document


def _to_chunk_end(doc: torch.Tensor, previous_document: torch.Tensor, cumulative: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """What the state after a chunk is made of, given the chunk's document ids (batch, chunk), the document of the
    token before it (batch,) and the decay's running sum over it (batch, heads, chunk): each position's decay to the
    chunk's end (batch, heads, chunk), 0 outside the chunk's last document (a document start zeroes what came
    before), and the factor of the state the chunk started from (batch, heads, 1, 1): its decay over the chunk, 0
    where a document started in it."""
    last = (doc == doc[:, -1:])[:, None, :]
    to_end = torch.where(last, cumulative[..., -1:] - cumulative, float("-inf")).exp()
    kept = (doc[:, :1] == previous_document[:, None]) & (doc[:, -1:] == doc[:, :1])  # no document started
    return to_end, kept[:, :, None, None] * cumulative[..., -1:, None].exp()


RECURRENCE_CHUNK = 64
"""Positions `gated_linear_recurrence` and `gated_delta_rule` compute at once: within a chunk as masked matrix
products, across chunks through the state."""


def gated_linear_recurrence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_decay: torch.Tensor,
                            document_ids: torch.Tensor | None = None, chunk: int = RECURRENCE_CHUNK, *,
                            initial_state: torch.Tensor | None = None, previous_document: torch.Tensor | None = None,
                            final_state: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """A gated linear recurrence per head, S_t = exp(log_decay_t) S_{t-1} + k_t v_t^T, out_t = S_t^T q_t (linear
    attention with a data-dependent decay, as in GLA, Mamba 2 and RetNet), the state zero at each document's first
    token: the `RecurrentLayer`'s kernel for q, k (batch, seq, heads, key_dim), v (batch, seq, heads, value_dim),
    log_decay (batch, seq, heads), each <= 0.

    Computed by chunks: within one, out_t = sum over s <= t in t's document of exp(L_t - L_s) (q_t . k_s) v_s, L the
    decay's running sum, plus exp(L_t) q_t S where S is the state the chunk starts from, if t's document began
    before the chunk.

    `initial_state` (batch, heads, key_dim, value_dim): the state before the first token, carried into it if it is
    in `previous_document` (batch,: the document of the token before, default the first token's own), for a kernel
    run on a piece of a longer sequence; with `final_state` the state after the last token is returned too. The
    output and the final state are linear in v and in the initial state (what passing the state between context-
    parallel ranks relies on: parallelisms/sequence_mixers.py)."""
    batch, seq, heads, key_dim = k.shape
    dtype, compute = v.dtype, torch.promote_types(v.dtype, torch.float32)  # at least float32
    q, k, v = (t.transpose(1, 2).to(compute) for t in (q, k, v))  # (batch, heads, seq, dim)
    log_decay = log_decay.transpose(1, 2).to(compute)
    ids = torch.zeros(batch, seq, dtype=torch.long, device=q.device) if document_ids is None else document_ids
    state, previous_document = _starting_state(q, ids, v.shape[-1], initial_state, previous_document)
    outputs = []
    for start in range(0, seq, chunk):
        end = min(start + chunk, seq)
        qc, kc, vc = q[:, :, start:end], k[:, :, start:end], v[:, :, start:end]
        cumulative = log_decay[:, :, start:end].cumsum(-1)  # L_t - L_(start - 1)
        doc = ids[:, start:end]
        causal = torch.ones(end - start, end - start, dtype=torch.bool, device=q.device).tril()
        visible = (causal & (doc[:, :, None] == doc[:, None, :]))[:, None]  # (batch, 1, t, s)
        exponent = cumulative[..., :, None] - cumulative[..., None, :]
        weights = torch.where(visible, exponent, float("-inf")).exp() * (qc @ kc.transpose(-2, -1))
        carries = (doc == previous_document[:, None])[:, None, :, None]  # t's document began before the chunk
        outputs.append(weights @ vc + carries * cumulative.exp()[..., None] * (qc @ state))
        to_end, kept = _to_chunk_end(doc, previous_document, cumulative)
        state = kept * state + (kc * to_end[..., None]).transpose(-2, -1) @ vc
        previous_document = doc[:, -1]
    out = torch.cat(outputs, dim=2).transpose(1, 2).to(dtype)
    return (out, state) if final_state else out


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_decay: torch.Tensor, beta: torch.Tensor,
                     document_ids: torch.Tensor | None = None, chunk: int = RECURRENCE_CHUNK, *,
                     initial_state: torch.Tensor | None = None, previous_document: torch.Tensor | None = None,
                     final_state: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule per head (Gated DeltaNet, Yang et al. 2024; Qwen3.5's and Qwen3-Next's linear attention):
    S_t = exp(log_decay_t) S_(t-1) (I - beta_t k_t k_t^T) + beta_t k_t v_t^T, out_t = S_t^T q_t, the state zero at
    each document's first token: the `RecurrentLayer`'s kernel for q, k (batch, seq, heads, key_dim), v (batch, seq,
    heads, value_dim), log_decay <= 0 and beta in [0, 1] (batch, seq, heads). Normalizing and scaling q and k is the
    caller's part.

    Computed by chunks (the WY form of DeltaNet's chunked algorithm): within one, the delta rule's corrections
    u = T beta v and the keys' reads of the state w = T beta k exp(L) solve one unit lower-triangular system
    T^-1 = I + strictly_lower(beta_t k_t . k_s exp(L_t - L_s)), L the decay's running sum from the chunk's start,
    masked to t's document; then the values written are u - w S, out = exp(L) q S + (q k^T masked, decayed)
    (u - w S), and S moves on to the chunk's end. Terms of the state are dropped for a document that begins inside
    the chunk. `initial_state`, `previous_document` and `final_state` as for `gated_linear_recurrence`."""
    batch, seq, heads, key_dim = k.shape
    dtype, compute = v.dtype, torch.promote_types(v.dtype, torch.float32)  # at least float32
    q, k, v = (t.transpose(1, 2).to(compute) for t in (q, k, v))  # (batch, heads, seq, dim)
    log_decay, beta = (t.transpose(1, 2).to(compute) for t in (log_decay, beta))  # (batch, heads, seq)
    ids = torch.zeros(batch, seq, dtype=torch.long, device=q.device) if document_ids is None else document_ids
    state, previous_document = _starting_state(q, ids, v.shape[-1], initial_state, previous_document)
    outputs = []
    for start in range(0, seq, chunk):
        end = min(start + chunk, seq)
        qc, kc, vc, bc = q[:, :, start:end], k[:, :, start:end], v[:, :, start:end], beta[:, :, start:end, None]
        cumulative = log_decay[:, :, start:end].cumsum(-1)  # L_t
        doc = ids[:, start:end]
        same = (doc[:, :, None] == doc[:, None, :])[:, None]  # (batch, 1, t, s)
        causal = torch.ones(end - start, end - start, dtype=torch.bool, device=q.device).tril()
        decay = torch.where(causal & same, cumulative[..., :, None] - cumulative[..., None, :], float("-inf")).exp()
        carries = (doc == previous_document[:, None])[:, None, :, None]  # t's document began before the chunk
        from_start = carries * cumulative.exp()[..., None]  # the decay of the state up to t, 0 in a new document
        system = torch.eye(end - start, dtype=compute, device=q.device) + ((bc * kc) @ kc.transpose(-2, -1) * decay
                                                                           ).tril(-1)
        corrections = torch.linalg.solve_triangular(system, torch.cat([bc * vc, bc * kc * from_start], -1),
                                                    upper=False, unitriangular=True)
        u, w = corrections.split([vc.shape[-1], key_dim], dim=-1)
        written = u - w @ state
        outputs.append(from_start * (qc @ state) + (qc @ kc.transpose(-2, -1) * decay) @ written)
        to_end, kept = _to_chunk_end(doc, previous_document, cumulative)
        state = kept * state + (kc * to_end[..., None]).transpose(-2, -1) @ written
        previous_document = doc[:, -1]
    out = torch.cat(outputs, dim=2).transpose(1, 2).to(dtype)
    return (out, state) if final_state else out


# The kernels that can start from a given state and give their final one (what passing the state between
# context-parallel ranks needs, parallelisms/sequence_mixers.py).
gated_linear_recurrence.passes_state = True
gated_delta_rule.passes_state = True
