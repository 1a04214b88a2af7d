"""Activation checkpointing, compile and float8 on one process (CPU, fp32)."""

import math

import pytest
from conftest import TINY, losses

pytestmark = pytest.mark.slow

RUN = [*TINY, "--training.steps", "4"]


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    import train

    dump = tmp_path_factory.mktemp("plain")
    assert train.main([*RUN, "--job.dump_folder", str(dump)]) == 0
    return losses(dump)


@pytest.mark.parametrize("mode, option", [("full", "2"), ("selective", "2"), ("selective", "1"), ("selective", "op")])
def test_activation_checkpointing_is_bitwise_identical(plain, tmp_path, train_in_process, mode, option):
    args = ["--activation_checkpoint.mode", mode, "--activation_checkpoint.selective_ac_option", option]
    assert train_in_process([*RUN, *args, "--job.dump_folder", str(tmp_path)]) == 0
    assert losses(tmp_path) == plain


def test_compile_matches_eager(plain, tmp_path, train_in_process):
    assert train_in_process([*RUN, "--compile.enable", "--job.dump_folder", str(tmp_path)]) == 0
    for step, loss in losses(tmp_path).items():
        assert loss == pytest.approx(plain[step], rel=0.05)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_float8_emulated_trains(tmp_path, train_in_process, recipe):
    args = ["--float8.enable", "--float8.recipe_name", recipe, "--training.steps", "12"]
    assert train_in_process([*TINY, *args, "--job.dump_folder", str(tmp_path)]) == 0
    curve = list(losses(tmp_path).values())
    assert all(math.isfinite(x) for x in curve)
    assert curve[-1] < curve[0] - 0.5, curve
