"""The sweep file and the runs it expands into. Every run's config is resolved and validated here,
before anything is launched, so that a typo in a key fails the whole sweep at once."""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import re
import sys
from dataclasses import dataclass
from difflib import get_close_matches
from pathlib import Path

from components.config import REPO_ROOT, Config, ConfigError, load_config, resolve_config_file
from models.families import model_config_class

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

RUN_TRAIN = REPO_ROOT / "run_train.sh"
SWEEP_KEYS = ("base_config", "nproc_per_run", "overrides", "grid", "runs")
SWEEP_OWNED_KEYS = ("job.dump_folder", "job.config_file")
"""Config keys the sweep sets for every run (base_config, and DIR/<run>)."""


class SweepError(Exception):
    """A sweep that cannot start (a bad sweep file, an unknown key, too few GPUs); the message says why."""


@dataclass
class Run:
    name: str
    overrides: dict[str, object]
    """What sets this run apart (its grid point and/or [[runs]] entry), in sweep-file order."""
    all_overrides: dict[str, object]
    """The sweep's common [overrides], then this run's."""
    dump: Path
    config: Config
    command: list[str]


@dataclass
class Sweep:
    path: Path
    base_config: Path
    nproc_per_run: int
    overrides: dict[str, object]
    runs: list[Run]
    output: Path


def flatten(table: dict, prefix: str = "") -> dict[str, object]:
    """{"optimizer": {"lr": 1}} and {"optimizer.lr": 1} both become {"optimizer.lr": 1} (unquoted
    dotted keys in TOML make nested tables)."""
    flat = {}
    for key, value in table.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def cli_value(value) -> str:
    """A TOML value of the sweep file as train.py's command line takes it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else str(value)
    if isinstance(value, (int, str)):
        return str(value)
    if isinstance(value, list):  # list-typed keys parse a TOML array on the command line
        return "[" + ", ".join(json.dumps(v) if isinstance(v, str) else cli_value(v) for v in value) + "]"
    raise SweepError(f"unsupported value {value!r} ({type(value).__name__}): use a string, number, boolean or list")


def cli_args(overrides: dict[str, object]) -> list[str]:
    args = []
    for key, value in overrides.items():
        text = cli_value(value)
        # train.py reads `--key --x` as a bare flag followed by another key; `--key=--x` is unambiguous.
        args += [f"--{key}={text}"] if text.startswith("--") else [f"--{key}", text]
    return args


def name_value(value) -> str:
    """A value as run names, labels and tables show it (a list without brackets)."""
    if isinstance(value, list):
        return ",".join(name_value(v) for v in value)
    return cli_value(value)


def _sanitize(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._,+=-]+", "-", text).strip("-.")


def run_names(override_sets: list[dict[str, object]], explicit: list[str | None]) -> list[str]:
    """Readable, unique folder names: `lr=0.001_seed=1` from the last part of each key (the whole key
    where two keys share their last part), or an explicit name from a [[runs]] table."""
    keys = list(dict.fromkeys(k for overrides in override_sets for k in overrides))
    last_parts = [k.rsplit(".", 1)[-1] for k in keys]
    short = {k: (p if last_parts.count(p) == 1 else k) for k, p in zip(keys, last_parts)}
    names, seen = [], set()
    for overrides, given in zip(override_sets, explicit):
        if given:
            name = _sanitize(given)
        else:
            name = "_".join(_sanitize(f"{short[k]}={name_value(v)}") for k, v in overrides.items())
        name = name or "base"
        if len(name) > 120:  # keep paths sane; the overrides are in sweep_run.json anyway
            name = f"{name[:100]}-{hashlib.sha1(name.encode()).hexdigest()[:8]}"
        unique, n = name, 2
        while unique in seen:
            unique, n = f"{name}-{n}", n + 1
        seen.add(unique)
        names.append(unique)
    return names


def resolve_base(value: str, sweep_path: Path) -> Path:
    """A base config named in a sweep (or ladder) file: a path from here, from the repository root or
    from the file's folder, or a bare name in train_configs/."""
    for candidate in (Path(value), REPO_ROOT / value, sweep_path.parent / value):
        if candidate.is_file():
            return candidate.resolve()
    try:
        return resolve_config_file(value).resolve()
    except ConfigError as e:
        raise SweepError(f"{sweep_path}: base_config: {e}") from None


