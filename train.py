"""ingot's trainer, top to bottom: config -> DeviceMesh -> model on meta -> parallelize -> init or
load -> train loop. Launch it with ./run_train.sh (torchrun); `python train.py --job.config_file ...`
also works for a single process.

What runs inside the loop besides the step itself reaches it as small objects: features that add figures to
a step's record (components/training/loop_features.py), validation and evaluation
(components/evaluation/in_loop.py), the checkpointer, the profiler and the stop on a signal
(components/run/stopping.py).
"""

from __future__ import annotations

import gc
import logging
import os
import random
import sys
import warnings
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

from components.checkpoint.dcp import CheckpointManager, TrainState
from components.checkpoint.resume import check_resume, run_record
from components.config import Config, ConfigError, dump_config, load_config, to_toml
from components.data.batch_plan import batch_plan
from components.data.fingerprint import DataHash
from components.data.loaders import build_dataloader
from components.data.tokenizer import build_tokenizer
from components.distributed.fault_tolerance import (
    NoReplicas,
    ReplicaGroups,
    data_share,
    outer_step,
    replica_folder,
    replica_groups,
)
from components.distributed.mesh import (
    ParallelDims,
    init_distributed,
    on_rank0_for_all,
    set_collective_timeout,
)
from components.evaluation.in_loop import Evaluations
from components.hf.export import check_hf_form, export
from components.hf.load import load_hf_weights
from components.metrics import wandb_logging
from components.metrics.param_norm import ParamNorm
from components.metrics.per_layer import LayerMetrics
from components.metrics.profiling import Profiler
from components.metrics.reporting import MetricsLogger, peak_memory_gib, slow_step_warning
from components.metrics.stragglers import StepTimes
from components.model.contract import multi_token_depths
from components.model.layout_checks import check_model_supported, check_supported, check_token_mixing
from components.run.exit_codes import EXIT_BAD_INPUT, exit_process
from components.run.heartbeat import OPTIMIZING, STEPPED, Heartbeat, is_lost_peer, is_timeout
from components.run.launch import report_failure, run_worker
from components.run.lock import die_with_launcher, failed_before_first_step, lock_dump_folder, release_dump_folders
from components.run.stopping import Preemption, StopSignals, exit_status
from components.torch_private import seed_dtensor_random
from components.training.garbage_collection import GarbageCollection
from components.training.loop_features import SourceTokens, loss_figures
from components.training.loss import MultiTokenLoss, ZLoss, cross_entropy_loss
from components.training.model_on_rank import ModelOnRank, forward_backward, local, over_ranks, prepare_batch
from components.training.optimizers import LRSchedule, Optimizers, clip_grad_norm
from components.training.qk_clip import attention_logits
from components.training.routing import RoutingTally
from components.training.step_guard import StepGuard
from models.families import import_model_package, model_config_class
from parallelisms.context_parallel import shard_sequence, whole_sequence_logits
from parallelisms.float8 import Float8ScalePrecompute
from parallelisms.fsdp import initialize_on_device
from parallelisms.pipeline import build_pipeline, family_split

logger = logging.getLogger("ingot")
warnings.filterwarnings("ignore", message="'set_vital' is deprecated")  # torchdata, harmless


def setup_logging(rank: int, replica_group: int | None) -> None:
    """Rank 0 speaks; the other ranks report only warnings and errors. A replica group's lines name it."""
    level = logging.INFO if rank == 0 else logging.WARNING
    who = f"g{replica_group} rank{rank}" if replica_group is not None else f"rank{rank}"
    logging.basicConfig(level=level, format=f"[{who}] %(asctime)s %(message)s", datefmt="%H:%M:%S", force=True)
    logging.getLogger("torchao").setLevel(logging.ERROR)  # it warns about GPU kernels it could not load


