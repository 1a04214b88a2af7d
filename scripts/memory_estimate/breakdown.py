"""One rank's memory, part by part: persistent state counted exactly from the parameter shapes after
tensor parallelism and FSDP, and the simulated activations and working memory scaled to the layout
(tensor and context parallel, the pipeline's micro-batches in flight, FSDP's gathered buffers)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from components.config import Config
from components.distributed.mesh import ParallelDims
from scripts.memory_estimate.simulation import Simulation

GiB = 2**30
CPU_HEAP_FRAGMENTATION = 0.4
"""CPU: resident memory glibc malloc holds beyond the live tensors, as a fraction of the memory
allocated and freed in every step (activations and temporaries). Measured on the debug model
(0.38-0.39 with batch 8 or 16, 6 or 12 layers, a little more with full activation checkpointing)."""
CPU_TRAINER_STATE = 30 * 2**20
"""CPU: what the trainer process holds before its first step beyond its imports (tokenizer, data,
TensorBoard writer, process group): 0.03 GiB measured on the debug run."""

PARTS = ("baseline", "parameters", "gradients", "optimizer", "activations", "fsdp_buffers", "temporary", "allocator")
LABELS = {
    "baseline": "baseline (process before training)",
    "parameters": "parameters",
    "gradients": "gradients",
    "optimizer": "optimizer state",
    "activations": "activations (saved for backward)",
    "fsdp_buffers": "FSDP buffers",
    "temporary": "temporary (working memory at the peak)",
    "allocator": "allocator slack",
}


@dataclass
class MemoryEstimate:
    parts: dict[str, int]
    """Bytes per PARTS entry; they add up to `total`."""
    notes: dict[str, str]
    """A short explanation per part."""
    header: list[str]
    remarks: list[str] = field(default_factory=list)
    target: str = "cpu"
    phase: str = "backward"
    """Where the peak is: forward/backward, or the optimizer step."""
    saved_activations: int = 0
    """Activation bytes of the forward/backward phase (also when the optimizer step is the peak)."""
    other_phase_total: int = 0
    n_params: int = 0
    params_on_rank: int = 0
    pp_rank: int = 0
    seconds: float = 0.0

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    @property
    def total_gib(self) -> float:
        return self.total / GiB

    def format(self) -> str:
        width = max(len(LABELS[p]) for p in PARTS)
        lines = list(self.header) + [""]
        for part in PARTS:
            lines.append(f"  {LABELS[part]:<{width}}  {self.parts[part] / GiB:9.3f} GiB   {self.notes.get(part, '')}")
        lines.append(f"  {'total':<{width}}  {self.total / GiB:9.3f} GiB   peak in the {self.phase}")
        other = "optimizer step" if self.phase == "forward/backward" else "forward/backward"
        lines.append(f"  ({other}: {self.other_phase_total / GiB:.3f} GiB)")
        if self.remarks:
            lines += [""] + [f"note: {r}" for r in self.remarks]
        lines.append(f"(estimated in {self.seconds:.1f} s)")
        return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# Parameters per rank
# --------------------------------------------------------------------------------------------------


def tp_shard_dims(model: nn.Module, plan: dict) -> dict[str, int | None]:
    """Parameter name -> the dim tensor parallelism splits (None: replicated), from the model's TP
    plan: column-wise weights split along dim 0, row-wise ones along dim 1 (embeddings along 0)."""
    dims = {}
    for name, _ in model.named_parameters():
        module_name = name.rpartition(".")[0]
        style = plan.get(module_name)
        if isinstance(style, ColwiseParallel):
            dims[name] = 0
        elif isinstance(style, RowwiseParallel):
            dims[name] = 0 if isinstance(model.get_submodule(module_name), nn.Embedding) else 1
        else:
            dims[name] = None
    return dims


def local_numel(shape: tuple[int, ...], tp_dim: int | None, tp: int, fsdp: int) -> int:
    """Elements rank 0 holds: the TP shard (ceil), then FSDP's dim-0 chunk of it (ceil)."""
    shape = list(shape)
    if tp_dim is not None and tp > 1:
        shape[tp_dim] = math.ceil(shape[tp_dim] / tp)
    if fsdp > 1 and shape:
        shape[0] = math.ceil(shape[0] / fsdp)
    return math.prod(shape)


