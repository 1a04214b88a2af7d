"""The report of a sweep, or of any run folders (`compare`): results.csv and results.md with a row per
run and a row per setting (runs that differ only in their seed), and loss_curves.png. It is rebuilt
from the runs' files every time, so it always shows what is on disk."""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from components.config import Config, ConfigError, load_config
from components.data.batch_plan import batch_plan
from components.distributed.mesh import ParallelDims
from components.metrics.reporting import read_metrics
from models.families import model_config_class
from scripts.sweep.plan import Sweep, SweepError, flatten, name_value
from scripts.sweep.state import last_logged_step, newest_checkpoint, read_state

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

SEED_KEY = "training.seed"
FINAL_WINDOW = 5  # "final loss": mean of at most this many logged losses ...
FINAL_FRACTION = 0.1  # ... from the last 10% of the run's steps
# Keys that do not change what a run computes; compare ignores them when it looks for differences.
NOT_A_SETTING = ("job.", "metrics.", "profiling.", "comm.", "checkpoint.enable", "checkpoint.folder",
                 "checkpoint.interval", "checkpoint.async_mode", "checkpoint.keep_latest_k", "validation.freq")


# --- Results: what each run reached ------------------------------------------------------------------


@dataclass
class Result:
    name: str
    overrides: dict[str, object]
    status: str
    steps: int
    tokens_per_step: int | None
    train: list[dict]
    val: list[dict]
    exit_code: int | None = None
    error: str | None = None
    wall_time_s: float | None = None
    summary: dict = field(default_factory=dict)

    def __post_init__(self):
        self.summary = summarize(self.train, self.val) | {"wall_time_s": self.wall_time_s}


def summarize(train: list[dict], val: list[dict]) -> dict:
    """final_loss: mean of the last few logged losses (at most FINAL_WINDOW, from the last 10% of the
    steps); best_loss; final_val_loss; tokens_per_second and mfu: medians over the logged steps after
    the first (which includes start-up); peak_memory_gib; last_step."""
    out = dict.fromkeys(("last_step", "final_loss", "best_loss", "final_val_loss", "tokens_per_second", "mfu",
                         "peak_memory_gib"))
    if train:
        last = train[-1]["step"]
        tail = [r for r in train if r["step"] >= last * (1 - FINAL_FRACTION)][-FINAL_WINDOW:]
        steady = train[1:] or train
        out.update(
            last_step=last,
            final_loss=statistics.fmean(r["loss"] for r in tail),
            best_loss=min(r["loss"] for r in train),
            tokens_per_second=statistics.median(r["tokens_per_second"] for r in steady),
            mfu=statistics.median(mfus) if (mfus := [r["mfu"] for r in steady if r.get("mfu") is not None]) else None,
            peak_memory_gib=max(r["memory_gib"] for r in train),
        )
    if val:
        out["final_val_loss"] = val[-1].get("val_loss")  # None with several named validation sources
    return out


def flat_config(config: Config | dict) -> dict[str, object]:
    return flatten(dataclasses.asdict(config) if isinstance(config, Config) else config)


def tokens_per_step(config: Config, world_size: int) -> int | None:
    """Tokens of one optimizer step on `world_size` processes; None where the layout does not fit
    that many processes (the run itself then fails at start-up)."""
    try:
        dp = ParallelDims.from_config(config.parallelism, world_size).dp
        return batch_plan(config.training, dp).tokens_per_step
    except ConfigError:
        return None


def sweep_results(sweep: Sweep) -> list[Result]:
    results = []
    for run in sweep.runs:
        state = read_state(run.dump)
        train, val = read_metrics(run.dump / "metrics.jsonl")
        attempts = state.get("attempts", [])
        wall = sum(a.get("wall_time_s") or 0 for a in attempts) if attempts else None
        results.append(Result(
            run.name, run.overrides, state.get("status", "not run"), run.config.training.steps,
            tokens_per_step(run.config, sweep.nproc_per_run), train, val,
            state.get("exit_code"), state.get("error"), wall,
        ))
    return results


def _world_size_of(dump: Path, state: dict, checkpoint_folder: str) -> int:
    """Processes of a finished run: from sweep_run.json, else from the ranks of its newest checkpoint
    (DCP writes __<rank>_<n>.distcp), else 1."""
    if state.get("nproc"):
        return int(state["nproc"])
    step = newest_checkpoint(dump, checkpoint_folder)
    if step is not None:
        ranks = {p.name.split("_")[2] for p in (dump / checkpoint_folder / f"step-{step}").glob("__*_*.distcp")}
        if ranks:
            return len(ranks)
    return 1


def _dump_tokens_per_step(dump: Path, state: dict) -> int | None:
    """Tokens per step of a run folder, from the config.toml train.py wrote there; None where that config
    no longer loads (say a key that this version does not know)."""
    try:
        config = load_config(["--job.config_file", str(dump / "config.toml")], model_config_class)
    except ConfigError:
        return None
    return tokens_per_step(config, _world_size_of(dump, state, config.checkpoint.folder))


