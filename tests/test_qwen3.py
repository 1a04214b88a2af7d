"""Qwen3, dense and mixture-of-experts: the same logits as transformers' Qwen3ForCausalLM and
Qwen3MoeForCausalLM through the converter and load_hf_model (both directions), exact round trips,
the published sizes, one-line errors, training on the shipped corpus, tensor parallelism with the
QK-norms in its plan, and an HF folder loaded by FSDP ranks.

Every comparison of logits prints its relative error and largest absolute difference (run with -s)."""

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import TINY, losses, metric_lines, torchrun, torchrun_runs

import models.qwen3 as qwen3
from components.checkpoint.dcp import ModelState
from components.config import load_config
from components.hf.load import load_hf_weights, read_hf_weights
from models.families import load_hf_model, model_config_class
from scripts import hf as converter

VOCAB = 4096  # the shipped tokenizer's, which TINY uses
DENSE = [*TINY, "--job.config_file", "debug_qwen3.toml"]  # the last config file is the one read
MOE = [*TINY, "--job.config_file", "debug_moe.toml"]
# The same small models as ingot configs and as HF configs: GQA, head_dim (64) larger than dim / n_heads.
SHAPE = ["--model.dim", "64", "--model.n_heads", "4", "--model.n_kv_heads", "2", "--model.ffn_dim", "160"]
SMALL = {"dense": [*DENSE, *SHAPE], "moe": [*MOE, *SHAPE, "--moe.num_experts", "4", "--moe.hidden_dim", "32"]}
SMALL_HF = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=64,
    bos_token_id=1, eos_token_id=2,
)
SMALL_MOE_HF = SMALL_HF | dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)


def transformers_module():
    return pytest.importorskip("transformers", minversion="4.51")  # the first release with Qwen3


def relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return ((ours - reference).norm() / reference.norm()).item()


def report(what: str, ours: torch.Tensor, reference: torch.Tensor) -> float:
    error = relative_error(ours, reference)
    print(f"\n{what}: relative error {error:.2e}, max abs diff {(ours - reference).abs().max().item():.2e}")
    return error


def token_ids(batch: int = 2, seq: int = 64) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(0))


@torch.no_grad()
def randomize(model: torch.nn.Module) -> None:
    """Weights larger than either initialization, so that attention (RoPE, the QK-norms) and the
    routers' choices shape the logits; norms away from 1."""
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.copy_(1 + 0.1 * torch.randn_like(p))
        else:
            p.normal_(0, 1.0 if "embed" in name else 1.5 * p.shape[-1] ** -0.5)


def hf_qwen3(folder: Path, config: dict, dtype: torch.dtype = torch.float32) -> Path:
    """A random Qwen3ForCausalLM (Qwen3MoeForCausalLM with num_experts) saved with save_pretrained."""
    transformers = transformers_module()
    torch.manual_seed(0)
    if "num_experts" in config:
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**config))
    else:
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**config))
    randomize(model)
    model.to(dtype).save_pretrained(folder)
    return folder


def transformers_logits(folder: Path, ids: torch.Tensor) -> torch.Tensor:
    model = transformers_module().AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        return model(ids).logits


def ingot_model(argv: list[str], checkpoint: Path | None = None, package=qwen3) -> torch.nn.Module:
    """The model of an ingot config (of the family `package`), initialized as train.py does on a CPU, or with the
    weights of a DCP checkpoint."""
    torch.manual_seed(0)
    with torch.device("meta"):
        model = package.Transformer(package.build_model_args(load_config(argv, model_config_class), VOCAB))
    model.to_empty(device="cpu")
    model.init_weights()
    if checkpoint is not None:
        with converter.one_process():
            dcp.load({"model": ModelState([model])}, checkpoint_id=str(checkpoint), no_dist=True)
    return model.eval()


def run_hf(*argv) -> None:
    assert converter.main([str(a) for a in argv]) == 0


