"""The estimate of a config: its layout, the pipeline stages of the ranks to estimate, one simulation
per kind of stage, and the breakdown of the most loaded rank."""

from __future__ import annotations

import importlib.util
import math
import sys
import time
from pathlib import Path

import torch
from torch import nn

from components.config import DTYPES, REPO_ROOT, Config, ConfigError
from components.data.batch_plan import batch_plan
from components.data.loaders import validation_sources
from components.data.sources import reader_libraries
from components.distributed.mesh import ParallelDims
from components.metrics.reporting import peak_rss_bytes
from components.model.contract import blocks_name, check_model_contract
from components.model.layout_checks import uses_fsdp
from components.model.moe_layer import moe_layers
from models.families import import_model_package
from parallelisms.pipeline import family_split, is_multi_stage
from scripts.memory_estimate.breakdown import (
    Layout,
    MemoryEstimate,
    RankStages,
    Stage,
    count_params,
    micro_batches_in_flight,
    rank_breakdown,
    tp_shard_dims,
)
from scripts.memory_estimate.simulation import Simulation, simulate_micro_batch

LLAMA3_VOCAB = 128256  # used when the config's tokenizer file is not on this machine


def default_target(config: Config) -> str:
    """cuda when this machine has it or the config computes in a half-precision dtype, else cpu."""
    if torch.cuda.is_available() or config.training.mixed_precision_param != "float32":
        return "cuda"
    return "cpu"


def vocab_size(config: Config) -> tuple[int, str | None]:
    """The tokenizer's vocabulary, or Llama 3's when the tokenizer file is not on this machine."""
    if getattr(config.model, "vocab_size", None) is not None:  # a [model] key of the family, if it has one
        return config.model.vocab_size, None
    from components.data.tokenizer import build_tokenizer

    if not Path(config.model.tokenizer_path).exists():
        return LLAMA3_VOCAB, (f"tokenizer {config.model.tokenizer_path} not found: vocabulary of {LLAMA3_VOCAB} "
                              "(Llama 3's) assumed")
    return build_tokenizer(config.model.tokenizer_path).vocab_size, None


def cpu_baseline_bytes(config: Config) -> int:
    """Peak resident memory of this process after importing what the trainer imports for this config:
    train.py itself, the model package, and the data and logging libraries the config uses (Hugging Face datasets
    and pyarrow only for the sources that need them: with them 0.1 GiB more)."""
    if "train" not in sys.modules:
        # train.py is not an installed module: loaded from its file, since the repository is not on
        # sys.path under the console script.
        spec = importlib.util.spec_from_file_location("train", REPO_ROOT / "train.py")
        trainer = importlib.util.module_from_spec(spec)
        sys.modules["train"] = trainer
        spec.loader.exec_module(trainer)
    import_model_package(config.model.name)
    sources = {"training.dataset_path": config.training.dataset_path if config.training.dataset == "hf" else [],
               "validation.dataset_path": (validation_sources(config.validation.dataset_path).values()
                                           if config.validation.enable else [])}
    for module in {module for setting, entries in sources.items() for entry in entries
                   for module in reader_libraries(entry, setting)}:
        importlib.import_module(module)
    if config.metrics.enable_tensorboard:
        importlib.import_module("torch.utils.tensorboard")
    return peak_rss_bytes()


def moe_parameters(model: nn.Module) -> dict[str, bool]:
    """The parameters of the model's mixture-of-experts layers: True for the experts', False for the
    routers' and shared experts'."""
    return {f"{name}.{param}": param.startswith("experts.") for name, layer in moe_layers(model)
            for param, _ in layer.named_parameters()}


class PipelinePlace:
    """Stands in for the pipeline mesh of rank `rank` of `size`: `split_for_pipeline` (parallelisms/pipeline.py,
    or the family's own) asks it only these two, and the estimate runs without a process group."""

    def __init__(self, size: int, rank: int):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def get_local_rank(self) -> int:
        return self._rank