def train(config: Config, signals: StopSignals) -> int:
    """Train as configured; return the exit status (0, or EXIT_PREEMPTED after a stop signal)."""
    # --- Processes, the device mesh, the batch plan and the run's folder ---------------------
    device = init_distributed(config.comm, Path(config.job.dump_folder))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    setup_logging(rank, config.fault_tolerance.replica_id if config.fault_tolerance.enable else None)
    dims = ParallelDims.from_config(config.parallelism, world_size)
    check_supported(config, dims, device)
    mesh = dims.build_mesh(device.type)
    training, dump_folder = config.training, Path(config.job.dump_folder)
    data_rank, data_degree = data_share(config.fault_tolerance, dims)  # replica groups read shares of one batch
    plan = batch_plan(training, data_degree)
    seed_and_determinism(training)
    # One job per dump folder: a second one stops here, before it writes anything (components/run/lock.py).
    on_rank0_for_all(lock_dump_folder, dump_folder)

    # --- Tokenizer and model, built on the meta device (no memory) ---------------------------
    tokenizer = build_tokenizer(config.model.tokenizer_path)
    model_package = import_model_package(config.model.name)
    model_args = model_package.build_model_args(config, tokenizer.vocab_size)
    if config.checkpoint.last_save_in_hf:  # a model without a Hugging Face form fails now, not after training
        on_rank0_for_all(check_hf_form, model_package, model_args)
    with torch.device("meta"):
        whole_model = model_package.Transformer(model_args)
    check_model_supported(config, dims, whole_model)
    on_rank0_for_all(check_token_mixing, config, dims, whole_model)  # one block of each kind, run on the CPU
    n_params = sum(p.numel() for p in whole_model.parameters())
    matmul_dtype = "float8" if config.float8.enable else training.mixed_precision_param

    # --- Whether this config may resume the folder's checkpoint; the first step's cost --------
    record = run_record(config, plan.global_batch, world_size, dims.describe())
    if not config.checkpoint.create_seed_checkpoint:
        on_rank0_for_all(check_resume, config, dump_folder, get_model_state_dict(whole_model), record)
    rank_flops = model_args.flops_per_token(training.seq_len) * plan.tokens_per_step / world_size  # of one step
    if (slow := slow_step_warning(rank_flops, device, config.metrics.peak_flops, matmul_dtype)) and rank == 0:
        logger.warning(slow)

    # --- Split into pipeline stages, parallelize, then initialize -----------------------------
    model_parts, stage_ids, num_stages = place_model(whole_model, model_package, dims, mesh, config, device)
    model = model_on_rank(model_parts, stage_ids, num_stages, dims, mesh, config, device, plan.grad_accum_steps)
    params_on_rank = sum(local(p).numel() for part in model_parts for p in part.parameters())
    logger.info(
        f"mesh: {dims.describe()} | model {config.model.name} {config.model.flavor}: {n_params / 1e6:.2f}M "
        f"parameters, {params_on_rank / 1e6:.2f}M on this rank | global batch {plan.global_batch} x "
        f"{training.seq_len} tokens, gradient accumulation {plan.grad_accum_steps}")

    # --- Optimizer, schedule, data, evaluation and checkpoints -------------------------------
    optimizers = Optimizers(model_parts, config.optimizer)
    lr_schedule = LRSchedule(optimizers, training.steps, config.lr_scheduler, config.optimizer.lr)
    dataloader = build_dataloader(config, tokenizer, data_rank, data_degree)
    eos_id = tokenizer.eos_id if training.document_masking else None
    share = partial(shard_sequence, cp_mesh=mesh["cp"]) if dims.cp > 1 else None  # this rank's share of a sequence
    evaluations = Evaluations(config, tokenizer, model, dims, plan, device, eos_id, share)
    train_state, step_guard = TrainState(), StepGuard(training, device)
    logger.info(step_guard.describe())
    checkpointer = CheckpointManager(
        config.checkpoint, dump_folder, model_parts, optimizers, lr_schedule, dataloader, train_state, step_guard,
        training.steps, device, run_record=record, outer_step=outer_step(config.fault_tolerance, model_parts),
        load_hf=partial(load_hf_weights, model_parts=model_parts, package=model_package, args=model_args))
    if config.checkpoint.create_seed_checkpoint:  # one process (components/model/layout_checks.py)
        logger.info(f"config written to {dump_config(config, dump_folder, 0)}")
        logger.info(f"seed checkpoint written to {checkpointer.save_seed()}")
        return 0
    start_step = train_state.step = checkpointer.load()
    preemption = Preemption(signals, checkpointer, dump_folder, config.comm.train_timeout_seconds)
    preemption.before_first_step()  # a stop signal during start-up ends the run here, nothing trained or written
    if start_step >= training.steps:
        logger.info(f"nothing trained: the checkpoint in {dump_folder} is at step {start_step} = training.steps; raise "
                    "--training.steps to train on, or give a new run its own --job.dump_folder")
        return 0
    metrics = MetricsLogger(dump_folder, config.metrics, device, model_args.flops_per_token(training.seq_len),
                            world_size, rank == 0, to_toml(config), matmul_dtype=matmul_dtype,
                            resume_step=None if config.fault_tolerance.enable else start_step)  # groups: at a quorum
    if rank == 0:  # only now: a launch refused at start-up (W&B's included) leaves the folder as it was
        logger.info(f"config written to {dump_config(config, dump_folder, start_step)}")
    replicas = replica_groups(config, checkpointer.states, start_step, metrics, dump_folder, device)
    layer_metrics = LayerMetrics(model_parts, model_args.n_layers, model.pp_group) if config.metrics.per_layer else None
    # What each step adds to its record (components/training/loop_features.py), in this order.
    micro_batches = plan.grad_accum_steps * (model.pipeline.n_microbatches if model.pipeline else 1)
    step_features = [RoutingTally(model_parts, model_args.n_layers, micro_batches, metrics, device), replicas]
    step_features += loss_figures(model)
    dp_group = dims.dp_mesh.get_group() if dims.dp > 1 else None
    step_features += [SourceTokens(dataloader, dp_group, device), ParamNorm(optimizers, model.pp_group)]
    step_features.append(data_hash := DataHash(dataloader, dp_group, device))
    step_features += [collector := GarbageCollection(training.gc_every_steps),
                      step_times := StepTimes(config.metrics.straggler_factor, model.pp_group, device)]
    if config.float8.enable and config.float8.precompute_float8_dynamic_scale_for_fsdp:
        step_features.append(Float8ScalePrecompute(model_parts))
    step_features += attention_logits(config, model, whole_model, model_args.n_heads, mesh, device)  # QK-clip
    set_collective_timeout(config.comm.train_timeout_seconds, mesh)
    heartbeat = Heartbeat(config.comm.train_timeout_seconds)  # where this rank is: a hang names who stopped
    batches = heartbeat.reading(prepare_batch(b, device, eos_id, share) for b in step_times.reading(data_hash))

    # --- The training loop -------------------------------------------------------------------
    logger.info(f"training steps {start_step + 1} to {training.steps}")
    try:
        with Profiler(config.profiling, dump_folder, rank, device, start_step, training.steps) as profiler:
            while train_state.step < training.steps:
                replicas.start_step()  # a replica group that (re)joins takes a live group's state here, step included
                step = train_state.step + 1
                heartbeat.start(step)
                log_this_step = metrics.should_log(step)
                # A pipeline's first step also runs forwards on placeholders (shapes): no per-layer statistics.
                first_pipeline_step = model.pipeline is not None and step == start_step + 1
                record_layers = layer_metrics if log_this_step and not first_pipeline_step else None
                lr = lr_schedule.lr
                loss, grad_norm, layers = train_step(model, batches, plan.grad_accum_steps, training.max_norm,
                                                     optimizers, replicas, record_layers)
                heartbeat.beat(step, OPTIMIZING)
                if not replicas.should_commit(step):
                    continue
                skip = step_guard.decide(step, loss, grad_norm)
                optimizers.step(skip=skip)
                heartbeat.beat(step, STEPPED)
                lr_schedule.step()
                train_state.step = step
                metrics.count_tokens(plan.tokens_per_step)
                figures = {}
                for feature in step_features:
                    figures |= feature.after_step(step, skip, log_this_step)
                stop_now = preemption.agreed()
                # The guard's counters are read (a sync) only where the loop syncs anyway, before any save.
                if log_this_step or checkpointer.due(step) or stop_now or step == training.steps:
                    skipped = step_guard.check()
                    if log_this_step:
                        metrics.log(step, loss.item(), grad_norm.item(), lr, skipped | figures)
                metrics.log_layers(step, layers)
                evaluations.after_step(step, metrics)
                if step == start_step + 1:
                    logger.info(f"peak memory after the first step: {peak_memory_gib(device):.2f} GiB on this rank")
                checkpointer.maybe_save(step)
                profiler.step(step)
                if stop_now and step < training.steps:
                    return preemption.stop(step)
    except RuntimeError as e:  # torch's DistBackendError too: a collective timed out or lost a peer: name who stopped
        if is_timeout(e) or is_lost_peer(e):
            raise heartbeat.stopped(e) from e
        raise
    finally:
        # A save is waited for.
        for part in (checkpointer, dataloader, metrics, collector, replicas, heartbeat):
            part.close()
        if sys.exc_info()[1] is not None and train_state.step == start_step:  # e.g. the first read met a bad line:
            failed_before_first_step(dump_folder)  # a folder this launch made goes again
    if config.checkpoint.last_save_in_hf and rank == 0:  # the others need not wait: DCP reads it from disk
        last = f"step-{training.steps}"
        export(config, model_package, checkpointer.folder / last, dump_folder / "hf" / last,
               config.checkpoint.export_dtype)
    logger.info(f"training done: {training.steps} steps; outputs in {dump_folder}")
    return 0