CASES = {  # ingot config, HF config
    "dense": (SMALL["dense"], SMALL_HF),
    "dense-tied": ([*SMALL["dense"], "--model.tie_embeddings", "true"], SMALL_HF | {"tie_word_embeddings": True}),
    "moe": (SMALL["moe"], SMALL_MOE_HF),
}


@pytest.mark.parametrize("case", CASES)
def test_random_hf_qwen3_imports_with_the_same_logits(tmp_path, case):
    """load_hf_model (the family from config.json), and the import command into an ingot config."""
    argv, hf = CASES[case]
    source = hf_qwen3(tmp_path / "hf", hf)
    reference = transformers_logits(source, token_ids())
    with torch.no_grad():
        loaded = load_hf_model(source)(token_ids())
    run_hf("import", *argv, "--hf", source, "--output", tmp_path / "dcp")
    with torch.no_grad():
        imported = ingot_model(argv, tmp_path / "dcp")(token_ids())
    errors = (report(f"HF Qwen3 {case} -> ingot, load_hf_model", loaded, reference),
              report(f"HF Qwen3 {case} -> ingot, import", imported, reference))
    assert max(errors) < 1e-4

    # The test sees the QK-norms: without them the logits move far more.
    plain = load_hf_model(source)
    for block in plain.layers.values():
        block.attention.q_norm.weight.data.fill_(1.0)
    with torch.no_grad():
        assert relative_error(plain(token_ids()), reference) > 1e-3


