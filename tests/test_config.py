import subprocess
import sys

import pytest

from components.config import REPO_ROOT, Config, ConfigError, load_config, to_toml
from models.families import model_config_class
from scripts.config import markdown_reference


def test_defaults_then_file_then_cli():
    config = load_config(["--job.config_file", "debug_model.toml", "--training.steps", "7", "--optimizer.lr=0.01"],
                         model_config_class)
    assert config.job.config_file.endswith("train_configs/debug_model.toml")
    assert config.model.flavor == "debugmodel"
    assert config.training.seq_len == 256  # from the file
    assert config.training.steps == 7 and config.optimizer.lr == 0.01  # from the command line
    assert config.optimizer.beta2 == 0.95  # a default the file does not set


def test_value_types_from_the_command_line():
    config = load_config([
        "--checkpoint.enable", "--metrics.enable_tensorboard", "false", "--model.ffn_dim_multiplier", "1.3",
        "--float8.filter_fqns", "output,w2", "--lr_scheduler.decay_ratio", "0.2", "--model.n_layers", "3",
    ], model_config_class)
    assert config.checkpoint.enable is True and config.metrics.enable_tensorboard is False
    assert config.model.ffn_dim_multiplier == 1.3 and config.model.n_layers == 3
    assert config.float8.filter_fqns == ["output", "w2"] and config.lr_scheduler.decay_ratio == 0.2
    assert load_config(["--float8.filter_fqns", '["a", "b"]'], model_config_class).float8.filter_fqns == ["a", "b"]
    assert load_config(["--optimizer.lr", "1"], model_config_class).optimizer.lr == 1.0  # an int is a valid float


def test_later_config_file_wins(tmp_path):
    other = tmp_path / "other.toml"
    other.write_text("[training]\nsteps = 3\n")
    config = load_config(["--job.config_file", "debug_model.toml", "--job.config_file", str(other)], model_config_class)
    assert config.training.steps == 3 and config.training.seq_len == Config().training.seq_len


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--training.stepz", "3"], "unknown config key 'training.stepz' (did you mean training.steps?)"),
        (["--trainig.steps", "3"], "unknown config section 'trainig' (did you mean training.steps?)"),
        (["--training.steps", "ten"], "training.steps must be int, got 'ten'"),
        (["--checkpoint.enable", "yes"], "checkpoint.enable must be bool, got 'yes'"),
        (["--checkpoint.async_mode", "fast"],
         "checkpoint.async_mode must be one of disabled, async, async_with_pinned_mem"),
        (["--job.config_file", "no_such.toml"], "config file not found: no_such.toml"),
        (["training.steps", "3"], "expected --section.key [value]"),
    ],
)
def test_bad_input_names_the_key(argv, message):
    with pytest.raises(ConfigError) as info:
        load_config(argv, model_config_class)
    assert message in str(info.value)


def test_each_family_owns_its_model_keys_and_refuses_another_familys_naming_itself(tmp_path):
    """A key is checked against the family that model.name picks, wherever model.name is set (file or command
    line, before or after the key): Llama's QK-norm switch is not a Qwen3 key (Qwen3 always has QK-norm)."""
    assert load_config(["--model.qk_norm", "true"], model_config_class).model.qk_norm is True
    moe = load_config(["--job.config_file", "debug_moe.toml"], model_config_class)
    assert type(moe.model).__module__ == "models.qwen3.config"
    refused = "unknown config key 'model.qk_norm': the model family qwen3 does not define it; its keys are name, "
    with pytest.raises(ConfigError, match=refused):
        load_config(["--model.qk_norm", "true", "--model.name", "qwen3"], model_config_class)
    in_file = tmp_path / "qwen.toml"
    in_file.write_text('[model]\nname = "qwen3"\nmultiple_of = 256\n')
    with pytest.raises(ConfigError, match=r"qwen.toml: unknown config key 'model.multiple_of': the model family qwen3"):
        load_config(["--job.config_file", str(in_file)], model_config_class)
    with pytest.raises(ConfigError, match=r"unknown config key 'model.ffn_dimm' for the model family qwen3 \(did you "
                                          r"mean model.ffn_dim\?\)"):
        load_config(["--model.name", "qwen3", "--model.ffn_dimm", "3"], model_config_class)
    with pytest.raises(ConfigError, match="model.name 'llama9': there is no package models/llama9"):
        load_config(["--model.name", "llama9"], model_config_class)


def test_bad_toml_files(tmp_path):
    broken = tmp_path / "broken.toml"
    broken.write_text("[training]\nsteps = = 3\n")
    with pytest.raises(ConfigError, match=r"broken.toml: invalid TOML: .*\(at line 2, column 9\)"):
        load_config(["--job.config_file", str(broken)], model_config_class)
    wrong = tmp_path / "wrong.toml"
    wrong.write_text('[training]\nsteps = "many"\n')
    with pytest.raises(ConfigError, match=r"wrong.toml: training.steps must be int, got 'many'"):
        load_config(["--job.config_file", str(wrong)], model_config_class)
    typo = tmp_path / "typo.toml"
    typo.write_text("[optimizer]\nlearning_rate = 3\n")
    with pytest.raises(ConfigError, match=r"unknown config key 'optimizer.learning_rate'"):
        load_config(["--job.config_file", str(typo)], model_config_class)


def test_dumped_toml_reloads_to_the_same_config(tmp_path):
    config = load_config(["--job.config_file", "llama3_8b.toml", "--model.n_layers", "2",
                          "--job.description", 'a "quoted" run'], model_config_class)
    path = tmp_path / "config.toml"
    path.write_text(to_toml(config))
    reloaded = load_config(["--job.config_file", str(path)], model_config_class)
    assert reloaded.job.config_file == str(path)
    reloaded.job.config_file = config.job.config_file
    assert reloaded == config


def test_every_shipped_config_loads():
    for path in sorted((REPO_ROOT / "train_configs").glob("*.toml")):
        load_config(["--job.config_file", str(path)], model_config_class)


def test_cli_exit_code_and_message():
    result = subprocess.run([sys.executable, "-m", "scripts.config", "--training.stepz", "3"], cwd=REPO_ROOT,
                            capture_output=True, text=True)
    assert result.returncode != 0
    assert "did you mean training.steps?" in result.stderr


def test_configuration_reference_is_in_step_with_the_code():
    documented = (REPO_ROOT / "docs" / "configuration.md").read_text()
    assert documented == markdown_reference(), (
        "regenerate: python -m scripts.config --markdown > docs/configuration.md"
    )


def test_the_launcher_reads_a_key_as_load_config_does_without_the_model_family():
    """components/run/launch.py reads job.max_restarts before any worker starts: the same value as load_config, from
    the file and the command line, checked the same way, but without the family's config class (importing the family
    costs 1.3 CPU-s per launch)."""
    from components.config import read_key

    argv = ["--job.config_file", "debug_model.toml", "--job.max_restarts", "2"]
    assert read_key(argv, "job.max_restarts") == load_config(argv, model_config_class).job.max_restarts == 2
    assert read_key(argv, "job.max_restarts") == 2
    assert read_key(["--job.config_file", "debug_model.toml"], "job.max_restarts") == 0
    assert read_key([*argv, "--model.name", "nosuchfamily"], "job.dump_folder") == "./outputs/debug_model"
    with pytest.raises(ConfigError, match=r"job.max_restarts must be >= 0, got -1"):
        read_key([*argv, "--job.max_restarts", "-1"], "job.max_restarts")
    with pytest.raises(ConfigError, match=r"job.max_restarts must be int, got 'x'"):
        read_key(["--job.max_restarts", "x"], "job.max_restarts")
