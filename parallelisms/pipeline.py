"""Pipeline parallelism with `torch.distributed.pipelining`: the layers are split into stages, each
rank runs its stages, and a schedule streams micro-batches through them (activations forward,
their gradients backward, point-to-point between neighbouring ranks).

Single-stage schedules (GPipe, 1F1B) give each rank one stage. Multi-stage schedules give each
rank several smaller stages to shrink the pipeline bubble: looped ones (Interleaved1F1B, LoopedBFS,
InterleavedZeroBubble) place stage s on rank s % pp, V-shaped ones (ZBVZeroBubble, DualPipeV) go
down the ranks and back up, so that rank 0 holds both the first and the last stage.

Which modules go into which stage: `split_for_pipeline` serves every model that follows the model contract
(components/model/contract.py: the modules its `pipeline_ends` names before the blocks go into the first stage, those
after them into the last, its `transformer_blocks()` are split between the stages, and a stage sets what it does not
hold to None); a family with another structure exports its own split_for_pipeline, which `family_split` then picks.
"""

from __future__ import annotations

import copy
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from components.config import Config, ConfigError
from components.model.contract import DecoderModel, blocks_name
from components.model.moe_layer import moe_layers

if TYPE_CHECKING:
    from torch.distributed.pipelining import schedules


def _pipelining():
    """torch.distributed.pipelining, imported when a run uses it: it brings in torch's compiler (about a second
    of every process's start-up otherwise)."""
    return importlib.import_module("torch.distributed.pipelining")

# The schedules a user may name, if the installed torch offers them (`offered_schedules`).
KNOWN_SCHEDULES = (
    "GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV",
)
V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")
"""Schedules that need the V-shaped stage-to-rank mapping and exactly two stages per rank."""

SCHEDULE_KEYS = "parallelism.pipeline_parallel_schedule"
MICROBATCH_KEYS = "training.local_batch_size / parallelism.pipeline_parallel_microbatch_size"


def offered_schedules() -> list[str]:
    """The KNOWN_SCHEDULES names the installed torch provides."""
    offered = []
    for name in KNOWN_SCHEDULES:
        try:
            _pipelining().schedules.get_schedule_class(name)
        except ValueError:
            continue
        offered.append(name)
    return offered


def schedule_class(schedule_name: str) -> type:
    if schedule_name not in offered_schedules():
        raise ConfigError(
            f"{SCHEDULE_KEYS} '{schedule_name}' is not offered by torch {torch.__version__}; "
            f"choose one of: {', '.join(offered_schedules())}"
        )
    return _pipelining().schedules.get_schedule_class(schedule_name)


def is_multi_stage(schedule_name: str) -> bool:
    """Whether the schedule runs several stages per rank (and so takes a list of stages)."""
    return issubclass(schedule_class(schedule_name), _pipelining().schedules.PipelineScheduleMulti)


def is_v_style(schedule_name: str) -> bool:
    return schedule_name in V_SCHEDULES


def gloo_cannot_run(schedule_name: str) -> bool:
    """torch 2.11's V schedules pass between a rank's two adjacent stages through the process group, and gloo
    (CPU) cannot send to its own rank: the rank fails with "Pair is not connected" and the other waits for it.
    torch 2.13 passes them within the rank."""
    return is_v_style(schedule_name) and torch.__version__ < "2.13"


def stage_ids_for_rank(pp_rank: int, pp_size: int, stages_per_rank: int, v_style: bool) -> list[int]:
    """The stages rank `pp_rank` runs, in order.

    Loop style: pp_rank, pp_rank + pp, pp_rank + 2 pp, ... (every chunk goes down the ranks).
    V style: chunks alternate direction, e.g. with two stages per rank: pp_rank and 2 pp - 1 - pp_rank;
    this is the mapping torch's V schedules expect."""
    if v_style:
        return [chunk * pp_size + (pp_rank if chunk % 2 == 0 else pp_size - 1 - pp_rank)
                for chunk in range(stages_per_rank)]
    return [chunk * pp_size + pp_rank for chunk in range(stages_per_rank)]


