"""What every decoder family's forward computes once, before its blocks, and hands to each of them: the RoPE angles
of the positions the forward sees, and under document masking the mask of each attention declaration. Written once
for the families; a family's `Transformer.forward` calls `rope_and_masks` and runs its own blocks and ends."""

from __future__ import annotations

import torch
from torch import nn

from components.data.documents import document_positions
from components.model.attention import attention_layers


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
