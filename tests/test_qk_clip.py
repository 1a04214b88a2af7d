"""QK-clip and the largest attention logit (components/training/qk_clip.py): the logits it measures are the scores
the attention computes, a clipped head's largest logit becomes the threshold and no other changes, and a run
under each layout clips and logs as one process does."""

from functools import partial
from types import SimpleNamespace

import pytest
import torch
from conftest import TINY, layout, reference_runs, step_figures, tiny_model_args, torchrun_runs

import models.deepseek_v3 as deepseek_v3
import models.gpt_oss as gpt_oss
from components.config import ConfigError
from components.model.attention import CAUSAL, AttentionMask, attention_layers, document_mask
from components.training.qk_clip import AttentionLogits, layer_logits
from models.llama3 import Transformer
from parallelisms.sequence_shares import zigzag_positions

THRESHOLD = 0.25  # below the tiny models' largest logits of their first steps (0.28 to 0.6): the clip acts


def brute_force(q, k, allowed):
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scores = (q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5).masked_fill(~allowed, float("-inf"))
    return scores.amax(dim=(0, 2, 3))


SPECS = [CAUSAL, AttentionMask(window=5), AttentionMask(window=4, sinks=2)]
EXACT = {"rtol": 1e-6, "atol": 0}  # chunked matmuls, other summation orders


@pytest.mark.parametrize("spec", SPECS, ids=["causal", "window", "window_sinks"])
def test_the_largest_logit_is_that_of_the_scores_the_mask_lets_each_query_see(spec, monkeypatch):
    """Under the layer's declared mask, a boolean document mask and FlexAttention's (CUDA's), several rows at once."""
    generator = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, 19, 8, generator=generator), torch.randn(2, 2, 19, 8, generator=generator)
    monkeypatch.setattr("components.training.qk_clip.SCORES_AT_ONCE", 2 * 4 * 19 * 7)  # by 7 rows, the last short
    positions = torch.arange(19)
    torch.testing.assert_close(layer_logits(q, k, spec=spec),
                               brute_force(q, k, spec.allows(positions[:, None], positions[None])), **EXACT)
    documents = torch.tensor([[0] * 6 + [1] * 13, [0] * 11 + [1] * 8])
    mask = document_mask(documents, spec, flex=False)
    torch.testing.assert_close(layer_logits(q, k, mask, spec), brute_force(q, k, mask), **EXACT)
    torch.testing.assert_close(layer_logits(q, k, document_mask(documents, spec, flex=True), spec),
                               brute_force(q, k, mask), **EXACT)


class KeysOfTheRing:
    """parallelisms/ring_attention.py's Ring for one rank of several, in one process: what it receives at each
    turn is the share of keys of the rank before the last one heard from."""

    def __init__(self, rank: int, shares: list[torch.Tensor]):
        self.rank, self.size, self.shares, self.turn = rank, len(shares), shares, 0

    def start(self, tensor: torch.Tensor, tag: int = 0):
        assert torch.equal(tensor, self.shares[(self.rank - self.turn) % self.size]), "it sends what it holds"
        self.turn += 1
        return self.shares[(self.rank - self.turn) % self.size]

    @staticmethod
    def finish(pending: torch.Tensor) -> torch.Tensor:
        return pending


@pytest.mark.parametrize("documents", ["zigzag", "allgather", "ring", "alltoall"])
@pytest.mark.parametrize("spec", SPECS, ids=["causal", "window", "window_sinks"])
def test_under_context_parallelism_each_rank_s_queries_meet_the_keys_of_every_rank(spec, documents):
    """Each of 3 ranks' largest logits are its queries' against the whole sequence's keys, with its zigzag share or
    (under document masking) the share each method's mask assigns it."""
    from parallelisms.context_parallel import sequence_largest_logits
    from parallelisms.context_parallel_documents import allgather_documents, alltoall_documents, ring_documents

    cp, seq = 3, 24
    generator = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, seq, 8, generator=generator), torch.randn(2, 2, seq, 8, generator=generator)
    positions = torch.arange(seq)
    ids = torch.tensor([[0] * 5 + [1] * 12 + [2] * 7, [0] * 14 + [1] * 10])
    if documents == "zigzag":
        masks = [None] * cp
        shares = [zigzag_positions(seq, cp, r).expand(2, -1) for r in range(cp)]
        whole = spec.allows(positions[:, None], positions[None])
    else:
        masks = [{"allgather": partial(allgather_documents, cp_rank=r), "ring": partial(ring_documents, cp_rank=r),
                  "alltoall": partial(alltoall_documents, whole_mask=document_mask)}[documents](ids, spec, cp_size=cp)
                 for r in range(cp)]
        shares = list(masks[0].shares.unbind(1))
        whole = document_mask(ids, spec, flex=False)[:, 0]
    q_shares, k_shares = ([t.gather(2, s[:, None, :, None].expand(-1, t.shape[1], -1, 8)) for s in shares]
                          for t in (q, k))
    for rank in range(cp):
        got = sequence_largest_logits(q_shares[rank], k_shares[rank], masks[rank], spec,
                                      ring=KeysOfTheRing(rank, k_shares))
        rows = whole.expand(2, -1, -1).gather(1, shares[rank][:, :, None].expand(-1, -1, seq))
        torch.testing.assert_close(got, brute_force(q_shares[rank], k, rows[:, None]), **EXACT)


