"""Stability options for long runs: z-loss on the output logits (training.z_loss) and QK-norm for Llama 3
(model.qk_norm). Both are off by default, which leaves the model and its losses as they were."""

import json
import math
import shutil
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import REPO, TINY, build_model, losses, metric_lines, tiny_model_args, torchrun_runs, val_losses

import models.llama3.model as llama
from components.config import load_config
from components.training.loss import ZLoss, cross_entropy_loss, z_loss
from models.families import model_config_class
from models.llama3 import Transformer, build_model_args, hf_config, to_hf
from scripts.hf import main as hf_converter, one_process

RUN = [*TINY, "--metrics.log_freq", "1"]
STABLE = [*RUN, "--training.z_loss", "1e-2", "--model.qk_norm", "true", "--training.global_batch_size", "8"]
"""Both options on, with two micro-batches per step (gradient accumulation)."""
PARITY = [*STABLE, "--training.steps", "4", "--validation.enable", "true", "--validation.freq", "2",
          "--validation.steps", "1"]
"""4 steps with a validation after steps 2 and 4 (a pipeline schedule reinitializes after an eval)."""


def z_losses(dump: Path) -> dict[int, float]:
    return {m["step"]: m["z_loss"] for m in metric_lines(dump) if "z_loss" in m}


def test_z_loss_is_the_mean_squared_logsumexp_of_the_logits():
    logits = torch.randn(2, 5, 11, dtype=torch.float64) * 40  # large: the written-out logsumexp must not overflow
    expected = torch.logsumexp(logits, -1).square().mean()
    assert z_loss(logits.float()).item() == pytest.approx(expected.item(), rel=1e-6)
    assert z_loss(logits.bfloat16()).dtype == torch.float32


def test_z_loss_reaches_the_gradients_and_its_tally_but_not_the_loss_value():
    model = build_model(tiny_model_args())
    tokens = torch.randint(0, 97, (2, 17))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]

    def gradients(loss_of_logits) -> tuple[torch.Tensor, list[torch.Tensor]]:
        model.zero_grad()
        loss = loss_of_logits(model(inputs))
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    with_z = ZLoss(0.1, torch.device("cpu"))
    loss, grads = gradients(lambda logits: with_z(logits, labels))
    plain_loss, plain_grads = gradients(lambda logits: cross_entropy_loss(logits, labels))
    _, by_hand = gradients(lambda logits: cross_entropy_loss(logits, labels) + 0.1 * z_loss(logits))
    assert torch.equal(loss, plain_loss)  # the logged loss stays the cross-entropy, bit for bit
    assert all(torch.allclose(g, h, rtol=1e-4, atol=1e-7) for g, h in zip(grads, by_hand))
    assert max((g - p).abs().max() for g, p in zip(grads, plain_grads)) > 1e-4
    with torch.no_grad():  # validation: not tallied
        with_z(model(inputs), labels)
    assert with_z.step_mean().item() == pytest.approx(z_loss(model(inputs)).item(), rel=1e-6)
    assert with_z.step_mean().item() == 0  # a new tally each step
    # A pipeline run: a call on placeholder outputs, then the real micro-batches; settle keeps those.
    for logits in (torch.full((2, 16, 97), 1e4), torch.zeros(2, 16, 97), torch.zeros(2, 16, 97)):
        with_z(logits.requires_grad_(), labels)
    with_z.settle(2)
    assert with_z.step_mean().item() == pytest.approx(math.log(97) ** 2, rel=1e-6)


def test_compiled_z_loss_matches_eager():
    logits, labels = torch.randn(2, 8, 97, requires_grad=True), torch.randint(0, 97, (2, 8))
    eager, compiled = ZLoss(0.1, torch.device("cpu")), ZLoss(0.1, torch.device("cpu"), compile=True)
    grads = []
    for loss_fn in (eager, compiled):
        logits.grad = None
        loss_fn(logits, labels).backward()
        grads.append(logits.grad.clone())
    assert torch.allclose(*grads, rtol=1e-5, atol=1e-8)
    assert compiled.step_mean().item() == pytest.approx(eager.step_mean().item(), rel=1e-6)