def seed_and_determinism(training) -> None:
    """Seed torch's and Python's RNGs (checkpoints carry both states: every launch must start from the same ones) and
    turn on deterministic algorithms where training.deterministic asks for them."""
    torch.manual_seed(training.seed)
    random.seed(training.seed)
    if training.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # what deterministic cuBLAS requires
        torch.use_deterministic_algorithms(True)


def place_model(whole_model: nn.Module, model_package, dims: ParallelDims, mesh: DeviceMesh, config: Config,
                device: torch.device) -> tuple[list[nn.Module], list[int], int]:
    """This rank's share of the model, parallelized and initialized: (parts, their pipeline stage ids, the
    number of stages); without pipeline parallelism one part, the whole model.

    DTensor draws random numbers layout-independently only on CUDA-like devices. Elsewhere the full model is
    initialized before it is split and sharded, so that every layout starts from the same weights."""
    init_before_sharding = device.type == "cpu"
    if init_before_sharding:
        whole_model.to_empty(device=device)
        whole_model.init_weights()
    model_parts, stage_ids, num_stages = [whole_model], [0], 1
    if dims.pp > 1:
        model_parts, stage_ids, num_stages = family_split(model_package)(whole_model, mesh["pp"], config)
    model_parts = [model_package.parallelize(part, dims, mesh, config, device) for part in model_parts]
    if not init_before_sharding and dims.pp > 1:
        seed_dtensor_random(config.training.seed + mesh["pp"].get_local_rank(), mesh)  # each stage its own draws
    for part in model_parts:
        if not init_before_sharding:
            initialize_on_device(part, device, config.parallelism.fsdp_cpu_offload)
        part.train()
    return model_parts, stage_ids, num_stages