@pytest.mark.parametrize("case", CASES)
def test_export_gives_transformers_the_same_logits(tmp_path, case):
    """An ingot checkpoint of random weights, exported by the converter, read by transformers."""
    argv, _ = CASES[case]
    model = ingot_model(argv)
    torch.manual_seed(1)
    randomize(model)
    with converter.one_process():
        dcp.save({"model": ModelState([model])}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    run_hf("export", *argv, "--checkpoint", tmp_path / "dcp", "--output", tmp_path / "hf")
    with torch.no_grad():
        ours = model(token_ids())
    assert report(f"ingot Qwen3 {case} -> HF export", ours, transformers_logits(tmp_path / "hf", token_ids())) < 1e-4


def test_export_warns_that_routing_biases_are_left_out(tmp_path, caplog):
    model = ingot_model(SMALL["moe"])
    model.layers["1"].feed_forward.expert_bias.copy_(torch.linspace(-0.02, 0.02, 4))
    with converter.one_process():
        dcp.save({"model": ModelState([model])}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    caplog.set_level("WARNING", logger="components.hf.export")
    run_hf("export", *SMALL["moe"], "--checkpoint", tmp_path / "dcp", "--output", tmp_path / "hf")
    assert "routing biases (moe.bias_update_speed, up to 0.02)" in caplog.text
    assert "expert_bias" not in json.dumps(list(read_hf_weights(tmp_path / "hf")))


def test_moe_export_is_per_expert_and_round_trips_bit_exact(tmp_path):
    """HF -> ingot -> HF gives back the files' tensors and config; several output files keep each
    layer's experts together."""
    transformers = transformers_module()
    source = hf_qwen3(tmp_path / "source", SMALL_MOE_HF)
    run_hf("import", *SMALL["moe"], "--hf", source, "--output", tmp_path / "dcp")
    run_hf("export", *SMALL["moe"], "--checkpoint", tmp_path / "dcp", "--output", tmp_path / "back",
           "--max-shard-gb", "0.0005")
    before, after = read_hf_weights(source), read_hf_weights(tmp_path / "back")
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in after
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    weight_map = json.loads((tmp_path / "back" / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(weight_map.values())) > 2
    assert len({weight_map[f"model.layers.0.mlp.experts.{i}.up_proj.weight"] for i in range(4)}) == 1

    def config(folder):
        ignored = {"transformers_version": None, "_name_or_path": None, "ingot_model": None}
        return transformers.AutoConfig.from_pretrained(folder).to_dict() | ignored
    assert config(tmp_path / "back") == config(source)
    assert json.loads((tmp_path / "back" / "config.json").read_text())["ingot_model"] == "qwen3"  # the exporter


def test_transformers_fused_experts_and_mixed_layers_load_alike(tmp_path):
    """from_hf also reads the experts as transformers (5 and later) holds them in memory, fused
    (gate_up_proj, down_proj), and a model whose mlp_only_layers keep a dense feed-forward."""
    transformers = transformers_module()
    source = hf_qwen3(tmp_path / "hf", SMALL_MOE_HF | {"mlp_only_layers": [1]})
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(source).eval()
    with torch.no_grad():
        reference = hf_model(token_ids()).logits
        loaded = load_hf_model(source)
        assert report("HF Qwen3-MoE, layer 1 dense -> ingot", loaded(token_ids()), reference) < 1e-4
        args = loaded.args
        assert not args.is_moe_layer(1) and args.is_moe_layer(0)
        in_memory = hf_model.state_dict()
        if int(transformers.__version__.split(".")[0]) >= 5:
            assert "model.layers.0.mlp.experts.gate_up_proj" in in_memory
        loaded.load_state_dict(qwen3.from_hf(in_memory, args), strict=True)
        assert report("fused experts -> ingot", loaded(token_ids()), reference) < 1e-4


def test_sharded_loader_fills_the_experts_in_place(tmp_path):
    """load_hf_weights, as training runs it, in one process from bf16 files: to_hf's per-expert views
    are filled by DCP, so the stacked experts hold the files' tensors."""
    source = hf_qwen3(tmp_path / "hf", SMALL_MOE_HF, dtype=torch.bfloat16)
    args = qwen3.build_model_args(load_config(SMALL["moe"], model_config_class), VOCAB)
    model = ingot_model(SMALL["moe"])
    with converter.one_process():
        load_hf_weights(source, [model], qwen3, args)
    stored = qwen3.from_hf(read_hf_weights(source), args)
    assert stored.keys() == model.state_dict().keys()
    assert all(torch.equal(p, stored[k].float()) for k, p in model.state_dict().items())


# Fields of the config.json published with Qwen3-8B and Qwen3-30B-A3B.
QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 12288, "max_position_embeddings": 40960, "model_type": "qwen3", "num_attention_heads": 32,
    "num_hidden_layers": 36, "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": None,
    "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}
QWEN3_30B_A3B = QWEN3_8B | {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
    "intermediate_size": 6144, "num_hidden_layers": 48, "num_key_value_heads": 4, "decoder_sparse_step": 1,
    "mlp_only_layers": [], "moe_intermediate_size": 768, "norm_topk_prob": True, "num_experts": 128,
    "num_experts_per_tok": 8,
}


def test_published_configs_map_to_flavors_and_back():
    for published, flavor in ((QWEN3_8B, "8B"), (QWEN3_30B_A3B, "30B-A3B")):
        args = qwen3.model_args_from_hf(published)
        assert args == qwen3.ModelArgs(**(vars(qwen3.flavors[flavor]) | {"max_seq_len": 40960})), flavor
        ours = qwen3.hf_config(args, bos_id=151643, eos_id=151645, dtype="bfloat16")
        assert {k: ours[k] for k in published} == published, flavor


@pytest.mark.parametrize("flavor", [f for f in qwen3.flavors if not f.startswith("debug")])
def test_published_flavors_are_shapes_transformers_accepts(flavor):
    """hf_config of every flavor builds the HF model (on the meta device), whose weights map onto
    the ingot model's shapes; the parameter count is the published one."""
    transformers = transformers_module()
    args = qwen3.flavors[flavor]
    with torch.device("meta"):
        ours = qwen3.Transformer(args)
        hf_config = transformers.AutoConfig.for_model(**qwen3.hf_config(args))
        theirs = transformers.AutoModelForCausalLM.from_config(hf_config)
    mapped = qwen3.from_hf(theirs.state_dict(), args)
    assert {k: v.shape for k, v in mapped.items()} == {k: v.shape for k, v in ours.state_dict().items()}
    billions = sum(p.numel() for p in ours.parameters()) / 1e9
    assert billions == pytest.approx(float(flavor.split("B")[0]), rel=0.1), billions


def test_flops_count_the_active_experts_only():
    moe = qwen3.flavors["30B-A3B"]
    dense_same_shape = qwen3.ModelArgs(**(vars(moe) | {"moe": None, "ffn_dim": 8 * 768}))
    router = moe.n_layers * moe.dim * 128
    assert moe.flops_per_token(4096) == dense_same_shape.flops_per_token(4096) + 6 * router
    weights = (moe.flops_per_token(4096) - 12 * 48 * 32 * 128 * 4096) / 6
    assert 3.0e9 < weights + moe.dim * moe.vocab_size < 3.6e9  # "A3B": 3.3B active parameters


def test_an_unsupported_model_type_is_one_line_naming_the_file(tmp_path, capsys):
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "mistral", "hidden_size": 64}))
    with pytest.raises(ValueError) as info:
        load_hf_model(folder)
    message = str(info.value)
    assert str(folder / "config.json") in message and "'mistral' is not supported" in message
    assert "\n" not in message
    assert converter.main(["import", *SMALL["dense"], "--hf", str(folder), "--output", str(tmp_path / "dcp")]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and str(folder / "config.json") in error and "mistral" in error
    # A supported model_type of another family names the model to configure.
    llama = json.loads((hf_qwen3(tmp_path / "qwen3", SMALL_HF) / "config.json").read_text()) | {"model_type": "llama"}
    (tmp_path / "qwen3" / "config.json").write_text(json.dumps(llama))
    assert converter.main(["import", *SMALL["dense"], "--hf", str(tmp_path / "qwen3"),
                           "--output", str(tmp_path / "dcp")]) == 2
    assert "model_type 'llama' is not read by qwen3: set model.name to llama3" in capsys.readouterr().err


def test_bad_moe_settings_name_the_key(train_in_process, tmp_path, capsys):
    assert train_in_process([*MOE, "--moe.top_k", "9", "--job.dump_folder", str(tmp_path)]) == 2
    assert "moe.top_k 9 must be between 1 and moe.num_experts (8)" in capsys.readouterr().err
    assert train_in_process([*DENSE, "--model.multiple_of", "64", "--job.dump_folder", str(tmp_path)]) == 2
    assert "unknown config key 'model.multiple_of': the model family qwen3 does not define it" in \
        capsys.readouterr().err


def test_dense_debug_model_trains(train_in_process, tmp_path):
    assert train_in_process([*DENSE, "--training.steps", "30", "--job.dump_folder", str(tmp_path)]) == 0
    loss = losses(tmp_path)
    first, last = loss[1], sum(loss[s] for s in range(26, 31)) / 5
    print(f"\nQwen3 debug model: loss {first:.3f} at step 1, {last:.3f} over steps 26-30")
    assert last < first - 1.5, (first, last)


def test_moe_debug_model_trains(train_in_process, tmp_path):
    assert train_in_process([*MOE, "--training.steps", "12", "--job.dump_folder", str(tmp_path)]) == 0
    records = metric_lines(tmp_path)
    loss = [r["loss"] for r in records]
    print(f"\nQwen3 MoE debug model: loss {loss[0]:.3f} at step 1, {loss[-1]:.3f} at step 12, "
          f"max expert load {records[-1]['moe_max_load']:.2f}")
    assert all(torch.isfinite(torch.tensor(loss))) and loss[-1] < loss[0] - 0.5, loss
    assert all(r["moe_max_load"] >= 1 for r in records)


def saved_weights(checkpoint: Path, names: list[str], shape: tuple[int, ...]) -> dict[str, torch.Tensor]:
    tensors = {name: torch.empty(shape) for name in names}
    with converter.one_process():
        dcp.load({"model": tensors}, checkpoint_id=str(checkpoint), no_dist=True)
    return tensors


def tied_or_not(tie: str) -> list[str]:
    return [*DENSE, "--model.tie_embeddings", tie, "--training.steps", "6", "--checkpoint.enable", "true",
            "--checkpoint.interval", "6"]


@pytest.fixture(scope="module")
def tensor_parallel_runs(tmp_path_factory):
    """TP 2 with and without tied embeddings, in one launch."""
    runs = {tie: (2, [*tied_or_not(tie), "--parallelism.tensor_parallel_degree", "2"]) for tie in ("false", "true")}
    return torchrun_runs(runs, tmp_path_factory.mktemp("tensor_parallel"))


@pytest.mark.slow
@pytest.mark.parametrize("tie", ["false", "true"], ids=["untied", "tied"])
def test_tensor_parallel_matches_one_process_qk_norms_included(tmp_path, train_in_process, tensor_parallel_runs, tie):
    """TP over 2 processes: the losses of one process, and the QK-norm weights too (each rank's
    heads contribute to their gradients; a plan without them lets each rank's copy drift). Tied
    embeddings stay one matrix under TP (the 0.6B to 4B flavors tie them)."""
    assert train_in_process([*tied_or_not(tie), "--job.dump_folder", str(tmp_path / "one")]) == 0
    tp, problem = tensor_parallel_runs[tie]
    assert not problem, problem
    one, two = losses(tmp_path / "one"), losses(tp)
    print("\nQwen3 debug model losses, 1 process vs TP 2: "
          + ", ".join(f"{one[s]:.6f}/{two[s]:.6f}" for s in sorted(one)))
    assert sorted(one) == list(range(1, 7)) and one == pytest.approx(two, rel=1e-4)
    names = [f"layers.{i}.attention.{norm}.weight" for i in range(2) for norm in ("q_norm", "k_norm")]
    single, tensor_parallel = (saved_weights(run / "checkpoint" / "step-6", names, (64,))
                               for run in (tmp_path / "one", tp))
    drift = max((single[n] - tensor_parallel[n]).abs().max().item() for n in names)
    moved = max((single[n] - 1).abs().max().item() for n in names)
    print(f"QK-norm weights after 6 steps: moved up to {moved:.2e} from 1, TP 2 vs 1 process differ by {drift:.2e}")
    assert moved > 1e-3 and drift < 1e-5


@pytest.mark.slow
def test_training_from_an_hf_moe_folder_starts_alike_on_one_and_two_processes(tmp_path, train_in_process):
    """--checkpoint.initial_load_path HFDIR with FSDP over 2 ranks: each rank reads its own experts
    (the per-expert views of its shard of the experts tensor); the first loss is that of one process."""
    source = hf_qwen3(tmp_path / "hf", SMALL_MOE_HF)
    common = [*SMALL["moe"], "--training.steps", "1", "--training.global_batch_size", "8",
              "--checkpoint.initial_load_path", str(source)]
    one = ["--training.local_batch_size", "8", "--job.dump_folder", str(tmp_path / "one")]
    assert train_in_process([*common, *one]) == 0
    torchrun(2, [*common, "--training.local_batch_size", "4", "--parallelism.data_parallel_shard_degree", "2",
                 "--job.dump_folder", str(tmp_path / "fsdp2")])
    first, sharded = losses(tmp_path / "one")[1], losses(tmp_path / "fsdp2")[1]
    print(f"\nfirst loss from an HF Qwen3-MoE folder: 1 process {first:.7f}, FSDP 2 {sharded:.7f}")
    assert sharded == pytest.approx(first, rel=1e-5)
