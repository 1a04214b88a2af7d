"""One rank of a layout at its full world size, in this process: train.py's start-up path over torch's fake
process group (every collective returns at once, carrying no data), then one training step on fake tensors
(shapes and dtypes, no memory), recording what it sends and computes.

What differs from train.py, and why: the model is materialized as fake tensors (no weights are drawn: their values
change nothing here); mixture-of-experts layers route evenly, fake tensors having no values to route by
(scripts/preflight/routing.py); attention keeps what CUDA's kernels keep (the memory estimator's stand-in: the CPU's
kernels keep the scores of learned sinks and of values narrower than the keys); compile is off for the step
(compiling on fake tensors would measure the compiler, and compiled code sends and computes the same), and so is
async TP (compiled CUDA code: the same collectives, overlapped, which the prediction assumes); pipeline stages are
given their shapes rather than learning them from their neighbours (scripts/preflight/pipeline.py); no data is read
(the step's token ids are random, of the batch's shape)."""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor import DTensor
from torch.testing._internal.distributed.fake_pg import FakeStore  # torch's fake process group: private, here only
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only
from torch.utils.flop_counter import flop_registry

from components.config import Config, ConfigError
from components.data.batch_plan import batch_plan
from components.distributed.fault_tolerance import NoReplicas
from components.distributed.mesh import ParallelDims
from components.model.attention import attention_layers
from components.model.layout_checks import check_model_supported, check_supported
from components.model.moe_layer import has_moe_layer
from components.training.model_on_rank import local, prepare_batch
from components.training.optimizers import Optimizers
from models.families import import_model_package
from parallelisms.context_parallel import shard_sequence
from parallelisms.float8 import Float8ScalePrecompute, pays_in_float8
from parallelisms.pipeline import family_split
from scripts.memory_estimate.estimator import vocab_size
from scripts.memory_estimate.simulation import as_cuda_attends
from scripts.preflight.collectives import Collective, CollectiveRecorder
from scripts.preflight.memory import PeakMemory
from scripts.preflight.pipeline import first_stage, stage_maker
from scripts.preflight.routing import balance_routing


@dataclass
class RankReport:
    rank: int
    coordinates: dict[str, int]
    """This rank's place on each mesh dimension of more than one rank."""
    params: int = 0
    """Elements of this rank's share of the parameters."""
    param_bytes: int = 0
    root_param_bytes: int = 0
    """Of the parameters outside the transformer blocks (embedding, final norm, output): FSDP's root unit."""
    optimizer_bytes: int = 0
    flops: int = 0
    """Of this rank's step (forward, backward and optimizer), as torch's FLOP counter counts them."""
    float8_flops: int = 0
    """Of them, those of the linear layers that compute in float8 on a GPU with float8 matmuls."""
    model_flops: float = 0.0
    """This rank's share of the step's FLOPs by the model's own formula (flops_per_token, which MFU uses)."""
    collectives: dict[tuple[str, str], Collective] = field(default_factory=dict)
    peak_bytes: int = 0
    """The most the step's tensors held at once (scripts/preflight/memory.py), with the optimizer state a later
    step holds throughout."""
    pipeline_bubble: float = 0.0
    """Of the compute, what this rank's pipeline idles beside it: (pp - 1) / (stages a rank x micro-batches),
    interleaved 1F1B's bubble (zero-bubble schedules fill part of it: not modelled)."""
    seconds: float = 0.0
    note: str | None = None
    """What was assumed (a vocabulary where the tokenizer file is missing)."""


def _on_local_shards(formula) -> Callable:
    """`formula` (one of torch's registry: it takes the tensors and reads their shapes) applied to what this rank
    computes: a DTensor operation's local shards. The counter sees a DTensor's matmul once, with the DTensor's
    global shapes; DTensor then computes it on the local shards, which the counter does not see."""

    def count(*args, **kwargs) -> int:
        args, kwargs = tree_map_only(DTensor, DTensor.to_local, (args, kwargs))
        return formula(*args, **kwargs)

    return count


# The step runs the CPU's attention kernels, which torch's FLOP counter does not know: counted as the GPU ones are
# (every query against every key, the convention of the models' flops_per_token too).
aten = torch.ops.aten
LOCAL_FLOPS = {op: _on_local_shards(formula) for op, formula in flop_registry.items()} | {
    aten._scaled_dot_product_flash_attention_for_cpu: _on_local_shards(
        flop_registry[aten._scaled_dot_product_flash_attention]),
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _on_local_shards(
        flop_registry[aten._scaled_dot_product_flash_attention_backward]),
}
"""The formulas of the step's counter: torch's on each rank's local shards, CPU attention counted as GPU's."""


