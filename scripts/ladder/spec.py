"""The ladder file: model sizes (rungs), the token or compute budgets each is trained for, what loss
is fitted, and the larger model to predict. Every mistake is reported here, in one line, before
any config is resolved or anything is run."""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from difflib import get_close_matches
from pathlib import Path

from scripts.sweep.plan import flatten

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

LADDER_KEYS = ("base_config", "nproc_per_run", "memory_budget_gib", "loss", "holdout", "bootstrap", "tokens",
               "compute", "overrides", "rungs", "target")
BUDGET_KEYS = ("tokens", "compute")
LADDER_OWNED_KEYS = ("job.dump_folder", "job.config_file", "training.steps")
"""Config keys the ladder sets for every run: the base config, DIR/runs/<run>, and the steps from the budget."""
LOSSES = ("validation", "train")
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9.+-]*$")
"""Rung names: they start run folder names (`<rung>_D<tokens>`), so no `_`, `/` or spaces."""


class LadderError(Exception):
    """A ladder that cannot run: the message says why, in one line."""


@dataclass
class Budget:
    kind: str
    """tokens: D itself; compute: C in FLOPs, from which D = C / (6 N)."""
    value: float


@dataclass
class Rung:
    name: str
    overrides: dict[str, object]
    """Its model shape (model.* keys) and any other config keys of its own."""
    budgets: list[Budget]


@dataclass
class Target:
    """The larger model to predict: its size as `n_params` (non-embedding) or as a model shape."""
    n_params: float | None
    overrides: dict[str, object]
    budget: Budget


@dataclass
class Ladder:
    path: Path
    base_config: str
    nproc_per_run: int
    overrides: dict[str, object]
    rungs: list[Rung]
    loss: str = "validation"
    holdout: list[str] = field(default_factory=list)
    bootstrap: int = 100
    memory_budget_gib: float | None = None
    target: Target | None = None


def _unknown(key: str, allowed: tuple[str, ...], where: str) -> LadderError:
    close = get_close_matches(key, allowed, n=1)
    return LadderError(f"{where}: unknown key '{key}'" + (f" (did you mean {close[0]}?)" if close else "")
                       + f"; allowed: {', '.join(allowed)}")


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _budgets(table: dict, where: str) -> list[Budget]:
    budgets = []
    for kind in BUDGET_KEYS:
        values = table.get(kind, [])
        values = values if isinstance(values, list) else [values]
        for value in values:
            if not _is_number(value) or not value > 0:
                raise LadderError(f"{where}: {kind} must be a positive number or a list of them, got {value!r}")
            budgets.append(Budget(kind, float(value)))
    return budgets


def _config_keys(table: dict, where: str) -> dict[str, object]:
    """The "section.key" overrides of a table (everything but its own keys, already removed)."""
    for key in table:
        if "." not in key:
            raise LadderError(f"{where}: '{key}' is not a config key: write \"section.key\" (quoted), e.g. "
                              "\"model.dim\"")
        if key in LADDER_OWNED_KEYS:
            raise LadderError(f"{where}: {key} is set by the ladder (the base config, DIR/runs/<run> and the steps "
                              "from the budget); do not set it")
    return table


def _rung(table, index: int, default_budgets: list[Budget], where: str) -> Rung:
    if not isinstance(table, dict):
        raise LadderError(f"{where}: rungs must be [[rungs]] tables")
    table = flatten(table)
    name = table.pop("name", None)
    if not isinstance(name, str) or not NAME.match(name):
        raise LadderError(f"{where}: rung {index + 1} needs a name (letters, digits, '.', '+', '-'), got {name!r}")
    here = f"{where}: rung '{name}'"
    budgets = _budgets(table, here) or default_budgets
    for kind in BUDGET_KEYS:
        table.pop(kind, None)
    overrides = _config_keys(table, here)
    if not any(key.startswith("model.") for key in overrides):
        raise LadderError(f"{here} has no size: give it model.* keys, e.g. \"model.dim\" and \"model.n_layers\"")
    if not budgets:
        raise LadderError(f"{here} has no budget: give it tokens = [...] or compute = [...] (FLOPs), or set them "
                          "at the top of the ladder file for every rung")
    return Rung(name, overrides, budgets)


