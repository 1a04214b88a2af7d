import json
import shutil
from pathlib import Path

import pytest
import tiktoken
from tiktoken.load import load_tiktoken_bpe

from components.tokenizer import LLAMA3_PATTERN, SentencePieceTokenizer, TiktokenTokenizer, build_tokenizer
from components.train_tokenizer import train

ASSETS = Path(__file__).parent / "assets"
CORPUS = ASSETS / "shakespeare"
TOKENIZERS = ASSETS / "tokenizers"
TOKENIZER_FILES = {
    "shakespeare_bpe_4k.model": (SentencePieceTokenizer, 4096),
    "gpt2.tiktoken": (TiktokenTokenizer, 50256 + 256),
    "mistral_v1.model": (SentencePieceTokenizer, 32000),
}
GPT2_RANKS = 50256

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


@pytest.fixture(scope="module", params=list(TOKENIZER_FILES))
def tokenizer_file(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def tokenizer(tokenizer_file):
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
    kind, vocab_size = TOKENIZER_FILES[tokenizer_file]
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


def test_detects_format_by_content_not_name(tmp_path):
    tiktoken_file = tmp_path / "llama3" / "tokenizer.model"
    sentencepiece_file = tmp_path / "llama2" / "tokenizer.model"
    for source, target in [("gpt2.tiktoken", tiktoken_file), ("mistral_v1.model", sentencepiece_file)]:
        target.parent.mkdir()
        shutil.copy(TOKENIZERS / source, target)
    assert type(build_tokenizer(tiktoken_file)) is TiktokenTokenizer
    assert type(build_tokenizer(sentencepiece_file)) is SentencePieceTokenizer


def test_missing_file_is_named(tmp_path):
    missing = tmp_path / "nowhere" / "tokenizer.model"
    with pytest.raises(FileNotFoundError, match="nowhere"):
        build_tokenizer(missing)


@pytest.mark.parametrize("content", [b"", b"not a tokenizer\n", bytes(range(256)) * 4])
def test_garbage_file_is_rejected(tmp_path, content):
    garbage = tmp_path / "garbage.model"
    garbage.write_bytes(content)
    with pytest.raises(ValueError) as error:
        build_tokenizer(garbage)
    assert str(garbage) in str(error.value)
    assert "sentencepiece" in str(error.value) and "tiktoken" in str(error.value)


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
    reference = tiktoken.Encoding("reference", pat_str=LLAMA3_PATTERN, mergeable_ranks=load_tiktoken_bpe(str(path)), special_tokens={})
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