def split_module(model: nn.Module, keep: list[str]) -> nn.Module:
    """A deep copy of `model` with only the named modules: top-level children ("norm") or entries of a
    top-level ModuleDict ("layers.3"). Other children become None and other ModuleDict entries are
    removed, so kept modules keep their names and state-dict keys.

    Dropped modules are not copied (the deepcopy memo maps them to None), so splitting a
    materialized model costs only the memory of the kept part."""
    keep_set = set(keep)
    memo: dict[int, object] = {}
    dropped_entries: list[tuple[str, str]] = []
    found = set()
    for name, child in model.named_children():
        if isinstance(child, nn.ModuleDict):
            for key, entry in child.items():
                if f"{name}.{key}" in keep_set:
                    found.add(f"{name}.{key}")
                else:
                    memo[id(entry)] = None
                    dropped_entries.append((name, key))
        elif name in keep_set:
            found.add(name)
        elif child is not None:
            memo[id(child)] = None
    if keep_set - found:
        raise ValueError(f"split_module: no module named {sorted(keep_set - found)}")
    part = copy.deepcopy(model, memo)
    for name, key in dropped_entries:
        del getattr(part, name)[key]
    return part


def pipeline_module_names(n_layers: int, num_stages: int, layers_per_stage: int | None, blocks: str,
                          ends: tuple[tuple[str, ...], tuple[str, ...]]) -> list[list[str]]:
    """The module names each stage holds: the `ends` before the blocks in the first, those after them in the last,
    and the blocks (entries of the child `blocks`) in order, `layers_per_stage` per stage or split evenly (the first
    stages take one more block each when they do not divide evenly)."""
    if num_stages > n_layers:
        raise ConfigError(
            f"{num_stages} pipeline stages (parallelism.pipeline_parallel_degree x stages per rank) but "
            f"model.n_layers is {n_layers}: every stage needs at least one block"
        )
    if layers_per_stage is not None:
        if layers_per_stage * num_stages != n_layers:
            raise ConfigError(
                f"parallelism.pipeline_parallel_layers_per_stage {layers_per_stage} x {num_stages} stages = "
                f"{layers_per_stage * num_stages} blocks, but model.n_layers is {n_layers}"
            )
        sizes = [layers_per_stage] * num_stages
    else:
        base, extra = divmod(n_layers, num_stages)
        sizes = [base + (1 if stage < extra else 0) for stage in range(num_stages)]
    names, start = [], 0
    for size in sizes:
        names.append([f"{blocks}.{i}" for i in range(start, start + size)])
        start += size
    names[0][:0] = ends[0]
    names[-1].extend(ends[1])
    return names


def stages_per_rank(schedule_name: str, pp_size: int, n_layers: int, layers_per_stage: int | None) -> int:
    """One for single-stage schedules, two for V schedules; looped multi-stage schedules take two, or
    as many as `layers_per_stage` makes (n_layers / layers_per_stage stages over pp_size ranks)."""
    if not is_multi_stage(schedule_name):
        return 1
    if is_v_style(schedule_name) or layers_per_stage is None:
        return 2
    num_stages, rest = divmod(n_layers, layers_per_stage)
    if rest or num_stages % pp_size:
        raise ConfigError(
            f"parallelism.pipeline_parallel_layers_per_stage {layers_per_stage} must divide model.n_layers "
            f"({n_layers}) into a multiple of parallelism.pipeline_parallel_degree ({pp_size}) stages"
        )
    return num_stages // pp_size


def split_for_pipeline(model: DecoderModel, pp_mesh: DeviceMesh, config: Config,
                       ) -> tuple[list[nn.Module], list[int], int]:
    """This rank's pipeline stages of `model` (on meta, or materialized: its weights are copied):
    (model_parts, stage_ids, num_stages), parts in the order of their stage ids."""
    p = config.parallelism
    first, last = ({id(param) for name in names for param in getattr(model, name).parameters()}
                   for names in model.pipeline_ends)
    if first & last:
        # The first and last stages would each hold (and update) their own copy of the matrix.
        raise ConfigError(
            f"model.flavor {config.model.flavor} ties its embedding and output weights, which pipeline "
            "parallelism does not support yet; use parallelism.pipeline_parallel_degree = 1"
        )
    pp_size, pp_rank = pp_mesh.size(), pp_mesh.get_local_rank()
    n_layers = len(model.transformer_blocks())
    per_rank = stages_per_rank(p.pipeline_parallel_schedule, pp_size, n_layers, p.pipeline_parallel_layers_per_stage)
    num_stages = pp_size * per_rank
    names = pipeline_module_names(n_layers, num_stages, p.pipeline_parallel_layers_per_stage, blocks_name(model),
                                  model.pipeline_ends)
    stage_ids = stage_ids_for_rank(pp_rank, pp_size, per_rank, is_v_style(p.pipeline_parallel_schedule))
    return [split_module(model, names[stage]) for stage in stage_ids], stage_ids, num_stages


