import json
import pickle
import shutil
import sys
from pathlib import Path

import pytest
import tiktoken
import torch
from tiktoken.load import load_tiktoken_bpe

from components.data.streaming import build_streaming_dataloader
from components.data.tokenizer import (
    LLAMA3_PATTERN,
    HFTokenizer,
    MissingDependencyError,
    SentencePieceTokenizer,
    TiktokenTokenizer,
    build_tokenizer,
    tokenizer_files,
)
from scripts.train_tokenizer import train

try:
    import tokenizers as hf_tokenizers
except ImportError:
    hf_tokenizers = None
needs_tokenizers = pytest.mark.skipif(hf_tokenizers is None, reason="the optional `tokenizers` package is not "
                                      "installed (pip install 'ingot[hf]'); it is in the test extra")

ASSETS = Path(__file__).parent / "assets"
CORPUS = ASSETS / "shakespeare"
TOKENIZERS = ASSETS / "tokenizers"
TOKENIZER_FILES = {
    "shakespeare_bpe_4k.model": (SentencePieceTokenizer, 4096),
    "gpt2.tiktoken": (TiktokenTokenizer, 50256 + 256),
    "mistral_v1.model": (SentencePieceTokenizer, 32000),
}
GPT2_RANKS = 50256
HF_MERGES = 300
HF_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>"]
HF_VOCAB = 256 + HF_MERGES + len(HF_SPECIALS)
HF_FILE = "tokenizer.json"
"""A byte-level BPE tokenizer.json that the tests train (see `train_hf_tokenizer`), Llama 3 style."""
EXPECTED = {**TOKENIZER_FILES, HF_FILE: (HFTokenizer, HF_VOCAB)}

TRICKY_TEXTS = [
    "",
    " ",
    "\n",
    "  leading spaces and trailing ones  ",
    "tabs\tand\t\ttabs \t mixed",
    "line\r\nendings\rof every\nkind",
    "blank lines\n\n\n\n   and an indented one",
    "digits 0123456789, 3.14159, 2024-06-25, 1,000,000",
    "naïve café, Ærøskøbing, Ελληνικά, русский, 日本語, 한국어, עברית, 🎭🗡️👑, e\u0301",
    "non-breaking\u00a0space, zero\u200bwidth, nul\x00byte",
    "<|begin_of_text|><|eot_id|> <s></s> <unk> <pad>",
]


def read_jsonl(path: Path) -> list[dict]:
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def train_docs() -> list[str]:
    return [doc["text"] for doc in read_jsonl(CORPUS / "train.jsonl")]


@pytest.fixture(scope="module")
def validation_docs() -> list[str]:
    return [doc["text"] for doc in read_jsonl(CORPUS / "validation.jsonl")]


def train_hf_tokenizer(folder: Path, docs: list[str], merges: int = HF_MERGES, special_tokens=tuple(HF_SPECIALS),
                       add_bos: bool = True) -> Path:
    """Train a byte-level BPE (Llama 3's pre-tokenizer pattern, `merges` merges) on `docs` and save it
    as folder/tokenizer.json. Like Llama 3's, its post-processor puts BOS before every encoding."""
    from tokenizers import Regex, decoders, models, pre_tokenizers, processors, trainers

    hf = hf_tokenizers.Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=256 + merges + len(special_tokens), special_tokens=list(special_tokens),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    hf.train_from_iterator(docs, trainer=trainer)
    if add_bos:
        bos = special_tokens[0]
        hf.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                          special_tokens=[(bos, hf.token_to_id(bos))])
    folder.mkdir(parents=True, exist_ok=True)
    hf.save(str(folder / "tokenizer.json"))
    return folder / "tokenizer.json"


@pytest.fixture(scope="module")
def hf_file(tmp_path_factory, train_docs) -> Path:
    if hf_tokenizers is None:
        pytest.skip("the optional `tokenizers` package is not installed")
    return train_hf_tokenizer(tmp_path_factory.mktemp("hf"), train_docs[:300])


