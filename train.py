"""ingot's trainer, top to bottom: config -> DeviceMesh -> model on meta -> parallelize -> init or
load -> train loop. Launch it with ./run_train.sh (torchrun); `python train.py --job.config_file ...`
also works for a single process.
"""

from __future__ import annotations

import importlib
import logging
import sys
import time
import warnings
from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from components.checkpoint import CheckpointManager, TrainState
from components.config import Config, ConfigError, dump_config, load_config, to_toml
from components.data.loaders import build_dataloader, build_validation_dataloader
from components.data.documents import document_ids
from components.distributed import ParallelDims, init_distributed, set_collective_timeout
from components.hf import load_hf_weights
from components.layer_metrics import LayerMetrics
from components.metrics import MetricsLogger, peak_memory_gib
from components.optim import LRSchedule, Optimizers, clip_grad_norm
from components.preemption import EXIT_PREEMPTED, PREEMPTED_FILE, StopSignals, write_preempted_record
from components.profiling import Profiler
from components.step_guard import StepGuard, TrainingStopped
from components.tokenizer import build_tokenizer
from parallelisms.context_parallel import shard_sequence
from parallelisms.float8 import precompute_float8_scales

logger = logging.getLogger("ingot")
warnings.filterwarnings("ignore", message="'set_vital' is deprecated")  # torchdata, harmless


def setup_logging(rank: int) -> None:
    """Rank 0 speaks; the other ranks report only warnings and errors."""
    level = logging.INFO if rank == 0 else logging.WARNING
    logging.basicConfig(level=level, format=f"[rank{rank}] %(asctime)s %(message)s", datefmt="%H:%M:%S", force=True)
    logging.getLogger("torchao").setLevel(logging.ERROR)  # it warns about GPU kernels it could not load


