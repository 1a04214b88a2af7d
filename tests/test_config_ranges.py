"""Numeric keys out of their range are refused at start-up in one line; a first step that would take
very long is announced."""

import math
import typing

import pytest
import torch
from conftest import TINY

from components.config import ConfigError, all_keys, all_ranges, field_types, load_config
from components.metrics.reporting import slow_step_warning
from models.families import model_config_class, model_package_names

CONFIGS = {family: load_config(["--model.name", family], model_config_class) for family in model_package_names()}
"""Every family's defaults: the [model] keys, and so their ranges, are the family's own."""


def value_type(config, key: str):
    """int or float for a numeric key (optional or not), else None."""
    section, _, name = key.partition(".")
    typ = field_types(type(getattr(config, section)))[name]
    return next((t for t in (typ, *typing.get_args(typ)) if t in (int, float)), None)


def numeric_keys(config) -> list[str]:
    return [key for key in all_keys(config) if value_type(config, key)]


def out_of_range(config, key: str) -> list[float]:
    """Values just outside the key's range (and, for a float, not finite), of the key's type."""
    allowed, typ = all_ranges(config)[key], value_type(config, key)
    candidates = [bound + step for bound, step in ((allowed.low, -1), (allowed.low, -2), (allowed.high, 1))
                  if bound is not None]
    if allowed.open_low:
        candidates.append(allowed.low)
    if allowed.open_high:
        candidates.append(allowed.high)
    if typ is float:
        candidates += [math.nan, math.inf]
    return [typ(value) for value in candidates if not allowed.allows(value)]


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_every_numeric_key_has_a_range_and_the_defaults_are_in_it(family):
    config = CONFIGS[family]
    assert sorted(numeric_keys(config)) == sorted(all_ranges(config))
    for key, allowed in all_ranges(config).items():
        section, _, name = key.partition(".")
        value = getattr(getattr(config, section), name)
        assert value is None or allowed.allows(value), key


CASES = sorted({key: family for family, config in reversed(CONFIGS.items()) for key in all_ranges(config)}.items())
"""Each numeric key with a family that has it (the first in name order)."""


@pytest.mark.parametrize("key, family", CASES)
def test_each_numeric_key_refuses_values_out_of_its_range(key, family):
    values = out_of_range(CONFIGS[family], key)
    assert values, key
    for value in values:
        with pytest.raises(ConfigError) as error:
            load_config(["--model.name", family, f"--{key}", str(value)], model_config_class)
        message = str(error.value)
        assert message.startswith(f"{key} must be ") and message.endswith(f", got {value!r}"), message
        assert all_ranges(CONFIGS[family])[key].describe() in message and "\n" not in message


@pytest.mark.parametrize("key, value, expected", [
    ("training.steps", "-5", "training.steps must be >= 1, got -5"),
    ("training.seq_len", "0", "training.seq_len must be >= 1, got 0"),
    ("training.local_batch_size", "0", "training.local_batch_size must be >= 1, got 0"),
])
def test_the_trainer_exits_2_with_one_line_naming_the_key_and_range(key, value, expected, tmp_path,
                                                                     train_in_process, capsys):
    assert train_in_process([*TINY, f"--{key}", value, "--job.dump_folder", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"config error: {expected}"]
    assert not any(tmp_path.iterdir())


def test_a_step_that_would_take_minutes_is_announced_with_its_estimate():
    cpu = torch.device("cpu")
    assert slow_step_warning(1e9, cpu, 0.0, "float32") is None  # cheap: not even measured
    warning = slow_step_warning(1e15, cpu, 1e9, "float32")
    assert warning.startswith("one optimizer step will take at least 16,667 minutes: 1.00e+15 FLOPs per device")
    assert "(metrics.peak_flops)" in warning
    assert "a matmul measured at start-up" in slow_step_warning(1e18, cpu, 0.0, "float32")