def _check_keys(data: dict, where: str) -> None:
    for key in data:
        if key not in SWEEP_KEYS:
            close = get_close_matches(key, SWEEP_KEYS, n=1)
            raise SweepError(f"{where}: unknown key '{key}'" + (f" (did you mean {close[0]}?)" if close else "")
                             + f"; a sweep file has {', '.join(SWEEP_KEYS)}")


def _check_override_keys(keys: list[str], where: str) -> None:
    for key in keys:
        if key in SWEEP_OWNED_KEYS:
            raise SweepError(f"{where}: {key} is set by the sweep (base_config, and DIR/<run>); do not override it")
        if "." not in key:
            raise SweepError(f"{where}: '{key}' is not a config key: "
                             "write \"section.key\" (quoted), e.g. \"optimizer.lr\"")


def expand(data: dict, where: str = "sweep file") -> tuple[dict, list[tuple[dict, str | None]]]:
    """The common overrides and each run's own overrides (with its explicit name or None): the grid's
    Cartesian product (in file order, the first key varying slowest), then the [[runs]] tables."""
    _check_keys(data, where)
    common = flatten(data.get("overrides", {}))
    grid = flatten(data.get("grid", {}))
    for key, values in grid.items():
        if not isinstance(values, list) or not values:
            raise SweepError(f"{where}: grid key '{key}' needs a non-empty list of values, got {values!r}")
    runs = data.get("runs", [])
    if not isinstance(runs, list) or not all(isinstance(r, dict) for r in runs):
        raise SweepError(f"{where}: runs must be [[runs]] tables")
    sets: list[tuple[dict, str | None]] = []
    if grid:
        sets += [(dict(zip(grid, combo)), None) for combo in itertools.product(*grid.values())]
    for table in runs:
        table = flatten(table)
        name = table.pop("name", None)
        if name is not None and not isinstance(name, str):
            raise SweepError(f"{where}: a [[runs]] name must be a string, got {name!r}")
        sets.append((table, name))
    if not sets:
        sets = [({}, None)]  # just the base config with the common overrides
    for overrides, _ in sets:
        _check_override_keys([*common, *overrides], where)
    # The same override set twice (say a [[runs]] table repeating a grid point) is one run.
    unique, seen = [], set()
    for overrides, name in sets:
        signature = json.dumps({k: cli_value(v) for k, v in sorted(overrides.items())})
        if signature in seen:
            print(f"note: the override set {overrides} appears twice in {where}; running it once")
            continue
        seen.add(signature)
        unique.append((overrides, name))
    return common, unique


def read_sweep(sweep_path: str | Path, output: str | Path | None = None) -> Sweep:
    """Read a sweep file and resolve and validate every run's config; launches nothing, writes nothing."""
    sweep_path = Path(sweep_path)
    try:
        data = tomllib.loads(sweep_path.read_text())
    except FileNotFoundError:
        raise SweepError(f"sweep file not found: {sweep_path}") from None
    except tomllib.TOMLDecodeError as e:
        raise SweepError(f"cannot parse {sweep_path}: {e}") from None
    if "base_config" not in data or not isinstance(data["base_config"], str):
        raise SweepError(f"{sweep_path}: base_config = \"path/to/config.toml\" is required")
    base = resolve_base(data["base_config"], sweep_path)
    nproc = data.get("nproc_per_run", 1)
    if not isinstance(nproc, int) or isinstance(nproc, bool) or nproc < 1:
        raise SweepError(f"{sweep_path}: nproc_per_run must be a positive integer, got {nproc!r}")
    common, sets = expand(data, str(sweep_path))
    output = Path(output if output is not None else REPO_ROOT / "outputs" / "sweeps" / sweep_path.stem).resolve()
    names = run_names([o for o, _ in sets], [n for _, n in sets])
    runs = []
    for (overrides, _), name in zip(sets, names):
        dump = output / name
        merged = common | overrides
        args = ["--job.config_file", str(base), "--job.dump_folder", str(dump), *cli_args(merged)]
        try:
            config = load_config(args, model_config_class)
        except ConfigError as e:
            raise SweepError(f"{sweep_path}: run {name}: {e}") from None
        runs.append(Run(name, overrides, merged, dump, config, [str(RUN_TRAIN), *args]))
    return Sweep(sweep_path, base, nproc, common, runs, output)
