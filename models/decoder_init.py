"""How every decoder family fills its ends after its blocks: the final norm, the token embedding and the output
layer, tied or not. Written once for the families; a family's `init_weights` fills its RoPE table and blocks, then
calls `init_decoder_ends`."""

from __future__ import annotations

from torch import nn


def init_decoder_ends(model: nn.Module, embedding: str, norm: str, output: str, *, tied: bool,
                      output_std: float) -> None:
    """Fill the ends this model (or pipeline stage) holds, named `embedding`, `norm` and `output`: the norm reset,
    the embedding normal (std 1, or 0.02 when `tied` to the output layer, which then shares its matrix again:
    to_empty() from the meta device gives each module its own), the output layer truncated normal (std
    `output_std`, cut at 3 std) unless tied."""
    embed, final_norm, out = (getattr(model, name) for name in (embedding, norm, output))
    if tied and embed is not None and out is not None:
        out.weight = embed.weight
    if final_norm is not None:
        final_norm.reset_parameters()
    if embed is not None:
        nn.init.normal_(embed.weight, std=0.02 if tied else 1.0)
    if out is not None and not tied:
        nn.init.trunc_normal_(out.weight, mean=0.0, std=output_std, a=-3 * output_std, b=3 * output_std)
