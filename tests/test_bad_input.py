"""Bad input anywhere stops the run with one line that names the file, key or value at fault."""

import json
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import REPO, TINY

from components.config import ConfigError, Parallelism, load_config
from components.data.loaders import build_validation_dataloader
from components.data.packed import build_packed_dataloader
from components.data.tokenizer import build_tokenizer
from components.distributed.mesh import ParallelDims
from models.families import model_config_class
from scripts.preprocess import main as preprocess

TOKENIZERS = REPO / "tests" / "assets" / "tokenizers"
TOKENIZER = str(TOKENIZERS / "shakespeare_bpe_4k.model")


@pytest.fixture(scope="module")
def packed_once(tmp_path_factory):
    folder = tmp_path_factory.mktemp("data") / "packed"
    corpus = REPO / "tests" / "assets" / "shakespeare" / "validation.jsonl"
    argv = [str(corpus), "--output", str(folder), "--tokenizer", TOKENIZER, "--workers", "0", "--quiet"]
    assert preprocess(argv) == 0
    return folder


@pytest.fixture
def packed(packed_once, tmp_path):
    """A copy of a packed folder of the shipped corpus, free to damage."""
    return shutil.copytree(packed_once, tmp_path / "packed")


def load_packed(paths, tokenizer=TOKENIZER):
    return build_packed_dataloader([str(p) for p in paths], "train", tokenizer, 64, 2, 0, 1, 0, 0)


def error_line(err: str) -> str:
    """The last line a run printed to stderr: its error."""
    return err.strip().splitlines()[-1]


@pytest.mark.slow
def test_invalid_toml_names_file_line_and_column(tmp_path):
    (tmp_path / "bad.toml").write_text("[training]\nsteps = 3\nseq = = 4\n")
    result = subprocess.run([sys.executable, str(REPO / "train.py"), "--job.config_file", "bad.toml"],
                            cwd=tmp_path, capture_output=True, text=True)
    assert result.returncode == 2
    assert error_line(result.stderr).startswith("config error: bad.toml: invalid TOML: ")
    assert error_line(result.stderr).endswith("(at line 3, column 7)")


def test_config_file_that_is_not_text(tmp_path):
    (tmp_path / "binary.toml").write_bytes(b"[training]\nsteps = \xff\n")
    with pytest.raises(ConfigError, match=r"binary.toml: not a UTF-8 text file \(byte 19\)$"):
        load_config(["--job.config_file", str(tmp_path / "binary.toml")], model_config_class)


def test_top_level_key_outside_a_section(tmp_path):
    (tmp_path / "flat.toml").write_text("steps = 3\n")
    with pytest.raises(ConfigError, match=r"flat.toml: top-level key 'steps' must be a \[section\]$"):
        load_config(["--job.config_file", str(tmp_path / "flat.toml")], model_config_class)


@pytest.mark.parametrize("argv, message", [
    (["--training.stepz", "3"], "config error: unknown config key 'training.stepz' (did you mean training.steps?)"),
    (["--optimizer.lr", "fast"], "config error: optimizer.lr must be float, got 'fast'"),
])
def test_trainer_exits_2_on_a_bad_key_or_value(argv, message, train_in_process, capsys):
    assert train_in_process(argv) == 2
    assert error_line(capsys.readouterr().err) == message


@pytest.mark.parametrize("degrees, world_size, message", [
    (dict(data_parallel_shard_degree=2, tensor_parallel_degree=2), 2,
     "dp_replicate(1) * dp_shard(2) * cp(1) * tp(2) * pp(1) = 4, but 2 processes were started; "
     "the parallelism.*_degree keys must multiply to the world size"),
    (dict(tensor_parallel_degree=2), 1,
     "dp_replicate*cp*tp*pp = 2 (the parallelism.*_degree keys) needs a multiple of 2 processes, but 1 were started "
     "(NGPU / --nproc_per_node)"),
    (dict(pipeline_parallel_degree=0), 1, "parallelism.pipeline_parallel_degree must be >= 1, got 0"),
])
def test_degrees_that_do_not_fit_the_world_size(degrees, world_size, message):
    with pytest.raises(ConfigError) as error:
        ParallelDims.from_config(Parallelism(**degrees), world_size)
    assert str(error.value) == message


def test_tensor_parallel_degree_that_does_not_divide_the_heads():
    from models.decoder_parallelize import tp_divides_heads
    from models.llama3 import ModelArgs, Transformer

    with torch.device("meta"):
        model = Transformer(ModelArgs(dim=96, n_layers=1, n_heads=6, vocab_size=32))
    with pytest.raises(ConfigError) as error:
        tp_divides_heads(model, 4)
    assert str(error.value) == "parallelism.tensor_parallel_degree 4 must divide model.n_heads (6)"