def stages_of_ranks(model_package, model: nn.Module, config: Config, pp: int) -> dict[int, list[nn.Module]]:
    """The pipeline stages (`model` split as train.py splits it) of the ranks worth estimating:
    the first and the last pipeline rank; without PP the one rank holds the whole model."""
    if pp == 1:
        return {0: [model]}
    return {rank: family_split(model_package)(model, PipelinePlace(pp, rank), config)[0]
            for rank in sorted({0, pp - 1})}


def estimate(config: Config, world_size: int | None = None, target: str | None = None,
             baseline_bytes: int | None = None) -> MemoryEstimate:
    """The peak memory of the most loaded rank for `config` on `world_size` processes (default: the
    product of the parallelism degrees, dp_shard = -1 counting as 1). `target`: cpu or cuda
    (default: `default_target`); on cpu `baseline_bytes` defaults to `cpu_baseline_bytes`."""
    start = time.perf_counter()
    target = target or default_target(config)
    if target not in ("cpu", "cuda"):
        raise ConfigError(f"target must be cpu or cuda, got {target!r}")
    remarks: list[str] = []
    if target == "cpu" and baseline_bytes is None:
        baseline_bytes = cpu_baseline_bytes(config)
    p, training = config.parallelism, config.training
    if world_size is None:
        others = (p.data_parallel_replicate_degree * p.context_parallel_degree * p.tensor_parallel_degree
                  * p.pipeline_parallel_degree)
        world_size = others * max(p.data_parallel_shard_degree, 1)
    dims = ParallelDims.from_config(p, world_size)
    model_package = import_model_package(config.model.name)
    vocab, note = vocab_size(config)
    if note:
        remarks.append(note)
    args = model_package.build_model_args(config, vocab)
    if training.seq_len % dims.cp or (dims.cp > 1 and training.seq_len % (2 * dims.cp)):
        raise ConfigError(f"training.seq_len {training.seq_len} must be divisible by 2 x cp ({2 * dims.cp})")
    grad_accum_steps = batch_plan(training, dims.dp).grad_accum_steps
    fsdp = uses_fsdp(config, dims)
    compute = DTYPES[training.mixed_precision_param] if fsdp else torch.float32
    fsdp_degree = dims.dp_shard * dims.cp if fsdp else 1

    # Parameters of the whole model on meta (names, shapes, TP split), and the stages of the ranks.
    with torch.device("meta"):
        meta_model = model_package.Transformer(args)
    check_model_contract(meta_model, config.model.name)
    shapes = {n: tuple(t.shape) for n, t in meta_model.named_parameters()}
    blocks = blocks_name(meta_model)
    by_block: dict[str, dict[str, tuple[int, ...]]] = {}
    for name, shape in shapes.items():
        if name.startswith(f"{blocks}."):
            by_block.setdefault(name.removeprefix(f"{blocks}.").split(".")[0], {})[name] = shape
    # The largest block stands for each one FSDP gathers (a mixture of experts, not DeepSeek-V3's dense first ones).
    block = max(by_block.values(), key=lambda one: sum(math.prod(s) for s in one.values()))
    tp_dims = tp_shard_dims(meta_model, model_package.tensor_parallel_plan(meta_model, False))
    moe = moe_parameters(meta_model)
    n_params = sum(math.prod(s) for s in shapes.values())
    stages = stages_of_ranks(model_package, meta_model, config, dims.pp)
    del meta_model

    schedule = p.pipeline_parallel_schedule if dims.pp > 1 else ""
    multi_stage = dims.pp > 1 and is_multi_stage(schedule)
    if dims.pp > 1:
        micro_batch = p.pipeline_parallel_microbatch_size
        if training.local_batch_size % micro_batch:
            raise ConfigError("training.local_batch_size must be a multiple of "
                              f"parallelism.pipeline_parallel_microbatch_size {micro_batch}")
        n_micro_batches = training.local_batch_size // micro_batch
    else:
        micro_batch, n_micro_batches = training.local_batch_size, 1
    layout = Layout(
        dims=dims, fsdp=fsdp, fsdp_degree=fsdp_degree, compute_dtype=compute,
        reduce_dtype=DTYPES[training.mixed_precision_reduce], micro_batch=micro_batch,
        local_seq=training.seq_len // dims.cp, grad_accum_steps=grad_accum_steps,
        pipeline_micro_batches=n_micro_batches, target=target, baseline=baseline_bytes or 0,
        cpu_offload=p.fsdp_cpu_offload,
    )

    ac_mode, ac_option = config.activation_checkpoint.mode, config.activation_checkpoint.selective_ac_option
    simulations: dict[tuple[tuple[int, ...], bool, bool], Simulation] = {}  # per (layer numbers, first, last)
    candidates = []
    for pp_rank, parts in stages.items():
        rank_shapes = {n: tuple(t.shape) for part in parts for n, t in part.named_parameters()}
        rank = RankStages(pp_rank, count_params(rank_shapes, block, tp_dims, dims, fsdp_degree, moe, blocks), [])
        for part in parts:
            kind = (tuple(int(name) for name in part.transformer_blocks()),
                    *(all(getattr(part, name) is not None for name in ends) for ends in part.pipeline_ends))
            if kind not in simulations:
                simulations[kind] = simulate_micro_batch(
                    model_package, args, batch=micro_batch, seq=layout.local_seq, dtype=compute, ac_mode=ac_mode,
                    ac_option=ac_option, n_blocks=len(kind[0]), first=kind[1], last=kind[2], cp=dims.cp,
                    cp_method=p.context_parallel_method, document_masking=training.document_masking,
                    target=target, layer_ids=kind[0], ep=dims.ep,
                )
            in_flight = (micro_batches_in_flight(schedule, multi_stage, n_micro_batches, dims.pp, pp_rank, len(parts))
                         if dims.pp > 1 else 1)
            rank.stages.append(Stage(simulations[kind], in_flight, len(kind[0])))
        candidates.append(rank_breakdown(config, args, layout, rank))
    result = max(candidates, key=lambda e: e.total)
    result.n_params = n_params
    where = f", pipeline rank {result.pp_rank} (the larger of the first and last)" if dims.pp > 1 else ""
    dtype_name = str(compute).removeprefix("torch.")
    ac = ac_mode if ac_mode != "selective" else f"selective ({ac_option})"
    fsdp_text = f"over {fsdp_degree} ranks" if fsdp else "off"
    measured = "peak resident memory" if target == "cpu" else "torch.cuda.max_memory_reserved"
    result.header = [
        f"Peak memory estimate per rank{where}: {config.model.name} {config.model.flavor}, "
        f"{n_params / 1e6:,.2f}M parameters, {result.params_on_rank / 1e6:,.2f}M on this rank",
        f"  layout: world size {world_size}: {dims.describe()}; FSDP {fsdp_text}; target {target} ({measured})",
        f"  step: micro-batch {micro_batch} x {layout.local_seq} tokens, compute {dtype_name}, "
        f"activation checkpointing {ac}, gradient accumulation {grad_accum_steps}"
        + (f", {n_micro_batches} pipeline micro-batches ({schedule})" if dims.pp > 1 else ""),
        f"  method: persistent state counted from shapes; activations and temporaries from a simulated "
        f"forward+backward on fake tensors ({sum(s.seconds for s in simulations.values()):.1f} s)",
    ]
    if config.compile.enable:
        remarks.append("compile.enable: the simulation is of eager mode; compiled blocks usually save less "
                       "(an upper bound)")
    if config.float8.enable:
        remarks.append("float8.enable: float8 casts are not simulated (matmul inputs counted in the compute dtype)")
    if multi_stage:
        remarks.append(f"{schedule}: the micro-batches in flight per stage are approximated from the schedule's "
                       "warm-up depth")
    if target == "cuda":
        remarks.append("CUDA: the CUDA context, NCCL and cuBLAS workspaces are not included (nor in "
                       "max_memory_reserved); allocator fragmentation typically adds a few percent")
    result.remarks = remarks + result.remarks
    result.seconds = time.perf_counter() - start
    return result