def dump_results(dumps: list[Path]) -> list[Result]:
    """Results of any finished (or unfinished) run folders, for `compare`. A run's overrides are the
    keys of its config.toml that differ between the folders (leaving out job.*, metrics.* and other
    keys that do not change what is computed)."""
    configs = {}
    for dump in dumps:
        path = dump / "config.toml"
        if not path.is_file():
            raise SweepError(f"{dump} has no config.toml: not a run's dump folder")
        try:
            configs[dump] = flat_config(tomllib.loads(path.read_text()))
        except tomllib.TOMLDecodeError as e:
            raise SweepError(f"cannot parse {path}: {e}") from None
    keys = list(dict.fromkeys(k for cfg in configs.values() for k in cfg))
    differing = [k for k in keys if not k.startswith(NOT_A_SETTING)
                 and len({json.dumps(cfg.get(k)) for cfg in configs.values()}) > 1]
    names = [d.name for d in dumps]
    results = []
    for dump, cfg in configs.items():
        name = dump.name if names.count(dump.name) == 1 else f"{dump.parent.name}/{dump.name}"
        state = read_state(dump)
        train, val = read_metrics(dump / "metrics.jsonl")
        steps = int(cfg.get("training.steps", 0))
        reached_end = bool(train) and train[-1]["step"] >= last_logged_step(steps, int(cfg.get("metrics.log_freq", 10)))
        status = state.get("status") or ("done" if reached_end else "incomplete")
        attempts = state.get("attempts", [])
        wall = sum(a.get("wall_time_s") or 0 for a in attempts) if attempts else None
        results.append(Result(
            name, {k: cfg.get(k) for k in differing}, status, steps, _dump_tokens_per_step(dump, state), train, val,
            state.get("exit_code"), state.get("error"), wall,
        ))
    return results


# --- Settings: runs that differ only in their seed ---------------------------------------------------


def short_label(overrides: dict[str, object]) -> str:
    """`lr=0.001, seed=1` for a legend or a table."""
    if not overrides:
        return "base"
    keys = list(overrides)
    parts = [k.rsplit(".", 1)[-1] for k in keys]
    return ", ".join(f"{p if parts.count(p) == 1 else k}={_value_text(overrides[k])}" for k, p in zip(keys, parts))


@dataclass
class Group:
    """Runs that differ only in training.seed."""
    label: str
    results: list[Result]

    def curve(self) -> tuple[list[int], list[float], list[float], list[float]]:
        """Steps logged by every member, and the mean, min and max of the training loss at each."""
        members = [{r["step"]: r["loss"] for r in res.train} for res in self.results if res.train]
        if not members:
            return [], [], [], []
        steps = sorted(set.intersection(*(set(m) for m in members))) or sorted(members[0])
        values = [[m[s] for m in members if s in m] for s in steps]
        return steps, [statistics.fmean(v) for v in values], [min(v) for v in values], [max(v) for v in values]

    def stat(self, key: str) -> list[float]:
        return [r.summary[key] for r in self.results if r.summary.get(key) is not None]


def group_by_setting(results: list[Result]) -> list[Group]:
    groups: dict[str, Group] = {}
    for res in results:
        setting = {k: v for k, v in res.overrides.items() if k != SEED_KEY}
        signature = json.dumps(setting, sort_keys=True, default=str)
        groups.setdefault(signature, Group(short_label(setting), []))
        groups[signature].results.append(res)
    return list(groups.values())


# --- Tables and plot -------------------------------------------------------------------------------------


def _fmt(value, digits: int = 4) -> str:
    if value is None:
        return ""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return f"{value:.{digits}f}"


def _fmt_time(seconds: float | None) -> str:
    if seconds is None:
        return ""
    seconds = round(seconds)
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


def _value_text(value) -> str:
    """A config value in a label or a table; `unset` for a key a run's config does not have."""
    return name_value(value) if value is not None else "unset"


def overrides_text(overrides: dict[str, object], sep: str = " ") -> str:
    return sep.join(f"{k}={_value_text(v)}" for k, v in overrides.items())


CSV_COLUMNS = ("run", "overrides", "status", "exit_code", "last_step", "steps", "final_loss", "best_loss",
               "final_val_loss", "tokens_per_second", "mfu", "peak_memory_gib", "wall_time_s", "error")


def write_csv(results: list[Result], path: Path) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(CSV_COLUMNS)
        for r in results:
            s = r.summary
            exit_code = "" if r.exit_code is None else r.exit_code
            summary_columns = ("" if s[k] is None else s[k] for k in CSV_COLUMNS[6:13])
            writer.writerow([r.name, overrides_text(r.overrides, "; "), r.status, exit_code, s["last_step"] or "",
                             r.steps, *summary_columns, r.error or ""])


