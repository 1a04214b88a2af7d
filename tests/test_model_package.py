"""The model-package contract (docs/models.md): every model exports it, and forking Llama 3 as the
docs say gives a model that trains alone and under tensor parallelism with the same losses and weights."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import REPO, TINY, losses

from components.config import ConfigError
from components.model_package import MODEL_EXPORTS, import_model_package
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
    assert "model.name 'llama9': there is no package models/llama9" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="does not export"):
        import_model_package("llama3.model")  # a module without the contract


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
    baseline = subprocess.run([sys.executable, str(REPO / "train.py"), *TINY, "--training.steps", "1",
                               "--job.dump_folder", str(tmp_path / "llama")], cwd=REPO, capture_output=True, text=True)
    assert baseline.returncode == 0
    assert losses(tmp_path / "llama")[1] != one[1]  # the QK norms change the model
