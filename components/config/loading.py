"""Loading a config: the defaults, then a TOML file, then `--section.key value` overrides, each value
checked against its key's type, choices and range; and writing the resolved config back as TOML.

The `[model]` keys depend on the family: the class of `config.model` is the family's `ModelConfig`
(models/<model.name>/config.py), picked by the last model.name the file or the command line gives, before
any other key is set, so that a key the family does not define is refused naming the family. The caller passes
the lookup from a family's name to its ModelConfig (models/families.py's `model_config_class`): the families
sit above this package, which they import.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import subprocess
import sys
import time
import types
import typing
from collections.abc import Callable
from pathlib import Path

from components.config.errors import ConfigError
from components.config.schema import (
    CHOICES,
    CONFIG_DIR,
    RANGES,
    REPO_ROOT,
    SECTIONS,
    Config,
    Model,
    Range,
    field_types,
)

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib


def all_ranges(config: Config) -> dict[str, Range]:
    """{key: allowed range} of every numeric key of this config, its family's [model] keys included."""
    return RANGES | {f"model.{name}": allowed for name, allowed in type(config.model).ranges.items()}


def all_keys(config: Config) -> list[str]:
    """Every key of this config, its family's [model] keys included."""
    return [f"{section}.{name}" for section in SECTIONS for name in field_types(type(getattr(config, section)))]


def check_ranges(config: Config) -> None:
    """Refuse the first numeric key whose value (when set) is out of its range, naming both."""
    for key, allowed in all_ranges(config).items():
        section, _, name = key.partition(".")
        _check_range(key, getattr(getattr(config, section), name), allowed)


def _check_range(key: str, value, allowed: Range) -> None:
    if value is not None and not allowed.allows(value):
        finite = "" if math.isfinite(value) else "finite and "
        raise ConfigError(f"{key} must be {finite}{allowed.describe()}, got {value!r}")


def _nearest(name: str, candidates: list[str]) -> str:
    close = difflib.get_close_matches(name, candidates, n=1, cutoff=0.5)
    return f" (did you mean {close[0]}?)" if close else ""


def _convert(key: str, value, typ):
    """Check `value` (from TOML, or a str from the command line) against `typ`; return it converted."""
    origin, args = typing.get_origin(typ), typing.get_args(typ)
    if origin in (typing.Union, types.UnionType):
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null", "")):
            return None
        return _convert(key, value, next(a for a in args if a is not type(None)))
    from_cli = isinstance(value, str) and typ is not str
    if origin is list:
        if isinstance(value, str):
            text = value.strip()
            value = _parse_toml_value(text) if text.startswith("[") else [v for v in text.split(",") if v]
        if not isinstance(value, list):
            raise ConfigError(f"{key} must be a list, got {value!r}")
        return [_convert(key, v, args[0]) for v in value]
    if typ is bool:
        if from_cli and value.lower() in ("true", "false"):
            return value.lower() == "true"
        if isinstance(value, bool):
            return value
    elif typ is int:
        if from_cli:
            try:
                return int(value)
            except ValueError:
                pass
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif typ is float:
        if from_cli:
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif typ is str:
        if isinstance(value, str):
            return value
    raise ConfigError(f"{key} must be {getattr(typ, '__name__', typ)}, got {value!r}")


def _parse_toml_value(text: str):
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"cannot parse {text!r} as a TOML value: {e}") from None


def _set(config: Config, key: str, value) -> None:
    section, _, name = key.partition(".")
    if section not in SECTIONS:
        raise ConfigError(f"unknown config section '{section}'{_nearest(key, all_keys(config))}")
    types_ = field_types(type(getattr(config, section)))
    if name not in types_:
        if section == "model":
            family, typo = config.model.name, difflib.get_close_matches(name, list(types_), n=1, cutoff=0.75)
            if typo:
                raise ConfigError(f"unknown config key '{key}' for the model family {family} (did you mean "
                                  f"model.{typo[0]}?)")
            raise ConfigError(f"unknown config key '{key}': the model family {family} does not define it; its keys "
                              f"are {', '.join(types_)} (models/{family}/config.py)")
        raise ConfigError(f"unknown config key '{key}'{_nearest(key, all_keys(config))}")
    setattr(getattr(config, section), name, _checked(key, value, types_[name]))


def _checked(key: str, value, type_):
    """A value of `key` converted to its type and refused when it is not one of the key's choices."""
    value = _convert(key, value, type_)
    choices = CHOICES.get(key)
    if choices and value not in choices:
        raise ConfigError(f"{key} must be one of {', '.join(choices)}, got {value!r}")
    return value


def resolve_config_file(path: str) -> Path:
    """A path as given, or a bare name under train_configs/ (`--job.config_file llama3_8b.toml`)."""
    for candidate in (Path(path), CONFIG_DIR / path, CONFIG_DIR / f"{path}.toml"):
        if candidate.is_file():
            return candidate
    raise ConfigError(f"config file not found: {path} (looked in . and {CONFIG_DIR})")


