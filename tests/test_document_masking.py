"""Document masking and per-document RoPE: a packed window behaves like its documents run alone."""

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from conftest import TINY, build_model, losses, tiny_model_args
from torch.nn.attention.flex_attention import BlockMask

import components.model.attention as attention
import models.llama3.model as llama
from components.data.documents import document_ids, document_positions
from components.model.attention import apply_rope
from models.families import model_config_class
from models.llama3.model import ModelArgs

BOS, EOS, VOCAB = 1, 2, 128


def tiny_args(**overrides) -> ModelArgs:
    return tiny_model_args(**({"vocab_size": VOCAB, "max_seq_len": 64} | overrides))


def make_documents(lengths=(8, 11, 9), seed: int = 1) -> list[torch.Tensor]:
    """Documents of the given total lengths, each BOS + random ids + EOS."""
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.cat([torch.tensor([BOS]), torch.randint(3, VOCAB, (n - 2,), generator=generator), torch.tensor([EOS])])
        for n in lengths
    ]


def packed_batch() -> tuple[torch.Tensor, list[list[torch.Tensor]]]:
    """Three rows of 28 tokens with different layouts; returns the window and each row's segments
    (the pieces that must behave as if run alone). Row 2 starts in the middle of a document and
    ends in the middle of another."""
    a, b, c = make_documents()
    rows = [[a, b, c], [b, c, a], [a[3:], c, b, a[:3]]]
    return torch.stack([torch.cat(row) for row in rows]), rows


def segment_slices(segments):
    start = 0
    for segment in segments:
        yield segment, slice(start, start + len(segment))
        start += len(segment)


# --- document_ids / document_positions ---------------------------------------------------------


def test_document_ids_and_positions_on_hand_made_windows():
    tokens = torch.tensor([
        [1, 5, 6, 2, 1, 7, 2, 1, 8],  # starts at a BOS, ends inside the third document
        [9, 9, 2, 1, 4, 2, 1, 5, 2],  # starts mid-document, EOS is the last token
        [4, 5, 6, 7, 8, 9, 4, 5, 6],  # no boundary at all
        [2, 1, 3, 2, 2, 1, 4, 4, 4],  # EOS first; an empty document between two EOS
    ])
    ids = document_ids(tokens, eos_id=2)
    assert ids.dtype == torch.long and ids.shape == tokens.shape
    assert ids.tolist() == [
        [0, 0, 0, 0, 1, 1, 1, 2, 2],
        [0, 0, 0, 1, 1, 1, 2, 2, 2],
        [0, 0, 0, 0, 0, 0, 0, 0, 0],
        [0, 1, 1, 1, 2, 3, 3, 3, 3],
    ]
    assert document_positions(ids).tolist() == [
        [0, 1, 2, 3, 0, 1, 2, 0, 1],
        [0, 1, 2, 0, 1, 2, 0, 1, 2],
        [0, 1, 2, 3, 4, 5, 6, 7, 8],
        [0, 0, 1, 2, 0, 0, 1, 2, 3],
    ]


def test_apply_rope_per_row_matches_shared_rope_at_the_same_positions():
    args = tiny_args()
    rope = llama.rope_frequencies(args)
    x = torch.randn(2, 6, 4, args.head_dim)
    positions = torch.tensor([[0, 1, 2, 0, 1, 2], [3, 4, 5, 6, 7, 8]])
    rotated = apply_rope(x, rope[positions])
    assert torch.equal(rotated[0, :3], apply_rope(x[:1, :3], rope)[0])
    assert torch.equal(rotated[0, 3:], apply_rope(x[:1, 3:], rope)[0])
    assert torch.equal(rotated[1], apply_rope(x[1:], rope[3:])[0])
    # The shared form still uses only the first seq rows of a longer table.
    assert torch.equal(apply_rope(x, rope), apply_rope(x, rope[:6]))


# --- the model ------------------------------------------------------------------------------


def test_packed_window_matches_documents_run_alone():
    model = build_model(tiny_args(rope_per_document=True))
    window, rows = packed_batch()
    logits = model(window, document_ids=document_ids(window, EOS))
    for row, segments in enumerate(rows):
        for segment, where in segment_slices(segments):
            alone = model(segment[None])[0]
            torch.testing.assert_close(logits[row, where], alone, atol=1e-5, rtol=1e-5)


def test_rope_per_document_feeds_positions_within_documents_to_attention():
    window, _ = packed_batch()
    ids = document_ids(window, EOS)
    for per_document, expected in ((True, document_positions(ids)), (False, torch.arange(window.shape[1]))):
        model = build_model(tiny_args(rope_per_document=per_document))
        seen = []
        model.layers["1"].attention.register_forward_pre_hook(lambda module, args: seen.append(args[1]))
        model(window, document_ids=ids)
        rope = seen[0] if per_document else seen[0][: window.shape[1]]
        assert torch.equal(rope, model.rope[expected])