@dataclass
class StageParams:
    """Parameter element counts of a set of pipeline stages on one rank."""

    tp: int = 0  # after TP, before FSDP
    rank: int = 0  # after TP and FSDP: what this rank stores
    root_tp: int = 0  # embeddings, norm, output of these stages, after TP
    block_tp: int = 0  # one transformer block, after TP
    largest: int = 0  # the largest single parameter, after TP and FSDP
    matrices: int = 0  # the blocks' 2-D and 3-D parameters (Muon's), after TP and FSDP
    largest_matrix: int = 0  # the largest of those after TP and expert parallelism: what Muon gathers whole


def count_params(shapes: dict[str, tuple[int, ...]], block: dict[str, tuple[int, ...]],
                 tp_dims: dict[str, int | None], dims: ParallelDims, fsdp_degree: int,
                 moe: dict[str, bool], blocks: str) -> StageParams:
    """The counts for the parameters `shapes` (name -> shape) of a rank's stages; `block`: those of
    one transformer block; `blocks`: the name of the model's child holding the blocks. `moe`: the names of
    mixture-of-experts parameters, True for the experts' (sharded over the ep ranks on dim 0), False for the
    routers' and shared experts'; FSDP shards these over every rank that routes other tokens through them
    (parallelisms/expert_parallel.py)."""
    moe_degree = dims.dp_shard * dims.cp * dims.tp if fsdp_degree > 1 or dims.tp > 1 else 1

    def numel(subset: dict[str, tuple[int, ...]], sharded: bool) -> int:
        """Elements after tensor and expert parallelism, and after FSDP if `sharded`."""
        total = 0
        for name, shape in subset.items():
            if name not in moe:
                total += local_numel(shape, tp_dims[name], dims.tp, fsdp_degree if sharded else 1)
            elif moe[name]:  # this rank's experts, then FSDP over the ranks holding the same ones
                shape = (math.ceil(shape[0] / dims.ep), *shape[1:])
                total += local_numel(shape, None, 1, moe_degree // dims.ep if sharded else 1)
            else:
                total += local_numel(shape, None, 1, moe_degree if sharded else 1)
        return total

    root = {name: shape for name, shape in shapes.items() if not name.startswith(f"{blocks}.")}
    matrices = {name: shape for name, shape in shapes.items() if name not in root and len(shape) in (2, 3)}
    return StageParams(tp=numel(shapes, False), rank=numel(shapes, True), root_tp=numel(root, False),
                       block_tp=numel(block, False), largest=max(numel({n: s}, True) for n, s in shapes.items()),
                       matrices=numel(matrices, True),
                       largest_matrix=max((numel({n: s}, False) for n, s in matrices.items()), default=0))


# --------------------------------------------------------------------------------------------------
# One rank's breakdown
# --------------------------------------------------------------------------------------------------


def micro_batches_in_flight(schedule: str, multi_stage: bool, n_micro_batches: int, pp: int, pp_rank: int,
                            stages_on_rank: int) -> int:
    """Micro-batches whose activations a stage of rank `pp_rank` holds at once (approximate for the
    multi-stage schedules: their warm-up depth spread over the rank's stages)."""
    if schedule in ("GPipe", "LoopedBFS"):
        return n_micro_batches
    if not multi_stage:  # 1F1B
        return max(1, min(n_micro_batches, pp - pp_rank))
    warmup = (stages_on_rank - 1) * pp + 2 * (pp - 1 - pp_rank) + 1
    return max(1, min(n_micro_batches, math.ceil(warmup / stages_on_rank)))


@dataclass(frozen=True)
class Layout:
    """How the ranks split the model and the step, and what the estimate is for."""

    dims: ParallelDims
    fsdp: bool
    fsdp_degree: int
    """Ranks FSDP shards over (dp_shard x cp); 1 without FSDP."""
    compute_dtype: torch.dtype
    reduce_dtype: torch.dtype
    micro_batch: int
    """Sequences per forward: the local batch, or the pipeline's micro-batch."""
    local_seq: int
    """Tokens of each sequence on a rank: seq_len / cp."""
    grad_accum_steps: int
    pipeline_micro_batches: int
    target: str
    """cpu (peak resident memory) or cuda (torch.cuda.max_memory_reserved)."""
    baseline: int
    """cpu: the resident memory of the trainer's imports."""
    cpu_offload: bool = False
    """parallelism.fsdp_cpu_offload: FSDP keeps parameters, gradient shards and optimizer state on the host."""


@dataclass
class Stage:
    """A pipeline stage of a rank (the whole model without PP) and its simulated micro-batch."""

    simulation: Simulation
    in_flight: int
    """Micro-batches whose activations the stage holds at once."""
    blocks: int


@dataclass
class RankStages:
    pp_rank: int
    params: StageParams
    stages: list[Stage]


def rank_breakdown(config: Config, model_args, layout: Layout, rank: RankStages) -> MemoryEstimate:
    """Combine the exact parameter counts and the stage simulations into one rank's breakdown."""
    dims, params, stages = layout.dims, rank.params, rank.stages
    tp, cb, rb = dims.tp, layout.compute_dtype.itemsize, layout.reduce_dtype.itemsize
    fsdp_degree = layout.fsdp_degree
    parts = dict.fromkeys(PARTS, 0)
    notes: dict[str, str] = {}
    remarks: list[str] = []
    parts["parameters"] = params.rank * 4
    notes["parameters"] = (f"{params.rank:,} fp32 (master copy"
                           + (f", 1/{fsdp_degree} by FSDP" if fsdp_degree > 1 else "")
                           + (f", 1/{tp} by TP" if tp > 1 else "") + ")")
    muon = config.optimizer.name == "Muon"
    parts["optimizer"] = (params.rank - params.matrices) * 8 + params.matrices * 4 if muon else params.rank * 8
    notes["optimizer"] = ("Muon's momentum of the block matrices, AdamW's exp_avg + exp_avg_sq of the rest, fp32"
                          if muon else "AdamW's exp_avg + exp_avg_sq, fp32")
    full_grads = params.rank * 4

    # Activations: the saved tensors of each stage times its micro-batches in flight, / tp, plus the
    # full-sequence inputs that non-checkpointed blocks save for their column-parallel matmuls.
    ac_mode, ac_option = config.activation_checkpoint.mode, config.activation_checkpoint.selective_ac_option
    activations = 0
    split = tp if config.parallelism.sequence_parallel else 1
    if tp > 1 and split == 1:
        remarks.append("parallelism.sequence_parallel false: the activations are counted whole on every tp rank, an "
                       "upper bound (those inside the split layers are 1/tp)")
    for stage in stages:
        saved = stage.simulation.saved / split
        if split > 1:
            if ac_mode == "none":
                plain = stage.blocks
            elif ac_mode == "selective" and ac_option.isdigit():
                plain = stage.blocks - stage.blocks // int(ac_option)
            else:
                plain = 0
            saved += plain * 2 * layout.micro_batch * layout.local_seq * model_args.dim * cb * (1 - 1 / tp)
        activations += saved * stage.in_flight
    parts["activations"] = int(activations)
    notes["activations"] = f"{layout.micro_batch} x {layout.local_seq} tokens" + (
        f", micro-batches in flight: {'/'.join(str(s.in_flight) for s in stages)}" if dims.pp > 1 else "")

    # Gradient bytes per simulated byte: FSDP keeps the root's gradients unsharded in the compute
    # dtype until the end of backward and reduce-scatters each block's into fp32 shards; without
    # FSDP every gradient is fp32 and whole (/ tp).
    root_scale = 1 / tp
    block_scale = (4 / cb) / (tp * fsdp_degree) if layout.fsdp else 1 / tp
    offloaded = layout.cpu_offload and layout.target == "cuda"
    if offloaded:  # each block's reduce-scattered gradient shards are copied to the host
        block_scale = 0
    accumulating = layout.grad_accum_steps > 1 or (dims.pp > 1 and layout.pipeline_micro_batches > 1)
    accumulated = 0
    if accumulating:
        # Gradients from earlier micro-batches are alive throughout: FSDP (no reduce-scatter until the
        # last micro-batch) keeps them unsharded in the reduce dtype, plain modules as .grad (fp32);
        # a micro-batch's new gradients are added into them (FSDP: one block at a time).
        accumulated = (params.tp * (rb if layout.reduce_dtype != layout.compute_dtype else cb) if layout.fsdp
                       else full_grads)
        block_scale = 0
        root_scale = root_scale if layout.fsdp else 0
    # The peak of the forward/backward timeline, the last stage's sample weighted as scaled.
    best = (-1.0, 0.0, 0.0)
    for stage in stages:
        own_saved = stage.simulation.saved / tp
        others_saved = activations - own_saved  # other micro-batches and stages stay alive meanwhile
        for other, root_g, block_g in stage.simulation.samples:
            grads = root_g * root_scale + block_g * block_scale
            value = other / tp + grads + others_saved
            if value > best[0]:
                best = (value, other / tp - own_saved, grads)
    _, working, grads_at_peak = best
    parts["gradients"] = int(grads_at_peak + accumulated)
    if accumulating:
        kept = "unsharded, FSDP without reduce-scatter" if layout.fsdp else "fp32"
        notes["gradients"] = f"accumulated over micro-batches ({kept})"
    else:
        notes["gradients"] = (f"alive at the peak{', with the unsharded ones of the root' if layout.fsdp else ''} "
                              f"(all, fp32{' sharded' if layout.fsdp else ''}: {full_grads / GiB:.3f} GiB)")
    parts["temporary"] = int(max(0.0, working))
    notes["temporary"] = "logits/loss in fp32, activation gradients, recomputation"
    if working < 0:  # the peak is late in backward: part of the activations is freed by then
        parts["activations"] = int(activations + working)
        notes["activations"] += (f"; alive at the peak, late in backward (saved at the end of forward: "
                                 f"{activations / GiB:.3f} GiB)")

    if layout.fsdp:
        reshard_modes = {"always": True, "never": False, "default": dims.pp == 1}
        reshard = reshard_modes[config.parallelism.fsdp_reshard_after_forward]
        stage_blocks = sum(s.blocks for s in stages)
        gathered_blocks = min(2, stage_blocks) if reshard else stage_blocks
        gathered = (params.root_tp + gathered_blocks * params.block_tp) * cb
        grad_buffer = params.block_tp * (cb + (rb if layout.reduce_dtype != layout.compute_dtype else 0))
        parts["fsdp_buffers"] = gathered + grad_buffer
        notes["fsdp_buffers"] = (f"all-gathered {str(layout.compute_dtype).removeprefix('torch.')} params: root + "
                                 f"{gathered_blocks} block(s); one block's grads before reduce-scatter")
    if layout.target == "cpu":
        parts["baseline"] = layout.baseline + CPU_TRAINER_STATE
        notes["baseline"] = (f"peak resident memory here after importing the trainer's modules "
                             f"({layout.baseline / GiB:.3f} GiB) + {CPU_TRAINER_STATE / GiB:.2f} GiB of trainer state")
        parts["allocator"] = int(CPU_HEAP_FRAGMENTATION * (parts["activations"] + parts["temporary"]))
        notes["allocator"] = f"glibc heap fragmentation: {CPU_HEAP_FRAGMENTATION:.0%} of activations + temporary"
    else:
        notes["baseline"] = "not part of max_memory_reserved"
        notes["allocator"] = "not modelled (caching allocator: typically a few %)"

    # The optimizer step: all parameters, gradients, states, and foreach AdamW's fp32 temporaries.
    impl = config.optimizer.implementation
    opt_temp = {"foreach": params.rank * 4, "fused": 0}.get(impl, params.largest * 4)
    if muon:  # each matrix gathered whole, then the iteration's operands (components/training/muon.py)
        opt_temp = max(opt_temp, 4 * params.largest_matrix * 4)
    opt_parts = dict.fromkeys(PARTS, 0) | {k: parts[k] for k in ("baseline", "parameters", "optimizer")}
    opt_parts["gradients"], opt_parts["temporary"] = full_grads, opt_temp
    if layout.target == "cpu":
        opt_parts["allocator"] = int(CPU_HEAP_FRAGMENTATION * opt_temp)
    opt_total = sum(opt_parts.values())
    if offloaded:
        host = params.rank * 16
        parts["parameters"] = parts["optimizer"] = opt_total = 0
        notes["parameters"] = notes["optimizer"] = "in host memory (parallelism.fsdp_cpu_offload)"
        remarks.append(f"parallelism.fsdp_cpu_offload: {host / GiB:.3f} GiB of fp32 parameters, gradients and "
                       "optimizer state in pinned host memory on this rank (the optimizer steps there); not counted")
    estimate = MemoryEstimate(parts, notes, [], remarks, layout.target, "forward/backward", int(activations))
    if opt_total > estimate.total:
        fwd_total, parts = estimate.total, opt_parts
        step_temporary = "Muon's gathered matrices" if muon else f"{impl} AdamW temporaries"
        notes = notes | {"gradients": "all, fp32", "temporary": step_temporary, "activations": "none alive"}
        estimate = MemoryEstimate(parts, notes, [], remarks, layout.target, "optimizer step", int(activations),
                                  fwd_total)
    else:
        estimate.other_phase_total = opt_total
    estimate.params_on_rank, estimate.pp_rank = params.rank, rank.pp_rank
    return estimate
