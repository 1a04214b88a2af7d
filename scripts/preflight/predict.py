"""A step's time on a GPU cluster from what preflight recorded of one rank: the FLOPs it computes and the
collectives it calls, priced by a cluster description (peak FLOP/s, the fraction of it training reaches,
link bandwidths and latencies). A first-order model, every assumption printed beside its result:

- compute: the counted FLOPs at the achievable fraction of the peak for the matmuls' dtype (compiled or eager),
  those of float8 linear layers at float8's;
- a collective: its ring volume (an all-gather receives n-1 shards, a reduce-scatter or all-to-all moves
  (n-1)/n of its buffer, an all-reduce twice that, a send its tensor) over the link its group uses (NVLink within
  a node, the GPU's network port across nodes), plus a latency per call;
- overlap: FSDP's and HSDP's collectives of 1 MiB or more a call (weights gathered ahead, gradients reduced
  behind) and TP's of 1 MiB or more under async TP run beside the compute; every other collective (TP's, CP's,
  EP's, the small all-reduces of the loss, the gradient norm and float8's scales, the pipeline's sends) waits;
- the pipeline's bubble: (pp - 1) / (stages a rank x micro-batches) of the compute, interleaved 1F1B's (GPipe's
  and 1F1B's with one stage a rank): step = max(compute, overlapped) + bubble + exposed.
Not modelled: the smaller bubble of zero-bubble schedules, kernel launch gaps, memory-bound kernels beyond the
achievable fraction, network congestion, data loading, stragglers."""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field
from pathlib import Path

from components.config import Config
from components.data.batch_plan import batch_plan
from components.distributed.mesh import ParallelDims
from components.metrics.reporting import GPU_PEAK_TFLOPS
from scripts.preflight.collectives import Collective, is_data_parallel

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

MIB = 2**20
BULK_BYTES = MIB
"""A data-parallel collective moving at least this much a call is FSDP's or HSDP's bulk traffic, overlapped."""


@dataclass(frozen=True)
class Cluster:
    name: str
    gpus_per_node: int = 8
    peak_tflops: dict[str, float] = field(default_factory=lambda: dict(GPU_PEAK_TFLOPS["H100"]))
    """Dense peak TFLOP/s of one GPU by matmul dtype (bfloat16, float8, float32)."""
    compiled_fraction: float = 0.45
    """Of the peak, what a compiled bf16 step reaches: ingot's Llama 3 on one H200, 44% (1B) and 48% (8B-shaped
    layers) MFU (docs/benchmarks.md)."""
    eager_fraction: float = 0.38
    """Likewise without torch.compile: 39% (1B on one H200)."""
    float8_fraction: float = 0.31
    """Of float8's peak, what float8 linear layers reach: 1.4x bf16's compiled matmuls, the gain that gives
    TorchTitan's published 8B float8 step (8,532 against 6,667 tokens/s a GPU)."""
    intra_node_gbps: float = 450.0
    """GB/s one way per GPU within a node (NVLink 4: 900 GB/s both ways)."""
    inter_node_gbps: float = 50.0
    """GB/s one way per GPU across nodes (a 400 Gb/s InfiniBand port per GPU)."""
    bandwidth_fraction: float = 0.8
    """Of those, what NCCL's collectives reach."""
    intra_node_latency_us: float = 10.0
    inter_node_latency_us: float = 25.0


CLUSTERS = {
    "h100": Cluster("h100: H100 SXM nodes, NVLink 4, 400 Gb/s InfiniBand a GPU"),
    "h200": Cluster("h200: H200 SXM nodes, NVLink 4, 400 Gb/s InfiniBand a GPU",
                    peak_tflops=dict(GPU_PEAK_TFLOPS["H200"])),
}


def load_cluster(name_or_file: str) -> Cluster:
    """A cluster by name (h100, h200) or from a TOML file: `base` (a name, default h100) and any of Cluster's
    fields to change, e.g. `inter_node_gbps = 25.0`."""
    if name_or_file in CLUSTERS:
        return CLUSTERS[name_or_file]
    path = Path(name_or_file)
    if not path.is_file():
        raise ValueError(f"--cluster {name_or_file}: neither a cluster ({', '.join(CLUSTERS)}) nor a TOML file")
    try:
        values = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"--cluster {path}: not valid TOML: {e}") from None
    base = values.pop("base", "h100")
    if base not in CLUSTERS:
        raise ValueError(f"--cluster {path}: base {base!r} is not one of {', '.join(CLUSTERS)}")
    fields = {f.name for f in dataclasses.fields(Cluster)} - {"name"}
    if unknown := sorted(set(values) - fields):
        raise ValueError(f"--cluster {path}: unknown key {unknown[0]!r}; the keys: base, {', '.join(sorted(fields))}")
    return dataclasses.replace(CLUSTERS[base], name=f"{path} (on {base})", **values)


@dataclass(frozen=True)
class Step:
    """How train.py runs the step, as far as its speed goes."""
    matmul_dtype: str
    compiled: bool
    async_tp: bool
    tokens: int
    """Of the whole job, one step."""
    world_size: int

    @classmethod
    def of(cls, config: Config, dims: ParallelDims) -> Step:
        return cls(config.training.mixed_precision_param, config.compile.enable,
                   config.parallelism.enable_async_tensor_parallel,
                   batch_plan(config.training, dims.dp).tokens_per_step, dims.world_size)