@pytest.mark.parametrize("family", ["llama3_gqa", "deepseek_v3_mla", "gpt_oss_biased"])
def test_a_clipped_head_s_largest_logit_becomes_the_threshold_and_the_others_keep_theirs(family):
    """Grouped-query heads (Llama 3: 4 query heads on 2 key heads; gpt-oss's with biased projections and sinks) and
    multi-head latent attention (DeepSeek-V3: the heads' own query and key parts, the shared rotated key left
    alone)."""
    torch.manual_seed(0)
    if family == "llama3_gqa":
        heads, args = 4, tiny_model_args(n_heads=4, n_kv_heads=2)
        package_model = Transformer
    else:
        package = deepseek_v3 if family == "deepseek_v3_mla" else gpt_oss
        debug = package.flavors["debugmodel"]
        heads, args = debug.n_heads, debug.__class__(**{**vars(debug), "n_layers": 2, "vocab_size": 97})
        package_model = package.Transformer
    with torch.device("meta"):
        model = package_model(args)
    model.to_empty(device="cpu")
    model.init_weights()
    with torch.no_grad():  # larger query weights, the more so the later the head: some heads far above the rest
        for _, layer in attention_layers(model):
            weight = (layer.wq_b if family == "deepseek_v3_mla" else layer.wq).weight
            weight.mul_(torch.linspace(1, 30, weight.shape[0])[:, None])
            if family == "gpt_oss_biased":
                for linear in (layer.wq, layer.wk):
                    linear.bias.normal_(0, 0.5)
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


def test_a_model_whose_attention_cannot_be_clipped_is_refused_at_start_up():
    from components.config import load_config
    from components.training import qk_clip
    from models.families import import_model_package, model_config_class

    qwen3 = ["--model.name", "qwen3", "--job.config_file", "debug_qwen3.toml"]  # QK-norm
    config = load_config([*TINY, "--optimizer.qk_clip_threshold", str(THRESHOLD), *qwen3], model_config_class)
    package = import_model_package(config.model.name)
    args = package.build_model_args(config, 4096)
    with torch.device("meta"):
        model = package.Transformer(args)
    with pytest.raises(ConfigError, match=r"qwen3's attention \(layers.0.attention\) cannot be clipped"):
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
    "cp2_allgather_compile": (layout(cp=2, extra=["--parallelism.context_parallel_method", "allgather",
                                                  "--compile.enable", "true"]), "llama3"),
    "cp2_ring_documents": (layout(cp=2, extra=["--parallelism.context_parallel_method", "ring"]), "llama3_documents"),
    "cp2_alltoall_mla": (layout(cp=2, extra=["--parallelism.context_parallel_method", "alltoall"]), "deepseek_v3"),
    "tp2_gpt_oss": (layout(tp=2), "gpt_oss"),
}
MODELS = {"llama3": [], "llama3_muon": ["--optimizer.name", "Muon", "--optimizer.muon_ns_dtype", "float32"],
          "llama3_documents": ["--training.document_masking", "true"], "deepseek_v3": MOE,
          "gpt_oss": ["--job.config_file", "debug_gpt_oss.toml", "--model.n_layers", "2", "--training.seq_len", "64",
                      "--moe.bias_update_speed", "0"]}


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
    assert len(logits) == {"deepseek_v3": 3, "gpt_oss": 2}.get(LAYOUTS[name][1], 4)
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
