"""Pipeline parallelism for Qwen3, as for Llama 3: which modules each stage holds, and the stages and
schedule of this rank.

train.py's call order is in models/llama3/pipeline.py.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from components.config import Config, ConfigError
from parallelisms.pipeline import (
    is_multi_stage,
    is_v_style,
    split_module,
    stage_ids_for_rank,
)


def pipeline_module_names(n_layers: int, num_stages: int, layers_per_stage: int | None = None) -> list[list[str]]:
    """The module names each stage holds: embeddings in the first, norm and output in the last, and
    the blocks in order, `layers_per_stage` per stage or split evenly (the first stages take one
    more block each when they do not divide evenly)."""
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
        names.append([f"layers.{i}" for i in range(start, start + size)])
        start += size
    names[0].insert(0, "tok_embeddings")
    names[-1].extend(["norm", "output"])
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


def split_qwen3(model: nn.Module, pp_mesh: DeviceMesh, config: Config) -> tuple[list[nn.Module], list[int], int]:
    """This rank's pipeline stages of `model` (on meta, or materialized: its weights are copied):
    (model_parts, stage_ids, num_stages), parts in the order of their stage ids."""
    p = config.parallelism
    if model.args.tie_embeddings:
        # The first and last stages would each hold (and update) their own copy of the matrix.
        raise ConfigError(
            f"model.flavor {config.model.flavor} ties its embedding and output weights, which pipeline "
            "parallelism does not support yet; use parallelism.pipeline_parallel_degree = 1"
        )
    pp_size, pp_rank = pp_mesh.size(), pp_mesh.get_local_rank()
    n_layers = len(model.layers)
    per_rank = stages_per_rank(p.pipeline_parallel_schedule, pp_size, n_layers, p.pipeline_parallel_layers_per_stage)
    num_stages = pp_size * per_rank
    names = pipeline_module_names(n_layers, num_stages, p.pipeline_parallel_layers_per_stage)
    stage_ids = stage_ids_for_rank(pp_rank, pp_size, per_rank, is_v_style(p.pipeline_parallel_schedule))
    return [split_module(model, names[stage]) for stage in stage_ids], stage_ids, num_stages