def model_on_rank(model_parts: list[nn.Module], stage_ids: list[int], num_stages: int, dims: ParallelDims,
                  mesh: DeviceMesh, config: Config, device: torch.device, grad_accum_steps: int,
                  make_stage: Callable | None = None) -> ModelOnRank:
    """The parts with their loss (with z-loss: a ZLoss; with multi-token prediction: a MultiTokenLoss) and, under
    pipeline parallelism, the pipeline (its stages made by `make_stage`, as build_pipeline says)."""
    # Read from this module's globals at this point, so that a test can swap the loss (test_reliability.py).
    compile_loss = config.compile.enable and dims.tp == 1
    loss_fn = torch.compile(cross_entropy_loss) if compile_loss else cross_entropy_loss
    if config.training.z_loss:
        loss_fn = ZLoss(config.training.z_loss, device, compile_loss)
    if multi_token_depths(model_parts[0]):  # never under pipeline parallelism (components/model/layout_checks.py)
        loss_fn = MultiTokenLoss(loss_fn, device)
    pipeline = None
    if dims.pp > 1:
        pipeline = build_pipeline(model_parts, stage_ids, num_stages, mesh["pp"], config, device, loss_fn,
                                  grad_accum_steps, make_stage)
    return ModelOnRank(
        model_parts, pipeline, loss_fn, loss_parallel=dims.tp > 1,
        pp_group=mesh["pp"].get_group() if dims.pp > 1 else None,
        loss_group=dims.loss_mesh.get_group() if dims.dp * dims.cp > 1 else None,
        cp_largest_logits=whole_sequence_logits(mesh["cp"]) if dims.cp > 1 else None,
    )


