"""ingot's trainer, top to bottom: config -> DeviceMesh -> model on meta -> parallelize -> init or
load -> train loop. Launch it with ./run_train.sh (torchrun); `python train.py --job.config_file ...`
also works for a single process.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from components import wandb_logging
from components.batch import batch_plan
from components.checkpoint import CheckpointManager, TrainState
from components.config import Config, ConfigError, dump_config, load_config, to_toml
from components.data.documents import document_ids
from components.data.loaders import build_dataloader, build_validation_dataloader, validation_sources
from components.distributed import ParallelDims, init_distributed, set_collective_timeout
from components.evaluation.scoring import evaluate_task, prepare_task
from components.evaluation.tasks import read_task
from components.hf import load_hf_weights
from components.hf_export import export
from components.launch import EXIT_BAD_INPUT, EXIT_STOPPED, report_failure, run_worker
from components.layer_metrics import LayerMetrics
from components.layout_checks import check_supported
from components.loss import ZLoss, cross_entropy_loss, sequence_loglikelihoods
from components.metrics import MetricsLogger, peak_memory_gib, slow_step_warning
from components.model_package import import_model_package
from components.optim import LRSchedule, Optimizers, clip_grad_norm
from components.preemption import EXIT_PREEMPTED, PREEMPTED_FILE, StopSignals, write_preempted_record
from components.profiling import Profiler
from components.resume import check_resume, run_record
from components.run_lock import FolderInUse, die_with_launcher, lock_dump_folder, release_dump_folders
from components.step_guard import StepGuard, TrainingStopped
from components.tokenizer import build_tokenizer
from models.moe import RoutingTally
from parallelisms.context_parallel import shard_sequence
from parallelisms.float8 import precompute_float8_scales
from parallelisms.fsdp import offload_parameters
from parallelisms.pipeline import Pipeline, build_pipeline

logger = logging.getLogger("ingot")
warnings.filterwarnings("ignore", message="'set_vital' is deprecated")  # torchdata, harmless


def setup_logging(rank: int) -> None:
    """Rank 0 speaks; the other ranks report only warnings and errors."""
    level = logging.INFO if rank == 0 else logging.WARNING
    logging.basicConfig(level=level, format=f"[rank{rank}] %(asctime)s %(message)s", datefmt="%H:%M:%S", force=True)
    logging.getLogger("torchao").setLevel(logging.ERROR)  # it warns about GPU kernels it could not load


def train(config: Config, signals: StopSignals) -> int:
    """Train as configured; return the exit status (0, or EXIT_PREEMPTED after a stop signal)."""
    # --- Processes, the device mesh, the batch plan and the run's folder ---------------------
    device = init_distributed(config.comm, Path(config.job.dump_folder))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    setup_logging(rank)
    dims = ParallelDims.from_config(config.parallelism, world_size)
    check_supported(config, dims, device)
    mesh = dims.build_mesh(device.type)
    dp_rank = dims.dp_mesh.get_local_rank()
    training = config.training
    plan = batch_plan(training, dims.dp)
    torch.manual_seed(training.seed)
    if training.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # what deterministic cuBLAS requires
        torch.use_deterministic_algorithms(True)
    dump_folder = Path(config.job.dump_folder)
    # One job per dump folder: a second one stops here, before it writes anything (components/run_lock.py).
    in_use = [None]
    if rank == 0:
        try:
            lock_dump_folder(dump_folder)
        except FolderInUse as e:
            in_use = [str(e)]
    dist.broadcast_object_list(in_use, src=0)
    if in_use[0]:
        raise FolderInUse(in_use[0])
    # Agreeing on stop signals without a device sync: a CPU group, with the training timeout.
    stop_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=config.comm.train_timeout_seconds))

    # --- Tokenizer and model, built on the meta device (no memory) ---------------------------
    tokenizer = build_tokenizer(config.model.tokenizer_path)
    model_package = import_model_package(config.model.name)
    model_args = model_package.build_model_args(config, tokenizer.vocab_size)
    if config.checkpoint.last_save_in_hf:  # a model without a Hugging Face form fails now, not after training
        model_package.hf_config(model_args)
    with torch.device("meta"):
        whole_model = model_package.Transformer(model_args)
    n_params = sum(p.numel() for p in whole_model.parameters())
    matmul_dtype = "float8" if config.float8.enable else training.mixed_precision_param

    # --- Whether this config may resume the folder's checkpoint; the first step's cost --------
    record = run_record(config, plan.global_batch, world_size, dims.describe())
    refused = [None]
    if rank == 0 and not config.checkpoint.create_seed_checkpoint:
        try:
            check_resume(config, dump_folder, get_model_state_dict(whole_model), record)
        except ConfigError as e:
            refused = [str(e)]
    dist.broadcast_object_list(refused, src=0)
    if refused[0]:
        raise ConfigError(refused[0])
    step_flops = model_args.flops_per_token(training.seq_len) * plan.tokens_per_step
    slow = slow_step_warning(step_flops / world_size, device, config.metrics.peak_flops, matmul_dtype) \
        if rank == 0 else None
    if slow:
        logger.warning(slow)

    # --- Split into pipeline stages, parallelize, then initialize -----------------------------
    # DTensor draws random numbers layout-independently only on CUDA-like devices. Elsewhere the
    # full model is initialized before it is split and sharded, so every layout starts alike.
    init_before_sharding = device.type == "cpu"
    if init_before_sharding:
        whole_model.to_empty(device=device)
        whole_model.init_weights()
    model_parts, stage_ids, num_stages = [whole_model], [0], 1
    if dims.pp > 1:
        model_parts, stage_ids, num_stages = model_package.split_for_pipeline(whole_model, mesh["pp"], config)
    model_parts = [model_package.parallelize(part, dims, mesh, config, device) for part in model_parts]
    if not init_before_sharding and dims.pp > 1:
        # Each pipeline stage draws its own weights. DTensor's RNG would otherwise copy rank 0's
        # state to every rank (private API: torch has no public way to opt out of that sync).
        torch.distributed.tensor._random.manual_seed(training.seed + mesh["pp"].get_local_rank(), mesh)
    for part in model_parts:
        if not init_before_sharding:
            part.to_empty(device=device)
            part.init_weights()
            if config.parallelism.fsdp_cpu_offload:
                offload_parameters(part)
        part.train()
    # Read from this module's globals at this point, so that a test can swap the loss (test_reliability.py).
    compile_loss = config.compile.enable and dims.tp == 1
    loss_fn = torch.compile(cross_entropy_loss) if compile_loss else cross_entropy_loss
    z_loss = ZLoss(training.z_loss, device, compile_loss) if training.z_loss else None
    loss_fn = z_loss or loss_fn
    pipeline = None
    if dims.pp > 1:
        pipeline = build_pipeline(
            model_parts, stage_ids, num_stages, mesh["pp"], config, device, loss_fn, plan.grad_accum_steps
        )
    model = ModelOnRank(
        model_parts, pipeline, loss_fn, loss_parallel=dims.tp > 1,
        pp_group=mesh["pp"].get_group() if dims.pp > 1 else None,
        loss_group=dims.loss_mesh.get_group() if dims.dp * dims.cp > 1 else None,
    )
    pipeline_micro_batches = (training.local_batch_size // config.parallelism.pipeline_parallel_microbatch_size
                              if dims.pp > 1 else 1)
    routing = RoutingTally(model_parts, model_args.n_layers, plan.grad_accum_steps * pipeline_micro_batches)
    if dims.ep > 1 and not routing.layers:
        raise ConfigError(f"parallelism.expert_parallel_degree {dims.ep} needs a mixture-of-experts model; "
                          f"{config.model.name} {config.model.flavor} has none")
    params_on_rank = sum(local(p).numel() for part in model_parts for p in part.parameters())
    logger.info(
        f"mesh: {dims.describe()} | model {config.model.name} {config.model.flavor}: {n_params / 1e6:.2f}M "
        f"parameters, {params_on_rank / 1e6:.2f}M on this rank | global batch {plan.global_batch} x "
        f"{training.seq_len} tokens, gradient accumulation {plan.grad_accum_steps}"
    )

    # --- Optimizer, schedule, data and checkpoints -------------------------------------------
    optimizers = Optimizers(model_parts, config.optimizer)
    lr_schedule = LRSchedule(optimizers, training.steps, config.lr_scheduler, config.optimizer.lr)
    dataloader = build_dataloader(config, tokenizer, dp_rank, dims.dp)
    validation_paths = validation_sources(config.validation.dataset_path)
    if config.validation.enable:  # a bad validation.dataset_path fails now, not at the first validation
        for path in validation_paths.values():
            if next(iter(build_validation_dataloader(config, tokenizer, dp_rank, dims.dp, path)), None) is None:
                raise ConfigError(f"validation.dataset_path {path} holds no batch of training.local_batch_size x "
                                  f"training.seq_len tokens for data-parallel rank {dp_rank}")
    evaluation = config.evaluation
    tasks = ([prepare_task(read_task(spec, evaluation.limit), tokenizer, training.seq_len) for spec in evaluation.tasks]
             if evaluation.enable else [])
    train_state = TrainState()
    step_guard = StepGuard(training, device)
    spikes = (f"skips steps {training.spike_sigma} sigma above the last {training.spike_window} accepted ones, "
              f"from step {training.spike_window + 1}" if training.spike_guard else "off")
    nonfinite = "stops the run" if training.on_nonfinite == "stop" else "skips the step"
    logger.info(f"step guard: a non-finite loss or gradient norm {nonfinite}; spike guard {spikes}")
    checkpointer = CheckpointManager(
        config.checkpoint, dump_folder, model_parts, optimizers, lr_schedule, dataloader, train_state, step_guard,
        training.steps, device, load_hf=lambda path: load_hf_weights(path, model_parts, model_package, model_args),
        run_record=record,
    )
    if config.checkpoint.create_seed_checkpoint:
        if world_size != 1:
            raise ConfigError("checkpoint.create_seed_checkpoint runs on one process (NGPU=1)")
        logger.info(f"config written to {dump_config(config, dump_folder, 0)}")
        logger.info(f"seed checkpoint written to {checkpointer.save_seed()}")
        return 0
    start_step = checkpointer.load()
    train_state.step = start_step
    if rank == 0:
        (dump_folder / PREEMPTED_FILE).unlink(missing_ok=True)
    if start_step >= training.steps:
        logger.info(f"nothing to do: the checkpoint is at step {start_step} and training.steps is {training.steps}")
        return 0
    metrics = MetricsLogger(
        dump_folder, config.metrics, device, model_args.flops_per_token(training.seq_len), world_size, rank == 0,
        to_toml(config), matmul_dtype=matmul_dtype,
        resume_step=start_step,
    )
    if rank == 0:  # only now: a launch refused at start-up (W&B's included) leaves the folder as it was
        logger.info(f"config written to {dump_config(config, dump_folder, start_step)}")
    layer_metrics = LayerMetrics(model_parts, model_args.n_layers, model.pp_group) if config.metrics.per_layer else None
    set_collective_timeout(config.comm.train_timeout_seconds, mesh)
    eos_id = tokenizer.eos_id if training.document_masking else None
    cp_mesh = mesh["cp"] if dims.cp > 1 else None
    batches = (prepare_batch(batch, device, eos_id, cp_mesh) for batch in dataloader)
    precompute_float8 = config.float8.enable and config.float8.precompute_float8_dynamic_scale_for_fsdp

    def source_tokens() -> dict[str, int]:
        """The tokens each source of an hf blend gave the batches so far, over all data-parallel ranks."""
        by_source = getattr(dataloader, "tokens_by_source", {})
        if len(by_source) < 2:
            return {}
        counts = torch.tensor(list(by_source.values()), dtype=torch.float64, device=device)
        if dims.dp > 1:
            dist.all_reduce(counts, group=dims.dp_mesh.get_group())
        return {f"data_tokens/{name}": int(n) for name, n in zip(by_source, counts.tolist())}

    short_validation = set()  # sources found to hold fewer batches than validation.steps, said once

    def validate(step: int) -> None:
        start = time.perf_counter()
        losses = {}
        for name, path in validation_paths.items():
            loader = build_validation_dataloader(config, tokenizer, dp_rank, dims.dp, path)
            val_batches = (prepare_batch(batch, device, eos_id, cp_mesh) for batch in loader)
            losses[name], batches_used = validation_loss(model, val_batches, config.validation.steps,
                                                         plan.grad_accum_steps, device)
            if batches_used < config.validation.steps and name not in short_validation:
                short_validation.add(name)
                logger.warning(f"validation data {path} holds {batches_used} batches, fewer than validation.steps "
                               f"{config.validation.steps}: validating on those {batches_used}")
        metrics.log_validation(step, losses, time.perf_counter() - start)

    def evaluate(step: int) -> None:
        start = time.perf_counter()
        for part in model_parts:
            part.eval()

        def score(windows: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            return loglikelihoods(model, *prepare_batch(windows, device, eos_id, cp_mesh, labels))

        results = {
            prepared.task.name: evaluate_task(
                prepared, score, lambda totals: over_ranks(model, totals, dist.ReduceOp.SUM), dp_rank, dims.dp,
                training.local_batch_size, training.seq_len, multiple=math.lcm(64, 2 * dims.cp * dims.tp),
                fixed_length=dims.pp > 1, device=device,
            )
            for prepared in tasks
        }
        for part in model_parts:
            part.train()
        metrics.log_evaluation(step, results, time.perf_counter() - start)

    def stop_for_signal(step: int) -> int:
        """Save a checkpoint of `step` on every rank; return the exit status of a preempted run."""
        cause = signals.describe()
        if not config.checkpoint.enable:
            logger.warning(f"{cause} at step {step}: stopping without a checkpoint (checkpoint.enable is false)")
            return EXIT_PREEMPTED
        checkpointer.maybe_save(step, force=True)
        checkpointer.wait()
        path = checkpointer.folder / f"step-{step}"
        if rank == 0:
            write_preempted_record(dump_folder, step, path, cause)
        logger.info(f"{cause}: checkpoint {path} saved; exiting with status {EXIT_PREEMPTED} (rerun to resume)")
        return EXIT_PREEMPTED

    # --- The training loop -------------------------------------------------------------------
    logger.info(f"training steps {start_step + 1} to {training.steps}")
    try:
        with Profiler(config.profiling, dump_folder, rank, device, start_step, training.steps) as profiler:
            for step in range(start_step + 1, training.steps + 1):
                log_this_step = metrics.should_log(step)
                # A pipeline's first step also runs forwards on placeholder tensors to infer shapes,
                # which would pollute the per-layer statistics.
                first_pipeline_step = pipeline is not None and step == start_step + 1
                record_layers = layer_metrics if log_this_step and not first_pipeline_step else None
                lr = lr_schedule.lr
                loss, grad_norm, layers = train_step(model, batches, plan.grad_accum_steps, training.max_norm,
                                                     optimizers, record_layers)
                z_loss_mean = z_loss.step_mean() if z_loss else None
                skip = step_guard.decide(step, loss, grad_norm)
                optimizers.step(skip=skip)
                moe_figures, expert_load = routing.end_step(skip, metrics=log_this_step)
                lr_schedule.step()
                if precompute_float8:
                    for part in model_parts:
                        precompute_float8_scales(part)
                train_state.step = step
                metrics.count_tokens(plan.tokens_per_step)
                stop_now = signals.agreed(stop_group)
                # The guard's counters are read (a sync) only where the loop syncs anyway; a run that
                # must stop does so before it saves.
                if log_this_step or checkpointer.due(step) or stop_now or step == training.steps:
                    skipped = step_guard.check()
                    if log_this_step:
                        # Averaged like the loss: over_ranks is a collective, so only on steps every rank logs.
                        z_figure = {"z_loss": over_ranks(model, z_loss_mean).item()} if z_loss else {}
                        metrics.log(step, loss.item(), grad_norm.item(), lr,
                                    skipped | moe_figures | z_figure | source_tokens())
                        metrics.log_expert_load(step, expert_load)
                if layers:
                    metrics.log_layers(step, layers)
                if config.validation.enable and (step % config.validation.freq == 0 or step == training.steps):
                    validate(step)
                if evaluation.enable and (step % evaluation.freq == 0 or step == training.steps):
                    evaluate(step)
                if step == start_step + 1:
                    logger.info(f"peak memory after the first step: {peak_memory_gib(device):.2f} GiB on this rank")
                checkpointer.maybe_save(step)
                profiler.step(step)
                if stop_now and step < training.steps:
                    return stop_for_signal(step)
    finally:
        checkpointer.close()
        dataloader.close()
        metrics.close()
    if config.checkpoint.last_save_in_hf and rank == 0:  # the others need not wait: DCP reads it from disk
        hf_folder = dump_folder / "hf" / f"step-{training.steps}"
        export(config, checkpointer.folder / f"step-{training.steps}", hf_folder, config.checkpoint.export_dtype)
    logger.info(f"training done: {training.steps} steps; outputs in {dump_folder}")
    return 0


# --- One step -------------------------------------------------------------------------------------


@dataclass
class ModelOnRank:
    """This rank's share of the model and what running a batch through it needs."""

    parts: list[nn.Module]
    """The whole model, or this rank's pipeline stages."""
    pipeline: Pipeline | None
    """Drives the stages under pipeline parallelism; None without it."""
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    loss_parallel: bool
    """Tensor parallelism leaves the logits sharded over the vocabulary; the loss is taken on the shards."""
    pp_group: dist.ProcessGroup | None
    """The pipeline ranks, which each hold part of the gradients (None without pipeline parallelism)."""
    loss_group: dist.ProcessGroup | None
    """The data- and context-parallel ranks, whose losses are averaged (None when this rank is alone)."""


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor, or the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def gathered(tensor: torch.Tensor) -> torch.Tensor:
    """A plain tensor, gathered if it is a DTensor (a loss computed under loss parallel)."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def prepare_batch(
    batch: torch.Tensor, device: torch.device, eos_id: int | None, cp_mesh: DeviceMesh | None,
    labels: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """This rank's inputs, labels and (with document masking: an eos_id) document ids of a batch of
    windows; under context parallelism (a cp_mesh), its share of the sequence. The labels are the
    windows' next tokens unless given."""
    batch = batch.to(device, non_blocking=True)
    inputs = batch[:, :-1]
    labels = batch[:, 1:] if labels is None else labels.to(device, non_blocking=True)
    documents = document_ids(inputs, eos_id) if eos_id is not None else None
    if cp_mesh is not None:
        inputs, labels = shard_sequence(inputs, cp_mesh), shard_sequence(labels, cp_mesh)
    return inputs, labels, documents


