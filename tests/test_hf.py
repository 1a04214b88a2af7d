"""Hugging Face interop: export to transformers, import from it, sharded loads, exact round trips.

Every comparison of logits prints its relative error (run with -s to see them; docs/hf.md quotes them).
"""

import json
import logging
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

transformers = pytest.importorskip("transformers")

from conftest import REPO, TINY, build_model, losses, torchrun, torchrun_runs  # noqa: E402

import models.llama3 as llama  # noqa: E402
from components.checkpoint.dcp import ModelState  # noqa: E402
from components.config import load_config  # noqa: E402
from components.hf import export as hf_export  # noqa: E402
from components.hf.load import load_hf_weights, read_hf_weights  # noqa: E402
from models.families import load_hf_model, model_config_class  # noqa: E402
from scripts import hf as converter  # noqa: E402

VOCAB = 4096  # tests/assets/tokenizers/shakespeare_bpe_4k.model, which TINY uses
# An ingot config and an HF LlamaConfig of the same small model: GQA, Llama 3.1 RoPE scaling, an FFN
# size that Llama's sizing rule does not give.
SMALL = [*TINY, "--model.dim", "64", "--model.n_heads", "4", "--model.n_kv_heads", "2", "--model.ffn_dim", "160",
         "--model.use_rope_scaling", "true"]
SMALL_HF = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=131072,
    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192},
    bos_token_id=1, eos_token_id=2,
)


def relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return ((ours - reference).norm() / reference.norm()).item()


def token_ids(batch: int = 2, seq: int = 64) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(0))


