"""Settings that do not combine with the layout or the device, checked at start-up for every model.

What is model-specific (e.g. whether the tensor-parallel degree divides the heads) stays in the model's
parallelize.py; what holds for any model lives here, so that a forked model does not copy it."""

from __future__ import annotations

import torch
from torch import nn

from components.config import Config, ConfigError
from components.distributed.fault_tolerance import check_replica_config
from components.distributed.mesh import ParallelDims
from components.model.contract import check_model_contract, multi_token_depths
from components.model.moe_layer import has_moe_layer
from components.model.undeclared_mixing import undeclared_mixing


def check_supported(config: Config, dims: ParallelDims, device: torch.device) -> None:
    """Name the settings this version cannot apply rather than silently ignoring them."""
    unsupported = {
        # Dynamo would trace the statistics hooks into the compiled blocks.
        "metrics.per_layer with compile.enable": config.metrics.per_layer and config.compile.enable,
        # Compiled checkpointed blocks trace the ring into one graph, and its point-to-point sends cannot be traced.
        "parallelism.context_parallel_method ring with compile.enable and activation checkpointing":
            dims.cp > 1 and config.parallelism.context_parallel_method == "ring" and config.compile.enable
            and config.activation_checkpoint.mode != "none",
        # FSDP re-pins offloaded shards as plain tensors, not as torchao's float8-cast weights.
        "parallelism.fsdp_cpu_offload with float8.enable_fsdp_float8_all_gather":
            config.parallelism.fsdp_cpu_offload and config.float8.enable
            and config.float8.enable_fsdp_float8_all_gather,
    }
    named = [key for key, used in unsupported.items() if used]
    if named:
        raise ConfigError(f"not available yet: {', '.join(named)}; leave these at their defaults")
    if getattr(config.model, "rope_per_document", False) and not config.training.document_masking:
        raise ConfigError(
            "model.rope_per_document needs training.document_masking = true (it restarts positions at document "
            "boundaries)"
        )
    if config.parallelism.enable_async_tensor_parallel and (
        dims.tp == 1 or not config.compile.enable or device.type != "cuda" or not config.parallelism.sequence_parallel
    ):
        raise ConfigError(
            "parallelism.enable_async_tensor_parallel needs parallelism.tensor_parallel_degree > 1, "
            "parallelism.sequence_parallel, compile.enable = true and CUDA (here: tp "
            f"{dims.tp}, sequence_parallel {config.parallelism.sequence_parallel}, compile {config.compile.enable}, "
            f"{device.type})"
        )
    if config.checkpoint.create_seed_checkpoint and dims.world_size != 1:
        raise ConfigError("checkpoint.create_seed_checkpoint runs on one process (NGPU=1)")
    if config.evaluation.enable and not config.evaluation.tasks:
        raise ConfigError("evaluation.enable needs at least one task in evaluation.tasks")
    check_replica_config(config.fault_tolerance, dims)


def check_model_supported(config: Config, dims: ParallelDims, model: nn.Module) -> None:
    """What the model built (on the meta device) lacks of the model contract, or cannot do with this config."""
    check_model_contract(model, config.model.name)
    if dims.ep > 1 and not has_moe_layer(model):
        raise ConfigError(f"parallelism.expert_parallel_degree {dims.ep} needs a mixture-of-experts model; "
                          f"{config.model.name} {config.model.flavor} has none")
    if config.moe.aux_loss_coef and (dims.tp > 1 or dims.cp > 1) and has_moe_layer(model):
        # Each rank's experts see its share of every sequence: the loss would measure balance over shares.
        raise ConfigError(f"not available yet: moe.aux_loss_coef {config.moe.aux_loss_coef} with tensor or context "
                          f"parallelism (each rank would measure the balance of its part of every sequence); balance "
                          f"with moe.bias_update_speed instead")
    depths = multi_token_depths(model)
    if depths and (dims.pp > 1 or dims.cp > 1):
        # A pipeline's stages would need the embedding and the output layer on the last stage too; a context-parallel
        # rank would need the tokens of the next rank's share, whose embeddings the extra depths read.
        raise ConfigError(f"not available yet: multi-token prediction ({depths} extra depths: model.num_mtp_layers) "
                          f"with pipeline or context parallelism; set model.num_mtp_layers 0 for such a layout")


def check_token_mixing(config: Config, dims: ParallelDims, model: nn.Module) -> None:
    """Under a layout that splits the sequence (sequence or context parallelism), refuse a model (built on the meta
    device) one of whose blocks mixes positions in a way it does not declare (components/model/undeclared_mixing.py).
    It materializes one block of each kind on the CPU: call it on one rank
    (components.distributed.mesh.on_rank0_for_all).
    """
    splits = [layout for layout, splitting in (
        (f"parallelism.tensor_parallel_degree {dims.tp} with sequence parallelism",
         dims.tp > 1 and config.parallelism.sequence_parallel),
        (f"parallelism.context_parallel_degree {dims.cp}", dims.cp > 1)) if splitting]
    if splits:
        mixing = undeclared_mixing(model)
        if mixing is not None:
            ways_out = ["declare it (docs/models.md#other-ways-to-mix-tokens)"]
            if dims.tp > 1 and config.parallelism.sequence_parallel:
                ways_out.append("set --parallelism.sequence_parallel false")
            if dims.cp > 1:
                ways_out.append("choose a layout without context parallelism")
            raise ConfigError(f"model.name {config.model.name}: {mixing} mixes positions outside the attention, "
                              f"convolutions and recurrent layers it declares, and {' and '.join(splits)} splits the "
                              f"sequence, so each rank would mix only its own share: {', '.join(ways_out)}")


def uses_fsdp(config: Config, dims: ParallelDims) -> bool:
    """FSDP shards over data-parallel (and context-parallel) ranks; on one rank it still provides
    bf16 mixed precision and CPU offload."""
    return (dims.dp * dims.cp > 1 or config.training.mixed_precision_param != "float32"
            or config.parallelism.fsdp_cpu_offload)
