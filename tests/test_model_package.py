"""The model-package contract (docs/models.md): every model exports it, and forking Llama 3 as the
docs say gives a model that trains alone and under tensor parallelism with the same losses and weights."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import (
    REPO,
    TINY,
    fork_with_renamed_modules,
    import_fork,
    losses,
    metric_lines,
    sliding_window_fork,
    train_main,
)

from components.config import ConfigError
from models.families import MODEL_EXPORTS, import_model_package, model_config_class
from scripts.hf import one_process


def test_the_contract_table_in_docs_lists_exactly_the_required_exports():
    table = (REPO / "docs" / "models.md").read_text().split("## The contract")[1].split("##")[0]
    documented = [name for row in re.findall(r"^\| (`.+?`) \|", table, re.M) for name in re.findall(r"`(\w+)`", row)]
    assert sorted(documented) == sorted(MODEL_EXPORTS)


@pytest.mark.parametrize("name", sorted(p.name for p in (REPO / "models").iterdir() if (p / "__init__.py").is_file()))
def test_every_model_package_exports_the_contract(name):
    package = import_model_package(name)
    assert set(MODEL_EXPORTS) <= set(package.__all__)
    assert all(hasattr(package, export) for export in package.__all__)


def test_an_unknown_model_name_is_one_clear_error(train_in_process, tmp_path, capsys):
    assert train_in_process([*TINY, "--model.name", "llama9", "--job.dump_folder", str(tmp_path)]) == 2
    assert ("model.name 'llama9': there is no package models/llama9; the families are deepseek_v3, gpt_oss, llama3, "
            "qwen3, qwen3_5 (docs/models.md)") in capsys.readouterr().err
    with pytest.raises(ConfigError, match="does not export"):
        import_model_package("llama3.model")  # a module without the contract


@pytest.mark.parametrize("name", ["llama3", "qwen3"])
def test_every_family_fulfils_the_model_contract(name):
    from components.config import load_config
    from components.model.contract import check_model_contract

    package = import_model_package(name)
    with torch.device("meta"):
        config = load_config(["--model.name", name], model_config_class)
        model = package.Transformer(package.build_model_args(config, 4096))
    check_model_contract(model, name)


def test_a_model_that_breaks_the_contract_is_refused_in_one_line_naming_what_it_lacks():
    from components.model.contract import check_model_contract
    from models.llama3 import ModelArgs, Transformer

    def refusal(edit) -> str:
        with torch.device("meta"):
            model = Transformer(ModelArgs(dim=32, n_layers=2, n_heads=2, vocab_size=64))
        edit(model)
        with pytest.raises(ConfigError) as error:
            check_model_contract(model, "fork")
        assert "\n" not in str(error.value) and str(error.value).startswith("model.name fork: its Transformer ")
        return str(error.value).removeprefix("model.name fork: its Transformer ").split(" (the model contract")[0]

    def renamed_without_declaring(model):
        model.embed = model.tok_embeddings
        del model.tok_embeddings

    def no_blocks_method(model):
        model.transformer_blocks = None

    def own_mask_object(model):
        model.layers["1"].attention.attention_mask = {"window": 16}

    def blocks_keyed_by_name(model):
        model.layers = torch.nn.ModuleDict({f"block{i}": block for i, block in model.layers.items()})

    assert refusal(renamed_without_declaring) == ("names 'tok_embeddings' in pipeline_ends, which is none of its "
                                                  "modules other than the blocks")
    assert refusal(no_blocks_method) == "has no method transformer_blocks"
    assert refusal(own_mask_object) == ("declares for layers.1.attention an attention_mask that is no AttentionMask "
                                        "({'window': 16})")
    assert refusal(blocks_keyed_by_name) == "has blocks keyed ['block0', 'block1'], not 0..1 (args.n_layers)"


RENAMED_RUNS = {
    "groups": ["--training.steps", "3", "--metrics.log_freq", "1", "--metrics.per_layer", "true", "--optimizer.name",
               "Muon", "--model.mup", "true", "--model.mup_base_dim", "128"],
    "export": ["--training.steps", "2", "--checkpoint.enable", "true", "--checkpoint.interval", "2",
               "--checkpoint.last_save_in_hf", "true"],
    "import": ["--training.steps", "1", "--checkpoint.initial_load_path", "{export}/hf/step-2"],
}
"""Muon's and µP's parameter groups (the blocks' matrices) with per-layer metrics; an export to Hugging Face (µP has
no HF form); a run from that export."""


def test_a_fork_that_renames_its_modules_trains_exports_and_imports_as_llama_does(tmp_path, monkeypatch,
                                                                                  train_in_process):
    """`blocks` for `layers`, `embed` for `tok_embeddings`, declared through the model contract: the same losses and
    per-layer figures as Llama 3, bit for bit (the same initial weights, the same parameter groups), the same
    Hugging Face export, tensor for tensor, which the fork then loads as Llama loads its own."""
    from safetensors.torch import load_file

    import models

    fork_with_renamed_modules(tmp_path)
    monkeypatch.setattr(models, "__path__", [*models.__path__, str(tmp_path / "models")])
    from models.renamed import ModelArgs, Transformer

    with torch.device("meta"):
        fork = Transformer(ModelArgs(dim=32, n_layers=2, n_heads=2, vocab_size=64))
    assert not hasattr(fork, "layers") and not hasattr(fork, "tok_embeddings")
    figures = {}
    for name in ("llama3", "renamed"):
        for run, args in RENAMED_RUNS.items():
            args = [arg.format(export=tmp_path / name / "export") for arg in args]
            dump = tmp_path / name / run
            assert train_in_process([*TINY, *args, "--model.name", name, "--job.dump_folder", str(dump)]) == 0
        timeless = [{k: v for k, v in line.items() if k not in ("time", "tokens_per_second", "memory_gib")}
                    for line in metric_lines(tmp_path / name / "groups")]
        figures[name] = (timeless, load_file(tmp_path / name / "export/hf/step-2/model.safetensors"),
                         losses(tmp_path / name / "import"))
    (llama_lines, llama_hf, llama_loaded), (fork_lines, fork_hf, fork_loaded) = figures.values()
    assert sum("layers" in line for line in llama_lines) == 3 and sum("loss" in line for line in llama_lines) == 3
    assert fork_lines == llama_lines
    assert llama_hf.keys() == fork_hf.keys() and all(torch.equal(llama_hf[k], fork_hf[k]) for k in llama_hf)
    assert fork_loaded == llama_loaded


QK_NORM_EDITS = [  # docs/models.md, "Forking Llama 3 into your own model": (file, anchor, lines added after it)
    ("model.py", "        self.wo = nn.Linear(self.n_heads * self.head_dim, args.dim, bias=False)\n",
     "        self.q_norm = nn.RMSNorm(self.head_dim, eps=args.norm_eps)\n"
     "        self.k_norm = nn.RMSNorm(self.head_dim, eps=args.norm_eps)\n"),
    ("model.py", "        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=out_std)\n",
     "        self.q_norm.reset_parameters()\n        self.k_norm.reset_parameters()\n"),
    ("parallelize.py", '            f"{block}.attention.wv": Colwise(),\n',
     '            f"{block}.attention.q_norm": SequenceParallel(sequence_dim=2, use_local_output=True),\n'
     '            f"{block}.attention.k_norm": SequenceParallel(sequence_dim=2, use_local_output=True),\n'),
]


def fork_with_qk_norm(root: Path) -> None:
    """The docs' fork, made under `root`/models (a second portion of the `models` namespace package)."""
    fork = root / "models" / "mymodel"
    shutil.copytree(REPO / "models" / "llama3", fork, ignore=shutil.ignore_patterns("__pycache__"))
    for path in fork.glob("*.py"):
        path.write_text(path.read_text().replace("models.llama3", "models.mymodel"))
    for file, anchor, added in QK_NORM_EDITS:
        text = (fork / file).read_text()
        assert text.count(anchor) == 1
        (fork / file).write_text(text.replace(anchor, anchor + added))
    model = fork / "model.py"
    text = model.read_text()
    rope = "        q, k = apply_rope(q, rope), apply_rope(k, rope)\n"
    assert text.count(rope) == 1
    model.write_text(text.replace(rope, "        q, k = self.q_norm(q), self.k_norm(k)\n" + rope))


