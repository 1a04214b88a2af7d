"""QK-clip and the largest attention logit (components/training/qk_clip.py): the logits it measures are the scores
the attention computes, a clipped head's largest logit becomes the threshold and no other changes, and a run
under each layout clips and logs as one process does."""

from types import SimpleNamespace

import pytest
import torch
from conftest import TINY, layout, reference_runs, step_figures, tiny_model_args, torchrun_runs

import models.deepseek_v3 as deepseek_v3
from components.config import ConfigError
from components.model.attention import CAUSAL, AttentionMask, attention_layers, document_mask
from components.training.qk_clip import AttentionLogits, largest_logits
from models.llama3 import Transformer

THRESHOLD = 0.25  # below the tiny models' largest logits of their first steps (0.28 to 0.6): the clip acts


def brute_force(q, k, allowed):
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scores = (q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5).masked_fill(~allowed, float("-inf"))
    return scores.amax(dim=(0, 2, 3))


@pytest.mark.parametrize("spec", [CAUSAL, AttentionMask(window=5), AttentionMask(window=4, sinks=2)],
                         ids=["causal", "window", "window_sinks"])
def test_the_largest_logit_is_that_of_the_scores_the_mask_lets_each_query_see(spec, monkeypatch):
    monkeypatch.setattr("components.training.qk_clip.QUERY_CHUNK", 7)  # several chunks, the last one short
    generator = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, 19, 8, generator=generator), torch.randn(2, 2, 19, 8, generator=generator)
    positions = torch.arange(19)
    exact = {"rtol": 1e-6, "atol": 0}  # chunked matmuls, other summation orders
    torch.testing.assert_close(largest_logits(q, k, spec=spec),
                               brute_force(q, k, spec.allows(positions[:, None], positions[None])), **exact)
    documents = torch.tensor([[0] * 6 + [1] * 13, [0] * 11 + [1] * 8])
    mask = document_mask(documents, spec, flex=False)
    torch.testing.assert_close(largest_logits(q, k, mask, spec), brute_force(q, k, mask), **exact)


@pytest.mark.parametrize("family", ["llama3_gqa", "deepseek_v3_mla"])
def test_a_clipped_head_s_largest_logit_becomes_the_threshold_and_the_others_keep_theirs(family):
    """Grouped-query heads (Llama 3: 4 query heads on 2 key heads) and multi-head latent attention (DeepSeek-V3:
    the heads' own query and key parts, the shared rotated key left alone)."""
    torch.manual_seed(0)
    if family == "llama3_gqa":
        heads, args = 4, tiny_model_args(n_heads=4, n_kv_heads=2)
        package_model = Transformer
    else:
        debug = deepseek_v3.flavors["debugmodel"]
        heads, args = debug.n_heads, debug.__class__(**{**vars(debug), "n_layers": 2, "vocab_size": 97})
        package_model = deepseek_v3.Transformer
    with torch.device("meta"):
        model = package_model(args)
    model.to_empty(device="cpu")
    model.init_weights()
    with torch.no_grad():  # larger query weights, the more so the later the head: some heads far above the rest
        for _, layer in attention_layers(model):
            weight = (layer.wq if family == "llama3_gqa" else layer.wq_b).weight
            weight.mul_(torch.linspace(1, 30, weight.shape[0])[:, None])
    tokens = torch.randint(0, 97, (2, 32), generator=torch.Generator().manual_seed(1))
    names = [name for name, _ in attention_layers(model)]
    feature = AttentionLogits([model], names, heads, 0.0, 0, 1, torch.device("cpu"))
    model(tokens)  # a training forward: with gradients
    before = {name: values.clone() for name, values in feature.step_max.items()}
    feature.threshold = before[names[0]].median().item()
    figures = feature.after_step(1, torch.tensor(False), log=True)  # the step's maxima, then the clip
    assert figures == {f"max_logit/{name}": values.max().item() for name, values in before.items()}
    with torch.no_grad():
        model(tokens)  # validation's: not a training forward
    assert all((values == float("-inf")).all() for values in feature.step_max.values())
    model(tokens)
    first = names[0]  # the later layers' inputs change with the clip of the earlier ones
    values = before[first]
    torch.testing.assert_close(feature.step_max[first], values.clamp(max=feature.threshold), rtol=1e-5, atol=0)
    assert (values > feature.threshold).any() and (values < feature.threshold).any(), "both kinds of heads"


