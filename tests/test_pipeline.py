"""Pipeline parallelism: how the model is cut into stages, and every schedule the installed torch
offers, on 2 gloo processes, giving the loss and the gradients of one process (CPU, fp32), for Llama's blocks and
Qwen3.5's hybrid of DeltaNet and attention blocks."""

import gc
import json
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from conftest import on_ranks
from torch.distributed.device_mesh import init_device_mesh

import models.qwen3_5 as qwen3_5
from components.config import Config, ConfigError
from models.llama3 import ModelArgs, Transformer
from parallelisms.pipeline import (
    Pipeline,
    build_pipeline,
    check_microbatches,
    gloo_cannot_run,
    is_multi_stage,
    is_v_style,
    offered_schedules,
    pipeline_module_names,
    schedule_class,
    split_for_pipeline,
    split_module,
    stage_ids_for_rank,
)

ARGS = ModelArgs(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=97, max_seq_len=16, multiple_of=32)


def fake_mesh(size: int, rank: int):
    return SimpleNamespace(size=lambda: size, get_local_rank=lambda: rank)


def make_config(schedule: str, local_batch: int = 8, microbatch: int = 2, layers_per_stage=None) -> Config:
    config = Config()
    config.training.local_batch_size = local_batch
    config.parallelism.pipeline_parallel_degree = 2
    config.parallelism.pipeline_parallel_schedule = schedule
    config.parallelism.pipeline_parallel_microbatch_size = microbatch
    config.parallelism.pipeline_parallel_layers_per_stage = layers_per_stage
    return config


# --- Splitting the model (one process) -------------------------------------------------------


LLAMA = {"blocks": "layers", "ends": Transformer.pipeline_ends}


def test_module_names_split_blocks_evenly_first_stages_taking_the_rest():
    assert pipeline_module_names(4, 2, None, **LLAMA) == [
        ["tok_embeddings", "layers.0", "layers.1"],
        ["layers.2", "layers.3", "norm", "output"],
    ]
    assert pipeline_module_names(5, 3, None, **LLAMA) == [
        ["tok_embeddings", "layers.0", "layers.1"],
        ["layers.2", "layers.3"],
        ["layers.4", "norm", "output"],
    ]


def test_module_names_are_those_the_model_declares():
    assert pipeline_module_names(3, 2, None, "blocks", (("embed", "embed_norm"), ("head",))) == [
        ["embed", "embed_norm", "blocks.0", "blocks.1"], ["blocks.2", "head"],
    ]


def test_module_names_with_explicit_layers_per_stage():
    assert pipeline_module_names(4, 4, 1, **LLAMA) == [
        ["tok_embeddings", "layers.0"], ["layers.1"], ["layers.2"], ["layers.3", "norm", "output"],
    ]
    assert pipeline_module_names(6, 2, 3, **LLAMA)[1] == ["layers.3", "layers.4", "layers.5", "norm", "output"]


def test_module_names_errors_name_the_settings():
    with pytest.raises(ConfigError, match=r"pipeline_parallel_layers_per_stage 3 x 2 stages = 6 .*n_layers is 4"):
        pipeline_module_names(4, 2, 3, **LLAMA)
    with pytest.raises(ConfigError, match=r"8 pipeline stages .*pipeline_parallel_degree.*n_layers is 4"):
        pipeline_module_names(4, 8, None, **LLAMA)


