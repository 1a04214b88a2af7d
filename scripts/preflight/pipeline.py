"""Pipeline stages for a rank stepped alone. torch's stages learn what they receive and send (shapes, dtypes) at the
first step from the ranks that hold their neighbours (under torch 2.13, after a vote over the process group on
whether every stage was given its shapes); a rank alone over the fake process group receives nothing. So preflight gives
each stage its shapes (PipelineStage's input_args and output_args, torch's static mode), found by running stages on
fake tensors: the first stage's output, which every later stage takes and every stage but the last returns, from
the first stage itself (built here when this rank does not hold it); the last stage's output from the last stage.
A stage that returns something else than the first stage does is refused, naming both."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from types import SimpleNamespace

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage
from torch.distributed.tensor import DTensor

from components.config import Config, ConfigError
from components.distributed.mesh import ParallelDims
from parallelisms.pipeline import family_split


class GivenShapesStage(PipelineStage):
    """A PipelineStage given its shapes, whose neighbours are given theirs too."""

    def _warmup_backward_result(self, received_result=None):
        """torch >= 2.13: the vote's result (1: every stage was given its shapes) as every stage would receive it,
        a constant fake tensors can read (a received fake tensor has no value to read)."""
        super()._warmup_backward_result(received_result)
        return torch.tensor([1], dtype=torch.int32)


def _shape(t: torch.Tensor) -> str:
    kind = f"DTensor {t.placements} of " if isinstance(t, DTensor) else ""
    return f"{kind}{tuple(t.shape)} {t.dtype}"


def _run(stage: nn.Module, inputs: torch.Tensor) -> torch.Tensor:
    """The stage's output, as an activation (requiring its gradient); FSDP's parameters sharded again after (a
    forward without gradients leaves the root's gathered, and the step's backward would then make no gradients)."""
    with torch.no_grad():
        outputs = stage(inputs).detach().requires_grad_(True)
    for module in stage.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
    return outputs


def first_stage(parts: list[nn.Module], stage_ids: list[int], whole: nn.Module, package, dims: ParallelDims,
                mesh, config: Config, device: torch.device) -> nn.Module:
    """Stage 0 as pipeline rank 0 builds and parallelizes it: this rank's own where it holds it, else built here
    (on meta; the caller materializes it)."""
    if 0 in stage_ids:
        return parts[stage_ids.index(0)]
    rank_0 = SimpleNamespace(size=lambda: dims.pp, get_local_rank=lambda: 0)  # what the split reads of the pp mesh
    built, ids, _ = family_split(package)(whole, rank_0, config)
    return package.parallelize(built[ids.index(0)], dims, mesh, config, device)


def stage_maker(first: nn.Module, micro_batch: torch.Tensor) -> Callable:
    """build_pipeline's make_stage: each stage given the shapes it takes and returns, run once on fake tensors
    (`micro_batch`: the first stage's input, one micro-batch of token ids)."""
    boundary = _run(first, micro_batch)

    def make_stage(part: nn.Module, stage_id: int, num_stages: int, device: torch.device, group) -> PipelineStage:
        inputs = micro_batch if stage_id == 0 else boundary
        outputs = boundary if part is first else _run(part, inputs)  # the first stage ran once already
        last = stage_id == num_stages - 1
        if not last and _shape(outputs) != _shape(boundary):
            raise ConfigError(f"preflight: pipeline stage {stage_id} returns {_shape(outputs)} where the first stage "
                              f"returns {_shape(boundary)}; preflight gives every stage the first stage's output")
        # With a DTensor among them (the last stage's logits under loss parallelism), torch 2.13's static mode wants
        # the gradients' shapes too: the inputs' as the inputs, none for the outputs of the last stage (the loss's).
        # Earlier torch takes neither.
        grads = {"input_grads": inputs if stage_id else None, "output_grads": None if last else outputs}
        takes_grads = isinstance(outputs, DTensor) and "output_grads" in inspect.signature(PipelineStage).parameters
        return GivenShapesStage(part, stage_id, num_stages, device, input_args=inputs, output_args=outputs,
                                group=group, **(grads if takes_grads else {}))

    return make_stage
