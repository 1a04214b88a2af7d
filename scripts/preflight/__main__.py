"""python -m scripts.preflight --world-size N [--ranks R,R] [--cluster h100|h200|FILE] [--section.key value ...]

Runs train.py's start-up path and one training step for chosen ranks of an N-process job over torch's fake
process group, on fake tensors: whether the layout composes (else train.py's own error, exit 2), and per rank
its share of the parameters and optimizer state, the collectives of one step by mesh dimension, the step's
FLOPs, and the step's time, tokens/s and MFU predicted on a GPU cluster (docs/preflight.md)."""

from __future__ import annotations

import argparse
import sys

from components.config import ConfigError, load_config
from components.distributed.mesh import ParallelDims
from models.families import model_config_class
from scripts.preflight.predict import Cluster, Step, assumptions, duration, load_cluster, predict
from scripts.preflight.rank import RankReport, default_ranks, run_ranks

GIB = 2**30


def positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return int(text)


def size(n: float) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB / 10 else f"{n / 2**20:.1f} MiB"


def describe(report: RankReport, step: Step, cluster: Cluster) -> str:
    where = ", ".join(f"{k} {v}" for k, v in report.coordinates.items()) or "the only rank"
    lines = [f"rank {report.rank} ({where}), its start-up and one step checked in {report.seconds:.1f} s:",
             f"  parameters {report.params / 1e6:,.2f}M ({size(report.param_bytes)}), optimizer state "
             f"{size(report.optimizer_bytes)}; checkpoint share {size(report.param_bytes + report.optimizer_bytes)}",
             f"  memory at the step's peak {size(report.peak_bytes)} (its tensors)",
             f"  FLOPs of one step {report.flops / 1e12:,.3f} T counted"
             + (f" ({report.float8_flops / 1e12:,.3f} T in float8 linear layers)" if report.float8_flops else "")
             + f"; the model's formula (MFU's) gives this rank {report.model_flops / 1e12:,.3f} T",
             "  collectives of one step (bytes put in: a gather's or all-to-all's input, a reduce-scatter's whole "
             "buffer, a reduction's or send's tensors):" if report.collectives else "  no collectives"]
    if report.note:
        lines.insert(1, f"  note: {report.note}")
    width = max([14, *(len(dim) for _, dim in report.collectives)])
    if report.collectives:
        lines.append(f"    {'mesh dimension':{width}s} {'collective':32s} {'calls':>5s} {'bytes put in':>12s}  group")
    for (op, dim), c in sorted(report.collectives.items(), key=lambda kv: (kv[0][1], -kv[1].bytes)):
        lines.append(f"    {dim:{width}s} {op:32s} {c.count:5d} {size(c.bytes):>12s}  {c.group_size} ranks")
    p = predict(report.flops, report.float8_flops, report.model_flops, report.collectives, step, cluster,
                report.pipeline_bubble)
    waits = p.waits()
    lines.append(f"  predicted step {duration(p.step_s)}: compute {duration(p.compute_s)} beside "
                 f"{duration(p.overlapped_s)} of overlapped collectives, "
                 + (f"a pipeline bubble of {duration(p.bubble_s)}, " if p.bubble_s else "")
                 + f"then {duration(p.exposed_s)} waiting"
                 + (f" ({waits})" if waits else ""))
    lines.append(f"  predicted {p.tokens_per_gpu_s:,.0f} tokens/s per GPU, MFU {p.mfu:.1%}")
    return "\n".join(lines)


EPILOG = """Every other argument is a train.py config argument (--section.key value).

Example: FSDP 4 x TP 2 of the debug model, ranks 0 and 7:
  python -m scripts.preflight --world-size 8 --job.config_file debug_model.toml \\
      --parallelism.data_parallel_shard_degree 4 --parallelism.tensor_parallel_degree 2"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.preflight", description=__doc__.split("\n\n")[1],
                                     allow_abbrev=False, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=EPILOG)
    parser.add_argument("--world-size", type=positive_int, required=True, help="processes of the job (required)")
    parser.add_argument("--ranks", help="comma-separated ranks to check (default: the first and the last)")
    parser.add_argument("--cluster", default="h100",
                        help="h100, h200, or a TOML file of changes to one (scripts/preflight/predict.py's Cluster; "
                             "default h100)")
    args, config_args = parser.parse_known_args(argv)
    try:
        config = load_config(config_args, model_config_class)
        dims = ParallelDims.from_config(config.parallelism, args.world_size)
        ranks = [int(r) for r in args.ranks.split(",")] if args.ranks else default_ranks(dims)
        if bad := [r for r in ranks if not 0 <= r < args.world_size]:
            raise ConfigError(f"--ranks {args.ranks}: {bad} not in 0 to {args.world_size - 1}")
        cluster = load_cluster(args.cluster)
        step = Step.of(config, dims)
        reports = run_ranks(config, args.world_size, ranks)
        first = next(reports)  # a layout that does not compose is refused here, before anything is printed
        print(f"preflight: {config.model.name} {config.model.flavor} on {args.world_size} processes, "
              f"{dims.describe()}, ranks {ranks}\nprediction's assumptions:\n"
              + "\n".join(f"  {line}" for line in assumptions(cluster, step)), flush=True)
        for report in (first, *reports):
            print(describe(report, step, cluster), flush=True)
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
