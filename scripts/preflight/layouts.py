"""`python -m scripts.autotune --predict --world-size N --memory-budget-gib G [--cluster ...]`: candidate layouts
ranked by the tokens/s preflight predicts, among those the memory estimator fits in the budget, without running
a training. A candidate is a tensor-parallel degree (a divisor of N within a node) x a pipeline degree (of
--pp-degrees, the schedule and micro-batch size as configured), FSDP over the rest, x an activation checkpointing
mode x a local batch size; compile and float8 as configured. A pipeline layout is predicted by its slower end:
the first stage's rank or the last's. Context parallelism is not searched (it is for sequences a layout does not
fit otherwise)."""

from __future__ import annotations

from dataclasses import dataclass

from components.config import ConfigError, load_config
from components.distributed.mesh import ParallelDims
from models.families import model_config_class
from scripts.ac_modes import ac_flags
from scripts.memory_estimate import estimate
from scripts.preflight.predict import Cluster, Prediction, Step, duration, predict
from scripts.preflight.rank import default_ranks, run_ranks


@dataclass
class Layout:
    tp: int
    pp: int
    ac: str
    local_batch: int
    estimate_gib: float = 0.0
    prediction: Prediction | None = None
    problem: str = ""
    """Why it was not predicted: over the budget, or the layout does not compose."""

    def args(self, world_size: int) -> list[str]:
        return ["--parallelism.tensor_parallel_degree", str(self.tp), "--parallelism.data_parallel_shard_degree",
                str(world_size // self.tp // self.pp), "--parallelism.data_parallel_replicate_degree", "1",
                "--parallelism.context_parallel_degree", "1", "--parallelism.pipeline_parallel_degree", str(self.pp),
                "--training.local_batch_size", str(self.local_batch), "--training.global_batch_size", "-1",
                *ac_flags(self.ac)]

    @property
    def name(self) -> str:
        pp = f"pp {self.pp}, " if self.pp > 1 else ""
        return f"tp {self.tp}, {pp}AC {self.ac}, batch {self.local_batch}"


def candidates(world_size: int, cluster: Cluster, ac_modes: list[str], batches: list[int],
               pp_degrees: list[int]) -> list[Layout]:
    degrees = [tp for tp in range(1, min(world_size, cluster.gpus_per_node) + 1) if world_size % tp == 0]
    return [Layout(tp, pp, ac, batch) for tp in degrees for pp in pp_degrees if world_size % (tp * pp) == 0
            for ac in ac_modes for batch in batches]


def predict_layouts(base_args: list[str], world_size: int, budget_gib: float, cluster: Cluster,
                    ac_modes: list[str], batches: list[int], pp_degrees: list[int] = (1,),
                    progress=print) -> list[Layout]:
    """Every candidate, those predicted first, fastest first."""
    layouts = candidates(world_size, cluster, ac_modes, batches, list(pp_degrees))
    for layout in layouts:
        try:
            config = load_config([*base_args, *layout.args(world_size)], model_config_class)
            dims = ParallelDims.from_config(config.parallelism, world_size)
            layout.estimate_gib = estimate(config, world_size, "cuda").total_gib
            if layout.estimate_gib > budget_gib:
                layout.problem = f"estimate {layout.estimate_gib:.2f} GiB over the budget"
            else:
                step = Step.of(config, dims)
                layout.prediction = min((predict(r.flops, r.float8_flops, r.model_flops, r.collectives, step, cluster,
                                                 r.pipeline_bubble)
                                         for r in run_ranks(config, world_size,
                                                            default_ranks(dims) if dims.pp > 1 else [0])),
                                        key=lambda p: p.tokens_per_gpu_s)
        except (ConfigError, ValueError) as e:
            layout.problem = f"does not compose: {e}"
        progress(f"  {layout.name}: " + (layout.problem or f"{layout.prediction.tokens_per_gpu_s:,.0f} tokens/s"))
    return sorted(layouts, key=lambda x: -x.prediction.tokens_per_gpu_s if x.prediction else 0)


def table(layouts: list[Layout]) -> str:
    rows = ["| layout | memory estimate GiB | predicted step | tokens/s per GPU | MFU | waits for |",
            "| --- | ---: | ---: | ---: | ---: | --- |"]
    for x in layouts:
        p = x.prediction
        if p is None:
            rows.append(f"| {x.name} | {x.estimate_gib:.2f} | | | | {x.problem} |")
            continue
        rows.append(f"| {x.name} | {x.estimate_gib:.2f} | {duration(p.step_s)} | {p.tokens_per_gpu_s:,.0f} | "
                    f"{p.mfu:.1%} | {p.waits() or 'nothing'} |")
    return "\n".join(rows)
