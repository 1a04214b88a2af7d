"""torch.compile per transformer block: each block is compiled once and reused for every layer of
the same shape, which keeps compile time short and composes with FSDP's per-block hooks."""

from __future__ import annotations

from torch import nn

from components.model.moe_layer import has_moe_layer
from parallelisms.sequence_mixers import has_token_mixers


def compile_blocks(blocks: nn.ModuleDict, eager_attention: bool = False) -> None:
    """Compile every block in place (`Module.compile`, so parameter names stay unchanged).

    A dense block compiles as one graph. A mixture-of-experts block cannot: how many tokens each
    expert gets is data, which the expert computation and its all-to-all take as Python sizes, so
    that part runs eagerly between the compiled graphs of the rest. MoE layers are found by their interface
    (components/model/moe_layer.py), whatever module defines them. Nor can a block whose attention runs eagerly
    (`eager_attention`, which context parallelism's `attention_runs_eagerly` tells: ring's point-to-point sends),
    nor one with a convolution or recurrent layer (parallelisms/sequence_mixers.py: under context parallelism with
    documents, their shares' order is read on the host)."""
    for block in blocks.values():
        block.compile(fullgraph=not (has_moe_layer(block) or eager_attention or has_token_mixers(block)))
