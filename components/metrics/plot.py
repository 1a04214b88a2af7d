"""A picture of runs without TensorBoard: loss (validation loss dashed), learning rate, gradient norm and
throughput over steps, read from each run's metrics.jsonl, several runs on one chart. run_train.sh's launcher writes
<dump_folder>/metrics.png at the end of every launch that trained (components/run/launch.py); `python -m
scripts.plot DUMP_FOLDER...` draws any runs on demand."""

from __future__ import annotations

import os
from pathlib import Path

from components.metrics.reporting import read_metrics

PANELS = (("loss", "loss", "linear"), ("lr", "learning rate", "linear"), ("grad_norm", "gradient norm", "log"),
          ("tokens_per_second", "tokens/s per device", "linear"))
"""metrics.jsonl's field, the panel's title and its y scale."""


def plot_runs(folders: list[Path], output: Path) -> list[Path]:
    """Draw the runs of `folders` that logged a step into `output` (a PNG, written whole); the folders drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [(folder, *read_metrics(folder / "metrics.jsonl")) for folder in folders]
    runs = [run for run in runs if run[1]]
    if not runs:
        return []
    fig, axes = plt.subplots(2, 2, figsize=(10, 6.5), sharex=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (folder, train, validation) in enumerate(runs):
        color, label = colors[i % len(colors)], str(folder)
        for ax, (key, _, _) in zip(axes.flat, PANELS):
            points = [(r["step"], r[key]) for r in train if r.get(key) is not None]
            if points:
                ax.plot(*zip(*points), color=color, linewidth=1.2, label=label)
        points = [(r["step"], r["val_loss"]) for r in validation if r.get("val_loss") is not None]
        if points:
            axes[0, 0].plot(*zip(*points), color=color, linestyle="--", marker=".", label=f"{label} (validation)")
    for ax, (_, title, scale) in zip(axes.flat, PANELS):
        ax.set_title(title, fontsize="medium")
        ax.set_yscale(scale)
        ax.grid(alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel("step")
    axes[0, 0].legend(fontsize="small")
    fig.tight_layout()
    partial = output.with_name(f".{output.name}.partial")
    fig.savefig(partial, dpi=80, format="png")
    plt.close(fig)
    os.replace(partial, output)  # a reader (or another node's launcher) never sees half a picture
    return [folder for folder, _, _ in runs]