def test_without_rope_per_document_documents_see_shifted_positions_and_only_themselves():
    model = build_model(tiny_args(rope_per_document=False))
    window, rows = packed_batch()
    logits = model(window, document_ids=document_ids(window, EOS))
    for row, segments in enumerate(rows):
        for segment, where in segment_slices(segments):
            # The document alone, at the positions it holds in the window.
            model.local_positions = lambda document_ids, where=where: torch.arange(where.start, where.stop)
            shifted = model(segment[None])[0]
            model.local_positions = None
            torch.testing.assert_close(logits[row, where], shifted, atol=1e-5, rtol=1e-5)
            if where.start == 0:
                torch.testing.assert_close(logits[row, where], model(segment[None])[0], atol=1e-5, rtol=1e-5)
    # Changing document 0 leaves the other documents' logits exactly as they were.
    first = torch.tensor([len(segments[0]) for segments in rows])
    in_first = torch.arange(window.shape[1]) < first[:, None]
    ordinary = in_first & (window != BOS) & (window != EOS)
    changed = torch.where(ordinary, 3 + (window - 3 + 1) % (VOCAB - 3), window)  # no new boundary
    other = model(changed, document_ids=document_ids(changed, EOS))
    for row, end in enumerate(first.tolist()):
        assert torch.equal(other[row, end:], logits[row, end:])
        assert not torch.allclose(other[row, :end], logits[row, :end])


def test_one_document_window_matches_the_plain_causal_model():
    model = build_model(tiny_args(rope_per_document=True))
    tokens = torch.randint(3, VOCAB, (2, 20))
    plain = model(tokens)
    masked = model(tokens, document_ids=torch.zeros_like(tokens))
    torch.testing.assert_close(masked, plain, atol=1e-6, rtol=1e-6)


def test_gradients_of_the_packed_window_are_the_sum_over_its_documents():
    window, rows = packed_batch()
    targets = torch.randint(0, VOCAB, window.shape, generator=torch.Generator().manual_seed(3))

    packed = build_model(tiny_args(rope_per_document=True))
    logits = packed(window, document_ids=document_ids(window, EOS))
    F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum").backward()

    alone = build_model(tiny_args(rope_per_document=True))
    for row, segments in enumerate(rows):
        for segment, where in segment_slices(segments):
            F.cross_entropy(alone(segment[None])[0], targets[row, where], reduction="sum").backward()

    for (name, p), q in zip(packed.named_parameters(), alone.parameters()):
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        torch.testing.assert_close(p.grad, q.grad, atol=1e-4, rtol=1e-4, msg=name)


def test_every_forward_goes_through_the_swappable_sdpa_with_the_document_mask_when_there_is_one():
    """Context parallelism swaps `Attention.sdpa` (and may swap the model's `document_mask` builder): the
    plain and the document-masked forward both go through them, given the mask each layer declares."""
    model = build_model(tiny_args())
    tokens = torch.randint(3, VOCAB, (2, 12))
    documents = document_ids(tokens, EOS)
    expected, expected_masked = model(tokens), model(tokens, document_ids=documents)
    calls = []

    def spy(q, k, v, mask=None, spec=attention.CAUSAL):
        calls.append((mask is not None, spec))
        return attention.causal_attention(q, k, v, mask, spec)

    for module in model.modules():
        if hasattr(module, "sdpa"):
            module.sdpa = spy
    assert torch.equal(model(tokens), expected)
    assert torch.equal(model(tokens, document_ids=documents), expected_masked)
    assert calls == [(False, attention.CAUSAL)] * 2 + [(True, attention.CAUSAL)] * 2


def test_ring_is_refused_with_compiled_checkpoints_and_document_masking_is_taken_by_every_layout():
    from components.config import ConfigError, load_config
    from components.distributed.mesh import ParallelDims
    from components.model.layout_checks import check_supported

    def refusal(*overrides: str) -> str:
        config = load_config(["--training.document_masking", "true", *overrides], model_config_class)
        with pytest.raises(ConfigError) as refused:
            check_supported(config, ParallelDims.from_config(config.parallelism, 2), torch.device("cpu"))
        return str(refused.value)

    assert "ring with compile.enable and activation checkpointing" in refusal(
        "--training.document_masking", "false", "--parallelism.context_parallel_degree", "2",
        "--parallelism.context_parallel_method", "ring", "--compile.enable", "true",
        "--activation_checkpoint.mode", "full")
    for layout in (["--parallelism.context_parallel_degree", "2"], ["--parallelism.pipeline_parallel_degree", "2"],
                   ["--parallelism.context_parallel_degree", "2", "--parallelism.context_parallel_method", "alltoall"],
                   ["--parallelism.context_parallel_degree", "2", "--parallelism.context_parallel_method", "ring"]):
        config = load_config(["--training.document_masking", "true", *layout], model_config_class)
        check_supported(config, ParallelDims.from_config(config.parallelism, 2), torch.device("cpu"))


