"""Tokenizers behind one interface: sentencepiece models and tiktoken BPE-ranks files (Llama 3).

`build_tokenizer(path)` picks the format from the file's content, not its name: Llama 3's tiktoken
file and sentencepiece models are both commonly called tokenizer.model.
"""

from __future__ import annotations

import hashlib
import re
from abc import ABC, abstractmethod
from pathlib import Path


class Tokenizer(ABC):
    """Text to token ids and back. `pad_id` is -1 where the vocabulary has no pad token;
    `vocab_size` counts every id the tokenizer can emit, special tokens included."""

    bos_id: int
    eos_id: int
    pad_id: int
    vocab_size: int

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        return [self.bos_id] * bos + self._encode(text) + [self.eos_id] * eos

    @abstractmethod
    def _encode(self, text: str) -> list[int]: ...

    @abstractmethod
    def decode(self, ids: list[int]) -> str: ...


class SentencePieceTokenizer(Tokenizer):
    def __init__(self, path: str | Path):
        import sentencepiece as spm

        self._model = spm.SentencePieceProcessor(model_file=str(path))
        self.bos_id = self._model.bos_id()
        self.eos_id = self._model.eos_id()
        self.pad_id = self._model.pad_id()
        self.vocab_size = self._model.get_piece_size()

    def _encode(self, text: str) -> list[int]:
        return self._model.encode(text)

    def decode(self, ids: list[int]) -> str:
        return self._model.decode(list(ids))


LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_NUM_SPECIAL_TOKENS = 256
LLAMA3_NAMED_SPECIAL_TOKENS = {
    0: "<|begin_of_text|>",
    1: "<|end_of_text|>",
    6: "<|start_header_id|>",
    7: "<|end_header_id|>",
    9: "<|eot_id|>",
}


def llama3_special_tokens() -> list[str]:
    """Llama 3's 256 special tokens in id order; the slots without a name are numbered reserved tokens."""
    reserved = (f"<|reserved_special_token_{i}|>" for i in range(LLAMA3_NUM_SPECIAL_TOKENS))
    return [LLAMA3_NAMED_SPECIAL_TOKENS.get(slot) or next(reserved) for slot in range(LLAMA3_NUM_SPECIAL_TOKENS)]


class TiktokenTokenizer(Tokenizer):
    """A tiktoken BPE-ranks file with Llama 3's pre-tokenizer and special tokens after the ranks.

    Text is always encoded as plain text: a document that contains "<|eot_id|>" gets the ids of
    those characters, never the special token."""

    MAX_CHUNK_CHARS = 20_000
    """tiktoken's regex runs out of backtracking stack on very long whitespace runs (~1M spaces),
    so longer inputs are encoded in chunks of at most this many characters."""

    def __init__(self, path: str | Path):
        import tiktoken
        from tiktoken.load import load_tiktoken_bpe

        # tiktoken caches files by path name; the content's hash makes a stale cached copy miss.
        ranks = load_tiktoken_bpe(str(path), expected_hash=hashlib.sha256(Path(path).read_bytes()).hexdigest())
        specials = {token: len(ranks) + i for i, token in enumerate(llama3_special_tokens())}
        self._encoding = tiktoken.Encoding(Path(path).name, pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks, special_tokens=specials)
        self.bos_id = specials["<|begin_of_text|>"]
        self.eos_id = specials["<|end_of_text|>"]
        self.pad_id = -1
        self.vocab_size = len(ranks) + len(specials)

    def _encode(self, text: str) -> list[int]:
        return [i for chunk in self._chunks(text) for i in self._encoding.encode_ordinary(chunk)]

    def _chunks(self, text: str):
        """Cut `text` into pieces of at most MAX_CHUNK_CHARS.

        Cuts go before a space that precedes a non-space character: the pre-tokenizer always starts
        a new token there, so the ids are the same as for the uncut text. Only a stretch of half a
        chunk without such a space (runs of one character, say) gets a hard cut."""
        start = 0
        while len(text) - start > self.MAX_CHUNK_CHARS:
            low, end = start + self.MAX_CHUNK_CHARS // 2, start + self.MAX_CHUNK_CHARS
            cut = text.rfind(" ", low, end)
            while cut != -1 and text[cut + 1].isspace():
                cut = text.rfind(" ", low, cut)
            cut = end if cut == -1 else cut
            yield text[start:cut]
            start = cut
        yield text[start:]

    def decode(self, ids: list[int]) -> str:
        return self._encoding.decode(list(ids))


TIKTOKEN_RANK_LINE = re.compile(rb"[A-Za-z0-9+/]+={0,2} \d+\r?\n?")


def build_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer stored at `path`: a tiktoken BPE-ranks file (first line "<base64> <rank>") or a
    sentencepiece model."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no tokenizer file at {path}")
    with path.open("rb") as f:
        first_line = f.readline(1024)
    if TIKTOKEN_RANK_LINE.fullmatch(first_line):
        return TiktokenTokenizer(path)
    try:
        return SentencePieceTokenizer(path)
    except (RuntimeError, OSError) as e:
        raise ValueError(f"{path} is not a tokenizer this trainer reads: expected a sentencepiece model "
                         f"or a tiktoken BPE-ranks file (lines of '<base64 token> <rank>')") from e