def test_qk_norm_normalizes_each_head_of_q_and_k_before_rope(monkeypatch):
    args = tiny_model_args(qk_norm=True, norm_eps=1e-12)
    model = build_model(args)
    attention = model.layers["0"].attention
    assert torch.equal(attention.q_norm.weight, torch.ones(args.head_dim))  # initialized to ones
    weights = {"q": torch.rand(args.head_dim) + 0.5, "k": torch.rand(args.head_dim) + 0.5}
    with torch.no_grad():
        attention.q_norm.weight.copy_(weights["q"])
        attention.k_norm.weight.copy_(weights["k"])
    seen = []
    monkeypatch.setattr(llama, "apply_rope", lambda x, rope: seen.append(x) or x)
    model(torch.randint(0, 97, (2, 16)))
    q, k = seen[:2]  # layer 0's, as RoPE receives them
    assert q.shape == (2, 16, args.n_heads, args.head_dim) and k.shape == (2, 16, args.n_kv_heads, args.head_dim)
    for name, x in (("q", q), ("k", k)):
        rms = (x / weights[name]).square().mean(-1).sqrt()  # per token and head
        assert torch.allclose(rms, torch.ones_like(rms), atol=1e-5), name


def test_defaults_leave_the_state_dict_and_the_losses_unchanged(train_in_process, tmp_path):
    """Both options off by default: the same weights as a model without them, and the same losses as a run
    that turns them off explicitly; with z-loss on, the first loss is still the same (the logged loss is the
    cross-entropy alone) and the next ones differ (the gradients include the z-loss)."""
    with torch.device("meta"):
        default, explicit = (Transformer(build_model_args(load_config(argv, model_config_class), 4096)) for argv in (
            TINY, [*TINY, "--training.z_loss", "0", "--model.qk_norm", "false"]))
    assert list(default.state_dict()) == list(explicit.state_dict())
    assert not any("q_norm" in name or "k_norm" in name for name in default.state_dict())
    runs = {"default": [], "explicit": ["--training.z_loss", "0", "--model.qk_norm", "false"],
            "z_loss": ["--training.z_loss", "1e-2"]}
    for name, extra in runs.items():
        assert train_in_process([*RUN, "--training.steps", "3", *extra, "--job.dump_folder", str(tmp_path / name)]) == 0
    default, explicit, with_z = (metric_lines(tmp_path / name) for name in runs)
    assert [(m["loss"], m["grad_norm"]) for m in default] == [(m["loss"], m["grad_norm"]) for m in explicit]
    assert not any("z_loss" in m for m in default)
    assert with_z[0]["loss"] == default[0]["loss"] and with_z[0]["grad_norm"] != default[0]["grad_norm"]
    assert with_z[1]["loss"] != default[1]["loss"]
    assert [m["step"] for m in with_z if m["z_loss"] > 0] == [1, 2, 3]


def test_negative_z_loss_is_refused_at_start_up_naming_the_key(train_in_process, tmp_path, capsys):
    assert train_in_process([*TINY, "--training.z_loss", "-1e-4", "--job.dump_folder", str(tmp_path)]) == 2
    assert "training.z_loss must be >= 0 (0: off), got -0.0001" in capsys.readouterr().err


def test_a_llama_with_qk_norm_exports_as_qwen3_which_transformers_computes_alike():
    """Llama with QK-norm is Qwen3's architecture for transformers: hf_config derives that form from the args,
    and check_hf_form's round trip through transformers gives the same logits."""
    from components.hf.export import check_hf_form
    from models import llama3

    args = tiny_model_args(qk_norm=True)
    assert hf_config(args)["architectures"] == ["Qwen3ForCausalLM"] and hf_config(args)["head_dim"] == 16
    assert "model.layers.0.self_attn.q_norm.weight" in to_hf({"layers.0.attention.q_norm.weight": 1}, args)
    check_hf_form(llama3, args)


