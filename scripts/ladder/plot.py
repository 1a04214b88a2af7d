"""loss_vs_compute.png: each run's final loss against its compute C = 6 N D, one colour per rung;
the fitted law along each rung (N fixed, D growing), the compute-optimal frontier, and the target's
prediction with its bootstrap interval."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from scripts.ladder.fit import Law
from scripts.ladder.plan import short_count
from scripts.ladder.results import Row


def plot_loss_vs_compute(rows: list[Row], law: Law, summary: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured = [r for r in rows if r.loss is not None]
    target = summary.get("target")
    flops = [r.run.flops for r in measured] + ([target["C"]] if target else [])
    span = np.geomspace(min(flops) / 2, max(flops) * 2, 200)
    fig, ax = plt.subplots(figsize=(8, 5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, rung in enumerate(dict.fromkeys(r.run.rung for r in rows)):
        color = colors[i % len(colors)]
        members = [r for r in rows if r.run.rung == rung]
        n = members[0].run.n_params
        ax.plot(span, law.loss(n, span / (6 * n)), color=color, linewidth=1, alpha=0.6,
                label="fitted law at each rung's N" if i == 0 else None)
        for role, marker in (("fit", "o"), ("holdout", "D")):
            points = [r for r in members if r.role == role]
            if points:
                label = f"{rung} (N {short_count(n)})" + (", held out" if role == "holdout" else "")
                ax.scatter([r.run.flops for r in points], [r.loss for r in points], color=color, marker=marker,
                           facecolors="none" if role == "holdout" else color, s=40, zorder=3, label=label)
    n_opt, d_opt = law.compute_optimal(span)
    if np.isfinite(n_opt).all():
        ax.plot(span, law.loss(n_opt, d_opt), color="black", linestyle="--", linewidth=1, label="compute-optimal N")
    shown = [r.loss for r in measured]
    if target:
        predicted = target["predicted_loss"]
        interval = [predicted[k] for k in ("p5", "p95") if predicted.get(k) is not None]
        if len(interval) == 2:  # the full fit need not lie inside the bootstrap's interval: no error bar
            ax.plot([target["C"]] * 2, interval, color="black", linewidth=1.5, marker="_", markersize=14,
                    label="90% bootstrap interval")
        ax.scatter([target["C"]], [predicted["value"]], color="black", marker="*", s=70, zorder=4,
                   label=f"target N {short_count(target['N'])}, D {short_count(target['D'])}: predicted")
        shown += [predicted["value"], *interval]
    pad = 0.25 * (max(shown) - min(shown)) or 0.1
    ax.set_ylim(min(shown) - pad, max(shown) + pad)  # the points, not the curves' far ends
    ax.set_xscale("log")
    ax.set_xlabel("compute C = 6 N D (FLOPs)")
    ax.set_ylabel(summary["loss"].split(":")[0])
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1), fontsize="small")
    fig.savefig(path, dpi=90, bbox_inches="tight")
    plt.close(fig)
