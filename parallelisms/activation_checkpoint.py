"""Activation checkpointing: keep fewer activations in forward and recompute them in backward.

- full: every block keeps only its input; backward reruns the whole block.
- selective by layer ("N"): every N-th block is checkpointed in full, the others keep everything.
- selective by op ("op"): every block is checkpointed, but the outputs of matmuls and attention
  (the expensive ops) are saved, so backward only recomputes the cheap elementwise work. Ring attention's
  per-block kernels are the exception: keeping cp blocks of outputs would undo the ring's memory saving,
  so they run again (with the ring's communication).

Recomputation reruns the same kernels on the same inputs, so losses and gradients are identical to
a run without checkpointing."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from components.torch_private import checkpoint_wrapper

# Ops whose outputs selective-by-op checkpointing keeps rather than recomputes.
SAVED_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_mm.default,
}


ATTENTION_OPS = {op for op in SAVED_OPS if "scaled_dot_product" in str(op)}


def _save_matmuls_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _save_matmuls_but_not_attention_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    saved = op in SAVED_OPS and op not in ATTENTION_OPS
    return CheckpointPolicy.MUST_SAVE if saved else CheckpointPolicy.PREFER_RECOMPUTE


def _save_attention_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in ATTENTION_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _op_selective_contexts():
    return create_selective_checkpoint_contexts(_save_matmuls_policy)


def _op_selective_ring_contexts():
    return create_selective_checkpoint_contexts(_save_matmuls_but_not_attention_policy)


def _attention_saving_contexts():
    return create_selective_checkpoint_contexts(_save_attention_policy)


def recomputing_attention_breaks(blocks: nn.ModuleDict, compiled: bool) -> bool:
    """Whether torch's compiler fails to recompute attention in these blocks: compiled, on CPU, with tensor-
    parallel (DTensor) weights. Attention is a seeded op (its dropout), so the compiler saves the CPU generator's
    state to replay it, and inserts that state among the saved values after DTensor's device mesh, which backward
    then takes for a tensor ("expected all tensors_saved_with_vc_check to be Tensors", torch 2.13;
    tests/test_techniques.py keeps a minimal reproduction). On CUDA the state goes another way, unaffected. The
    models here use no dropout, so nothing needs the state: such blocks keep attention's outputs instead of
    recomputing them (one more activation per checkpointed block), which changes no number."""
    if not compiled:
        return False
    params = [p for block in blocks.values() for p in block.parameters()]
    return any(isinstance(p, DTensor) and p.device.type == "cpu" for p in params)


def apply_activation_checkpointing(blocks: nn.ModuleDict, mode: str, selective_option: str = "2",
                                   compiled: bool = False, ring_attention: bool = False) -> None:
    """Wrap the blocks of `blocks` in place. mode: full | selective; selective_option: "op" or N; `compiled`:
    the blocks will be compiled (see recomputing_attention_breaks); `ring_attention`: their attention is context
    parallelism's ring, whose per-block kernels selective-by-op recomputes rather than saves."""
    if mode == "none":
        return
    keep_attention = recomputing_attention_breaks(blocks, compiled)
    if mode == "selective" and selective_option != "op":
        if not selective_option.isdigit() or int(selective_option) < 1:
            raise ValueError("activation_checkpoint.selective_ac_option must be 'op' or a positive integer, "
                             f"got {selective_option!r}")
        every = int(selective_option)
    else:
        every = 1
    for index, (name, block) in enumerate(list(blocks.items())):
        if (index + 1) % every:
            continue
        if mode == "selective" and selective_option == "op":
            contexts = _op_selective_ring_contexts if ring_attention else _op_selective_contexts
            blocks[name] = checkpoint_wrapper(block, context_fn=contexts, preserve_rng_state=False)
        elif keep_attention:
            blocks[name] = checkpoint_wrapper(block, context_fn=_attention_saving_contexts, preserve_rng_state=False)
        else:
            blocks[name] = checkpoint_wrapper(block, preserve_rng_state=False)