@pytest.fixture(scope="module", params=[*TOKENIZER_FILES, pytest.param(HF_FILE, marks=needs_tokenizers)])
def tokenizer_file(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def tokenizer(request, tokenizer_file):
    if tokenizer_file == HF_FILE:
        return build_tokenizer(request.getfixturevalue("hf_file"))
    return build_tokenizer(TOKENIZERS / tokenizer_file)


def test_round_trips_corpus_text(tokenizer, validation_docs):
    for doc in validation_docs:
        assert tokenizer.decode(tokenizer.encode(doc)) == doc


@pytest.mark.parametrize("text", TRICKY_TEXTS)
def test_round_trips_tricky_text(tokenizer, validation_docs, text):
    assert tokenizer.decode(tokenizer.encode(text)) == text
    mixed = f"{text}{validation_docs[0][:500]}{text}"
    assert tokenizer.decode(tokenizer.encode(mixed)) == mixed


def test_ids_are_within_vocabulary(tokenizer, validation_docs):
    ids = [i for doc in validation_docs[:10] for i in tokenizer.encode(doc + TRICKY_TEXTS[-3])]
    assert 0 <= min(ids) and max(ids) < tokenizer.vocab_size


def test_bos_and_eos_placement(tokenizer):
    plain = tokenizer.encode("To be, or not to be")
    assert tokenizer.bos_id not in plain and tokenizer.eos_id not in plain
    assert tokenizer.encode("To be, or not to be", bos=True) == [tokenizer.bos_id, *plain]
    assert tokenizer.encode("To be, or not to be", eos=True) == [*plain, tokenizer.eos_id]
    assert tokenizer.encode("To be, or not to be", bos=True, eos=True) == [tokenizer.bos_id, *plain, tokenizer.eos_id]
    assert tokenizer.encode("", bos=True, eos=True) == [tokenizer.bos_id, tokenizer.eos_id]


def test_format_and_vocab_size(tokenizer, tokenizer_file):
    kind, vocab_size = EXPECTED[tokenizer_file]
    assert type(tokenizer) is kind
    assert tokenizer.vocab_size == vocab_size


def test_sentencepiece_special_ids():
    for name in ("shakespeare_bpe_4k.model", "mistral_v1.model"):
        tokenizer = build_tokenizer(TOKENIZERS / name)
        assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id) == (1, 2, -1)


def test_llama3_special_tokens_follow_the_ranks():
    tokenizer = build_tokenizer(TOKENIZERS / "gpt2.tiktoken")
    assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id) == (GPT2_RANKS, GPT2_RANKS + 1, -1)
    expected = {
        0: "<|begin_of_text|>",
        1: "<|end_of_text|>",
        2: "<|reserved_special_token_0|>",
        5: "<|reserved_special_token_3|>",
        6: "<|start_header_id|>",
        7: "<|end_header_id|>",
        8: "<|reserved_special_token_4|>",
        9: "<|eot_id|>",
        10: "<|reserved_special_token_5|>",
        255: "<|reserved_special_token_250|>",
    }
    for offset, token in expected.items():
        assert tokenizer.decode([GPT2_RANKS + offset]) == token


def test_special_token_text_is_encoded_as_plain_text():
    tokenizer = build_tokenizer(TOKENIZERS / "gpt2.tiktoken")
    ids = tokenizer.encode("<|end_of_text|><|eot_id|>")
    assert max(ids) < GPT2_RANKS


def test_special_token_text_is_plain_text_for_every_format(tokenizer):
    text = "<|begin_of_text|><|end_of_text|><|endoftext|><s></s>"
    ids = tokenizer.encode(text)
    assert tokenizer.bos_id not in ids and tokenizer.eos_id not in ids
    assert tokenizer.decode(ids) == text


def test_detects_format_by_content_not_name(tmp_path):
    tiktoken_file = tmp_path / "llama3" / "tokenizer.model"
    sentencepiece_file = tmp_path / "llama2" / "tokenizer.model"
    for source, target in [("gpt2.tiktoken", tiktoken_file), ("mistral_v1.model", sentencepiece_file)]:
        target.parent.mkdir()
        shutil.copy(TOKENIZERS / source, target)
    assert type(build_tokenizer(tiktoken_file)) is TiktokenTokenizer
    assert type(build_tokenizer(sentencepiece_file)) is SentencePieceTokenizer