def _run_rows(results: list[Result]) -> list[str]:
    rows = [
        "| run | overrides | status | steps | final loss | best loss | final val loss | tokens/s | MFU % "
        "| peak memory GiB | wall time |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        s = r.summary
        tps = f"{s['tokens_per_second']:,.0f}" if s["tokens_per_second"] is not None else ""
        rows.append(
            f"| {r.name} | {overrides_text(r.overrides)} | {r.status} | {s['last_step'] or 0}/{r.steps} | "
            f"{_fmt(s['final_loss'])} | {_fmt(s['best_loss'])} | {_fmt(s['final_val_loss'])} | {tps} | "
            f"{_fmt(s['mfu'], 2)} | {_fmt(s['peak_memory_gib'], 2)} | {_fmt_time(s.get('wall_time_s'))} |"
        )
    return rows


def _setting_rows(groups: list[Group]) -> list[str]:
    rows = [
        "| setting | runs | final loss mean ± std | final loss min – max | best loss mean | final val loss mean "
        "| tokens/s mean |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for g in groups:
        final, best = g.stat("final_loss"), g.stat("best_loss")
        val, tps = g.stat("final_val_loss"), g.stat("tokens_per_second")
        std = statistics.stdev(final) if len(final) > 1 else 0.0
        rows.append(
            f"| {g.label} | {len(g.results)} | {_fmt(statistics.fmean(final)) + ' ± ' + _fmt(std) if final else ''} | "
            f"{_fmt(min(final)) + ' – ' + _fmt(max(final)) if final else ''} | "
            f"{_fmt(statistics.fmean(best)) if best else ''} | {_fmt(statistics.fmean(val)) if val else ''} | "
            f"{f'{statistics.fmean(tps):,.0f}' if tps else ''} |"
        )
    return rows


def markdown(results: list[Result], title: str, preamble: list[str] = (), plot: str | None = None) -> str:
    lines = [f"# {title}", "", *preamble, *_run_rows(results)]
    lines += ["", f"final loss: mean of the last {FINAL_WINDOW} logged training losses (within the last "
                  f"{FINAL_FRACTION:.0%} of the steps); tokens/s and MFU: medians over the logged steps after the "
                  "first (per device); wall time: all attempts."]
    groups = group_by_setting(results)
    if any(len(g.results) > 1 for g in groups):
        lines += ["", "## By setting (seeds grouped)", "", *_setting_rows(groups)]
    failures = [r for r in results if r.status == "failed"]
    if failures:
        lines += ["", "## Failed runs", ""]
        lines += [f"- {r.name} (exit code {r.exit_code}): `{(r.error or '').replace('`', chr(39))}` — "
                  f"see {r.name}/stderr.log" for r in failures]
    if plot:
        lines += ["", f"![loss curves]({plot})"]
    return "\n".join(lines) + "\n"


def plot_curves(results: list[Result], path: Path, title: str) -> bool:
    """Train loss against steps and against tokens, one line per setting; a setting with several seeds
    is drawn as their mean with a min-max band. False (and nothing written) where no run logged a loss."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import EngFormatter

    fig, (by_step, by_tokens) = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    drawn = 0
    for i, group in enumerate(group_by_setting(results)):
        steps, mean, low, high = group.curve()
        if not steps:
            continue
        color = colors[i % len(colors)]
        n = sum(1 for r in group.results if r.train)
        label = group.label + (f" ({n} seeds)" if n > 1 else "")
        per_step = next(r.tokens_per_step for r in group.results if r.train)
        for ax, xs in ((by_step, steps), (by_tokens, [s * per_step for s in steps] if per_step else None)):
            if xs is None:
                continue
            ax.plot(xs, mean, color=color, label=label, linewidth=1.5)
            if n > 1:
                ax.fill_between(xs, low, high, color=color, alpha=0.2, linewidth=0)
        drawn += 1
    if not drawn:
        plt.close(fig)
        return False
    by_step.set_xlabel("step")
    by_step.set_ylabel("train loss")
    by_tokens.set_xlabel("tokens (step × global batch × seq_len)")
    by_tokens.xaxis.set_major_formatter(EngFormatter())
    for ax in (by_step, by_tokens):
        ax.grid(alpha=0.3)
    by_step.legend(fontsize="small")
    fig.suptitle(title + " — mean over seeds, band: min–max")
    fig.tight_layout()
    fig.savefig(path, dpi=90, bbox_inches="tight")  # a long legend grows the figure rather than being cut
    plt.close(fig)
    return True


def write_report(results: list[Result], output: Path, title: str, preamble: list[str],
                 log: Callable[[str], None]) -> str:
    """results.csv, results.md and (where a run logged a loss) loss_curves.png in `output`; logs the markdown and
    the files written, and returns the markdown."""
    output.mkdir(parents=True, exist_ok=True)
    write_csv(results, output / "results.csv")
    plotted = plot_curves(results, output / "loss_curves.png", title)
    if not plotted:
        (output / "loss_curves.png").unlink(missing_ok=True)  # never leave a stale plot beside a new table
    text = markdown(results, title, preamble, "loss_curves.png" if plotted else None)
    (output / "results.md").write_text(text)
    log(text.rstrip("\n"))
    files = ["results.md", "results.csv"] + (["loss_curves.png"] if plotted else [])
    log(f"report: {', '.join(str(output / f) for f in files)}")
    return text