def _split_cli(argv: list[str]) -> list[tuple[str, str]]:
    pairs, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or len(arg) <= 2:
            raise ConfigError(f"expected --section.key [value], got {arg!r}")
        key, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                value, i = argv[i + 1], i + 1
            else:
                value = "true"  # a bare flag such as --checkpoint.enable
        pairs.append((key.replace("-", "_"), value))
        i += 1
    return pairs


def _read_file(path: Path) -> list[tuple[str, object]]:
    """The (section.key, value) pairs of a TOML config file, in file order."""
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: invalid TOML: {e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not a UTF-8 text file (byte {e.start})") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot be read ({e.strerror})") from None
    pairs = []
    for section, values in data.items():
        if not isinstance(values, dict):
            nearest = _nearest(section, list(SECTIONS))
            raise ConfigError(f"{path}: top-level key '{section}' must be a [section]{nearest}")
        pairs += [(f"{section}.{name}", value) for name, value in values.items()]
    return pairs


def _assignments(argv: list[str]) -> tuple[Path | None, list[tuple[str, object, str]]]:
    """The config file the last --job.config_file names, and every (key, value, where it came from) in the order
    they apply: the file's keys first, then the command line's."""
    overrides = _split_cli(argv)
    config_files = [v for k, v in overrides if k == "job.config_file"]
    path = resolve_config_file(config_files[-1]) if config_files else None
    assignments = [(key, value, f"{path}: ") for key, value in (_read_file(path) if path else [])]
    assignments += [(key, value, "") for key, value in overrides if key != "job.config_file"]
    return path, assignments


def read_key(argv: list[str], key: str):
    """The value load_config(argv) gives one key outside [model], without importing the model family (which
    imports its parallelisms and torch's checkpointing, 1.3 CPU-s): the launcher reads job.max_restarts so. The
    other keys are not checked here; the workers' load_config refuses a bad one."""
    section, _, name = key.partition(".")
    value, type_ = getattr(SECTIONS[section](), name), field_types(SECTIONS[section])[name]
    for assigned, assigned_value, source in _assignments(argv)[1]:
        if assigned == key:
            try:
                value = _checked(key, assigned_value, type_)
            except ConfigError as e:
                raise ConfigError(f"{source}{e}") from None
    if key in RANGES:
        _check_range(key, value, RANGES[key])
    return value


def load_config(argv: list[str], model_config_class: Callable[[str], type[Model]]) -> Config:
    """Defaults, then the TOML file named by the last --job.config_file, then the other overrides; the [model]
    section is the ModelConfig that `model_config_class` gives for the family model.name names."""
    path, assignments = _assignments(argv)
    family = Model.name
    for key, value, source in assignments:
        if key == "model.name":
            try:
                family = _convert(key, value, str)
            except ConfigError as e:
                raise ConfigError(f"{source}{e}") from None
    config = Config(model=model_config_class(family)(name=family))
    for key, value, source in assignments:
        try:
            _set(config, key, value)
        except ConfigError as e:
            raise ConfigError(f"{source}{e}") from None
    if path:
        config.job.config_file = str(path)
    check_ranges(config)
    return config


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and not math.isfinite(value):
        return ("-" if value < 0 else "") + ("nan" if math.isnan(value) else "inf")
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return json.dumps(value)  # a JSON string is a valid TOML basic string


def to_toml(config: Config) -> str:
    """The resolved config as TOML; unset optional keys (None) are left out, as TOML has no null."""
    lines = []
    for section in SECTIONS:
        lines.append(f"[{section}]")
        for name, value in dataclasses.asdict(getattr(config, section)).items():
            if value is not None:
                lines.append(f"{name} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


def git_commit() -> str:
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain"], cwd=REPO_ROOT, capture_output=True, text=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return commit + (" (uncommitted changes)" if dirty else "")


def dump_config(config: Config, folder: Path, start_step: int) -> Path:
    """Write the resolved config to <folder>/config.toml, the latest launch's, and a copy that stays,
    configs/launch-<n>-<time>.toml, so that the folder keeps the history of its launches."""
    history = folder / "configs"
    history.mkdir(parents=True, exist_ok=True)
    launch, started = len(list(history.glob("launch-*.toml"))) + 1, time.strftime("%Y%m%d-%H%M%S")
    text = (f"# git commit: {git_commit()}\n# command: {' '.join(sys.argv)}\n"
            f"# launch {launch} at {started}, training from step {start_step + 1}\n\n{to_toml(config)}")
    (history / f"launch-{launch:04d}-{started}.toml").write_text(text)
    path = folder / "config.toml"
    path.write_text(text)
    return path