@needs_tokenizers
def test_builds_each_format_from_its_file(tmp_path, hf_file):
    assert type(build_tokenizer(TOKENIZERS / "shakespeare_bpe_4k.model")) is SentencePieceTokenizer
    assert type(build_tokenizer(TOKENIZERS / "gpt2.tiktoken")) is TiktokenTokenizer
    assert type(build_tokenizer(hf_file)) is HFTokenizer
    assert type(build_tokenizer(str(hf_file))) is HFTokenizer
    # A HF tokenizer is also found by its content (a JSON object with a "model" key) under another name.
    for name in ("tokenizer.model", "tokenizer"):
        renamed = tmp_path / name
        shutil.copy(hf_file, renamed)
        assert type(build_tokenizer(renamed)) is HFTokenizer


def test_missing_file_is_named(tmp_path):
    missing = tmp_path / "nowhere" / "tokenizer.model"
    with pytest.raises(FileNotFoundError, match="nowhere"):
        build_tokenizer(missing)


@pytest.mark.parametrize("content", [b"", b"not a tokenizer\n", bytes(range(256)) * 4, b'{"not": "a tokenizer"}', b"{"])
def test_garbage_file_is_rejected(tmp_path, content):
    garbage = tmp_path / "garbage.model"
    garbage.write_bytes(content)
    with pytest.raises(ValueError) as error:
        build_tokenizer(garbage)
    assert str(garbage) in str(error.value)
    assert all(name in str(error.value) for name in ("sentencepiece", "tiktoken", "tokenizer.json"))


def test_rewritten_tiktoken_file_is_reread(tmp_path):
    ranks_file = tmp_path / "tokenizer.model"
    lines = (TOKENIZERS / "gpt2.tiktoken").read_text().splitlines(keepends=True)
    ranks_file.write_text("".join(lines[:300]))
    assert build_tokenizer(ranks_file).vocab_size == 300 + 256
    ranks_file.write_text("".join(lines[:280]))
    assert build_tokenizer(ranks_file).vocab_size == 280 + 256


@pytest.mark.parametrize("char", [" ", "\n", "a", ".", "日"])
def test_very_long_runs_encode(tokenizer, char):
    text = char * 1_000_000
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_tiktoken_chunking_keeps_the_ids(validation_docs):
    path = TOKENIZERS / "gpt2.tiktoken"
    reference = tiktoken.Encoding("reference", pat_str=LLAMA3_PATTERN, mergeable_ranks=load_tiktoken_bpe(str(path)),
                                  special_tokens={})
    text = "\n\n".join(validation_docs[:20]) + "   " * 10_000 + " word" * 10_000
    assert len(text) > 5 * TiktokenTokenizer.MAX_CHUNK_CHARS
    assert build_tokenizer(path).encode(text) == reference.encode_ordinary(text)


def test_corpus_files_are_clean_jsonl():
    splits = {split: read_jsonl(CORPUS / f"{split}.jsonl") for split in ("train", "validation")}
    for docs in splits.values():
        assert docs and all(doc["text"].strip() and doc["source"] for doc in docs)
        assert all("\r" not in doc["text"] for doc in docs)
    train_texts = {doc["text"] for doc in splits["train"]}
    assert not train_texts & {doc["text"] for doc in splits["validation"]}
    assert 0.03 < len(splits["validation"]) / (len(splits["train"]) + len(splits["validation"])) < 0.08
    assert len({doc["source"] for doc in splits["train"]}) == 42


def test_shipped_tokenizer_is_reproducible():
    shipped = (TOKENIZERS / "shakespeare_bpe_4k.model").read_bytes()
    assert train([CORPUS / "train.jsonl"], vocab_size=4096) == shipped


# Hugging Face tokenizer.json


@needs_tokenizers
def test_hf_special_ids_come_from_the_vocabulary(hf_file):
    tokenizer = build_tokenizer(hf_file)
    assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id) == (0, 1, -1)
    assert tokenizer.decode([tokenizer.bos_id, tokenizer.eos_id]) == "".join(HF_SPECIALS)


