"""The runs of a ladder. Each rung's config is resolved with train.py's loader, its parameters are
counted on the meta device by its model package, and each budget becomes a number of steps; the runs
are then written as a sweep file, which scripts/sweep runs (and skips, resumes, reports)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from components.config import Config, ConfigError, load_config
from models.families import import_model_package, model_config_class
from scripts.ladder.spec import Budget, Ladder, LadderError
from scripts.memory_estimate import cpu_baseline_bytes, default_target, estimate
from scripts.memory_estimate.estimator import vocab_size
from scripts.sweep.plan import SweepError, cli_args, resolve_base
from scripts.sweep.report import tokens_per_step

N_MEANING = ("non-embedding parameters: every parameter but the token embedding table (the output projection is a "
             "matmul and counts), as the MFU's FLOPs per token; counted on the meta device by the model package")


@dataclass
class LadderRun:
    name: str
    rung: str
    overrides: dict[str, object]
    """The rung's config keys and training.steps (the ladder's common [overrides] come first)."""
    n_params: int
    """N: non-embedding parameters (N_MEANING)."""
    n_total: int
    steps: int
    tokens: int
    """D: steps x tokens per step (global batch x seq_len), what the run trains on."""
    config: Config
    """The rung's resolved config (its steps are the base config's: the sweep sets them)."""

    @property
    def flops(self) -> float:
        """C = 6 N D: the matmul FLOPs of training, without attention's."""
        return 6.0 * self.n_params * self.tokens


def short_count(value: float) -> str:
    """125000 -> 125k, 2.5e9 -> 2.5B: three significant digits, for run names and tables."""
    value = float(f"{value:.3g}")
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if value >= scale:
            return f"{value / scale:g}{suffix}"
    return f"{value:g}"


def short_flops(value: float) -> str:
    return f"{value:.2g}".replace("e+", "e")


def resolve(base: Path, overrides: dict[str, object], where: str) -> Config:
    try:
        return load_config(["--job.config_file", str(base), *cli_args(overrides)], model_config_class)
    except (ConfigError, SweepError) as e:
        raise LadderError(f"{where}: {e}") from None


def count_params(config: Config, vocab: int, where: str) -> tuple[int, int]:
    """(N, total parameters) of the config's model (N_MEANING). A tied output projection counts in N."""
    try:
        package = import_model_package(config.model.name)
        args = package.build_model_args(config, vocab)
    except (ConfigError, ValueError) as e:
        raise LadderError(f"{where}: {e}") from None
    with torch.device("meta"):
        model = package.Transformer(args)
    total = sum(p.numel() for p in model.parameters())
    embedding = model.pipeline_ends[0]  # the modules before the blocks (components/model/contract.py)
    n_params = sum(p.numel() for name, p in model.named_parameters(remove_duplicate=False)
                   if name.split(".")[0] not in embedding)
    return n_params, total


def _check_loss_source(ladder: Ladder, config: Config, where: str) -> None:
    if ladder.loss != "validation":
        return
    paths = config.validation.dataset_path
    if not config.validation.enable:
        raise LadderError(f"{where}: loss = \"validation\" needs \"validation.enable\" = true in [overrides] "
                          "(or fit the training loss: loss = \"train\")")
    if len(paths) != 1 or "=" in paths[0]:
        raise LadderError(f"{where}: loss = \"validation\" needs one unnamed validation.dataset_path, got {paths}")


def _steps(budget: Budget, n_params: int, per_step: int) -> tuple[int, str]:
    """The steps of a budget and the run's name suffix: D<tokens> or C<FLOPs>."""
    if budget.kind == "tokens":
        return max(1, round(budget.value / per_step)), f"D{short_count(budget.value)}"
    return max(1, round(budget.value / (6 * n_params) / per_step)), f"C{short_flops(budget.value)}"