def _target(table, where: str) -> Target:
    if not isinstance(table, dict):
        raise LadderError(f"{where}: [target] must be a table")
    table = flatten(table)
    here = f"{where}: [target]"
    budgets = _budgets(table, here)
    if len(budgets) != 1:
        raise LadderError(f"{here} needs exactly one budget: tokens = D or compute = C (FLOPs)")
    n_params = table.pop("n_params", None)
    for kind in BUDGET_KEYS:
        table.pop(kind, None)
    shape = _config_keys(table, here)
    if any(not key.startswith("model.") for key in shape):
        raise LadderError(f"{here}: besides n_params, tokens and compute it takes model.* keys only")
    if (n_params is None) == (not shape):
        raise LadderError(f"{here} needs its size: n_params = N (non-embedding parameters) or model.* keys, "
                          "not both")
    if n_params is not None and (not _is_number(n_params) or not n_params > 0):
        raise LadderError(f"{here}: n_params must be a positive number, got {n_params!r}")
    return Target(None if n_params is None else float(n_params), shape, budgets[0])


def read_ladder(path: str | Path) -> Ladder:
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise LadderError(f"ladder file not found: {path}") from None
    except tomllib.TOMLDecodeError as e:
        raise LadderError(f"cannot parse {path}: {e}") from None
    where = str(path)
    for key in data:
        if key not in LADDER_KEYS:
            raise _unknown(key, LADDER_KEYS, where)
    if not isinstance(data.get("base_config"), str):
        raise LadderError(f"{where}: base_config = \"path/to/config.toml\" is required")
    nproc = data.get("nproc_per_run", 1)
    if not isinstance(nproc, int) or isinstance(nproc, bool) or nproc < 1:
        raise LadderError(f"{where}: nproc_per_run must be a positive integer, got {nproc!r}")
    loss = data.get("loss", "validation")
    if loss not in LOSSES:
        raise LadderError(f"{where}: loss must be one of {', '.join(LOSSES)}, got {loss!r}")
    budget = data.get("memory_budget_gib")
    if budget is not None and (not _is_number(budget) or not budget > 0):
        raise LadderError(f"{where}: memory_budget_gib must be a positive number (GiB per rank), got {budget!r}")
    bootstrap = data.get("bootstrap", 100)
    if not isinstance(bootstrap, int) or isinstance(bootstrap, bool) or bootstrap < 0:
        raise LadderError(f"{where}: bootstrap must be a number of resamples (0 or more), got {bootstrap!r}")
    holdout = data.get("holdout", [])
    holdout = [holdout] if isinstance(holdout, str) else holdout
    if not isinstance(holdout, list) or not all(isinstance(h, str) for h in holdout):
        raise LadderError(f"{where}: holdout must be a rung or run name, or a list of them")
    overrides = _config_keys(flatten(data.get("overrides", {})), f"{where}: [overrides]")
    rungs = data.get("rungs")
    if not isinstance(rungs, list) or not rungs:
        raise LadderError(f"{where}: no rungs: add [[rungs]] tables, each with a name, model.* keys and budgets")
    default_budgets = _budgets(data, where)
    rungs = [_rung(table, i, default_budgets, where) for i, table in enumerate(rungs)]
    names = [r.name for r in rungs]
    if len(set(names)) < len(names):
        raise LadderError(f"{where}: rung names repeat: {', '.join(sorted({n for n in names if names.count(n) > 1}))}")
    target = _target(data["target"], where) if "target" in data else None
    return Ladder(path, data["base_config"], nproc, overrides, rungs, loss, holdout, bootstrap,
                  None if budget is None else float(budget), target)
