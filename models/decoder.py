"""The decoder every family is, written once: token embedding, blocks keyed by layer number, final norm, output
layer. A family's model.py keeps what makes it that family (its attention, its feed-forward, which of them each
block takes, its RoPE table) and builds its `Transformer` as a `Decoder` of its blocks; what a forward hands every
block (the RoPE angles of the positions it sees, the document masks its layers declare), the pipeline ends and the
order in which the weights are filled are here, once, for every family.

A fork is still one copied folder: it can override any method of `Decoder` in its `Transformer` (DeepSeek-V3's
forward adds its multi-token prediction depths), or build its blocks from parts of its own.

Blocks live in a ModuleDict keyed by layer number so that a pipeline stage can drop the blocks it does not own and
keep the others' names (and so its checkpoint keys) unchanged. A stage without `tok_embeddings` takes hidden states
as input; one without `output` returns them. `local_positions` (None: 0..seq-1), which context parallelism sets,
gives the sequence positions of the tokens a forward sees, this rank's share of the sequence, from the document ids
(None without document masking): (seq,) shared by the rows, or (batch, seq).

`document_ids` (batch, seq), the document number of every token of a packed window
(components.data.documents.document_ids), turns on document masking: attention is causal within each document only
and, with `args.rope_per_document`, RoPE positions restart at each document. They cover the whole sequence, also
under context parallelism, whose method may replace `document_mask(document_ids, attention_mask)`, the builder of
what the layers declaring that mask give their `sdpa`; every pipeline stage gets them. The mask is built once per
forward for each mask the layers declare (`attention_mask` of their attention) and shared by the layers declaring
it: a FlexAttention BlockMask on CUDA, a dense boolean mask for SDPA elsewhere (components/model/attention.py).

The model is built on the meta device and filled by `init_weights()` after it has been parallelized, so every
method here works on plain tensors and on DTensors alike.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn
from torch.nn.attention.flex_attention import BlockMask

from components.data.documents import document_positions
from components.model.attention import attention_layers, document_mask
from models.activations import activation


class FeedForward(nn.Module):
    """Gated: w2(act(w1 x) * w3 x), SwiGLU with act = silu."""

    def __init__(self, dim: int, hidden_dim: int, hidden_act: str = "silu"):
        super().__init__()
        self.act = activation(hidden_act)
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def init_weights(self, std: float, out_std: float) -> None:
        nn.init.trunc_normal_(self.w1.weight, mean=0.0, std=std)
        for linear in (self.w2, self.w3):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=out_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.act(self.w1(x)) * self.w3(x))


class DecoderBlock(nn.Module):
    """Pre-norm residual block: x + attention(attention_norm(x)), then + feed_forward(ffn_norm(x)). A family's block
    is one, given its attention and feed-forward; their `init_weights(std, out_std)` get the block's stds: `std`
    for the matrices reading the residual stream, `out_std` for those writing to it, smaller with depth
    (1/sqrt(2 (layer + 1)) with `depth_init`, else 1/sqrt(2 n_layers))."""

    def __init__(self, attention: nn.Module, feed_forward: nn.Module, layer_id: int, args, width_scale: float = 1.0):
        super().__init__()
        self.attention = attention
        self.feed_forward = feed_forward
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        depth = layer_id + 1 if args.depth_init else args.n_layers
        self.std = 0.02 * width_scale
        self.out_std = 0.02 / math.sqrt(2 * depth) * width_scale

    def init_weights(self) -> None:
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(self.std, self.out_std)
        self.feed_forward.init_weights(self.std, self.out_std)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask: torch.Tensor | BlockMask | None = None,
                document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """`document_ids` (the Decoder passes them to every block) are for a block that mixes tokens besides its
        attention (a convolution, a recurrence: components/model/token_mixing.py), whose state restarts at each
        document; attention gets its document `mask`."""
        # mask by keyword: tensor parallelism's input hook on `attention` lays out (x, rope) only.
        x = x + self.attention(self.attention_norm(x), rope, mask=mask)
        return x + self.feed_forward(self.ffn_norm(x))


class Decoder(nn.Module):
    """Token ids (batch, seq) in, logits (batch, seq, vocab) out (the module docstring says how). `block(layer_id,
    args)` builds each block, `rope_frequencies(args)` the RoPE table (max_seq_len, rotated dims // 2, 2); `tied`
    shares one matrix between the embedding and the output layer; `output_std` is the output layer's init std.
    `before_output`: modules of the family's own between the final norm and the output layer in the parameters'
    order (DeepSeek-V3's `mtp`), which the gradient norm sums in: a family that adds them after would train the same
    up to the last bits of the norm."""

    pipeline_ends = (("tok_embeddings",), ("norm", "output"))
    """The modules before and after the blocks (components/model/contract.py)."""

    def __init__(self, args, block: Callable[[int, object], nn.Module],
                 rope_frequencies: Callable[[object], torch.Tensor], *, tied: bool, output_std: float,
                 before_output: dict[str, nn.Module] | None = None):
        super().__init__()
        self.args = args
        self.rope_frequencies, self.tied, self.output_std = rope_frequencies, tied, output_std
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.register_buffer("rope", rope_frequencies(args), persistent=False)
        self.layers = nn.ModuleDict({str(i): block(i, args) for i in range(args.n_layers)})
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        for name, module in (before_output or {}).items():
            self.add_module(name, module)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if tied:
            self.output.weight = self.tok_embeddings.weight
        self.local_positions: Callable[[torch.Tensor | None], torch.Tensor] | None = None
        self.document_mask = document_mask

    def transformer_blocks(self) -> nn.ModuleDict:
        return self.layers

    @torch.no_grad()
    def init_weights(self) -> None:
        """Fill every parameter and buffer; works after `to_empty()` on a meta-built model, and on a pipeline stage
        that holds only some of the modules: the RoPE table, the blocks, then the ends."""
        self.rope.copy_(self.rope_frequencies(self.args))
        for block in self.layers.values():
            block.init_weights()
        init_decoder_ends(self, tied=self.tied, output_std=self.output_std)

    def hidden_states(self, tokens: torch.Tensor, document_ids: torch.Tensor | None
                      ) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """The final norm's output (the blocks' on a stage without it), with the RoPE angles and masks the blocks
        were given."""
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        rope, masks = rope_and_masks(self, self.rope, document_ids)
        for block in self.layers.values():
            # A block whose token mixer is not attention (a recurrent layer) declares no mask.
            mask = masks.get(getattr(block.attention, "attention_mask", None))
            h = block(h, rope, mask=mask, document_ids=document_ids)
        return (self.norm(h) if self.norm is not None else h), rope, masks

    def forward(self, tokens: torch.Tensor, document_ids: torch.Tensor | None = None) -> torch.Tensor:
        h, _, _ = self.hidden_states(tokens, document_ids)
        return self.output(h) if self.output is not None else h


def rope_and_masks(model: nn.Module, rope: torch.Tensor, document_ids: torch.Tensor | None
                   ) -> tuple[torch.Tensor, dict]:
    """The angles of `rope` (the model's table, one row per position) of the positions this forward sees (this
    rank's share under context parallelism, the model's `local_positions`; restarting at each document with
    `args.rope_per_document`), and {attention_mask: what the model's `document_mask` built for it} for every mask
    its attention layers declare under document masking (built once, shared by the layers declaring it), else {}.

    `document_ids` are of the whole sequence, also under context parallelism."""
    positions = None if model.local_positions is None else model.local_positions(document_ids)
    angles = rope if positions is None else rope[positions]
    if document_ids is None:
        return angles, {}
    declared = {layer.attention_mask for _, layer in attention_layers(model)}
    masks = {spec: model.document_mask(document_ids, spec) for spec in declared}
    if model.args.rope_per_document:
        within = document_positions(document_ids)
        within = within if positions is None else within.gather(1, positions)
        angles = rope[within]  # (batch, seq, rotated dims // 2, 2)
    return angles, masks


def init_decoder_ends(model: nn.Module, *, tied: bool, output_std: float) -> None:
    """Fill the ends this model (or pipeline stage) holds: the final norm reset, the embedding normal (std 1, or 0.02
    when `tied` to the output layer, which then shares its matrix again: to_empty() from the meta device gives each
    module its own), the output layer truncated normal (std `output_std`, cut at 3 std) unless tied."""
    embed, final_norm, out = model.tok_embeddings, model.norm, model.output
    if tied and embed is not None and out is not None:
        out.weight = embed.weight
    if final_norm is not None:
        final_norm.reset_parameters()
    if embed is not None:
        nn.init.normal_(embed.weight, std=0.02 if tied else 1.0)
    if out is not None and not tied:
        nn.init.trunc_normal_(out.weight, mean=0.0, std=output_std, a=-3 * output_std, b=3 * output_std)