def forward_backward(
    model: ModelOnRank, inputs: torch.Tensor, labels: torch.Tensor, documents: torch.Tensor | None,
    grad_accum_steps: int, train: bool,
) -> torch.Tensor:
    """One micro-batch through this rank's model, and backward when `train`: its loss divided by
    grad_accum_steps (its share of the step's mean loss). Under pipeline parallelism the pipeline runs
    forward and backward of its own micro-batches, and only the last stage has a loss (others: 0)."""
    with loss_parallel() if model.loss_parallel else nullcontext():
        if model.pipeline is not None:
            losses = model.pipeline.run(inputs, labels, train)
            if isinstance(model.loss_fn, ZLoss):
                model.loss_fn.settle(len(losses))
            if not losses:
                return torch.zeros((), device=inputs.device)
            return torch.stack([gathered(loss) for loss in losses]).detach().sum()
        loss = model.loss_fn(model.parts[0](inputs, documents), labels) / grad_accum_steps
        if train:
            loss.backward()
        return gathered(loss).detach()


def over_ranks(model: ModelOnRank, value: torch.Tensor, op=dist.ReduceOp.AVG) -> torch.Tensor:
    """A value computed on the last pipeline stage (zeros elsewhere), reduced with `op` over the data-
    and context-parallel ranks: the mean of their losses, or the sum of their shares of log-likelihoods."""
    if model.pp_group is not None:
        dist.all_reduce(value, group=model.pp_group)
    if model.loss_group is not None:
        dist.all_reduce(value, op=op, group=model.loss_group)
    return value


