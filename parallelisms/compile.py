"""torch.compile per transformer block: each block is compiled once and reused for every layer of
the same shape, which keeps compile time short and composes with FSDP's per-block hooks."""

from __future__ import annotations

from torch import nn


def compile_blocks(blocks: nn.ModuleDict) -> None:
    """Compile every block in place (`Module.compile`, so parameter names stay unchanged)."""
    for block in blocks.values():
        block.compile(fullgraph=True)
