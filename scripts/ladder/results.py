"""What a ladder's runs reached (results.csv) and what the law fitted to them says (fit.json). Both
are rebuilt from the run folders every time, as the sweep's report is."""

from __future__ import annotations

import csv
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from scripts.ladder.fit import HUBER_DELTA, STARTS, Law, bootstrap, fit_law, spread
from scripts.ladder.plan import N_MEANING, LadderRun, short_count, short_flops
from scripts.sweep.report import FINAL_FRACTION, FINAL_WINDOW, Result

LOSS_MEANING = {
    "validation": "final validation loss: validation.steps batches of validation.dataset_path after the last step",
    "train": f"final training loss: the mean of the last {FINAL_WINDOW} logged losses within the last "
             f"{FINAL_FRACTION:.0%} of the steps",
}
PARAMETERS = ("E", "A", "alpha", "B", "beta")


@dataclass
class Row:
    run: LadderRun
    result: Result
    role: str
    """fit, holdout, or excluded (not done, or no final loss)."""
    loss: float | None
    """The loss the law is fitted to (LOSS_MEANING)."""
    predicted: float | None = None


def final_loss(run: LadderRun, result: Result, kind: str) -> float | None:
    """The run's final loss of `kind`; None unless it is done and logged a finite one at its last step."""
    if result.status != "done":
        return None
    if kind == "validation":
        last = result.val[-1] if result.val else {}
        loss = last.get("val_loss") if last.get("step") == run.steps else None
    else:
        loss = result.summary["final_loss"]
    return loss if loss is not None and math.isfinite(loss) else None


def collect(runs: list[LadderRun], results: list[Result], kind: str, holdout: set[str]) -> list[Row]:
    by_name = {r.name: r for r in results}
    rows = []
    for run in runs:
        result = by_name[run.name]
        loss = final_loss(run, result, kind)
        role = "excluded" if loss is None else "holdout" if run.name in holdout else "fit"
        rows.append(Row(run, result, role, loss))
    return rows


CSV_COLUMNS = ("run", "rung", "N", "N_total", "D", "C", "steps", "status", "role", "final_loss", "predicted_loss",
               "final_train_loss", "final_val_loss", "tokens_per_second", "wall_time_s")


def write_csv(rows: list[Row], path: Path) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(CSV_COLUMNS)
        for row in rows:
            run, s = row.run, row.result.summary
            values = (run.name, run.rung, run.n_params, run.n_total, run.tokens, f"{run.flops:.4g}", run.steps,
                      row.result.status, row.role, row.loss, row.predicted, s["final_loss"], s["final_val_loss"],
                      s["tokens_per_second"], s["wall_time_s"])
            writer.writerow(["" if v is None else v for v in values])


def _with_interval(value: float, laws: list[Law], of: Callable[[Law], float]) -> dict:
    """A value of the full fit, with the spread of the same value over the bootstrap laws."""
    return {"value": value} | (spread([of(law) for law in laws]) if laws else {})