@needs_tokenizers
def test_hf_post_processor_bos_is_not_doubled(hf_file):
    raw = hf_tokenizers.Tokenizer.from_file(str(hf_file))
    tokenizer = build_tokenizer(hf_file)
    text = "To be, or not to be, that is the question"
    assert raw.encode(text).ids[0] == tokenizer.bos_id  # the file's post-processor adds BOS itself
    plain = raw.encode(text, add_special_tokens=False).ids
    assert tokenizer.encode(text) == plain
    assert tokenizer.encode(text, bos=True, eos=True) == [tokenizer.bos_id, *plain, tokenizer.eos_id]


@needs_tokenizers
def test_hf_folder_is_read_through_its_tokenizer_json(tmp_path, hf_file, validation_docs):
    from_folder, from_file = build_tokenizer(hf_file.parent), build_tokenizer(hf_file)
    assert type(from_folder) is HFTokenizer and from_folder.vocab_size == from_file.vocab_size
    doc = validation_docs[0]
    assert from_folder.encode(doc, bos=True, eos=True) == from_file.encode(doc, bos=True, eos=True)
    assert tokenizer_files(hf_file.parent) == [hf_file]
    with pytest.raises(FileNotFoundError, match="without a tokenizer.json"):
        build_tokenizer(tmp_path)


@needs_tokenizers
@pytest.mark.parametrize("config, expected", [
    ({"bos_token": {"__type": "AddedToken", "content": "<|end_of_text|>", "special": True},
      "eos_token": "<|begin_of_text|>", "pad_token": "<|end_of_text|>"}, (1, 0, 1)),
    ({"bos_token": None, "eos_token": {"content": "<|begin_of_text|>"}, "pad_token": None}, (0, 0, -1)),
    ({"model_max_length": 8}, (0, 1, -1)),
])
def test_hf_tokenizer_config_names_the_special_tokens(tmp_path, hf_file, config, expected):
    tokenizer_json = tmp_path / "tokenizer.json"
    shutil.copy(hf_file, tokenizer_json)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    for path in (tokenizer_json, tmp_path):
        tokenizer = build_tokenizer(path)
        assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id) == expected
        assert tokenizer.encode("To be", bos=True, eos=True)[::len(tokenizer.encode("To be")) + 1] == list(expected[:2])
    files = [tokenizer_json, tmp_path / "tokenizer_config.json"]
    assert tokenizer_files(tmp_path) == tokenizer_files(tokenizer_json) == files


@needs_tokenizers
def test_hf_tokenizer_config_naming_an_unknown_token_is_an_error(tmp_path, hf_file):
    shutil.copy(hf_file, tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    message = r"tokenizer_config\.json sets bos_token '<s>', which is not in the vocabulary"
    with pytest.raises(ValueError, match=message):
        build_tokenizer(tmp_path)


@needs_tokenizers
def test_hf_without_special_tokens_is_a_clear_error(tmp_path, train_docs):
    path = train_hf_tokenizer(tmp_path / "plain", train_docs[:20], merges=20, special_tokens=(), add_bos=False)
    with pytest.raises(ValueError) as error:
        build_tokenizer(path)
    message = str(error.value)
    assert str(path) in message and "no BOS token" in message
    assert all(token in message for token in ("<|begin_of_text|>", "<s>", "<|endoftext|>"))
    assert "bos_token" in message and "tokenizer_config.json" in message


@needs_tokenizers
@pytest.mark.parametrize("specials, expected", [(["<s>", "</s>"], (0, 1)), (["<|endoftext|>"], (0, 0))])
def test_hf_well_known_special_tokens(tmp_path, train_docs, specials, expected):
    path = train_hf_tokenizer(tmp_path, train_docs[:20], merges=20, special_tokens=specials, add_bos=False)
    tokenizer = build_tokenizer(path)
    assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.vocab_size) == (*expected, 256 + 20 + len(specials))