def test_stage_ids_loop_and_v():
    assert [stage_ids_for_rank(r, 4, 1, False) for r in range(4)] == [[0], [1], [2], [3]]
    assert [stage_ids_for_rank(r, 4, 2, False) for r in range(4)] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert [stage_ids_for_rank(r, 4, 2, True) for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert stage_ids_for_rank(1, 2, 3, True) == [1, 2, 5]


def test_schedule_kinds():
    offered = offered_schedules()
    assert {"GPipe", "1F1B"} <= set(offered)
    assert not is_multi_stage("GPipe") and not is_multi_stage("1F1B")
    for name in set(offered) & {"Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble"}:
        assert is_multi_stage(name)
    assert is_v_style("ZBVZeroBubble") and not is_v_style("Interleaved1F1B")
    with pytest.raises(ConfigError, match=r"parallelism\.pipeline_parallel_schedule 'Zigzag' is not offered"):
        schedule_class("Zigzag")


def test_too_few_microbatches_names_the_settings():
    expected = (r"1F1B needs at least 4 micro-batches.*"
                r"training\.local_batch_size / parallelism\.pipeline_parallel_microbatch_size gives 2")
    with pytest.raises(ConfigError, match=expected):
        check_microbatches("1F1B", 2, pp_size=4, num_stages=4)
    check_microbatches("GPipe", 1, pp_size=4, num_stages=4)


def test_split_module_keeps_names_and_drops_the_rest():
    with torch.device("meta"):
        model = Transformer(ARGS)
    first = split_module(model, ["tok_embeddings", "layers.0", "layers.1"])
    last = split_module(model, ["layers.2", "layers.3", "norm", "output"])
    assert first.norm is None and first.output is None and list(first.layers) == ["0", "1"]
    assert last.tok_embeddings is None and list(last.layers) == ["2", "3"]
    assert set(first.state_dict()) | set(last.state_dict()) == set(model.state_dict())
    assert not set(first.state_dict()) & set(last.state_dict())
    assert len(model.layers) == 4 and model.norm is not None  # the original is untouched
    with pytest.raises(ValueError, match="layers.9"):
        split_module(model, ["layers.9"])


def test_split_for_pipeline_parts_per_schedule():
    with torch.device("meta"):
        model = Transformer(ARGS)
    parts, ids, n = split_for_pipeline(model, fake_mesh(2, 0), make_config("1F1B"))
    assert (ids, n, list(parts[0].layers)) == ([0], 2, ["0", "1"])
    parts, ids, n = split_for_pipeline(model, fake_mesh(2, 1), make_config("Interleaved1F1B"))
    assert (ids, n, [list(p.layers) for p in parts]) == ([1, 3], 4, [["1"], ["3"]])
    assert parts[1].output is not None and parts[0].tok_embeddings is None
    if "ZBVZeroBubble" in offered_schedules():
        parts, ids, n = split_for_pipeline(model, fake_mesh(2, 0), make_config("ZBVZeroBubble"))
        assert (ids, n) == ([0, 3], 4)
        assert parts[0].tok_embeddings is not None and parts[1].output is not None


def test_split_for_pipeline_layers_per_stage_sets_the_stages_of_looped_schedules():
    with torch.device("meta"):
        model = Transformer(ModelArgs(**{**vars(ARGS), "n_layers": 8}))
    parts, ids, n = split_for_pipeline(model, fake_mesh(2, 1), make_config("Interleaved1F1B", layers_per_stage=1))
    assert (ids, n) == ([1, 3, 5, 7], 8)
    with pytest.raises(ConfigError, match="pipeline_parallel_layers_per_stage 3"):
        split_for_pipeline(model, fake_mesh(2, 0), make_config("Interleaved1F1B", layers_per_stage=3))
    with pytest.raises(ConfigError, match="pipeline_parallel_layers_per_stage 2 x 2 stages"):
        split_for_pipeline(model, fake_mesh(2, 0), make_config("1F1B", layers_per_stage=2))


def test_split_for_pipeline_refuses_tied_embeddings():
    with torch.device("meta"):
        model = Transformer(ModelArgs(**{**vars(ARGS), "tie_embeddings": True}))
    with pytest.raises(ConfigError, match="ties its embedding"):
        split_for_pipeline(model, fake_mesh(2, 0), make_config("1F1B"))


def test_the_first_stage_is_given_contiguous_inputs():
    """torch 2.11's pipeline stages compare the strides of their inputs with those they recorded: a resumed
    `--parallelism.pipeline_parallel_degree 2` run failed there with "stride mismatch: expected (256, 1) actual
    (257, 1)" on views of the (batch, seq + 1) windows."""
    given = []
    schedule = SimpleNamespace(step=lambda *inputs, **kwargs: given.extend(inputs),
                               eval=lambda *inputs, **kwargs: given.extend(inputs), _loss_fn=None)
    pipeline = Pipeline(schedule, has_first_stage=True, has_last_stage=False, n_microbatches=1, parts=[])
    windows = torch.arange(18).view(2, 9)
    pipeline.run(windows[:, :-1], windows[:, 1:], train=True)
    pipeline.run(windows[:, :-1], windows[:, 1:], train=False)
    pipeline.score(windows[:, :-1], windows[:, 1:], score_fn=None)
    assert len(given) == 3 and all(t.is_contiguous() and torch.equal(t, windows[:, :-1]) for t in given)


def test_v_schedules_on_cpu_under_torch_2_11_are_refused_naming_the_way_out(monkeypatch):
    from torch.torch_version import TorchVersion

    monkeypatch.setattr(torch, "__version__", TorchVersion("2.11.0"))
    expected = r"ZBVZeroBubble on CPU needs torch 2.13 or newer: .* pick Interleaved1F1B"
    with pytest.raises(ConfigError, match=expected):
        build_pipeline([], [0, 3], 4, fake_mesh(2, 0), make_config("ZBVZeroBubble"), torch.device("cpu"), None)


def test_local_batch_must_be_a_multiple_of_the_microbatch():
    expected = r"training\.local_batch_size 8 must be a multiple of parallelism\.pipeline_parallel_microbatch_size 3"
    with pytest.raises(ConfigError, match=expected):
        build_pipeline([], [0], 2, fake_mesh(2, 0), make_config("GPipe", microbatch=3), torch.device("cpu"), None)


# --- Every schedule on 2 gloo processes -------------------------------------------------------


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


FAMILIES = {  # a family's Transformer and tiny args: Llama's blocks, and Qwen3.5's of two kinds (DeltaNet, attention)
    "llama3": (Transformer, ARGS),
    "qwen3_5": (qwen3_5.Transformer, qwen3_5.ModelArgs(
        dim=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16, full_attention_interval=2, linear_n_key_heads=2,
        linear_n_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, ffn_dim=96, vocab_size=97,
        max_seq_len=16)),
}


def compare_schedule(name: str, family: str, pp_mesh) -> list[str]:
    """Run `name` on this rank's stages of the family's model two ways (one step() over 8 sequences in 4
    micro-batches of 2; two accumulated step() calls of 4 micro-batches of 1) and list how its loss and gradients
    differ from one process doing forward and backward of the full model on the 8 sequences."""
    model, args = FAMILIES[family]
    torch.manual_seed(0)  # the same weights and data on every rank
    full = model(args)
    full.init_weights()
    tokens = torch.randint(0, args.vocab_size, (8, args.max_seq_len + 1))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    parts, stage_ids, num_stages = split_for_pipeline(full, pp_mesh, make_config(name))  # as train.py on CPU
    ref_loss = cross_entropy(full(inputs), labels)
    ref_loss.backward()
    ref_grads = {n: p.grad for n, p in full.named_parameters()}
    first, last = 0 in stage_ids, num_stages - 1 in stage_ids
    cpu = torch.device("cpu")

    problems = []
    for label, local_batch, microbatch, accum in (("one step", 8, 2, 1), ("accumulated", 4, 1, 2)):
        for part in parts:
            part.zero_grad(set_to_none=True)
        pipeline = build_pipeline(
            parts, stage_ids, num_stages, pp_mesh, make_config(name, local_batch, microbatch), cpu, cross_entropy, accum
        )
        assert (pipeline.has_first_stage, pipeline.has_last_stage) == (first, last)
        reported = torch.zeros(())
        for i in range(accum):
            chunk = slice(i * local_batch, (i + 1) * local_batch)
            losses = pipeline.run(inputs[chunk], labels[chunk], train=True)
            assert bool(losses) == last
            if last:
                reported += torch.stack(losses).detach().sum()
        dist.all_reduce(reported, group=pp_mesh.get_group())  # only the last stage has it
        try:
            torch.testing.assert_close(reported, ref_loss.detach(), rtol=1e-5, atol=1e-6)
        except AssertionError as e:
            problems.append(f"{label} loss: {e}")
        for part in parts:
            for n, p in part.named_parameters():
                try:
                    assert p.grad is not None, "no gradient"
                    torch.testing.assert_close(p.grad, ref_grads[n], rtol=1e-5, atol=1e-6)
                except AssertionError as e:
                    problems.append(f"{label} grad {n}: {e}")
    return problems


def _worker(rank: int, world: int, store_path: str, out_path: str, names: list[str]) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world)
    # A short timeout: a schedule failing on one rank must not leave the other waiting for long.
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60))
    pp_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("pp",))
    results = {}
    for name in names:
        for family in FAMILIES:
            try:
                results[f"{family} {name}"] = compare_schedule(name, family, pp_mesh)
            except Exception as e:  # reported per schedule by the test
                results[f"{family} {name}"] = [f"{type(e).__name__}: {e}"]
    with open(f"{out_path}.{rank}", "w") as f:
        json.dump(results, f)
    # Free the schedules' tensors and pending work while gloo still runs (see test_context_parallel).
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def schedule_results(tmp_path_factory):
    """One pair of processes runs every offered schedule on each family: {"family schedule": [problems on rank 0
    and 1]}."""
    tmp = tmp_path_factory.mktemp("pipeline")
    names = [name for name in offered_schedules() if not gloo_cannot_run(name)]
    on_ranks(_worker, 2, 2, str(tmp / "store"), str(tmp / "results"), names)
    per_rank = [json.loads((tmp / f"results.{rank}").read_text()) for rank in range(2)]
    return {run: [f"rank {rank}: {p}" for rank in range(2) for p in per_rank[rank][run]] for run in per_rank[0]}


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(
    "name", ["GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"]
)
def test_schedule_matches_one_process(name, family, schedule_results):
    if f"{family} {name}" not in schedule_results:
        pytest.skip(f"torch {torch.__version__} does not offer {name}, or not over gloo (gloo_cannot_run)")
    assert not schedule_results[f"{family} {name}"], "\n".join(schedule_results[f"{family} {name}"])
