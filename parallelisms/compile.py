"""torch.compile per transformer block: each block is compiled once and reused for every layer of
the same shape, which keeps compile time short and composes with FSDP's per-block hooks."""

from __future__ import annotations

from torch import nn

from models.moe import MoE


def compile_blocks(blocks: nn.ModuleDict) -> None:
    """Compile every block in place (`Module.compile`, so parameter names stay unchanged).

    A dense block compiles as one graph. A mixture-of-experts block cannot: how many tokens each
    expert gets is data, which the expert computation and its all-to-all take as Python sizes, so
    that part runs eagerly between the compiled graphs of the rest."""
    for block in blocks.values():
        block.compile(fullgraph=not any(isinstance(m, MoE) for m in block.modules()))