def train_step(
    model: ModelOnRank, batches: Iterator, grad_accum_steps: int, max_norm: float, optimizers: Optimizers,
    replicas: ReplicaGroups | NoReplicas, layer_metrics: LayerMetrics | None = None,
) -> tuple[torch.Tensor, torch.Tensor, dict | None]:
    """Forward and backward of grad_accum_steps micro-batches, the gradients averaged over the replica groups,
    then clipped to max_norm. Returns the step's mean loss over all ranks, the gradient norm before clipping and, with
    layer_metrics, the per-layer statistics. The optimizer step is left to the caller, whose step
    guard decides whether to take it."""
    optimizers.zero_grad()
    if layer_metrics is not None:
        layer_metrics.start()
    loss_sum = 0
    for micro_step in range(grad_accum_steps):
        for part in model.parts:  # reduce gradients across ranks on the last micro-batch only
            if isinstance(part, FSDPModule):
                part.set_requires_gradient_sync(micro_step == grad_accum_steps - 1)
        loss_sum = loss_sum + forward_backward(model, *next(batches), grad_accum_steps, train=True)
    loss = over_ranks(model, loss_sum)
    replicas.average_step(model.parts, loss)
    layers = layer_metrics.collect(loss_sum.device) if layer_metrics is not None else None  # before clipping
    # With FSDP's CPU offload the gradients and so their norm are in host memory.
    grad_norm = clip_grad_norm(optimizers, max_norm, model.pp_group).to(loss_sum.device)
    return loss, grad_norm, layers


def main(argv: list[str] | None = None) -> int:
    die_with_launcher()
    try:
        config = load_config(sys.argv[1:] if argv is None else argv, model_config_class)
        config.job.dump_folder = replica_folder(config.job.dump_folder, config.fault_tolerance)
        wandb_logging.check_installed(config.metrics)  # before anything is written
    except ConfigError as e:
        report_failure(f"config error: {e}")
        return EXIT_BAD_INPUT
    with StopSignals() as signals:
        try:
            return exit_status(partial(train, config, signals), report_failure)
        finally:
            release_dump_folders()
            if dist.is_initialized():
                dist.destroy_process_group()
            # Free the run's process groups now, in the process whose gloo threads their destructors join: left to
            # a later collection, a caller that goes on and forks (a DataLoader's workers) can free them in the
            # child, where those threads do not exist, and the child waits forever.
            gc.collect()


if __name__ == "__main__":
    exit_process(run_worker(main))
