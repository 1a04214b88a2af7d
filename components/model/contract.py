"""The model's side of the package contract (docs/models.md): what train.py, components/, parallelisms/ and the
scripts read of a family's model, declared by the model rather than found by its module names. A fork may rename
its modules (`blocks` for `layers`, `embed` for `tok_embeddings`): it declares them here and keeps every parallelism,
the per-layer metrics and the optimizers' parameter groups.

`check_model_contract` runs at start-up on the model built on the meta device: a fork that breaks the contract
stops there with one line naming what is missing, not with an AttributeError inside a parallelism."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from torch import nn

from components.config.errors import ConfigError
from components.model.attention import AttentionLayer, AttentionMask, attention_layers


class Dimensions(Protocol):
    """What shared code reads of the model's arguments (`model.args`, the family's ModelArgs)."""

    n_layers: int

    def flops_per_token(self, seq_len: int) -> float:
        """FLOPs of one trained token (forward and backward) at `seq_len`: MFU and the slow-step warning."""
        ...


class DecoderModel(Protocol):
    """A family's `Transformer`: `forward(tokens, document_ids=None)` gives logits (hidden states in a pipeline
    stage without the last end), and these members."""

    args: Dimensions
    pipeline_ends: tuple[tuple[str, ...], tuple[str, ...]]
    """The names of the top-level modules before the blocks (the first pipeline stage holds them: the embedding)
    and after them (the last stage's: the final norm and the output layer). A stage sets those it does not hold to
    None, and forward skips them."""
    local_positions: Callable[[torch.Tensor | None], torch.Tensor] | None
    """None: a forward sees positions 0..seq-1. Context parallelism sets it to the positions of this rank's share of
    the sequence, given the document ids (None without document masking)."""
    document_mask: Callable[[torch.Tensor, AttentionMask], object]
    """document_mask(document_ids, attention_mask): what the attention layers declaring that mask receive under
    document masking, built once per forward; context parallelism replaces it by its method's builder."""

    def transformer_blocks(self) -> nn.ModuleDict:
        """The blocks, keyed "0", "1", ... in order, a child of the model: what activation checkpointing, compile
        and FSDP wrap, the pipeline splits, per-layer metrics hook, and Muon and µP take as hidden matrices. A
        pipeline stage holds some of them, under their own keys."""
        ...

    def init_weights(self) -> None:
        """Fill every parameter and buffer after `to_empty()`, also in a stage holding some of the modules."""
        ...


def multi_token_depths(model: nn.Module) -> int:
    """How many extra tokens ahead the model learns to predict (`args.num_mtp_layers`, 0 when it declares none):
    while training, its forward then returns a MultiTokenLogits (components/training/loss.py), which the loss takes
    apart."""
    return getattr(model.args, "num_mtp_layers", 0)


def blocks_name(model: DecoderModel) -> str:
    """The name of the model's child that holds its transformer blocks."""
    blocks = model.transformer_blocks()
    return next(name for name, child in model.named_children() if child is blocks)


def check_model_contract(model: nn.Module, family: str) -> None:
    """Refuse at start-up a model that lacks what DecoderModel declares, in one line naming the member."""
    problem = contract_problem(model)
    if problem:
        raise ConfigError(f"model.name {family}: its Transformer {problem} (the model contract: "
                          "components/model/contract.py, docs/models.md)")


def contract_problem(model: nn.Module) -> str | None:
    """What the model lacks of the contract, or None."""
    for member in ("transformer_blocks", "init_weights", "document_mask"):
        if not callable(getattr(model, member, None)):
            return f"has no method {member}"
    if not hasattr(model, "local_positions"):
        return "has no attribute local_positions (None until context parallelism sets it)"
    args = getattr(model, "args", None)
    if not isinstance(getattr(args, "n_layers", None), int) or not callable(getattr(args, "flops_per_token", None)):
        return "has no args with n_layers and flops_per_token(seq_len)"
    blocks = model.transformer_blocks()
    if not isinstance(blocks, nn.ModuleDict) or not any(child is blocks for child in model.children()):
        return "gives from transformer_blocks() no nn.ModuleDict that is one of its children"
    if list(blocks) != [str(i) for i in range(args.n_layers)]:
        return f"has blocks keyed {list(blocks)}, not 0..{args.n_layers - 1} (args.n_layers)"
    ends = getattr(model, "pipeline_ends", None)
    if not (isinstance(ends, tuple) and len(ends) == 2 and all(isinstance(names, tuple) for names in ends)):
        return "declares no pipeline_ends = ((names before the blocks), (names after them))"
    children = dict(model.named_children())
    for name in (*ends[0], *ends[1]):
        if not isinstance(children.get(name), nn.Module) or children[name] is blocks:
            return f"names {name!r} in pipeline_ends, which is none of its modules other than the blocks"
    layers = dict(attention_layers(model))
    if not layers:
        return (f"has no attention layer: no module with an attention_mask and an sdpa ({AttentionLayer.__name__}, "
                "components/model/attention.py)")
    for name, layer in layers.items():
        if not isinstance(layer.attention_mask, AttentionMask):
            return f"declares for {name} an attention_mask that is no AttentionMask ({layer.attention_mask!r})"
    return None
