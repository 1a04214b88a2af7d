"""Where one profiled step's time goes, read from a torch.profiler chrome trace (train.py's profiling, or
the benchmark's --traces): the step's wall time, how much of it the GPU was busy, the idle gaps between
kernels, the kernels by total time (and by kind: matmuls, attention, compiled Triton kernels,
collectives, copies) and the peak memory the allocator reported.

    python -m scripts.benchmark.trace_summary TRACE.json [TRACE.json ...] [--top 15] > summary.md

On a CPU trace (no GPU kernels) the operators take the kernels' place, by their own time."""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
# The first pattern found in a kernel's lower-cased name names its kind.
KINDS = (("collective", ("nccl",)), ("attention", ("flash", "fmha", "attention", "flex")),
         ("matmul", ("gemm", "nvjet", "xmma", "cutlass", "cublas", "matmul", "_mm_")),
         ("copy", ("memcpy", "memset", "copy")), ("Triton (compiled)", ("triton",)))
GAP_US = 10.0
"""Gaps shorter than this are the launch-to-launch spacing of a busy stream, not idle time worth naming."""


def kind(name: str) -> str:
    lowered = name.lower()
    return next((k for k, patterns in KINDS if any(p in lowered for p in patterns)), "other")


def merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def short(name: str, width: int = 90) -> str:
    name = " ".join(name.split()).replace("|", "\\|")
    return name if len(name) <= width else name[:width - 1] + "…"


def summarize(trace: dict, title: str, top: int = 15) -> str:
    events = trace["traceEvents"]
    steps = [e for e in events if e.get("cat") == "user_annotation" and e.get("name", "").startswith("ProfilerStep#")]
    if not steps:
        raise ValueError(f"{title}: no ProfilerStep span: not a torch.profiler trace of a training step")
    step = max(steps, key=lambda e: e["dur"])  # the recorded step (the warm-up's span can be in the trace too)
    begin, end = step["ts"], step["ts"] + step["dur"]
    inside = [e for e in events if e.get("ph") == "X" and begin <= e["ts"] < end and "dur" in e]
    gpu = [e for e in inside if e.get("cat") in GPU_CATEGORIES]
    work = gpu or [e for e in inside if e.get("cat") == "cpu_op"]
    lines = [f"### {title}", ""]
    step_ms = step["dur"] / 1e3
    facts = [f"step {step_ms:.1f} ms"]
    if gpu:
        busy = merged([(e["ts"], e["ts"] + e["dur"]) for e in gpu])
        busy_ms = sum(b - a for a, b in busy) / 1e3
        gaps = [(busy[i + 1][0] - busy[i][1], i) for i in range(len(busy) - 1)]
        gaps = [(g, i) for g, i in gaps if g >= GAP_US]
        lead = (busy[0][0] - begin) / 1e3 if busy else 0.0
        idle_ms = sum(g for g, _ in gaps) / 1e3
        facts += [f"GPU busy {busy_ms:.1f} ms ({100 * busy_ms / step_ms:.0f}%)",
                  f"{len(gaps)} gaps of {GAP_US:.0f} µs or more between kernels, {idle_ms:.1f} ms in all",
                  f"first kernel {lead:.1f} ms after the step began"]
    memory = [e["args"] for e in events if e.get("name") == "[memory]" and "Total Allocated" in e.get("args", {})]
    device_type = 1 if gpu else 0
    memory = [m for m in memory if m.get("Device Type") == device_type]
    if memory:
        gib = 2 ** 30
        reserved = max(m.get("Total Reserved", 0) for m in memory) / gib
        facts.append(f"peak allocated {max(m['Total Allocated'] for m in memory) / gib:.2f} GiB"
                     + (f", reserved {reserved:.2f} GiB" if reserved else ""))
    lines += ["; ".join(facts) + ".", ""]
    totals: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    by_kind: dict[str, float] = defaultdict(float)
    for e in work:
        totals[e["name"]][0] += 1
        totals[e["name"]][1] += e["dur"]
        by_kind[kind(e["name"]) if gpu else "CPU operators (inclusive)"] += e["dur"]
    if gpu:
        lines += ["| kind | ms | % of the step |", "| --- | ---: | ---: |"]
        lines += [f"| {k} | {us / 1e3:.1f} | {100 * us / step['dur']:.1f} |"
                  for k, us in sorted(by_kind.items(), key=lambda kv: -kv[1])]
        lines.append("")
    what = "kernel" if gpu else "CPU operator (inclusive time)"
    lines += [f"| {what} | calls | ms | % of the step |", "| --- | ---: | ---: | ---: |"]
    for name, (calls, us) in sorted(totals.items(), key=lambda kv: -kv[1][1])[:top]:
        lines.append(f"| {short(name)} | {calls} | {us / 1e3:.2f} | {100 * us / step['dur']:.1f} |")
    if gpu and gaps:
        names = sorted(gpu, key=lambda e: e["ts"])
        lines += ["", "Largest gaps (the kernel that ended before, the one that began after):", ""]
        for g, i in sorted(gaps, reverse=True)[:5]:
            ended = [e for e in names if e["ts"] + e["dur"] <= busy[i][1] + 1e-3]
            before = max(ended, key=lambda e: e["ts"] + e["dur"])
            after = next(e for e in names if e["ts"] >= busy[i + 1][0] - 1e-3)
            lines.append(f"- {g / 1e3:.2f} ms after `{short(before['name'], 60)}`, before `{short(after['name'], 60)}`")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m scripts.benchmark.trace_summary",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("traces", nargs="+", type=Path)
    parser.add_argument("--top", type=int, default=15, help="kernels listed per trace (default 15)")
    opts = parser.parse_args(argv)
    for path in opts.traces:
        print(summarize(json.loads(path.read_text()), path.stem, opts.top))


if __name__ == "__main__":
    main()