def test_a_skipped_step_clips_nothing():
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Transformer(tiny_model_args())
    model.to_empty(device="cpu")
    model.init_weights()
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    feature = AttentionLogits([model], [n for n, _ in attention_layers(model)], 4, 1e-3, 0, 1, torch.device("cpu"))
    model(torch.randint(0, 97, (2, 16)))
    feature.after_step(1, torch.tensor(True), log=False)
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("argv, error", [
    (["--model.name", "qwen3", "--job.config_file", "debug_qwen3.toml"], r"qwen3's attention \(layers.0.attention\) "
     "cannot be clipped"),
    (["--parallelism.context_parallel_degree", "2"], "not available yet: optimizer.qk_clip_threshold 0.25 with "
     "context parallelism"),
])
def test_what_qk_clip_cannot_do_yet_is_refused_at_start_up(argv, error):
    from components.config import load_config
    from components.training import qk_clip
    from models.families import import_model_package, model_config_class

    config = load_config([*TINY, "--optimizer.qk_clip_threshold", str(THRESHOLD), *argv], model_config_class)
    package = import_model_package(config.model.name)
    args = package.build_model_args(config, 4096)
    with torch.device("meta"):
        model = package.Transformer(args)
    with pytest.raises(ConfigError, match=error):
        qk_clip.attention_logits(config, SimpleNamespace(parts=[model], pipeline=None), model, args.n_heads,
                                 OneRank(), torch.device("cpu"))


class OneRank:
    """A device mesh's answers for one process."""

    def __getitem__(self, name):
        return self

    def get_local_rank(self):
        return 0

    def size(self):
        return 1


CLIP = [*TINY, "--model.n_layers", "4", "--training.steps", "4", "--training.global_batch_size", "8",
        "--optimizer.qk_clip_threshold", str(THRESHOLD)]
MOE = ["--job.config_file", "debug_deepseek_v3.toml", "--model.n_layers", "3", "--training.seq_len", "64",
       "--moe.bias_update_speed", "0"]
LAYOUTS = {  # name: (processes, arguments), model
    "fsdp2": (layout(dp_shard=2), "llama3"),
    "tp2": (layout(tp=2), "llama3"),
    "pp2": (layout(pp=2), "llama3"),
    "dp_shard2_tp2_compile_muon": (layout(dp_shard=2, tp=2, extra=["--compile.enable", "true", "--optimizer.name",
                                                                    "Muon", "--optimizer.muon_ns_dtype", "float32"]),
                                   "llama3_muon"),
    "ep2": (layout(dp_shard=2, ep=2), "deepseek_v3"),
    "tp2_mla": (layout(tp=2), "deepseek_v3"),
}
MODELS = {"llama3": [], "llama3_muon": ["--optimizer.name", "Muon", "--optimizer.muon_ns_dtype", "float32"],
          "deepseek_v3": MOE}


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    return reference_runs(tmp_path_factory, CLIP, MODELS)


@pytest.fixture(scope="module")
def layout_runs(tmp_path_factory):
    runs = {name: (nproc, [*CLIP, *MODELS[model], *args]) for name, ((nproc, args), model) in LAYOUTS.items()}
    return torchrun_runs(runs, tmp_path_factory.mktemp("qk_clip_layouts"))


@pytest.mark.slow
@pytest.mark.parametrize("name", LAYOUTS)
def test_every_layout_clips_and_logs_the_largest_logits_of_one_process(name, references, layout_runs):
    dump, problem = layout_runs[name]
    assert not problem, problem
    got, expected = step_figures(dump), step_figures(references[LAYOUTS[name][1]])
    assert sorted(got) == [1, 2, 3, 4]
    logits = [key for key in expected[1] if key.startswith("max_logit/")]
    assert len(logits) == (3 if LAYOUTS[name][1] == "deepseek_v3" else 4)
    assert all(expected[step][key] > THRESHOLD for step in (1, 2) for key in logits), "the clip acts"
    for step in expected:
        for key in ["loss", *logits]:
            assert got[step][key] == pytest.approx(expected[step][key], rel=1e-5), (name, step, key)
        # (The gradient norm of several processes differs from one's by 1e-4 from the first step, clip or not.)
        assert got[step]["grad_norm"] == pytest.approx(expected[step]["grad_norm"], rel=1e-3), (name, step)


def test_a_pipeline_step_that_infers_shapes_leaves_out_each_layer_s_placeholder_forward():
    """torch's shape inference runs a stage first on uninitialized memory past the first stage: not logits of the
    step (they made a 2-stage run's second step non-finite where that memory held large values)."""
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Transformer(tiny_model_args())
    model.to_empty(device="cpu")
    model.init_weights()
    pipeline = SimpleNamespace(infers_shapes=True)
    feature = AttentionLogits([model], [n for n, _ in attention_layers(model)], 4, 0.0, 0, 1, torch.device("cpu"),
                              pipeline)
    model(torch.randint(0, 97, (2, 16)))  # the placeholder forward of each layer
    assert all((values == float("-inf")).all() for values in feature.step_max.values())
    model(torch.randint(0, 97, (2, 16)))  # the step's micro-batch
    assert all(torch.isfinite(values).all() for values in feature.step_max.values())
    feature.after_step(1, torch.tensor(False), log=False)
    pipeline.infers_shapes = False  # the next steps
    model(torch.randint(0, 97, (2, 16)))
    assert all(torch.isfinite(values).all() for values in feature.step_max.values())