def cross_entropy_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy, computed in fp32 whatever the logits' dtype."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def full(tensor: torch.Tensor) -> torch.Tensor:
    """A plain tensor, gathered if it is a DTensor (a loss computed under loss parallel)."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def train(config: Config, signals: StopSignals) -> int:
    """Train as configured; return the exit status (0, or EXIT_PREEMPTED after a stop signal)."""
    # --- Processes, the device mesh and the run's folder -------------------------------------
    device = init_distributed(config.comm, Path(config.job.dump_folder))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    setup_logging(rank)
    dims = ParallelDims.from_config(config.parallelism, world_size)
    mesh = dims.build_mesh(device.type)
    dp_rank, dp_size = dims.dp_mesh.get_local_rank(), dims.dp

    training = config.training
    local_per_step = training.local_batch_size * dp_size
    global_batch = local_per_step if training.global_batch_size == -1 else training.global_batch_size
    if global_batch % local_per_step:
        raise ConfigError(
            f"training.global_batch_size {global_batch} must be a multiple of training.local_batch_size "
            f"({training.local_batch_size}) x data-parallel degree ({dp_size}) = {local_per_step}"
        )
    grad_accum_steps = global_batch // local_per_step
    if config.validation.enable and min(config.validation.freq, config.validation.steps) < 1:
        raise ConfigError("validation.freq and validation.steps must be >= 1")

    torch.manual_seed(training.seed)
    if training.deterministic:
        torch.use_deterministic_algorithms(True)
    dump_folder = Path(config.job.dump_folder)
    # Agreeing on stop signals without a device sync: a CPU group, with the training timeout.
    stop_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=config.comm.train_timeout_seconds))
    if rank == 0:
        logger.info(f"config written to {dump_config(config, dump_folder)}")

    # --- Tokenizer and model, built on the meta device (no memory) ---------------------------
    tokenizer = build_tokenizer(config.model.tokenizer_path)
    model_package = importlib.import_module(f"models.{config.model.name}")
    model_args = model_package.build_model_args(config, tokenizer.vocab_size)
    with torch.device("meta"):
        model = model_package.Transformer(model_args)
    n_params = sum(p.numel() for p in model.parameters())

    # --- Split into pipeline stages, parallelize, then initialize -----------------------------
    # DTensor draws random numbers layout-independently only on CUDA-like devices. Elsewhere the
    # full model is initialized before it is split and sharded, so every layout starts alike.
    init_before_sharding = device.type == "cpu"
    if init_before_sharding:
        model.to_empty(device=device)
        model.init_weights()
    if dims.pp > 1:
        model_parts, stage_ids, num_stages = model_package.split_for_pipeline(model, mesh["pp"], config)
    else:
        model_parts = [model]
    model_parts = [model_package.parallelize(part, dims, mesh, config, device) for part in model_parts]
    if not init_before_sharding and dims.pp > 1:
        # Each pipeline stage draws its own weights. DTensor's RNG would otherwise copy rank 0's
        # state to every rank (private API: torch has no public way to opt out of that sync).
        torch.distributed.tensor._random.manual_seed(training.seed + mesh["pp"].get_local_rank(), mesh)
    for part in model_parts:
        if not init_before_sharding:
            part.to_empty(device=device)
            part.init_weights()
        part.train()
    use_loss_parallel = dims.tp > 1
    loss_fn = torch.compile(cross_entropy_loss) if config.compile.enable and not use_loss_parallel else cross_entropy_loss
    if dims.pp > 1:
        schedule = model_package.build_pipeline_schedule(
            model_parts, stage_ids, num_stages, mesh["pp"], config, device, loss_fn, grad_accum_steps
        )
        has_first_stage, has_last_stage = 0 in stage_ids, num_stages - 1 in stage_ids
    params_per_rank = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for part in model_parts for p in part.parameters())
    logger.info(
        f"mesh: {dims.describe()} | model {config.model.name} {config.model.flavor}: {n_params / 1e6:.2f}M parameters, "
        f"{params_per_rank / 1e6:.2f}M on this rank | global batch {global_batch} x {training.seq_len} tokens, "
        f"gradient accumulation {grad_accum_steps}"
    )

    # --- Optimizer, schedule, data and checkpoints -------------------------------------------
    optimizers = Optimizers(model_parts, config.optimizer)
    lr_schedule = LRSchedule(optimizers, training.steps, config.lr_scheduler, config.optimizer.lr)
    dataloader = build_dataloader(config, tokenizer, dp_rank, dp_size)
    if config.validation.enable:  # a bad validation.dataset_path fails now, not at the first validation
        build_validation_dataloader(config, tokenizer, dp_rank, dp_size)
    train_state = TrainState()
    step_guard = StepGuard(training, device)
    checkpointer = CheckpointManager(
        config.checkpoint, dump_folder, model_parts, optimizers, lr_schedule, dataloader, train_state, step_guard, training.steps, device,
        load_hf=lambda path: load_hf_weights(path, model_parts, model_package, model_args),
    )
    if config.checkpoint.create_seed_checkpoint:
        if world_size != 1:
            raise ConfigError("checkpoint.create_seed_checkpoint runs on one process (NGPU=1)")
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
        dump_folder, config.metrics, device, model_args.flops_per_token(training.seq_len), world_size, rank == 0, to_toml(config),
        matmul_dtype="float8" if config.float8.enable else training.mixed_precision_param, resume_step=start_step,
    )
    layer_metrics = (
        LayerMetrics(model_parts, model_args.n_layers, mesh["pp"].get_group() if dims.pp > 1 else None)
        if config.metrics.per_layer else None
    )
    set_collective_timeout(config.comm.train_timeout_seconds, mesh)
    data_iter = iter(dataloader)
    tokens_per_step = global_batch * training.seq_len
    precompute_float8 = config.float8.enable and config.float8.precompute_float8_dynamic_scale_for_fsdp

    def prepare(batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """This rank's inputs, labels and (with document masking) document ids of a batch of windows."""
        batch = batch.to(device, non_blocking=True)
        inputs, labels = batch[:, :-1], batch[:, 1:]
        documents = document_ids(inputs, tokenizer.eos_id) if training.document_masking else None
        if dims.cp > 1:  # each context-parallel rank takes its share of the sequence
            inputs, labels = shard_sequence(inputs, mesh["cp"]), shard_sequence(labels, mesh["cp"])
        return inputs, labels, documents

    def mean_over_ranks(loss_sum: torch.Tensor) -> torch.Tensor:
        """A loss summed on the last pipeline stage, averaged over data- and context-parallel ranks."""
        if dims.pp > 1:  # only the last stage computed it
            dist.all_reduce(loss_sum, group=mesh["pp"].get_group())
        if dims.dp * dims.cp > 1:
            dist.all_reduce(loss_sum, op=dist.ReduceOp.AVG, group=dims.loss_mesh.get_group())
        return loss_sum

    @torch.no_grad()
    def validation_loss() -> float:
        """Mean loss over the first validation.steps batches of the validation data."""
        for part in model_parts:
            part.eval()
        batches = iter(build_validation_dataloader(config, tokenizer, dp_rank, dp_size))
        loss_sum = torch.zeros((), device=device)
        with loss_parallel() if use_loss_parallel else nullcontext():
            for _ in range(config.validation.steps):
                inputs, labels, documents = prepare(next(batches))
                if dims.pp > 1:
                    losses = [] if has_last_stage else None
                    schedule.eval(*([inputs] if has_first_stage else []), target=labels if has_last_stage else None, losses=losses)
                    if has_last_stage:  # the schedule's losses are scaled for gradient accumulation
                        loss_sum += grad_accum_steps * torch.stack([full(l) for l in losses]).sum()
                else:
                    loss_sum += full(loss_fn(model_parts[0](inputs, documents), labels))
        for part in model_parts:
            part.train()
        return mean_over_ranks(loss_sum).item() / config.validation.steps

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
        with Profiler(config.profiling, dump_folder, rank, device) as profiler:
            for step in range(start_step + 1, training.steps + 1):
                optimizers.zero_grad()
                loss_sum = torch.zeros((), device=device)
                log_this_step = metrics.should_log(step)
                # A pipeline's first step also runs forwards on placeholder tensors to infer shapes,
                # which would pollute the per-layer statistics.
                log_layers = layer_metrics is not None and log_this_step and not (dims.pp > 1 and step == start_step + 1)
                if log_layers:
                    layer_metrics.start()
                for micro_step in range(grad_accum_steps):
                    inputs, labels, documents = prepare(next(data_iter))
                    for part in model_parts:  # reduce gradients across ranks on the last micro-batch only
                        if isinstance(part, FSDPModule):
                            part.set_requires_gradient_sync(micro_step == grad_accum_steps - 1)
                    with loss_parallel() if use_loss_parallel else nullcontext():
                        if dims.pp > 1:
                            # The schedule runs forward and backward of every micro-batch of the pipeline;
                            # the last stage's losses are already divided by the number of micro-batches.
                            losses = [] if has_last_stage else None
                            schedule.step(
                                *([inputs] if has_first_stage else []), target=labels if has_last_stage else None,
                                losses=losses, return_outputs=False,
                            )
                            if has_last_stage:
                                loss_sum += torch.stack([full(l) for l in losses]).detach().sum()
                        else:
                            loss = loss_fn(model_parts[0](inputs, documents), labels) / grad_accum_steps
                            loss.backward()
                            loss_sum += full(loss).detach()
                layers = layer_metrics.collect(device) if log_layers else None
                grad_norm = clip_grad_norm(model_parts, training.max_norm, mesh["pp"].get_group() if dims.pp > 1 else None)
                step_loss = mean_over_ranks(loss_sum)
                lr = lr_schedule.lr
                optimizers.step(skip=step_guard.decide(step, step_loss, grad_norm))
                lr_schedule.step()
                if precompute_float8:
                    for part in model_parts:
                        precompute_float8_scales(part)
                train_state.step = step

                metrics.count_tokens(tokens_per_step)
                stop_now = signals.agreed(stop_group)
                # The guard's counters are read (a sync) only where the loop syncs anyway; a run that
                # must stop does so before it saves.
                if log_this_step or checkpointer.due(step) or stop_now or step == training.steps:
                    skipped = step_guard.check()
                if log_this_step:
                    metrics.log(step, step_loss.item(), grad_norm.item(), lr, skipped)
                if layers:
                    metrics.log_layers(step, layers)
                if config.validation.enable and (step % config.validation.freq == 0 or step == training.steps):
                    start = time.perf_counter()
                    metrics.log_validation(step, validation_loss(), time.perf_counter() - start)
                if step == start_step + 1:
                    logger.info(f"peak memory after the first step: {peak_memory_gib(device):.2f} GiB on this rank")
                checkpointer.maybe_save(step)
                profiler.step(step)
                if stop_now and step < training.steps:
                    return stop_for_signal(step)
    finally:
        checkpointer.close()
        metrics.close()
    logger.info(f"training done: {training.steps} steps; outputs in {dump_folder}")
    return 0


EXIT_BAD_INPUT, EXIT_STOPPED = 2, 3
"""Exit statuses besides 0, 1 (a crash) and EXIT_PREEMPTED (75): a config or input that cannot be
used; a run stopped by its step guard (non-finite values, too many skipped steps)."""


def main(argv: list[str] | None = None) -> int:
    try:
        config = load_config(argv)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    with StopSignals() as signals:
        try:
            return train(config, signals)
        except (ConfigError, FileNotFoundError, ValueError) as e:
            return report(f"error: {e}", EXIT_BAD_INPUT)
        except TrainingStopped as e:
            return report(f"training stopped: {e}", EXIT_STOPPED)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()


def report(message: str, status: int) -> int:
    """One line in the log and on stderr (which torchrun shows per rank)."""
    logger.error(message)
    print(message, file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