def test_cpu_takes_the_dense_mask_and_cuda_takes_flex_attention():
    assert not attention.use_flex_attention(torch.device("cpu"))
    assert attention.use_flex_attention(torch.device("cuda"))
    ids = torch.tensor([[0, 0, 1, 1]])
    mask = attention.document_mask(ids, flex=False)
    assert mask.shape == (1, 1, 4, 4)
    assert mask[0, 0].tolist() == [
        [True, False, False, False],
        [True, True, False, False],
        [False, False, True, False],
        [False, False, True, True],
    ]


def test_flex_attention_path_matches_the_dense_mask_on_cpu():
    """torch 2.13's CPU flex_attention runs forward only (no backward on CPU). Eager flex is used
    here because compiling it on CPU takes tens of seconds; compiled, it matched as well."""
    model = build_model(tiny_args(rope_per_document=True))
    window, _ = packed_batch()
    ids = document_ids(window, EOS)
    with torch.no_grad():
        dense = model(window, document_ids=ids)
        built = []

        def flex_masks(document_ids, spec):  # the model contract's document_mask, FlexAttention's
            built.append(attention.document_mask(document_ids, spec, flex=True))
            return built[-1]

        model.document_mask = flex_masks
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "flex_attention called without torch.compile()"
            flex = model(window, document_ids=ids)
    assert len(built) == 1 and isinstance(built[0], BlockMask)  # one BlockMask, shared by every layer
    torch.testing.assert_close(flex, dense, atol=1e-5, rtol=1e-5)


def keys_two_apart(q_idx, kv_idx):
    """A mask_mod: no query sees the key two positions before it."""
    return q_idx - kv_idx != 2


DECLARED = [attention.AttentionMask(window=40), attention.AttentionMask(window=40, sinks=3),
            attention.AttentionMask(mask_mod=keys_two_apart),
            attention.AttentionMask(window=7, mask_mod=keys_two_apart)]


@pytest.mark.parametrize("documents", [False, True], ids=["alone", "documents"])
@pytest.mark.parametrize("spec", DECLARED, ids=["window", "window_sinks", "mask_mod", "window_mask_mod"])
def test_a_declared_mask_attends_as_its_definition_says_dense_chunked_and_flex(spec, documents):
    """causal_attention under each declaration (CPU: chunks of WINDOW_CHUNK queries, or the dense document mask)
    against softmax over the keys the definition lists, written out here: at or before the query, in its
    document, within the window or among the first `sinks` of its document, where mask_mod allows. The
    FlexAttention masks of the same declarations (CUDA's path; forward, eager, on CPU) give the same output."""
    seq = 600  # three chunks of WINDOW_CHUNK (256) queries
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, heads, seq, 8, generator=generator) for heads in (4, 2, 2))
    ids = (torch.rand(1, seq, generator=generator) < 1 / 90).long().cumsum(1) if documents else torch.zeros(1, seq)
    i, j = torch.arange(seq)[:, None], torch.arange(seq)[None]
    start = torch.tensor([ids[0].tolist().index(d) for d in ids[0].tolist()])  # each position's document start
    allowed = (j <= i) & (ids[0][:, None] == ids[0][None])
    if spec.window is not None:
        allowed &= (i - j < spec.window) | (j - start[None] < spec.sinks)
    if spec.mask_mod is not None:
        allowed &= spec.mask_mod(i, j)
    scores = (q @ k.repeat_interleave(2, 1).transpose(-1, -2) / math.sqrt(8)).masked_fill(~allowed, float("-inf"))
    expected = scores.softmax(-1) @ v.repeat_interleave(2, 1)
    mask = attention.document_mask(ids, spec) if documents else None
    torch.testing.assert_close(attention.causal_attention(q, k, v, mask, spec), expected, atol=1e-5, rtol=1e-5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "flex_attention called without torch.compile()"
        mask = (attention.document_mask(ids, spec, flex=True) if documents
                else attention.declared_block_mask(seq, spec, "cpu"))
        torch.testing.assert_close(attention.causal_attention(q, k, v, mask, spec), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_trainer_runs_with_document_masking(tmp_path, train_in_process, capsys):
    args = [*TINY, "--training.steps", "3", "--training.document_masking", "true", "--model.rope_per_document", "true"]
    assert train_in_process([*args, "--job.dump_folder", str(tmp_path / "a")]) == 0
    assert all(math.isfinite(loss) for loss in losses(tmp_path / "a").values())
    assert train_in_process([*TINY, "--model.rope_per_document", "true", "--job.dump_folder", str(tmp_path / "b")]) == 2
    assert "model.rope_per_document needs training.document_masking" in capsys.readouterr().err