@needs_tokenizers
def test_hf_stored_truncation_and_padding_are_dropped(tmp_path, hf_file, validation_docs):
    raw = hf_tokenizers.Tokenizer.from_file(str(hf_file))
    raw.enable_truncation(max_length=8)
    raw.enable_padding(pad_id=1, pad_token="<|end_of_text|>", length=4096)
    raw.save(str(tmp_path / "tokenizer.json"))
    tokenizer, reference = build_tokenizer(tmp_path / "tokenizer.json"), build_tokenizer(hf_file)
    assert tokenizer.pad_id == 1
    doc = validation_docs[0]
    assert tokenizer.encode(doc) == reference.encode(doc) and tokenizer.decode(tokenizer.encode(doc)) == doc
    assert len(tokenizer.encode("To be")) < 8


@needs_tokenizers
def test_hf_vocab_size_counts_added_tokens_and_holes(tmp_path, hf_file):
    raw = hf_tokenizers.Tokenizer.from_file(str(hf_file))
    raw.add_special_tokens(["<|pad|>"])
    raw.save(str(tmp_path / "added.json"))
    assert build_tokenizer(tmp_path / "added.json").vocab_size == HF_VOCAB + 1
    content = json.loads(hf_file.read_text())
    last = max(content["model"]["vocab"], key=content["model"]["vocab"].get)
    content["model"]["vocab"][last] = HF_VOCAB + 99  # ids need not be contiguous
    (tmp_path / "holes.json").write_text(json.dumps(content))
    tokenizer = build_tokenizer(tmp_path / "holes.json")
    assert tokenizer.vocab_size == HF_VOCAB + 100
    assert tokenizer.decode([HF_VOCAB + 99]) == hf_tokenizers.Tokenizer.from_file(str(hf_file)).decode([HF_VOCAB - 1])


@needs_tokenizers
def test_hf_tokenizer_pickles(hf_file):
    tokenizer = build_tokenizer(hf_file)
    copy = pickle.loads(pickle.dumps(tokenizer))
    text = "<|end_of_text|> Exeunt."
    assert copy.encode(text, bos=True, eos=True) == tokenizer.encode(text, bos=True, eos=True)
    ids = ("bos_id", "eos_id", "pad_id", "vocab_size")
    assert [getattr(copy, name) for name in ids] == [getattr(tokenizer, name) for name in ids]


@needs_tokenizers
def test_hf_unreadable_json_is_named(tmp_path):
    bad = tmp_path / "tokenizer.json"
    bad.write_text('{"model": "nonsense"}')
    with pytest.raises(ValueError, match="is not a Hugging Face tokenizer.json"):
        build_tokenizer(bad)


@needs_tokenizers
def test_hf_tokenizer_feeds_the_hf_loader(tmp_path, hf_file, validation_docs):
    docs = validation_docs[:3]
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": doc}) + "\n" for doc in docs))
    tokenizer = build_tokenizer(hf_file)
    loader = build_streaming_dataloader([str(data)], "text", tokenizer, seq_len=16, local_batch_size=1,
                                        global_batch_size=1, dp_rank=0, dp_size=1, num_workers=0, seed=0)
    batches = iter(loader)
    batch = torch.cat([next(batches), next(batches)])  # one stream: its first two windows
    stream = [i for doc in docs for i in tokenizer.encode(doc, bos=True, eos=True)]
    assert batch.shape == (2, 17)
    assert batch.flatten().tolist() == stream[:34]
    assert batch[0, 0] == tokenizer.bos_id and tokenizer.bos_id not in batch[0, 1:].tolist()


def test_hf_without_the_tokenizers_package_says_what_to_install(tmp_path, monkeypatch):
    path = tmp_path / "tokenizer.json"
    path.write_text('{"version": "1.0", "model": {"type": "BPE", "vocab": {}, "merges": []}}')
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # makes `import tokenizers` fail
    for target in (path, tmp_path):
        with pytest.raises(MissingDependencyError, match=r"pip install 'ingot\[hf\]'") as error:
            build_tokenizer(target)
        assert isinstance(error.value, ImportError) and isinstance(error.value, ValueError)
        assert "pip install tokenizers" in str(error.value)
