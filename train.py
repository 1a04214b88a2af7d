"""ingot's trainer, top to bottom: config -> DeviceMesh -> model on meta -> parallelize -> init or
load -> train loop. Launch it with ./run_train.sh (torchrun); `python train.py --job.config_file ...`
also works for a single process.
"""

from __future__ import annotations

import importlib
import logging
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from components.checkpoint import CheckpointManager, TrainState
from components.config import Config, ConfigError, dump_config, load_config, to_toml
from components.data import build_dataloader
from components.distributed import ParallelDims, init_distributed, set_collective_timeout
from components.metrics import MetricsLogger
from components.optim import build_lr_scheduler, build_optimizer
from components.tokenizer import build_tokenizer

logger = logging.getLogger("ingot")
warnings.filterwarnings("ignore", message="'set_vital' is deprecated")  # torchdata, harmless


def setup_logging(rank: int) -> None:
    """Rank 0 speaks; the other ranks report only warnings and errors."""
    level = logging.INFO if rank == 0 else logging.WARNING
    logging.basicConfig(level=level, format=f"[rank{rank}] %(asctime)s %(message)s", datefmt="%H:%M:%S", force=True)


def grad_norm_and_clip(model: torch.nn.Module, max_norm: float) -> torch.Tensor:
    """Clip gradients to `max_norm` (0: no clipping) and return their global norm."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm if max_norm > 0 else float("inf"), foreach=True)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def train(config: Config) -> None:
    # --- Processes, the device mesh and the run's folder -------------------------------------
    device = init_distributed(config.comm.init_timeout_seconds)
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

    torch.manual_seed(training.seed)
    if training.deterministic:
        torch.use_deterministic_algorithms(True)
    dump_folder = Path(config.job.dump_folder)
    if rank == 0:
        logger.info(f"config written to {dump_config(config, dump_folder)}")

    # --- Tokenizer and model, built on the meta device (no memory) ---------------------------
    tokenizer = build_tokenizer(config.model.tokenizer_path)
    model_package = importlib.import_module(f"models.{config.model.name}")
    model_args = model_package.build_model_args(config, tokenizer.vocab_size)
    with torch.device("meta"):
        model = model_package.Transformer(model_args)
    n_params = sum(p.numel() for p in model.parameters())

    # --- Parallelize, then initialize --------------------------------------------------------
    # DTensor draws random numbers layout-independently only on CUDA-like devices. Elsewhere the
    # full model is initialized before sharding, so every layout starts from the same weights.
    init_before_sharding = device.type == "cpu"
    if init_before_sharding:
        model.to_empty(device=device)
        model.init_weights()
    model = model_package.parallelize_llama(model, dims, mesh, config)
    if not init_before_sharding:
        model.to_empty(device=device)
        model.init_weights()
    model.train()
    params_per_rank = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in model.parameters())
    logger.info(
        f"mesh: {dims.describe()} | model {config.model.name} {config.model.flavor}: {n_params / 1e6:.2f}M parameters, "
        f"{params_per_rank / 1e6:.2f}M on this rank | global batch {global_batch} x {training.seq_len} tokens, "
        f"gradient accumulation {grad_accum_steps}"
    )

    # --- Optimizer, schedule, data and checkpoints -------------------------------------------
    optimizer = build_optimizer(model, config.optimizer)
    lr_scheduler = build_lr_scheduler(optimizer, training.steps, config.lr_scheduler)
    dataloader = build_dataloader(
        training.dataset_path, training.dataset_text_field, tokenizer, training.seq_len, training.local_batch_size,
        dp_rank, dp_size,
    )
    train_state = TrainState()
    checkpointer = CheckpointManager(
        config.checkpoint, dump_folder, model, optimizer, lr_scheduler, dataloader, train_state, training.steps, device
    )
    if config.checkpoint.create_seed_checkpoint:
        if world_size != 1:
            raise ConfigError("checkpoint.create_seed_checkpoint runs on one process (NGPU=1)")
        logger.info(f"seed checkpoint written to {checkpointer.save_seed()}")
        return
    start_step = checkpointer.load()
    train_state.step = start_step
    if start_step >= training.steps:
        logger.info(f"nothing to do: the checkpoint is at step {start_step} and training.steps is {training.steps}")
        return

    metrics = MetricsLogger(
        dump_folder, config.metrics, device, model_args.flops_per_token(training.seq_len), world_size, rank == 0, to_toml(config)
    )
    set_collective_timeout(config.comm.train_timeout_seconds, mesh)
    dp_group = dims.dp_mesh.get_group()
    data_iter = iter(dataloader)
    tokens_per_step = global_batch * training.seq_len

    # --- The training loop -------------------------------------------------------------------
    logger.info(f"training steps {start_step + 1} to {training.steps}")
    for step in range(start_step + 1, training.steps + 1):
        optimizer.zero_grad()
        loss_sum = torch.zeros((), device=device)
        for micro_step in range(grad_accum_steps):
            batch = next(data_iter).to(device, non_blocking=True)
            inputs, labels = batch[:, :-1], batch[:, 1:]
            if isinstance(model, FSDPModule):  # reduce gradients across ranks on the last micro-batch only
                model.set_requires_gradient_sync(micro_step == grad_accum_steps - 1)
            logits = model(inputs)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten()) / grad_accum_steps
            loss.backward()
            loss_sum += loss.detach()
        grad_norm = grad_norm_and_clip(model, training.max_norm)
        lr = lr_scheduler.get_last_lr()[0]
        optimizer.step()
        lr_scheduler.step()
        train_state.step = step

        metrics.count_tokens(tokens_per_step)
        if metrics.should_log(step):
            if dp_size > 1:
                dist.all_reduce(loss_sum, op=dist.ReduceOp.AVG, group=dp_group)
            metrics.log(step, loss_sum.item(), grad_norm.item(), lr)
        checkpointer.maybe_save(step)

    checkpointer.close()
    metrics.close()
    logger.info(f"training done: {training.steps} steps; outputs in {dump_folder}")


def main(argv: list[str] | None = None) -> int:
    try:
        config = load_config(argv)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    try:
        train(config)
    except (ConfigError, FileNotFoundError, ValueError) as e:
        logging.getLogger("ingot").error(f"error: {e}")
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