def qk_norm_weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The QK-norm weights (head_dim 16 in TINY's model) of a DCP checkpoint."""
    tensors = {f"layers.{i}.attention.{norm}_norm.weight": torch.empty(16) for i in range(2) for norm in ("q", "k")}
    with one_process():
        dcp.load({"model": tensors}, checkpoint_id=str(checkpoint), no_dist=True)
    return tensors


@pytest.mark.slow
def test_a_forked_model_with_qk_norm_trains_alike_on_one_process_and_under_tensor_parallel(tmp_path):
    """The same losses, and the same QK-norm weights: their gradients come from every tp rank's heads
    (without the plan entries each rank's copy follows its own heads and drifts; the losses hardly show it)."""
    fork_with_qk_norm(tmp_path)
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{REPO}", OMP_NUM_THREADS="1")
    run = [*TINY, "--model.name", "mymodel", "--training.steps", "4", "--checkpoint.enable", "true",
           "--checkpoint.interval", "4"]
    single = [sys.executable, str(REPO / "train.py"), *run, "--job.dump_folder", str(tmp_path / "one")]
    tp = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
          str(REPO / "train.py"), *run, "--parallelism.tensor_parallel_degree", "2",
          "--job.dump_folder", str(tmp_path / "tp")]
    for cmd in (single, tp):
        result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
    one, two = losses(tmp_path / "one"), losses(tmp_path / "tp")
    assert one.keys() == {1, 2, 3, 4} and one == pytest.approx(two, rel=1e-4)
    alone, split = (qk_norm_weights(tmp_path / dump / "checkpoint" / "step-4") for dump in ("one", "tp"))
    assert max((alone[k] - 1).abs().max() for k in alone) > 1e-3  # trained
    assert max((alone[k] - split[k]).abs().max() for k in alone) < 1e-5
    assert train_main([*TINY, "--training.steps", "1", "--job.dump_folder", str(tmp_path / "llama")]) == 0
    assert losses(tmp_path / "llama")[1] != one[1]  # the QK norms change the model


