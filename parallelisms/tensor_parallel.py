"""Tensor parallelism with sequence parallelism, through DTensor's `parallelize_module`.

Linear layers are split across the `tp` ranks (column-wise: each rank computes some output
features; row-wise: each rank holds some input features and the partial results are reduced).
Between the split regions, activations stay sharded along the sequence (sequence parallelism), so
norms and residuals also cost 1/tp of the memory; `parallelism.sequence_parallel false` keeps them
whole. The model's own parallelize.py says which layer gets which style; the functions here apply
such a plan."""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from components.torch_private import AsyncCollectiveTensor, enable_micro_pipeline_tp
from parallelisms.sequence_mixers import sequence_parallel_mixers


def apply_tensor_parallel(module: nn.Module, tp_mesh: DeviceMesh, plan: dict, sequence_parallel: bool = True
                          ) -> nn.Module:
    """Apply a `{submodule name: ParallelStyle}` plan to `module` over the tp mesh: the family's plan, with sequence
    parallelism, or without it (`without_sequence_parallel`). With it, the convolutions and recurrent layers the
    model declares and the plan does not place see whole sequences (parallelisms/sequence_mixers.py).

    Every module of the plan then hands on plain tensors rather than the AsyncCollectiveTensor that
    DTensor's asynchronous redistribution leaves (see `_WaitCollective`)."""
    if not sequence_parallel:
        plan = without_sequence_parallel(plan)
    parallelize_module(module, tp_mesh, plan)
    if sequence_parallel:
        sequence_parallel_mixers(module, tp_mesh, plan)
    for name in plan:
        module.get_submodule(name).register_forward_hook(_wait_collective_output)
    return module


def tensor_parallel_styles(float8_comm: bool) -> tuple[type, type, type]:
    """The column-wise, row-wise and input-preparing styles of a plan: torchao's float8 ones when the all-gathers
    move float8 rather than bf16 activations (`float8_comm`, parallelisms/float8.py's `gathers_float8`)."""
    if float8_comm:
        from torchao.float8.float8_tensor_parallel import (
            Float8ColwiseParallel,
            Float8RowwiseParallel,
            PrepareFloat8ModuleInput,
        )

        return Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput
    return ColwiseParallel, RowwiseParallel, PrepareModuleInput


SEQUENCE = Shard(1)
"""What sequence parallelism shards between the tensor-parallel regions: the sequence of (batch, seq, dim)."""


def without_sequence_parallel(plan: dict) -> dict:
    """A family's plan (written with sequence parallelism) with whole sequences between the tensor-parallel regions
    instead (TorchTitan's and Megatron's switch): the row-wise layers all-reduce their output rather than
    reduce-scatter it along the sequence, the column-wise ones take it whole, and the norms, which sequence
    parallelism splits along the sequence, are computed whole by every rank (plain weights with the same gradient
    on each). A module the plan keeps on a slice of the sequence (a mixture-of-experts layer routes its own tokens)
    is handed its slice and its output gathered. Every block then sees whole sequences, and so does any way it
    mixes tokens."""
    whole = {}
    for name, style in plan.items():
        if isinstance(style, SequenceParallel) and style.sequence_sharding == (SEQUENCE,):
            continue
        if isinstance(style, PrepareModuleInput) and SEQUENCE in (style.desired_input_layouts or ()):
            whole[name] = PrepareModuleInputOutput(
                input_layouts=tuple(Replicate() if layout == SEQUENCE else layout for layout in style.input_layouts),
                desired_input_layouts=style.desired_input_layouts, use_local_input=True,
                output_layouts=(SEQUENCE,), desired_output_layouts=(Replicate(),), use_local_output=True)
            continue
        style = copy.copy(style)
        for attribute in ("input_layouts", "output_layouts"):
            layouts = getattr(style, attribute, None)
            if layouts:
                setattr(style, attribute, tuple(Replicate() if layout == SEQUENCE else layout for layout in layouts))
        whole[name] = style
    return whole


class _WaitCollective(torch.autograd.Function):
    """Identity that waits for an AsyncCollectiveTensor and returns its values as a plain tensor.

    An output style's asynchronous redistribution (the embedding's reduce-scatter to sequence shards)
    returns such a tensor, and the eager embedding passes it to the first compiled block. torch 2.13
    swaps such graph inputs for the plain tensor they wrap before tracing, which has no autograd history
    (pytorch/pytorch#191113): the compiled block returns no gradient for its input, and the embedding's
    backward fails on a zero-filled plain tensor where it expects a DTensor. Waiting here, eagerly and
    through autograd, keeps that edge; the first use of the tensor would have waited anyway."""

    @staticmethod
    def forward(ctx, x: AsyncCollectiveTensor) -> torch.Tensor:
        return x.trigger_wait().view(x.shape)  # a new view: autograd attaches to it, not to the wrapped tensor

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


def _wait_collective_output(module: nn.Module, args: tuple, output):
    return _WaitCollective.apply(output) if isinstance(output, AsyncCollectiveTensor) else None


def enable_async_tensor_parallel(tp_mesh: DeviceMesh) -> None:
    """Let inductor overlap TP's all-gathers/reduce-scatters with the matmuls that use them
    ("micro-pipelining"). It needs CUDA symmetric memory and torch.compile; the caller checks both."""
    enable_micro_pipeline_tp(tp_mesh.get_group().group_name)


class ReplicateParallel(ParallelStyle):
    """A module every tp rank computes whole, from a Replicate input, for what its heads need (MLA's low-rank
    projections and their norms, models/deepseek_v3): its parameters become Replicate DTensors and its output
    stays a Replicate DTensor. The column-wise layers that take that output sum their input's gradient over
    the ranks, so these parameters get the whole model's gradient on every rank."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def replicated_input(module, inputs, device_mesh):
            return tuple(x if isinstance(x, DTensor) or not isinstance(x, torch.Tensor)
                         else DTensor.from_local(x, device_mesh, [Replicate()], run_check=False) for x in inputs)

        return distribute_module(module, device_mesh, input_fn=replicated_input)


def local_for_own_heads(x: torch.Tensor) -> torch.Tensor:
    """x, which every tp rank computed whole (a Replicate DTensor) and uses for its own heads only (MLA's rotated
    key, shared by the heads), as this rank's plain tensor whose gradient, from its own heads, is summed over the
    ranks in backward. A plain tensor (no tensor parallelism) is returned as it is."""
    if isinstance(x, DTensor):
        return x.to_local(grad_placements=[Partial()] * x.device_mesh.ndim)
    return x