def test_both_options_train_and_resume_bitwise(train_in_process, tmp_path, capsys):
    """12 steps straight == 6 steps, then a resume from the step-6 checkpoint to 12: losses and z-losses.
    The checkpoint exports as a Qwen3ForCausalLM folder."""
    args = [*STABLE, "--training.steps", "12", "--checkpoint.enable", "true", "--checkpoint.interval", "6"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert train_in_process([*args, "--job.dump_folder", str(straight)]) == 0
    shutil.copytree(straight / "checkpoint" / "step-6", resumed / "checkpoint" / "step-6")
    assert train_in_process([*args, "--job.dump_folder", str(resumed)]) == 0
    loss = losses(straight)
    print(f"\nz-loss and QK-norm: loss {loss[1]:.3f} at step 1, {loss[12]:.3f} at step 12; "
          f"z_loss {z_losses(straight)[1]:.2f} -> {z_losses(straight)[12]:.2f}")
    assert loss[12] < loss[1] - 0.5, loss
    assert losses(resumed) == {s: loss[s] for s in range(7, 13)}
    assert z_losses(resumed) == {s: z_losses(straight)[s] for s in range(7, 13)}
    capsys.readouterr()
    assert hf_converter(["export", "--checkpoint", str(straight / "checkpoint" / "step-12"),
                         "--output", str(tmp_path / "hf"), *args]) == 0
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == "qwen3"


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> Path:
    """The PARITY run on one process, with a checkpoint of the last step."""
    sys.path.insert(0, str(REPO))
    import train

    dump = tmp_path_factory.mktemp("one")
    assert train.main([*PARITY, "--checkpoint.enable", "true", "--checkpoint.interval", "4",
                       "--job.dump_folder", str(dump)]) == 0
    return dump


def qk_norm_weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The QK-norm weights (head_dim 16 in TINY's model) of a DCP checkpoint."""
    tensors = {f"layers.{i}.attention.{n}_norm.weight": torch.empty(16) for i in range(2) for n in ("q", "k")}
    with one_process():
        dcp.load({"model": tensors}, checkpoint_id=str(checkpoint), no_dist=True)
    return tensors


def assert_same_curves(one: Path, other: Path) -> None:
    """Losses, logged z-losses and validation losses within 1e-4 (relative) on every step."""
    print(f"\nlosses {losses(one)} / {losses(other)}\nz_loss {z_losses(one)} / {z_losses(other)}")
    assert sorted(losses(one)) == sorted(z_losses(one)) == [1, 2, 3, 4] and sorted(val_losses(one)) == [2, 4]
    for curve in (losses, z_losses, val_losses):
        assert curve(other) == pytest.approx(curve(one), rel=1e-4), curve.__name__


@pytest.fixture(scope="module")
def parallel_runs(tmp_path_factory):
    """PARITY under TP 2 (saving a checkpoint) and PP 2, in one launch: their dump folders and what went wrong."""
    runs = {"tp2": (2, [*PARITY, "--checkpoint.enable", "true", "--checkpoint.interval", "4",
                        "--parallelism.tensor_parallel_degree", "2"]),
            "pp2": (2, [*PARITY, "--parallelism.pipeline_parallel_degree", "2"])}
    return torchrun_runs(runs, tmp_path_factory.mktemp("parallel"))


@pytest.mark.slow
def test_tensor_parallel_matches_one_process_z_loss_and_qk_norm_weights_included(single, parallel_runs):
    """Loss parallel: the z-loss from the vocabulary shards; the QK-norm weights are replicated and get the
    gradients of every rank's heads, so they end as on one process."""
    dump, problem = parallel_runs["tp2"]
    assert not problem, problem
    assert_same_curves(single, dump)
    alone, split = (qk_norm_weights(run / "checkpoint" / "step-4") for run in (single, dump))
    assert max((alone[k] - 1).abs().max() for k in alone) > 1e-3  # trained
    assert max((alone[k] - split[k]).abs().max() for k in alone) < 1e-5


@pytest.mark.slow
def test_pipeline_parallel_matches_one_process(single, parallel_runs):
    """The z-loss comes from the last stage, through the schedule's loss function, over 4 micro-batches
    per batch and 2 batches per step."""
    dump, problem = parallel_runs["pp2"]
    assert not problem, problem
    assert_same_curves(single, dump)