@dataclass
class Prediction:
    compute_s: float
    overlapped_s: float
    bubble_s: float
    """The pipeline's idle time beside the compute."""
    exposed_s: float
    exposed_by_dim: dict[str, float]
    step_s: float
    tokens_per_gpu_s: float
    mfu: float

    def waits(self) -> str:
        """What the step waits for, by mesh dimension, longest first (those over 1% of the step)."""
        return ", ".join(f"{dim} {duration(s)}" for dim, s in sorted(self.exposed_by_dim.items(), key=lambda kv: -kv[1])
                         if s >= 0.01 * self.step_s)


def duration(seconds: float) -> str:
    return f"{seconds:.2f} s" if seconds >= 1 else f"{seconds * 1e3:.3g} ms"


def collective_seconds(op: str, c: Collective, cluster: Cluster) -> float:
    """A collective's ring volume over its slowest link, plus its latency a call."""
    n = c.group_size
    if n <= 1 or op.startswith("recv"):  # a receive is its sender's send, priced on the sending rank
        return 0.0
    across_nodes = len({rank // cluster.gpus_per_node for rank in c.ranks}) > 1
    gbps = cluster.inter_node_gbps if across_nodes else cluster.intra_node_gbps
    latency = cluster.inter_node_latency_us if across_nodes else cluster.intra_node_latency_us
    if "gather" in op:
        volume = c.bytes * (n - 1)  # each call put in this rank's shard; it receives the n-1 others
    elif "reduce_scatter" in op or "all_to_all" in op:
        volume = c.bytes * (n - 1) / n
    elif "reduce" in op:  # all-reduce: a reduce-scatter, then an all-gather
        volume = 2 * c.bytes * (n - 1) / n
    else:  # send, receive, broadcast
        volume = c.bytes
    return volume / (gbps * 1e9 * cluster.bandwidth_fraction) + c.count * latency * 1e-6


def overlapped(op: str, dim: str, c: Collective, step: Step) -> bool:
    """Bulk collectives (1 MiB or more a call) of FSDP and HSDP (expert parallelism's all-to-alls wait, whatever
    their group), and of TP under async TP, which overlaps its gathers and reduce-scatters with the matmuls beside
    them; small ones (a norm's, float8's scales) wait wherever they are."""
    fsdp = is_data_parallel(dim) and "all_to_all" not in op
    return (fsdp or (dim == "tp" and step.async_tp)) and c.bytes >= BULK_BYTES * c.count


def predict(flops: float, float8_flops: float, model_flops: float, collectives: dict[tuple[str, str], Collective],
            step: Step, cluster: Cluster, bubble: float = 0.0) -> Prediction:
    """One rank's step time from its counted FLOPs (`float8_flops` of them in float8 linear layers), its
    collectives, and `model_flops` (its share of the model's formula, for MFU); under pipeline parallelism, the
    `bubble` its stages idle, a fraction of the compute."""
    fraction = cluster.compiled_fraction if step.compiled else cluster.eager_fraction
    peak = cluster.peak_tflops[step.matmul_dtype] * 1e12
    compute = (flops - float8_flops) / (peak * fraction)
    if float8_flops:
        compute += float8_flops / (cluster.peak_tflops["float8"] * 1e12 * cluster.float8_fraction)
    hidden, exposed = 0.0, {}
    for (op, dim), c in collectives.items():
        seconds = collective_seconds(op, c, cluster)
        if overlapped(op, dim, c, step):
            hidden += seconds
        else:
            exposed[dim] = exposed.get(dim, 0.0) + seconds
    step_s = max(compute, hidden) + bubble * compute + sum(exposed.values())
    return Prediction(compute, hidden, bubble * compute, sum(exposed.values()), exposed, step_s,
                      step.tokens / step.world_size / step_s, model_flops / step_s / peak)


def assumptions(cluster: Cluster, step: Step) -> list[str]:
    peak = cluster.peak_tflops
    fraction = cluster.compiled_fraction if step.compiled else cluster.eager_fraction
    return [
        f"cluster {cluster.name}; {cluster.gpus_per_node} GPUs a node",
        f"matmuls in {step.matmul_dtype} at {fraction:.0%} of {peak[step.matmul_dtype]:,.0f} TFLOP/s "
        f"({'compiled' if step.compiled else 'eager'}); float8 linear layers at {cluster.float8_fraction:.0%} of "
        f"{peak.get('float8', 0):,.0f}",
        f"collectives at {cluster.bandwidth_fraction:.0%} of {cluster.intra_node_gbps:,.0f} GB/s a GPU within a node "
        f"and {cluster.inter_node_gbps:,.0f} GB/s across nodes, {cluster.intra_node_latency_us:g} / "
        f"{cluster.inter_node_latency_us:g} us a call",
        "overlapped with compute: data-parallel collectives of 1 MiB or more a call (FSDP's gathers and "
        "reduce-scatters, HSDP's all-reduces)" + (", TP's of 1 MiB or more (async TP)" if step.async_tp else ""),
        "the others wait: step = max(compute, overlapped) + pipeline bubble + the others; a point-to-point send "
        "of the pipeline waits (its receive is the sender's)",
        "pipeline bubble: (pp - 1) / (stages a rank x micro-batches) of the compute, interleaved 1F1B's",
        "not modelled: zero-bubble schedules' smaller bubble, launch gaps, memory-bound kernels beyond the fraction "
        "above, congestion, data loading",
    ]