def fit_rows(rows: list[Row], kind: str, resamples: int, target: tuple[float, float] | None,
             log: Callable[[str], None]) -> tuple[dict, Law] | None:
    """Fit the law to the rows of role `fit` and fill in every row's prediction; returns what fit.json
    holds and the law (None, with a note, when fewer than two runs can be fitted)."""
    fitted = [r for r in rows if r.role == "fit"]
    if len(fitted) < 2:
        log(f"no fit: {len(fitted)} finished run(s) to fit, at least 2 are needed")
        return None
    n, d, loss = (np.array(v, dtype=float) for v in zip(*((r.run.n_params, r.run.tokens, r.loss) for r in fitted)))
    if len(fitted) < len(PARAMETERS) or len(set(n)) < 2 or len(set(d)) < 2:
        log(f"note: {len(fitted)} runs at {len(set(n))} sizes and {len(set(d))} token counts do not determine "
            f"the {len(PARAMETERS)} parameters: read the fit as one of many that match")
    full = fit_law(n, d, loss)
    laws = bootstrap(n, d, loss, full, resamples) if resamples else []
    law = full.law
    for row in rows:
        row.predicted = float(law.loss(row.run.n_params, row.run.tokens))
    residuals = np.log(loss) - np.log(law.loss(n, d))
    summary = {
        "law": "L(N, D) = E + A / N^alpha + B / D^beta",
        "N": N_MEANING,
        "D": "training tokens: steps x global batch x seq_len",
        "loss": LOSS_MEANING[kind],
        "method": f"Huber loss (delta {HUBER_DELTA}) between predicted and measured log loss, minimised by L-BFGS "
                  f"from the {STARTS} best points of a grid of starts (Hoffmann et al. 2022, approach 3); "
                  f"intervals: 5th-95th percentiles over {len(laws)} bootstrap resamples of the fitted runs"
                  + (f" ({resamples - len(laws)} of {resamples} refits ran away and were dropped)"
                     if len(laws) < resamples else ""),
        "fitted_runs": [r.run.name for r in fitted],
        "held_out_runs": [r.run.name for r in rows if r.role == "holdout"],
        "excluded_runs": {r.run.name: r.result.status for r in rows if r.role == "excluded"},
        "bootstrap_resamples": len(laws),
        "parameters": {k: _with_interval(getattr(law, k), laws, lambda x, k=k: getattr(x, k)) for k in PARAMETERS},
        "huber_objective": full.objective,
        "rms_log_residual": float(np.sqrt(np.mean(residuals**2))),
        "compute_optimal_exponents": _with_interval(law.beta / (law.alpha + law.beta), laws,
                                                    lambda x: x.beta / (x.alpha + x.beta))
        | {"meaning": "N_opt grows as C^a with this a, D_opt as C^(1 - a)"},
        "held_out": [_prediction(r.run.n_params, r.run.tokens, law, laws) | {
            "run": r.run.name, "measured_loss": r.loss, "error": r.predicted - r.loss,
            "relative_error": (r.predicted - r.loss) / r.loss} for r in rows if r.role == "holdout"],
    }
    if target is not None:
        n_target, d_target = target
        n_opt, d_opt = law.compute_optimal(6 * n_target * d_target)
        summary["target"] = _prediction(n_target, d_target, law, laws) | {
            "compute_optimal_at_this_compute": {"N": float(n_opt), "D": float(d_opt),
                                                "loss": float(law.loss(n_opt, d_opt))}}
    return _finite(summary), law


def _finite(value):
    """NaN and infinities (a fit without a compute optimum, a diverging resample) as null: JSON has neither."""
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return None if isinstance(value, float) and not math.isfinite(value) else value


def _prediction(n: float, d: float, law: Law, laws: list[Law]) -> dict:
    predicted = _with_interval(float(law.loss(n, d)), laws, lambda x: float(x.loss(n, d)))
    return {"N": n, "D": d, "C": 6 * n * d, "predicted_loss": predicted}


def _interval(entry: dict, form: str) -> str:
    if "p5" not in entry:
        return f"{entry['value']:{form}}"
    return f"{entry['value']:{form}} [{entry['p5']:{form}}, {entry['p95']:{form}}]"


def summary_lines(summary: dict) -> list[str]:
    """The fit, the held-out runs and the target in a few lines (90% bootstrap intervals in brackets)."""
    resamples = summary["bootstrap_resamples"]
    intervals = f", 90% intervals over {resamples} resamples" if resamples else ""
    lines = [f"fit of {summary['law']} to {len(summary['fitted_runs'])} runs (the {summary['loss'].split(':')[0]}"
             f"{intervals}):"]
    for key, entry in summary["parameters"].items():
        lines.append(f"  {key:<5} = " + _interval(entry, ".4g"))
    lines.append(f"  rms residual {summary['rms_log_residual']:.4f} in log loss")
    for h in summary["held_out"]:
        lines.append(f"held out {h['run']} (N {short_count(h['N'])}, D {short_count(h['D'])}): measured "
                     f"{h['measured_loss']:.4f}, predicted {_interval(h['predicted_loss'], '.4f')} "
                     f"({h['relative_error']:+.2%})")
    if "target" in summary:
        t = summary["target"]
        lines.append(f"target N {short_count(t['N'])}, D {short_count(t['D'])} (C {short_flops(t['C'])} FLOPs): "
                     f"predicted loss {_interval(t['predicted_loss'], '.4f')}")
    return lines