def test_more_pipeline_stages_than_layers():
    from models.llama3 import Transformer
    from parallelisms.pipeline import pipeline_module_names

    with pytest.raises(ConfigError) as error:
        pipeline_module_names(2, 4, None, "layers", Transformer.pipeline_ends)
    assert str(error.value) == ("4 pipeline stages (parallelism.pipeline_parallel_degree x stages per rank) but "
                                "model.n_layers is 2: every stage needs at least one block")


def test_missing_tokenizer_file():
    with pytest.raises(FileNotFoundError) as error:
        build_tokenizer("nope.model")
    assert str(error.value) == "model.tokenizer_path: no tokenizer file at nope.model"


def test_missing_packed_folder_stops_the_trainer(tmp_path, train_in_process, capsys):
    args = ["--training.dataset", "packed", "--training.dataset_path", "/nonexistent",
            "--job.dump_folder", str(tmp_path)]
    assert train_in_process([*TINY, *args]) == 2
    assert error_line(capsys.readouterr().err) == "error: training.dataset_path: /nonexistent does not exist"


def test_missing_folder_in_a_blend(packed, tmp_path):
    with pytest.raises(FileNotFoundError) as error:
        load_packed([f"{packed}:0.7", f"{tmp_path / 'gone'}:0.3"])
    assert str(error.value) == f"training.dataset_path: {tmp_path / 'gone'} does not exist"


def test_missing_hf_files(tmp_path):
    config = load_config(["--validation.dataset_path", str(tmp_path / "val.jsonl")], model_config_class)
    with pytest.raises(FileNotFoundError) as error:
        build_validation_dataloader(config, tokenizer=None, dp_rank=0, dp_size=1, path=str(tmp_path / "val.jsonl"))
    assert str(error.value) == (f"validation.dataset_path: no data files at '{tmp_path / 'val.jsonl'}' "
                                "(JSON/JSONL, text or Parquet files, a dataset repository or save_to_disk folder, "
                                "or a hub id owner/name when online)")


def test_data_tokenized_with_another_tokenizer(packed):
    mistral = str(TOKENIZERS / "mistral_v1.model")
    with pytest.raises(ValueError) as error:
        load_packed([packed], tokenizer=mistral)
    fingerprint = json.loads((packed / "manifest.json").read_text())["tokenizer"]["fingerprint"]
    assert str(error.value).startswith(f"training.dataset_path: {packed} was tokenized with {TOKENIZER} "
                                       f"({fingerprint}), but model.tokenizer_path is {mistral} (sha256:")
    assert str(error.value).endswith(f"); re-run python -m scripts.preprocess with --tokenizer {mistral}, "
                                     "or set model.tokenizer_path to the data's tokenizer")


def test_missing_manifest(packed):
    (packed / "manifest.json").unlink()
    with pytest.raises(FileNotFoundError) as error:
        load_packed([packed])
    assert str(error.value) == (f"training.dataset_path: {packed} is not a packed dataset: no manifest.json "
                                "(write one with python -m scripts.preprocess)")


@pytest.mark.parametrize("content, problem", [
    ("half a manif", "not valid JSON (Expecting value: line 1 column 1 (char 0))"),
    ("[]", "not a JSON object"),
])
def test_manifest_that_is_not_json(packed, content, problem):
    (packed / "manifest.json").write_text(content)
    with pytest.raises(ValueError) as error:
        load_packed([packed])
    assert str(error.value) == (f"training.dataset_path: {packed / 'manifest.json'}: {problem}; "
                                "the dataset is damaged, preprocess it again")


@pytest.mark.parametrize("suffix, itemsize", [("bin", 2), ("idx", 8)])
def test_truncated_shard(packed, suffix, itemsize):
    shard = packed / f"train-00000.{suffix}"
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.truncate(size - itemsize)
    with pytest.raises(ValueError) as error:
        load_packed([packed])
    assert str(error.value) == (f"training.dataset_path: {shard}: expected {size} bytes, "
                                f"found {size - itemsize} bytes; the dataset is damaged, preprocess it again")


def test_a_missing_validation_path_fails_at_start_up(tmp_path, train_in_process, capsys):
    args = ["--job.config_file", "debug_model.toml", "--training.steps", "50", "--validation.enable", "true",
            "--validation.freq", "50", "--validation.dataset_path", str(tmp_path / "nope.jsonl"),
            "--job.dump_folder", str(tmp_path)]
    assert train_in_process(args) == 2
    assert f"validation.dataset_path: no data files at '{tmp_path / 'nope.jsonl'}'" in capsys.readouterr().err
    assert not (tmp_path / "metrics.jsonl").exists() or "loss" not in (tmp_path / "metrics.jsonl").read_text()


def test_an_unreadable_config_file_is_named(tmp_path, monkeypatch):
    """Permissions cannot be taken from root (the tests' user here), so reading is made to fail."""
    config = tmp_path / "locked.toml"
    config.write_text("[training]\nsteps = 3\n")

    def refuse(self, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(type(config), "read_text", refuse)
    with pytest.raises(ConfigError) as error:
        load_config(["--job.config_file", str(config)], model_config_class)
    assert str(error.value) == f"{config}: cannot be read (Permission denied)"