def plan_runs(ladder: Ladder) -> list[LadderRun]:
    """Every rung x budget, resolved and checked; raises LadderError naming the first problem."""
    try:
        base = resolve_base(ladder.base_config, ladder.path)
    except SweepError as e:
        raise LadderError(str(e)) from None
    runs, seen, notes = [], {}, []
    for rung in ladder.rungs:
        where = f"{ladder.path}: rung '{rung.name}'"
        key = json.dumps(rung.overrides, sort_keys=True, default=str)
        if key in seen:
            raise LadderError(f"{where} sets the same keys as rung '{seen[key]}': they would be one run")
        seen[key] = rung.name
        config = resolve(base, ladder.overrides | rung.overrides, where)
        _check_loss_source(ladder, config, where)
        vocab, note = vocab_size(config)
        if note and note not in notes:
            notes.append(note)
            print(f"note: {note}")
        n_params, n_total = count_params(config, vocab, where)
        per_step = tokens_per_step(config, ladder.nproc_per_run)
        if per_step is None:
            raise LadderError(f"{where}: its [parallelism] layout does not fit nproc_per_run = {ladder.nproc_per_run}")
        warmup = config.lr_scheduler.warmup_steps
        names = {}
        for budget in rung.budgets:
            steps, suffix = _steps(budget, n_params, per_step)
            name = f"{rung.name}_{suffix}"
            if steps <= warmup:
                raise LadderError(f"{where}: run {name} has {steps} steps ({per_step:,} tokens each), not more than "
                                  f"lr_scheduler.warmup_steps = {warmup}: raise its budget or lower the warmup")
            if steps in names.values() or name in names:
                raise LadderError(f"{where}: two budgets give the same run ({steps} steps): drop one")
            names[name] = steps
            runs.append(LadderRun(name, rung.name, rung.overrides | {"training.steps": steps}, n_params, n_total,
                                  steps, steps * per_step, config))
    return runs


def target_size(ladder: Ladder) -> tuple[float, float] | None:
    """(N, D) of the ladder's [target], or None without one."""
    target = ladder.target
    if target is None:
        return None
    n_params = target.n_params
    if n_params is None:
        base = resolve_base(ladder.base_config, ladder.path)
        where = f"{ladder.path}: [target]"
        config = resolve(base, ladder.overrides | target.overrides, where)
        n_params = count_params(config, vocab_size(config)[0], where)[0]
    budget = target.budget
    return n_params, budget.value if budget.kind == "tokens" else budget.value / (6 * n_params)


def held_out(runs: list[LadderRun], names: list[str]) -> set[str]:
    """The runs that `names` (rung or run names) leave out of the fit."""
    rungs = list(dict.fromkeys(r.rung for r in runs))
    out = set()
    for name in names:
        matched = {r.name for r in runs if name in (r.rung, r.name)}
        if not matched:
            raise LadderError(f"holdout '{name}' is neither a rung nor a run of the ladder; rungs: {', '.join(rungs)}")
        out |= matched
    return out


def memory_over_budget(ladder: Ladder, runs: list[LadderRun]) -> tuple[dict[str, float], list[str]]:
    """The estimated peak GiB per rank of each rung (its runs differ only in steps), and the rungs over
    the ladder's memory_budget_gib."""
    configs = {run.rung: run.config for run in runs}
    estimates, baseline = {}, None
    for rung, config in configs.items():
        target = default_target(config)
        if target == "cpu" and baseline is None:
            baseline = cpu_baseline_bytes(config)  # this process after a trainer's imports
        try:
            estimates[rung] = estimate(config, ladder.nproc_per_run, target, baseline).total_gib
        except (ConfigError, ValueError) as e:
            raise LadderError(f"{ladder.path}: rung '{rung}': memory estimate: {e}") from None
    return estimates, [rung for rung, gib in estimates.items() if gib > ladder.memory_budget_gib]


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else str(value)  # TOML spells them nan, inf, -inf as Python does
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a TOML basic string
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise LadderError(f"unsupported value {value!r} ({type(value).__name__}): use a string, number, boolean or list")


def sweep_file_text(ladder: Ladder, runs: list[LadderRun]) -> str:
    """The ladder's runs as a sweep file (docs/ablations.md): `python -m scripts.sweep` on it with
    --output DIR/runs is what the ladder does."""
    base = resolve_base(ladder.base_config, ladder.path)
    lines = [f"# Written by python -m scripts.ladder from {ladder.path}; edit that file, not this one.",
             f"base_config = {_toml_value(str(base))}", f"nproc_per_run = {ladder.nproc_per_run}", "", "[overrides]"]
    lines += [f"{json.dumps(k)} = {_toml_value(v)}" for k, v in ladder.overrides.items()]
    for run in runs:
        lines += ["", "[[runs]]", f"name = {json.dumps(run.name)}"]
        lines += [f"{json.dumps(k)} = {_toml_value(v)}" for k, v in run.overrides.items()]
    return "\n".join(lines) + "\n"