class StepFlops(TorchDispatchMode):
    """The FLOPs of each operator called while entered, by LOCAL_FLOPS (torch's formulas), on the tensors it is
    called with: above DTensor, an operation on DTensors once (on its local shards). torch's FlopCounterMode counts
    alike but first offers every operator without a formula its decomposition, entering the mode again each time (a
    sixth of a pipelined 405B rank's preflight), and attributes FLOPs to modules by backward hooks, which torch
    refuses inside autograd.grad, as the zero-bubble pipeline schedules take the input gradients."""

    supports_higher_order_operators = True

    def __init__(self):
        super().__init__()
        self.counts: dict[object, int] = defaultdict(int)
        """FLOPs by operator (its overload packet, as LOCAL_FLOPS and torch's registry key them)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if isinstance(func, torch._ops.HigherOrderOperator):
            return NotImplemented  # as torch's counter does, but for its `cond`
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if (formula := LOCAL_FLOPS.get(func._overloadpacket)) is not None:
            self.counts[func._overloadpacket] += formula(*args, **kwargs, out_val=out)
        return out


def float8_flops(model: torch.nn.Module, counts: dict[object, int], config: Config) -> int:
    """Of the step's counted matmul FLOPs, those of the linear layers that compute in float8 on a GPU with float8
    matmuls (emulated here, every eligible layer converts; on such a GPU `float8.skip_small_layers` keeps those
    too small to pay in bf16): the linear layers' share by their weights' sizes, as every linear layer of a dense
    model multiplies the same tokens. (The counter's own attribution to modules counts the backward of sibling
    layers that share an input, w1 and w3, wk and wv, under both.) Zero for a mixture-of-experts model, whose
    experts' matmuls are no linear layers' (a prediction then takes every matmul at bf16's speed)."""
    if not config.float8.enable or has_moe_layer(model):
        return 0
    from torchao.float8.float8_linear import Float8Linear

    def in_float8(m: torch.nn.Module) -> bool:
        return isinstance(m, Float8Linear) and (not config.float8.skip_small_layers or pays_in_float8(
            m.out_features, m.in_features, config.float8.recipe_name))

    sizes = [(m.in_features * m.out_features, in_float8(m)) for m in model.modules() if isinstance(m, torch.nn.Linear)]
    matmuls = counts[aten.mm] + counts[aten.addmm]
    return round(matmuls * sum(size for size, f8 in sizes if f8) / sum(size for size, _ in sizes))


def _bytes(tensors) -> int:
    return sum(local(t).numel() * local(t).element_size() for t in tensors)


def default_ranks(dims: ParallelDims) -> list[int]:
    """Rank 0 and the last rank: the ranks of the first and the last pipeline stage (rank 0 holds both under a V
    schedule); without pipeline stages every rank holds the same shapes, but the last is at the far end of each
    mesh dimension."""
    return sorted({0, dims.world_size - 1})


def run_ranks(config: Config, world_size: int, ranks: list[int]) -> Iterator[RankReport]:
    """preflight_rank of each rank, in order, each in a process of its own (torch keeps process groups and meshes
    in globals that one process cannot reset), as many at once as there are cores. The processes are forked from a
    server that imported torch and the trainer once: a fresh interpreter a rank would spend 2 to 3 s of CPU
    importing them again (autotune --predict runs a preflight per candidate layout)."""
    workers = min(len(ranks), os.cpu_count() or 1)
    forked = multiprocessing.get_context("forkserver")
    forked.set_forkserver_preload(["torch", "torch.distributed.tensor", "torch._dynamo", "train"])
    with ProcessPoolExecutor(workers, mp_context=forked, max_tasks_per_child=1) as pool:
        for report in [pool.submit(preflight_rank, config, world_size, rank) for rank in ranks]:
            yield report.result()


def run_rank(config: Config, world_size: int, rank: int) -> RankReport:
    return next(run_ranks(config, world_size, [rank]))


def preflight_rank(config: Config, world_size: int, rank: int) -> RankReport:
    """Build and step `rank` of `world_size` as train.py would, over the fake process group on fake tensors; a
    layout that does not compose raises the ConfigError train.py raises."""
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        return step_report(config, fake=True)
    finally:
        dist.destroy_process_group()


def step_report(config: Config, fake: bool) -> RankReport:
    """This process's rank of the initialized process group, built as train.py builds it and stepped once: on fake
    tensors (`fake`), or on real ones, which is how tests/test_preflight.py checks the fake step against a real
    run over gloo."""
    import train  # its start-up functions, called as it calls them

    start = time.perf_counter()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    parallelism = dataclasses.replace(config.parallelism, enable_async_tensor_parallel=False)
    config = dataclasses.replace(config, compile=dataclasses.replace(config.compile, enable=False),
                                 parallelism=parallelism)
    device = torch.device("cpu")
    dims = ParallelDims.from_config(config.parallelism, world_size)
    check_supported(config, dims, device)
    mesh = dims.build_mesh(device.type)
    plan = batch_plan(config.training, dims.dp)
    vocab, report_note = vocab_size(config)  # the estimator's rule: Llama 3's where the tokenizer file is missing
    package = import_model_package(config.model.name)
    model_args = package.build_model_args(config, vocab)
    with torch.device("meta"):
        whole = package.Transformer(model_args)
    check_model_supported(config, dims, whole)
    if config.training.document_masking and dims.cp > 1:  # CP shares a sequence by where its documents end
        raise ConfigError("not available yet in preflight: training.document_masking with context parallelism; "
                          "python -m scripts.memory_estimate estimates its memory")
    parts, stage_ids, num_stages = [whole], [0], 1
    if dims.pp > 1:
        parts, stage_ids, num_stages = family_split(package)(whole, mesh["pp"], config)
    parts = [package.parallelize(part, dims, mesh, config, device) for part in parts]
    first = first_stage(parts, stage_ids, whole, package, dims, mesh, config, device) if dims.pp > 1 else None
    model_parts = nn.ModuleList(parts)
    built = [*parts, *([first] if first is not None and first not in parts else [])]
    if fake and balance_routing(nn.ModuleList(built), dims.ep_mesh.get_group() if dims.ep > 1 else None):
        report_note = "; ".join(filter(None, [report_note, "routing assumed balanced: each expert an equal share"]))
    if fake and dims.cp == 1:  # attention that keeps what CUDA's kernels keep (the CPU's keep learned sinks' scores)
        for part in built:
            for _, layer in attention_layers(part):
                layer.sdpa = as_cuda_attends(layer.sdpa)
    coordinates = {name: mesh[name].get_local_rank() for name in mesh.mesh_dim_names if mesh[name].size() > 1}
    report = RankReport(rank, coordinates, model_flops=model_args.flops_per_token(
        config.training.seq_len) * plan.tokens_per_step / world_size, note=report_note)
    moe_meshes = [dims.moe_fsdp_mesh, dims.expert_fsdp_mesh, *([dims.ep_mesh] if dims.ep > 1 else [])]
    recorder = CollectiveRecorder([mesh, dims.dp_mesh, dims.loss_mesh, dims.fsdp_mesh,
                                   *(moe_meshes if has_moe_layer(whole) else [])])
    share = partial(shard_sequence, cp_mesh=mesh["cp"]) if dims.cp > 1 else None  # as train.py shares a sequence
    with FakeTensorMode(allow_non_fake_inputs=True) if fake else nullcontext():
        for part in built:
            part.to_empty(device=device)
            if not fake:
                part.init_weights()
            part.train()
        shape = (config.training.local_batch_size, config.training.seq_len + 1)
        # Under document masking any id may end a document: the token ids are random, and the masks' shapes are
        # the sequence's whatever its documents.
        eos_id = vocab - 1 if config.training.document_masking else None
        batches = (prepare_batch(torch.randint(0, vocab, shape), device, eos_id, share)
                   for _ in iter(int, 1))
        # A rank alone cannot learn its pipeline stages' shapes from its neighbours: they are given
        # (scripts/preflight/pipeline.py), in the tests' real run over gloo too, which then steps as preflight does.
        make_stage = None
        if first is not None:
            micro_batch = next(batches)[0][:config.parallelism.pipeline_parallel_microbatch_size].contiguous()
            make_stage = stage_maker(first, micro_batch)
        model = train.model_on_rank(parts, stage_ids, num_stages, dims, mesh, config, device, plan.grad_accum_steps,
                                    make_stage)
        optimizers = Optimizers(parts, config.optimizer)
        # A step after the first: with float8's scales precomputed after every optimizer step, as train.py's
        # loop does, the casts for FSDP's float8 all-gathers need no all-reduce of their own (the first step's do).
        precompute = config.float8.enable and config.float8.precompute_float8_dynamic_scale_for_fsdp
        scales = Float8ScalePrecompute(parts)
        if precompute:
            scales.after_step(0, None, log=False)
        # The counter above the memory's mode: it counts a DTensor operation's FLOPs on its local shards, then the
        # memory's mode and the recorder see the local operations DTensor runs (and the collectives it issues).
        memory = PeakMemory([*model_parts.parameters(), *model_parts.buffers()])
        with recorder:
            with memory, StepFlops() as flops:
                train.train_step(model, batches, plan.grad_accum_steps, config.training.max_norm, optimizers,
                                 NoReplicas())
            backward_peak, memory.peak = memory.peak, memory.live
            with memory:  # no matmuls: nothing for the counter
                optimizers.step()
                if precompute:
                    scales.after_step(1, None, log=False)
        report.flops = sum(flops.counts.values())
        report.float8_flops = float8_flops(model_parts, flops.counts, config)
        if model.pipeline is not None:
            report.pipeline_bubble = (dims.pp - 1) / (len(parts) * model.pipeline.n_microbatches)
        params = list(model_parts.parameters())
        report.params = sum(local(p).numel() for p in params)
        report.param_bytes = _bytes(params)
        in_blocks = {id(p) for part in parts for p in part.transformer_blocks().parameters()}
        report.root_param_bytes = _bytes(p for p in params if id(p) not in in_blocks)
        report.optimizer_bytes = sum(_bytes(t for t in state.values() if isinstance(t, torch.Tensor))
                                     for opt in optimizers.optimizers for state in opt.state.values())
        # A later step holds the optimizer state from its start; this one creates it in its optimizer step.
        report.peak_bytes = max(backward_peak + report.optimizer_bytes, memory.peak)
    report.collectives = dict(recorder.calls)
    report.seconds = time.perf_counter() - start
    return report