def fork_qwen3_with_its_own_moe(root: Path, name: str = "mymoe") -> Path:
    """A fork of Qwen3 under `root`/models with its own copy of models/moe.py (models/<name>/moe.py), whose MoE
    class is therefore not models.moe.MoE, and its modules renamed (`blocks`, `embed`: conftest.RENAMES)."""
    fork = fork_with_renamed_modules(root, "qwen3", name)
    shutil.copyfile(REPO / "models" / "moe.py", fork / "moe.py")
    for path in fork.glob("*.py"):
        path.write_text(path.read_text().replace("from models.moe import", f"from models.{name}.moe import"))
    return fork


MOE_FORK_RUN = ["--job.config_file", "debug_moe.toml", "--model.name", "mymoe", *TINY[2:], "--training.steps", "3",
                "--metrics.log_freq", "1", "--training.global_batch_size", "8"]


@pytest.fixture
def moe_fork(tmp_path, monkeypatch):
    """The fork, importable in this process (a second portion of the `models` namespace package)."""
    import models

    fork_qwen3_with_its_own_moe(tmp_path)
    monkeypatch.setattr(models, "__path__", [*models.__path__, str(tmp_path / "models")])
    return tmp_path


def test_a_fork_with_its_own_moe_module_keeps_load_balancing_metrics_and_the_compile_rule(moe_fork, train_in_process,
                                                                                         monkeypatch):
    """Shared code finds MoE layers by interface (components/model/moe_layer.py): the fork's routing biases move and its
    MoE metrics are logged (with models.moe.MoE recognised by class the biases stayed 0.0), and compile leaves
    the data-dependent expert computation out of the blocks' graphs. Its renamed modules keep the Hugging Face form
    (Qwen3-MoE's, which transformers loads to the same logits)."""
    import models.moe
    from models.mymoe import moe as fork_moe

    assert fork_moe.MoE is not models.moe.MoE
    dump = moe_fork / "run"
    assert train_in_process([*MOE_FORK_RUN, "--checkpoint.enable", "true", "--checkpoint.interval", "3",
                             "--job.dump_folder", str(dump)]) == 0
    records = [m for m in metric_lines(dump) if "loss" in m]
    assert len(records) == 3 and all(m["moe_max_load"] >= 1 and "moe_aux_loss" in m for m in records)
    biases = {f"model.blocks.{i}.feed_forward.expert_bias": torch.empty(8) for i in range(2)}
    with one_process():
        dcp.load(biases, checkpoint_id=str(dump / "checkpoint" / "step-3"), no_dist=True)
    assert all(bias.abs().max() > 1e-4 for bias in biases.values()), biases

    from components.config import load_config
    from parallelisms.compile import compile_blocks

    package = import_model_package("mymoe")
    with torch.device("meta"):
        model = package.Transformer(package.build_model_args(load_config(MOE_FORK_RUN, model_config_class), 4096))
    fullgraph = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kwargs: fullgraph.append(kwargs["fullgraph"]))
    compile_blocks(model.transformer_blocks())
    assert fullgraph == [False, False]
    pytest.importorskip("transformers")
    from components.hf.export import check_hf_form

    check_hf_form(package, package.build_model_args(load_config(MOE_FORK_RUN, model_config_class), 4096))


