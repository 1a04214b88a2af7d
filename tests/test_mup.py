"""µP for Llama 3 (model.mup, docs/mup.md): off by default and then the model as it was, the same as
the standard parametrization at the base width, the init and per-group lrs of its rules, the output
multiplier, activations that stay put as the width grows (a small coordinate check), and under
tensor parallelism and resume like any run."""

import shutil

import pytest
import torch
from conftest import ON_HF, TINY, build_model, losses, metric_lines, tiny_model_args, torchrun

from components.config import ConfigError, Optimizer as OptimizerConfig, load_config
from components.training.muon import Muon
from components.training.optimizers import Optimizers
from models.families import model_config_class
from models.llama3 import build_model_args, hf_config
from scripts import coord_check

STEPS = 6
RUN = [*TINY, "--training.steps", str(STEPS), "--metrics.log_freq", "1"]
MUP = [*RUN, "--model.mup", "true", "--model.mup_base_dim", "64", "--training.global_batch_size", "8"]
"""µP 4 times wider than its base (the debug model's dim 256), two micro-batches a step."""
HIDDEN = ("wq", "wk", "wv", "wo", "w1", "w2", "w3")


def wide(dim: int, base: int | None = 64):
    """A tiny model at `dim` with heads of 16 (their number grows with the width), µP relative to `base`."""
    return tiny_model_args(dim=dim, n_heads=dim // 16, n_kv_heads=dim // 32, mup_base_dim=base)


def group_lrs(model, cfg: OptimizerConfig) -> dict[str, float]:
    """Each parameter's peak lr, by name."""
    names = {p: name for name, p in model.named_parameters()}
    return {names[p]: group["lr"] for group in Optimizers([model], cfg).param_groups for p in group["params"]}


def test_mup_is_off_by_default_and_leaves_the_model_and_losses_as_they_were(train_in_process, tmp_path):
    """model.mup false (the default) ignores mup_base_dim: the standard init and one AdamW group at
    optimizer.lr, and the same losses and gradient norms, bit for bit, as a run that sets it."""
    args = build_model_args(load_config(RUN, model_config_class), 4096)
    assert args.mup_base_dim is None and args.mup_width == 1.0
    model = build_model(tiny_model_args())
    assert set(group_lrs(model, OptimizerConfig(lr=1e-2)).values()) == {1e-2}
    for name, extra in (("default", []), ("explicit", ["--model.mup", "false", "--model.mup_base_dim", "64"])):
        assert train_in_process([*RUN, *extra, "--job.dump_folder", str(tmp_path / name)]) == 0
    default, explicit = (metric_lines(tmp_path / name) for name in ("default", "explicit"))
    assert [(m["loss"], m["grad_norm"]) for m in default] == [(m["loss"], m["grad_norm"]) for m in explicit]


def test_init_std_lr_and_output_multiplier_follow_the_mup_rules_at_two_widths():
    """With m = dim / 64: block matrices drawn with std / sqrt(m) and stepped at lr / m (Muon under
    match_rms_adamw at lr / sqrt(m), under original at lr); embedding, norms and output layer at the
    base width's std and at lr; the output layer's input divided by m."""
    lr, stds = 1e-2, {}
    for dim in (64, 256):
        model, m = build_model(wide(dim)), dim / 64
        stds[dim] = {name: p.std().item() for name, p in model.named_parameters() if p.ndim == 2}
        expected = {"tok_embeddings.weight": 1.0, "output.weight": 64**-0.5,
                    "layers.0.attention.wq.weight": 0.02 / m**0.5,
                    "layers.1.feed_forward.w2.weight": 0.02 / 2 / m**0.5}  # depth_init: 0.02 / sqrt(2 x 2)
        for name, std in expected.items():
            assert stds[dim][name] == pytest.approx(std, rel=0.06), (dim, name)
        for name, peak in group_lrs(model, OptimizerConfig(lr=lr)).items():
            hidden = name.startswith("layers.") and name.split(".")[-2] in HIDDEN
            assert peak == (lr / m if hidden else lr), (dim, name)
        for adjust, scale in (("match_rms_adamw", m**-0.5), ("original", 1.0)):
            cfg = OptimizerConfig(name="Muon", lr=lr, muon_adjust_lr=adjust, adamw_lr=3e-3)
            muon, adamw = Optimizers([model], cfg).optimizers
            assert isinstance(muon, Muon) and {group["lr"] for group in muon.param_groups} == {lr * scale}
            assert {group["lr"] for group in adamw.param_groups} == {3e-3}
        seen = {}
        model.norm.register_forward_hook(lambda module, inputs, output: seen.update(normed=output))
        model.output.register_forward_hook(lambda module, inputs, output: seen.update(projected=inputs[0]))
        model(torch.randint(0, 97, (2, 16)))
        assert torch.equal(seen["projected"], seen["normed"] / m)
    for name in ("layers.0.attention.wq.weight", "layers.0.attention.wo.weight", "layers.1.feed_forward.w2.weight"):
        assert stds[256][name] / stds[64][name] == pytest.approx(0.5, rel=0.06), name
    for name in ("tok_embeddings.weight", "output.weight"):
        assert stds[256][name] / stds[64][name] == pytest.approx(1.0, rel=0.06), name


def test_at_the_base_width_mup_is_the_standard_parametrization(train_in_process, tmp_path):
    """dim == mup_base_dim (m = 1): the same weights and peak lrs, and the same losses bit for bit. The
    gradient norm, taken per param group and combined, may differ in its last bit, so clipping is off: a
    clip coefficient one bit apart would part the losses."""
    standard, mup = build_model(wide(128, None)), build_model(wide(128, 128))
    assert all(torch.equal(a, b) for a, b in zip(standard.state_dict().values(), mup.state_dict().values()))
    cfg = OptimizerConfig(lr=1e-2)
    assert group_lrs(standard, cfg) == group_lrs(mup, cfg)
    base = ["--model.mup", "true", "--model.mup_base_dim", "256"]  # the debug model's width
    for name, extra in (("sp", []), ("mup", base)):
        assert train_in_process([*RUN, *ON_HF, *extra, "--training.max_norm", "0",
                                 "--job.dump_folder", str(tmp_path / name)]) == 0
    sp, mup = metric_lines(tmp_path / "sp"), metric_lines(tmp_path / "mup")
    assert [m["loss"] for m in sp] == [m["loss"] for m in mup]
    assert [m["grad_norm"] for m in sp] == pytest.approx([m["grad_norm"] for m in mup], rel=1e-6)


def test_logits_updates_grow_with_width_under_sp_and_stay_put_under_mup():
    """The coordinate check in small: 4 steps of one block at widths 64 and 256 (m = 4). The RMS of
    the logits' change since initialisation grows about with the width under SP (measured: x3.1),
    not under µP (x0.70: a finite-width term of the init that fades as 1/sqrt(m))."""
    results = coord_check.coord_check([64, 256], base_dim=64, steps=4, n_layers=1, seq_len=64, batch_size=4)
    sp, mup = coord_check.growth(results["SP"]), coord_check.growth(results["µP"])
    assert sp > 2.5 and 1 / 1.6 < mup < 1.6, (sp, mup)


def test_the_coord_check_script_writes_a_png(tmp_path, capsys):
    output = tmp_path / "coord.png"
    assert coord_check.main(["--widths", "32", "64", "--base-dim", "32", "--steps", "2", "--n-layers", "1",
                             "--output", str(output)]) == 0
    assert output.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "logits" in capsys.readouterr().out


def test_a_mup_model_has_no_hugging_face_form_and_qwen3_refuses_it():
    with pytest.raises(ValueError, match="model.mup: Hugging Face's LlamaForCausalLM has no output multiplier"):
        hf_config(wide(128))
    with pytest.raises(ConfigError, match="unknown config key 'model.mup': the model family qwen3 does not define it"):
        load_config(["--job.config_file", "debug_qwen3.toml", "--model.mup", "true"], model_config_class)
    with pytest.raises(ConfigError, match="model.mup_base_dim must be"):
        load_config([*RUN, "--model.mup_base_dim", "0"], model_config_class)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process, µP at m = 4, checkpoints at steps 3 and 6."""
    import train

    dump = tmp_path_factory.mktemp("mup_reference")
    args = [*MUP, "--training.local_batch_size", "8", "--checkpoint.enable", "true", "--checkpoint.interval", "3"]
    assert train.main([*args, "--job.dump_folder", str(dump)]) == 0
    assert sorted(losses(dump)) == list(range(1, STEPS + 1))
    return dump, args


def test_mup_resumes_bit_for_bit(reference, tmp_path, train_in_process):
    """6 steps straight == 3 steps, then a resume from the step-3 checkpoint: the per-group lrs come
    from the config again, and the schedule scales each group's own peak."""
    dump, args = reference
    run = tmp_path / "run"
    shutil.copytree(dump, run)
    shutil.rmtree(run / "checkpoint" / f"step-{STEPS}")
    (run / "metrics.jsonl").write_text("")
    assert train_in_process([*args, "--job.dump_folder", str(run)]) == 0
    resumed = losses(run)
    assert sorted(resumed) == [4, 5, 6] and all(resumed[s] == losses(dump)[s] for s in resumed), resumed


@pytest.mark.slow
def test_mup_under_fsdp2_and_tensor_parallelism_2_matches_one_process(reference, tmp_path):
    """FSDP 2 x TP 2 (param groups per device mesh; under sequence parallelism the output multiplier
    acts on a DTensor) trains like one process."""
    torchrun(4, [*MUP, "--training.local_batch_size", "4", "--parallelism.data_parallel_shard_degree", "2",
                 "--parallelism.tensor_parallel_degree", "2", "--checkpoint.enable", "false",
                 "--job.dump_folder", str(tmp_path)])
    expected = losses(reference[0])
    assert sorted(losses(tmp_path)) == list(range(1, STEPS + 1))
    for step, loss in losses(tmp_path).items():
        assert loss == pytest.approx(expected[step], rel=1e-4), (step, loss, expected[step])