def hf_llama(folder: Path, tie: bool = False, dtype: torch.dtype = torch.float32) -> Path:
    """A random LlamaForCausalLM saved with save_pretrained. Its weights are drawn larger than
    transformers' initialization, so that attention (and with it RoPE) shapes the logits."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL_HF, tie_word_embeddings=tie))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0, 1.0 if "embed" in name else 1.5 * p.shape[-1] ** -0.5)
    model.to(dtype).save_pretrained(folder)
    return folder


def transformers_logits(folder: Path, ids: torch.Tensor) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        return model(ids).logits


def ingot_model(argv: list[str], checkpoint: Path) -> torch.nn.Module:
    """The model of an ingot config with the weights of a DCP checkpoint."""
    model = build_model(llama.build_model_args(load_config(argv, model_config_class), VOCAB))
    with converter.one_process():
        dcp.load({"model": ModelState([model])}, checkpoint_id=str(checkpoint), no_dist=True)
    return model.eval()


def run_hf(*argv) -> None:
    assert converter.main([str(a) for a in argv]) == 0


@pytest.mark.slow
def test_export_of_a_trained_checkpoint_gives_transformers_the_same_logits(tmp_path, train_in_process, monkeypatch):
    dump = tmp_path / "run"
    assert train_in_process([*TINY, "--training.steps", "3", "--checkpoint.enable", "true",
                             "--checkpoint.interval", "3", "--job.dump_folder", str(dump)]) == 0
    checkpoint = dump / "checkpoint" / "step-3"
    said = logging.Handler()  # the export's own lines (train.main's logging setup has replaced pytest's handler)
    said.emit, said.lines = lambda record: said.lines.append(record.getMessage()), []
    monkeypatch.setattr(hf_export.logger, "handlers", [said])
    run_hf("export", *TINY, "--checkpoint", checkpoint, "--output", tmp_path / "hf")
    assert said.lines[-1].endswith("; its form checked against transformers")
    with monkeypatch.context() as without_transformers:  # the README's install: the export says it did not check
        without_transformers.setitem(sys.modules, "transformers", None)
        run_hf("export", *TINY, "--checkpoint", checkpoint, "--output", tmp_path / "unchecked")
    assert said.lines[-2:] == [
        "models.llama3: the Hugging Face form is not checked: transformers is not installed (pip install -e '.[hf]' "
        "installs it)",
        f"exported {checkpoint} to {tmp_path / 'unchecked'}: 1 safetensors file(s), 13.8 MiB in float32; its form NOT "
        "checked (see above)"]
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.model"
    ]
    with torch.no_grad():
        ours = ingot_model(TINY, checkpoint)(token_ids())
    error = relative_error(ours, transformers_logits(tmp_path / "hf", token_ids()))
    print(f"\nexport of a trained debug checkpoint, ingot vs transformers logits: relative error {error:.2e}")
    assert error < 1e-4

    # Sharded output: several files and an index, which transformers reads alike.
    run_hf("export", *TINY, "--checkpoint", checkpoint, "--output", tmp_path / "sharded", "--max-shard-gb", "0.002")
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    assert torch.equal(transformers_logits(tmp_path / "sharded", token_ids()),
                       transformers_logits(tmp_path / "hf", token_ids()))


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_random_hf_llama_imports_with_the_same_logits(tmp_path, tie):
    """GQA, Llama 3.1 RoPE scaling, untied and tied embeddings: load_hf_model, and the import
    command into the model of an ingot config."""
    source = hf_llama(tmp_path / "hf", tie=tie)
    reference = transformers_logits(source, token_ids())
    with torch.no_grad():
        loaded = load_hf_model(source)(token_ids())
    tie_flag = ["--model.tie_embeddings", "true"] if tie else []
    run_hf("import", *SMALL, *tie_flag, "--hf", source, "--output", tmp_path / "dcp")
    with torch.no_grad():
        imported = ingot_model([*SMALL, *tie_flag], tmp_path / "dcp")(token_ids())
    errors = relative_error(loaded, reference), relative_error(imported, reference)
    print(f"\nrandom HF Llama ({'tied' if tie else 'untied'}) vs ingot logits: "
          f"load_hf_model {errors[0]:.2e}, import {errors[1]:.2e}")
    assert max(errors) < 1e-4

    # The test is sensitive to RoPE and its scaling: without the scaling the logits move far more.
    plain = load_hf_model(source)
    plain.rope.copy_(llama.model.rope_frequencies(llama.ModelArgs(**(vars(plain.args) | {"use_rope_scaling": False}))))
    with torch.no_grad():
        assert relative_error(plain(token_ids()), reference) > 1e-3


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_round_trip_hf_to_ingot_to_hf_is_bit_exact(tmp_path, tie):
    source = hf_llama(tmp_path / "source", tie=tie)
    tie_flag = ["--model.tie_embeddings", "true"] if tie else []
    run_hf("import", *SMALL, *tie_flag, "--hf", source, "--output", tmp_path / "dcp")
    run_hf("export", *SMALL, *tie_flag, "--checkpoint", tmp_path / "dcp", "--output", tmp_path / "back")
    before, after = read_hf_weights(source), read_hf_weights(tmp_path / "back")
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    def config(folder):
        ignored = {"transformers_version": None, "_name_or_path": None, "ingot_model": None}
        return transformers.AutoConfig.from_pretrained(folder).to_dict() | ignored
    assert config(tmp_path / "back") == config(source)
    assert json.loads((tmp_path / "back" / "config.json").read_text())["ingot_model"] == "llama3"  # the exporter


def test_mismatched_config_names_the_field(tmp_path, capsys):
    source = hf_llama(tmp_path / "hf")
    assert converter.main(["import", *SMALL, "--model.n_layers", "3", "--hf", str(source),
                           "--output", str(tmp_path / "dcp")]) == 2
    error = capsys.readouterr().err
    assert "num_hidden_layers = 2" in error and "model.n_layers" in error, error
    assert converter.main(["import", *TINY, "--hf", str(source), "--output", str(tmp_path / "dcp")]) == 2
    assert "hidden_size" in capsys.readouterr().err


def test_sharded_loader_casts_bf16_files_into_the_model(tmp_path):
    """load_hf_weights, as training runs it, here in one process on an HF folder stored in bf16."""
    source = hf_llama(tmp_path / "hf", dtype=torch.bfloat16)
    args = llama.build_model_args(load_config(SMALL, model_config_class), VOCAB)
    model = build_model(args)
    with converter.one_process():
        load_hf_weights(source, [model], llama, args)
    stored = llama.from_hf(read_hf_weights(source), args)
    assert all(p.dtype == torch.float32 and torch.equal(p, stored[k].float()) for k, p in model.state_dict().items())


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["data_parallel_shard_degree", "tensor_parallel_degree"], ids=["fsdp2", "tp2"])
def test_export_from_a_checkpoint_saved_by_two_processes_equals_one_process(tmp_path, train_in_process, layout):
    """A seed checkpoint (one process) and a checkpoint saved by two processes from it after a step
    at lr 0 (the weights are unchanged) export to the same tensors."""
    seed = tmp_path / "seed"
    assert train_in_process([*TINY, "--checkpoint.create_seed_checkpoint", "--job.dump_folder", str(seed)]) == 0
    torchrun(2, [*TINY, f"--parallelism.{layout}", "2", "--training.steps", "1", "--optimizer.lr", "0",
                 "--checkpoint.enable", "true", "--checkpoint.initial_load_path", str(seed / "checkpoint" / "step-0"),
                 "--job.dump_folder", str(tmp_path / "two")])
    sharded = tmp_path / "two" / "checkpoint" / "step-1"
    assert len(list(sharded.glob("*.distcp"))) == 2
    run_hf("export", *TINY, "--checkpoint", seed / "checkpoint" / "step-0", "--output", tmp_path / "from_one")
    run_hf("export", *TINY, "--checkpoint", sharded, "--output", tmp_path / "from_two")
    one, two = read_hf_weights(tmp_path / "from_one"), read_hf_weights(tmp_path / "from_two")
    assert one.keys() == two.keys() and all(torch.equal(one[k], two[k]) for k in one)


# Fields of the config.json published with Meta-Llama-3.1-8B and Llama-3.2-1B.
LLAMA31_8B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 128000,
    "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 14336, "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "pretraining_tp": 1,
    "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "use_cache": True, "vocab_size": 128256,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
}
LLAMA32_1B = LLAMA31_8B | {
    "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "head_dim": 64,
    "tie_word_embeddings": True,
    "rope_scaling": LLAMA31_8B["rope_scaling"] | {"factor": 32.0},
}


def test_published_configs_map_to_flavors_and_back():
    for published, flavor in ((LLAMA31_8B, "8B"), (LLAMA32_1B, "1B")):
        args = llama.model_args_from_hf(published)
        assert args == llama.ModelArgs(**(vars(llama.flavors[flavor]) | {"max_seq_len": 131072})), flavor
        ours = llama.hf_config(args, bos_id=128000, eos_id=128001, dtype="bfloat16")
        assert {k: ours[k] for k in published} == published, flavor


def test_export_copies_the_tokenizer_when_transformers_can_load_it(tmp_path, caplog):
    assets = REPO / "tests" / "assets" / "tokenizers"
    hf_export.copy_tokenizer(assets / "mistral_v1.model", tmp_path)
    assert (tmp_path / "tokenizer.model").read_bytes() == (assets / "mistral_v1.model").read_bytes()
    (tmp_path / "mine.json").write_text("{}")
    hf_export.copy_tokenizer(tmp_path / "mine.json", tmp_path)
    assert (tmp_path / "tokenizer.json").read_text() == "{}"
    caplog.set_level("INFO", logger="components.hf.export")
    (tmp_path / "tiktoken").mkdir()
    hf_export.copy_tokenizer(assets / "gpt2.tiktoken", tmp_path / "tiktoken")
    assert not list((tmp_path / "tiktoken").iterdir()) and "no tokenizer written" in caplog.text


@pytest.mark.slow
def test_training_from_an_hf_folder_starts_alike_on_one_and_two_processes(tmp_path, train_in_process):
    """--checkpoint.initial_load_path HFDIR: FSDP x2 ranks each read their shards, pipeline stages
    (PP x2) only their own weights; the first loss is that of one process."""
    source = hf_llama(tmp_path / "hf")
    common = [*SMALL, "--training.steps", "1", "--training.global_batch_size", "8",
              "--checkpoint.initial_load_path", str(source)]
    assert train_in_process([*common, "--training.local_batch_size", "8",
                             "--job.dump_folder", str(tmp_path / "one")]) == 0
    first = losses(tmp_path / "one")[1]
    layouts = {
        "fsdp2": ["--training.local_batch_size", "4", "--parallelism.data_parallel_shard_degree", "2"],
        "pp2": ["--training.local_batch_size", "8", "--parallelism.pipeline_parallel_degree", "2"],
    }
    for name, (dump, problem) in torchrun_runs({name: (2, [*common, *layout]) for name, layout in layouts.items()},
                                               tmp_path).items():
        assert not problem, problem
        print(f"\nfirst loss from an HF folder: 1 process {first:.7f}, {name} {losses(dump)[1]:.7f}")
        assert losses(dump)[1] == pytest.approx(first, rel=1e-5), name
    # The same weights through the import command and a DCP checkpoint.
    run_hf("import", *SMALL, "--hf", source, "--output", tmp_path / "dcp")
    assert train_in_process([*common, "--training.local_batch_size", "8",
                             "--checkpoint.initial_load_path", str(tmp_path / "dcp"),
                             "--job.dump_folder", str(tmp_path / "imported")]) == 0
    assert losses(tmp_path / "imported")[1] == first