@pytest.mark.slow
def test_a_fork_with_its_own_moe_module_trains_under_expert_parallel_like_one_process(tmp_path):
    fork_qwen3_with_its_own_moe(tmp_path)
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{REPO}", OMP_NUM_THREADS="1")
    runs = {"one": (1, ["--training.local_batch_size", "8"]),
            "ep2": (2, ["--training.local_batch_size", "4", "--parallelism.expert_parallel_degree", "2"])}
    for name, (nproc, extra) in runs.items():
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
               str(REPO / "train.py"), *MOE_FORK_RUN, *extra, "--job.dump_folder", str(tmp_path / name)]
        result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
    assert losses(tmp_path / "ep2") == pytest.approx(losses(tmp_path / "one"), rel=1e-5)


FORK_PATCH = REPO / "docs" / "assets" / "fork_hidden_act.patch"


def test_the_docs_show_the_fork_patch_they_apply():
    shown = (REPO / "docs" / "models.md").read_text().split("```diff\n")[1].split("```")[0]
    assert shown == FORK_PATCH.read_text()


@pytest.mark.slow
def test_the_docs_fork_walkthrough_ends_with_an_export_that_transformers_reloads_to_the_same_logits(tmp_path,
                                                                                                   monkeypatch):
    """docs/models.md: copy, point the imports at the copy, git apply the knob, train with it, export; the fork's
    trained logits and transformers' of the export agree. The key is the fork's: Llama 3 refuses it."""
    transformers = pytest.importorskip("transformers")
    import models

    fork = tmp_path / "models" / "mymodel"
    shutil.copytree(REPO / "models" / "llama3", fork, ignore=shutil.ignore_patterns("__pycache__"))
    for path in fork.glob("*.py"):
        path.write_text(path.read_text().replace("models.llama3", "models.mymodel"))
    subprocess.run(["git", "apply", str(FORK_PATCH)], cwd=tmp_path, check=True)
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{REPO}", OMP_NUM_THREADS="1")
    dump = tmp_path / "run"
    run = [*TINY, "--model.name", "mymodel", "--model.hidden_act", "gelu_pytorch_tanh", "--training.steps", "4",
           "--checkpoint.enable", "true", "--checkpoint.interval", "4", "--job.dump_folder", str(dump)]
    export = ["-m", "scripts.hf", "export", "--job.config_file", str(dump / "config.toml"),
              "--checkpoint", str(dump / "checkpoint" / "step-4"), "--output", str(tmp_path / "hf")]
    for cmd in ([str(REPO / "train.py"), *run], export):
        result = subprocess.run([sys.executable, *cmd], cwd=REPO, env=env, capture_output=True, text=True,
                                timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["hidden_act"] == "gelu_pytorch_tanh"

    from components.checkpoint.dcp import ModelState
    from components.config import load_config

    monkeypatch.setattr(models, "__path__", [*models.__path__, str(tmp_path / "models")])
    package = import_model_package("mymodel")
    config = load_config(["--job.config_file", str(dump / "config.toml")], model_config_class)
    with torch.device("meta"):
        model = package.Transformer(package.build_model_args(config, 4096))
    model.to_empty(device="cpu")
    model.init_weights()
    with one_process():
        dcp.load({"model": ModelState([model])}, checkpoint_id=str(dump / "checkpoint" / "step-4"), no_dist=True)
    ids = torch.randint(4096, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model.eval()(ids)
        theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()(ids).logits
    error = ((ours - theirs).abs().max() / ours.abs().max()).item()
    print(f"\nthe docs' fork (GeGLU), ingot vs transformers logits: relative error {error:.1e}")
    assert error < 1e-5
    with pytest.raises(ConfigError, match="unknown config key 'model.hidden_act'"):
        load_config(["--model.name", "llama3", "--model.hidden_act", "gelu"], model_config_class)


def test_an_export_refuses_a_model_its_hugging_face_form_does_not_compute(monkeypatch):
    """A fork that changes the activation in FeedForward.forward rather than through hidden_act: the form still
    says silu, and the export's check of the form says they differ, before anything is written."""
    import torch.nn.functional as F

    import models.llama3.model as llama_model
    from components.config import load_config
    from components.hf.export import check_hf_form

    pytest.importorskip("transformers")
    package = import_model_package("llama3")
    args = package.build_model_args(load_config([], model_config_class), 4096)
    check_hf_form(package, args)
    monkeypatch.setattr(llama_model.FeedForward, "forward", lambda self, x: self.w2(F.gelu(self.w1(x)) * self.w3(x)))
    with pytest.raises(ConfigError, match=r"models.llama3: its Hugging Face form \(LlamaForCausalLM, hidden_act "
                                          r"'silu'\) computes another model: logits .* apart"):
        check_hf_form(package, args)


def test_an_export_refuses_a_sliding_window_its_hugging_face_form_lacks_however_wide(tmp_path, monkeypatch):
    """docs/models.md's sliding-window fork: LlamaForCausalLM has no window, and the check runs past the widest
    one a module declares, wider than its usual 16 tokens and than the run's sequence; without a window the fork
    is Llama and passes."""
    import models
    from components.config import load_config
    from components.hf.export import check_hf_form

    pytest.importorskip("transformers")
    monkeypatch.setattr(models, "__path__", list(models.__path__))
    monkeypatch.delitem(sys.modules, "models.swa", raising=False)
    package = import_fork(sliding_window_fork(tmp_path))
    config = load_config(["--model.name", "swa", "--training.seq_len", "32"], model_config_class)
    check_hf_form(package, package.build_model_args(config, 4096))
    config = load_config(["--model.name", "swa", "--training.seq_len", "32", "--model.sliding_window", "40"],
                         model_config_class)
    with pytest.raises(ConfigError, match=r"models.swa: its Hugging Face form \(LlamaForCausalLM, .*\) computes "
                                          r"another model"):
        check_hf_form(package, package.build_model_args(config, 4096))
    for name in [name for name in sys.modules if name.startswith("models.swa")]:
        monkeypatch.delitem(sys.modules, name)


def test_a_fork_reads_its_own_exports_and_a_model_type_two_families_list_asks_which(tmp_path, monkeypatch):
    """components/ names no family: the export names its family in config.json, so the fork (a copy of Llama 3,
    listing Llama's model_type too) reads its own export back as itself; a plain Llama folder, which both list,
    is a one-line error naming both; and a broken folder under models/ does not stop the others."""
    import models
    from models.families import load_hf_model
    from scripts import hf as converter

    pytest.importorskip("transformers")
    monkeypatch.setattr(models, "__path__", list(models.__path__))
    monkeypatch.delitem(sys.modules, "models.swa", raising=False)
    folder = sliding_window_fork(tmp_path)
    import_fork(folder)
    run = [*TINY, "--model.name", "swa", "--checkpoint.create_seed_checkpoint", "true",
           "--job.dump_folder", str(tmp_path / "seed")]
    assert train_main(run) == 0
    assert converter.main(["export", "--job.config_file", str(tmp_path / "seed" / "config.toml"), "--checkpoint",
                           str(tmp_path / "seed" / "checkpoint" / "step-0"), "--output", str(tmp_path / "hf")]) == 0
    assert type(load_hf_model(tmp_path / "hf")).__module__ == "models.swa.model"

    plain = json.loads((tmp_path / "hf" / "config.json").read_text())
    del plain["ingot_model"]
    (tmp_path / "hf" / "config.json").write_text(json.dumps(plain))
    with pytest.raises(ValueError, match=r"config.json: model_type 'llama' is read by llama3 and swa: name the "
                                         r"family") as refused:
        load_hf_model(tmp_path / "hf")
    assert "\n" not in str(refused.value)
    assert type(load_hf_model(tmp_path / "hf", "swa")).__module__ == "models.swa.model"

    shutil.rmtree(tmp_path / "models" / "swa")
    (tmp_path / "models" / "broken").mkdir()
    (tmp_path / "models" / "broken" / "__init__.py").write_text("raise ImportError('half-edited')\n")
    assert type(load_hf_model(tmp_path / "hf")).__module__ == "models.llama3.model"
    for name in [name for name in sys.modules if name.startswith(("models.swa", "models.broken"))]:
        monkeypatch.delitem(sys.modules, name)
