"""A picture of runs without TensorBoard: loss (validation loss dashed), learning rate, gradient norm and
throughput over steps, and the largest attention logit where a run logged it (QK-clip's, max_logit/<layer>: the
largest over the layers), read from each run's metrics.jsonl, several runs on one chart. run_train.sh's launcher writes
<dump_folder>/metrics.png at the end of every launch that trained (components/run/launch.py); `python -m
scripts.plot DUMP_FOLDER...` draws any runs on demand."""

from __future__ import annotations

import os
from pathlib import Path

from components.metrics.reporting import read_metrics

PANELS = (("loss", "loss", "linear"), ("lr", "learning rate", "linear"), ("grad_norm", "gradient norm", "log"),
          ("tokens_per_second", "tokens/s per device", "linear"))
"""metrics.jsonl's field, the panel's title and its y scale."""
LOGIT_PANEL = ("max_logit", "largest attention logit", "log")
"""Drawn where a run logged max_logit/<layer>: the step's largest over its layers."""


def largest_logit(record: dict) -> float | None:
    return max((v for k, v in record.items() if k.startswith("max_logit/")), default=None)


def plot_runs(folders: list[Path], output: Path) -> list[Path]:
    """Draw the runs of `folders` that logged a step into `output` (a PNG, written whole); the folders drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [(folder, *read_metrics(folder / "metrics.jsonl")) for folder in folders]
    runs = [run for run in runs if run[1]]
    if not runs:
        return []
    for _, train, _ in runs:
        for record in train:
            record["max_logit"] = largest_logit(record)
    panels = PANELS + ((LOGIT_PANEL,) if any(r["max_logit"] is not None for _, t, _ in runs for r in t) else ())
    columns = 2 if len(panels) == 4 else 3
    fig, axes = plt.subplots(2, columns, figsize=(5 * columns, 6.5), sharex=True)
    if len(panels) < axes.size:
        axes.flat[-1].set_axis_off()
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (folder, train, validation) in enumerate(runs):
        color, label = colors[i % len(colors)], str(folder)
        for ax, (key, _, _) in zip(axes.flat, panels):
            points = [(r["step"], r[key]) for r in train if r.get(key) is not None]
            if points:
                ax.plot(*zip(*points), color=color, linewidth=1.2, label=label)
        points = [(r["step"], r["val_loss"]) for r in validation if r.get("val_loss") is not None]
        if points:
            axes[0, 0].plot(*zip(*points), color=color, linestyle="--", marker=".", label=f"{label} (validation)")
    for ax, (_, title, scale) in zip(axes.flat, panels):
        ax.set_title(title, fontsize="medium")
        ax.set_yscale(scale)
        ax.grid(alpha=0.3)
    for ax in axes.flat[max(0, len(panels) - columns):len(panels)]:  # the lowest panel of each column
        ax.set_xlabel("step")
        ax.xaxis.set_tick_params(labelbottom=True)
    axes[0, 0].legend(fontsize="small")
    fig.tight_layout()
    partial = output.with_name(f".{output.name}.partial")
    fig.savefig(partial, dpi=80, format="png")
    plt.close(fig)
    os.replace(partial, output)  # a reader (or another node's launcher) never sees half a picture
    return [folder for folder, _, _ in runs]