def family_split(model_package) -> Callable:
    """The family's own split_for_pipeline where its package exports one (docs/models.md), else the one above."""
    return getattr(model_package, "split_for_pipeline", split_for_pipeline)


def check_microbatches(schedule_name: str, n_microbatches: int, pp_size: int, num_stages: int) -> None:
    """Refuse micro-batch counts the schedule cannot run, naming the keys that set them."""
    needed = {"1F1B": pp_size, "DualPipeV": num_stages}.get(schedule_name, 1)
    if n_microbatches < needed:
        raise ConfigError(
            f"{SCHEDULE_KEYS} {schedule_name} needs at least {needed} micro-batches per step, but "
            f"{MICROBATCH_KEYS} gives {n_microbatches}; use a larger local batch or smaller micro-batches"
        )


def build_pipeline_schedule(
    stages: list,
    schedule_name: str,
    n_microbatches: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    grad_accum_steps: int = 1,
):
    """The schedule object running this rank's `stages` (PipelineStage objects, in stage order).

    `loss_fn(pred, labels)` is the mean loss of one micro-batch. The schedule backpropagates
    loss_fn / (n_microbatches * grad_accum_steps), with torch's own gradient scaling off
    (scale_grads=False): torch would divide *all* accumulated gradients by n_microbatches at the
    end of every step(), which is wrong once gradients accumulate over several step() calls.
    So after grad_accum_steps step() calls the gradients are those of the mean over all
    micro-batches, and the values step() puts in `losses` are scaled the same way: their sum over
    one step() call is that call's share of the mean loss (summing them over all grad_accum_steps
    calls gives the mean loss of the whole batch)."""
    cls = schedule_class(schedule_name)
    num_stages, pp_size = stages[0].num_stages, stages[0].group_size
    check_microbatches(schedule_name, n_microbatches, pp_size, num_stages)
    multi = issubclass(cls, _pipelining().schedules.PipelineScheduleMulti)
    if not multi and len(stages) != 1:
        raise ValueError(f"{schedule_name} runs one stage per rank, got {len(stages)}")
    scale = n_microbatches * grad_accum_steps

    def scaled_loss(pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return loss_fn(pred, labels) / scale

    try:
        return cls(stages if multi else stages[0], n_microbatches=n_microbatches, loss_fn=scaled_loss,
                   scale_grads=False)
    except (ValueError, RuntimeError) as e:
        # torch's own checks: e.g. micro-batches not a multiple of the rounds (Interleaved1F1B), or
        # compiled blocks (compile.enable) under the zero-bubble schedules.
        raise ConfigError(
            f"{SCHEDULE_KEYS} {schedule_name} with {n_microbatches} micro-batches ({MICROBATCH_KEYS}) "
            f"on {pp_size} pipeline ranks: {e}"
        ) from e


@dataclass
class Pipeline:
    """This rank's part of a pipeline: the schedule that drives its stages, and whether it holds the
    first stage (which takes the inputs) and the last one (which takes the labels and has the losses)."""

    schedule: schedules._PipelineSchedule
    has_first_stage: bool
    has_last_stage: bool
    n_microbatches: int
    """Pipeline micro-batches per local batch."""
    parts: list[nn.Module]
    """This rank's stages' modules."""
    infers_shapes: bool = True
    """Whether the next training step starts with torch's shape inference: its first, and the first after a
    forward-only one (evaluation, validation)."""

    def _first_stage_inputs(self, inputs: torch.Tensor) -> list[torch.Tensor]:
        """[inputs] on the first stage, contiguous: torch 2.11's stages compare the strides of their inputs with
        those they recorded (a resumed run failed on views of the (batch, seq + 1) windows)."""
        return [inputs.contiguous()] if self.has_first_stage else []

    def run(self, inputs: torch.Tensor, labels: torch.Tensor, train: bool,
            documents: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Forward (and with `train`, backward) every micro-batch of one batch through the pipeline.
        Returns the last stage's per-micro-batch losses, scaled as `build_pipeline_schedule` says
        (their sum is this batch's share of the step's mean loss); other stages get an empty list.
        `documents`, the batch's document ids under document masking, reach every stage (torch's schedules
        cut keyword arguments into micro-batches and give them to each stage's forward)."""
        stage_inputs = self._first_stage_inputs(inputs)
        target = labels if self.has_last_stage else None
        losses = [] if self.has_last_stage else None
        kwargs = {} if documents is None else {"document_ids": documents}
        if train:
            forget = ForgetFirstRouting()
            hooks = [part.register_forward_hook(forget) for part in self.parts] if self.infers_shapes else []
            try:
                self.schedule.step(*stage_inputs, target=target, losses=losses, return_outputs=False, **kwargs)
            finally:
                for hook in hooks:
                    hook.remove()
            self.infers_shapes = False
        else:
            self.schedule.eval(*stage_inputs, target=target, losses=losses, **kwargs)
            self.infers_shapes = True
        return losses or []

    def score(self, inputs: torch.Tensor, labels: torch.Tensor,
              score_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
              documents: torch.Tensor | None = None) -> torch.Tensor | None:
        """Forward only, with `score_fn(logits, labels)` of each micro-batch in place of the loss:
        their concatenation on the last stage, None elsewhere."""
        stage_inputs = self._first_stage_inputs(inputs)
        scores = [] if self.has_last_stage else None
        kwargs = {} if documents is None else {"document_ids": documents}
        # The schedule's loss function is fixed at construction; torch has no public way to run it
        # with another, so its attribute is swapped for the duration of this forward.
        loss_fn, self.schedule._loss_fn = self.schedule._loss_fn, score_fn
        try:
            self.schedule.eval(*stage_inputs, target=labels if self.has_last_stage else None, losses=scores,
                               return_outputs=False, **kwargs)
        finally:
            self.schedule._loss_fn = loss_fn
        self.infers_shapes = True
        return torch.cat(scores) if self.has_last_stage else None


class ForgetFirstRouting:
    """A forward hook on a stage's modules for a training step that starts with shape inference: torch runs each
    stage once on placeholder inputs (uninitialized memory past the first stage) to learn the shapes, and what the
    stage's mixture-of-experts layers routed then is forgotten rather than added to the step's routing tally
    (components/training/routing.py), which moves their biases: it made runs under pipeline parallelism depend on what
    the memory held. Only each module's first forward of the step is the placeholder one."""

    def __init__(self):
        self.seen: set[int] = set()

    def __call__(self, module: nn.Module, args, output) -> None:
        if id(module) not in self.seen:
            self.seen.add(id(module))
            for _, layer in moe_layers(module):
                layer.reset_tally()


def build_pipeline(
    model_parts: list[nn.Module],
    stage_ids: list[int],
    num_stages: int,
    pp_mesh: DeviceMesh,
    config: Config,
    device: torch.device,
    loss_fn,
    grad_accum_steps: int = 1,
    make_stage: Callable | None = None,
) -> Pipeline:
    """The pipeline running this rank's parts (parallelized and materialized: the PipelineStage
    objects are built now, so that they wrap exactly the modules that will run) with the schedule
    and micro-batch size of config.parallelism; `loss_fn` and `grad_accum_steps` as for
    build_pipeline_schedule. `make_stage(part, stage_id, num_stages, device, group=...)` makes each stage: by
    default torch's PipelineStage, which learns its shapes from its neighbours at the first step (preflight, a rank
    alone, gives them instead: scripts/preflight/pipeline.py)."""
    p = config.parallelism
    local_batch, mb_size = config.training.local_batch_size, p.pipeline_parallel_microbatch_size
    if mb_size < 1 or local_batch % mb_size:
        raise ConfigError(
            f"training.local_batch_size {local_batch} must be a multiple of "
            f"parallelism.pipeline_parallel_microbatch_size {mb_size}"
        )
    if device.type == "cpu" and gloo_cannot_run(p.pipeline_parallel_schedule):
        raise ConfigError(
            f"{SCHEDULE_KEYS} {p.pipeline_parallel_schedule} on CPU needs torch 2.13 or newer: torch "
            f"{torch.__version__}'s V schedules send between a rank's own two stages through gloo, which cannot; "
            "pick Interleaved1F1B or another looped schedule, or upgrade torch"
        )
    group, make_stage = pp_mesh.get_group(), make_stage or _pipelining().PipelineStage
    stages = [
        make_stage(part, stage_id, num_stages, device, group=group)
        for part, stage_id in zip(model_parts, stage_ids)
    ]
    n_microbatches = local_batch // mb_size
    schedule = build_pipeline_schedule(stages, p.pipeline_parallel_schedule, n_microbatches, loss_fn, grad_accum_steps)
    return Pipeline(schedule, has_first_stage=0 in stage_ids, has_last_stage=num_stages - 1 in stage_ids,
                    n_microbatches=n_microbatches, parts=model_parts)