@torch.no_grad()
def loglikelihoods(model: ModelOnRank, inputs: torch.Tensor, labels: torch.Tensor,
                   documents: torch.Tensor | None) -> torch.Tensor:
    """Each row's summed log-probability of its labelled tokens, as far as this rank sees them (its
    context-parallel share; zeros off the last pipeline stage); the model is in eval mode."""
    with loss_parallel() if model.loss_parallel else nullcontext():
        if model.pipeline is not None:
            scores = model.pipeline.score(inputs, labels, sequence_loglikelihoods)
            return scores if scores is not None else torch.zeros(len(inputs), device=inputs.device)
        return sequence_loglikelihoods(model.parts[0](inputs, documents), labels)


def train_step(
    model: ModelOnRank, batches: Iterator, grad_accum_steps: int, max_norm: float, optimizers: Optimizers,
    layer_metrics: LayerMetrics | None = None,
) -> tuple[torch.Tensor, torch.Tensor, dict | None]:
    """Forward and backward of grad_accum_steps micro-batches, then the gradients clipped to max_norm.
    Returns the step's mean loss over all ranks, the gradient norm before clipping and, with
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
    layers = layer_metrics.collect(loss_sum.device) if layer_metrics is not None else None  # before clipping
    # With FSDP's CPU offload the gradients and so their norm are in host memory.
    grad_norm = clip_grad_norm(optimizers, max_norm, model.pp_group).to(loss_sum.device)
    return over_ranks(model, loss_sum), grad_norm, layers


@torch.no_grad()
def validation_loss(model: ModelOnRank, batches: Iterator, steps: int, grad_accum_steps: int,
                    device: torch.device) -> tuple[float, int]:
    """Mean loss over the first `steps` batches of the validation data, on every rank, and how many
    batches that was: fewer when the data holds fewer (every rank stops where the first runs out; start-up
    made sure there is at least one)."""
    for part in model.parts:
        part.eval()
    loss_sum, done = torch.zeros((), device=device), 0
    for _ in range(steps):
        batch = next(batches, None)
        available = torch.tensor(int(batch is not None), device=device)
        dist.all_reduce(available, op=dist.ReduceOp.MIN)
        if not available.item():
            break
        loss_sum = loss_sum + forward_backward(model, *batch, grad_accum_steps, train=False)
        done += 1
    for part in model.parts:
        part.train()
    return (over_ranks(model, loss_sum) * grad_accum_steps).item() / done, done


def main(argv: list[str] | None = None) -> int:
    die_with_launcher()
    try:
        config = load_config(argv)
        wandb_logging.check_installed(config.metrics)  # before anything is written
    except ConfigError as e:
        return report(f"config error: {e}", EXIT_BAD_INPUT)
    with StopSignals() as signals:
        try:
            return train(config, signals)
        except (ConfigError, FileNotFoundError, ValueError, FolderInUse) as e:
            return report(f"error: {e}", EXIT_BAD_INPUT)
        except TrainingStopped as e:
            return report(f"training stopped: {e}", EXIT_STOPPED)
        finally:
            release_dump_folders()
            if dist.is_initialized():
                dist.destroy_process_group()


def report(message: str, status: int) -> int:
    """One line, once: on stderr, or to components/launch.py, which shows the first failing rank's."""
    report_failure(message)
    return status


if __name__ == "__main__":
    sys.exit(run_worker(main))
