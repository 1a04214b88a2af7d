"""Tokenizers behind one interface: sentencepiece models, tiktoken BPE-ranks files (Llama 3) and
Hugging Face `tokenizer.json` files (through the optional `tokenizers` package).

`build_tokenizer(path)` picks the format from the file, mostly from its content: Llama 3's tiktoken
file and sentencepiece models are both commonly called tokenizer.model.
"""

from __future__ import annotations

import hashlib
import json
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
        self._encoding = tiktoken.Encoding(Path(path).name, pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks,
                                           special_tokens=specials)
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


class MissingDependencyError(ImportError, ValueError):
    """An optional package that a tokenizer file needs is not installed. Also a ValueError, so the
    command-line entry points, which report a bad tokenizer path (ValueError) as a usage error, print
    the install hint instead of a traceback."""


HF_BOS_TOKENS = ("<|begin_of_text|>", "<s>", "<|endoftext|>")
HF_EOS_TOKENS = ("<|end_of_text|>", "</s>", "<|endoftext|>")
"""Well-known BOS and EOS tokens, looked up in this order when tokenizer_config.json names none."""


def _import_hf_tokenizers():
    try:
        import tokenizers
    except ImportError as e:
        raise MissingDependencyError(
            "reading a Hugging Face tokenizer.json needs the optional `tokenizers` package: "
            "pip install 'ingot[hf]' (or pip install tokenizers)") from e
    return tokenizers


def _hf_files(path: Path) -> tuple[Path, Path | None]:
    """The tokenizer.json of a HF tokenizer at `path` (the file, or a folder holding one) and the
    tokenizer_config.json next to it, if there is one."""
    file = path / "tokenizer.json" if path.is_dir() else path
    config = file.parent / "tokenizer_config.json"
    return file, (config if config.is_file() and config != file else None)


class HFTokenizer(Tokenizer):
    """A Hugging Face `tokenizer.json`, read by the `tokenizers` library.

    Text is encoded without the tokenizer's own post-processor (`add_special_tokens=False`: many
    add BOS themselves), and BOS/EOS come only from `encode`'s flags, so no id is ever doubled. As
    with the other formats, text that spells a special token ("<|end_of_text|>") is encoded as plain
    text, never as the special token, and a truncation or padding setting stored in the file is
    dropped: a document is encoded whole.

    BOS, EOS and pad are the `bos_token`, `eos_token` and `pad_token` of the tokenizer_config.json next
    to the file, where it names them (a string, or an object with "content"); otherwise BOS and EOS are
    the first of HF_BOS_TOKENS / HF_EOS_TOKENS in the vocabulary, and pad is -1 unless the file sets
    padding."""

    def __init__(self, path: str | Path):
        tokenizers = _import_hf_tokenizers()
        self.path, self.config_path = _hf_files(Path(path))
        try:
            tokenizer = tokenizers.Tokenizer.from_file(str(self.path))
        except Exception as e:  # noqa: BLE001 - the library raises a bare Exception for every parse error
            raise ValueError(
                f"{self.path} is not a Hugging Face tokenizer.json the `tokenizers` library reads: {e}"
            ) from e
        padding = tokenizer.padding
        self._tokenizer = tokenizer
        self._configure()
        config = self._read_config()
        self.bos_id = self._special_id(config, "bos_token", HF_BOS_TOKENS)
        self.eos_id = self._special_id(config, "eos_token", HF_EOS_TOKENS)
        pad = self._special_id(config, "pad_token", ())
        self.pad_id = pad if pad is not None else (padding["pad_id"] if padding else -1)
        # Ids are normally 0..n-1; the largest id + 1 also covers a vocabulary with holes.
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        self.vocab_size = max(tokenizer.get_vocab_size(with_added_tokens=True), max(vocab.values(), default=-1) + 1)

    def _configure(self) -> None:
        self._tokenizer.no_truncation()
        self._tokenizer.no_padding()
        self._tokenizer.encode_special_tokens = True

    def _read_config(self) -> dict:
        if self.config_path is None:
            return {}
        try:
            config = json.loads(self.config_path.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as e:
            raise ValueError(f"{self.config_path} is not valid JSON: {e}") from e
        if not isinstance(config, dict):
            raise ValueError(f"{self.config_path} is not a JSON object")
        return config

    def _special_id(self, config: dict, key: str, well_known: tuple[str, ...]) -> int | None:
        token = config.get(key)
        if isinstance(token, dict):
            token = token.get("content")
        if token is not None:
            token_id = self._tokenizer.token_to_id(token) if isinstance(token, str) else None
            if token_id is None:
                raise ValueError(
                    f"{self.config_path} sets {key} {token!r}, which is not in the vocabulary of {self.path}"
                )
            return token_id
        for token in well_known:
            token_id = self._tokenizer.token_to_id(token)
            if token_id is not None:
                return token_id
        if not well_known:
            return None
        if self.config_path:
            where = f"{self.config_path} sets no {key}"
        else:
            where = f"there is no tokenizer_config.json next to {self.path}"
        raise ValueError(f"{self.path}: no {key[:3].upper()} token: {where}, and the vocabulary has none of "
                         f"{', '.join(well_known)}; name it as {key} in a tokenizer_config.json next to the file")

    def _encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=False)

    def __setstate__(self, state: dict) -> None:
        # A pickled `tokenizers.Tokenizer` forgets encode_special_tokens (it is not in its JSON form).
        self.__dict__.update(state)
        self._configure()


TIKTOKEN_RANK_LINE = re.compile(rb"[A-Za-z0-9+/]+={0,2} \d+\r?\n?")


def _is_hf_json(path: Path, first_line: bytes) -> bool:
    """Whether a file not named *.json holds a HF tokenizer: a JSON object with a "model" key."""
    if not first_line.lstrip(b"\xef\xbb\xbf \t\r\n").startswith(b"{"):
        return False
    try:
        content = json.loads(path.read_bytes())
    except (ValueError, UnicodeDecodeError):
        return False
    return isinstance(content, dict) and "model" in content


def tokenizer_format(path: str | Path, setting: str = "model.tokenizer_path") -> type[Tokenizer]:
    """The class that reads the tokenizer at `path`, from the file (see `build_tokenizer`); `setting`
    names the option that gave the path, in errors."""
    path = Path(path)
    if path.is_dir():
        if not (path / "tokenizer.json").is_file():
            raise FileNotFoundError(f"{setting}: {path} is a folder without a tokenizer.json; point {setting} "
                                    f"at the tokenizer file itself (a sentencepiece or tiktoken tokenizer.model)")
        return HFTokenizer
    if not path.is_file():
        raise FileNotFoundError(f"{setting}: no tokenizer file at {path}")
    if path.suffix == ".json":
        return HFTokenizer
    with path.open("rb") as f:
        first_line = f.readline(1024)
    if TIKTOKEN_RANK_LINE.fullmatch(first_line):
        return TiktokenTokenizer
    if _is_hf_json(path, first_line):
        return HFTokenizer
    return SentencePieceTokenizer


def tokenizer_files(path: str | Path) -> list[Path]:
    """The files whose content defines the tokenizer at `path` (what a fingerprint should hash): the
    file itself, or for a HF tokenizer its tokenizer.json and the tokenizer_config.json next to it."""
    if tokenizer_format(path) is HFTokenizer:
        file, config = _hf_files(Path(path))
        return [file] + ([config] if config else [])
    return [Path(path)]


def build_tokenizer(path: str | Path, setting: str = "model.tokenizer_path") -> Tokenizer:
    """The tokenizer stored at `path`: a Hugging Face tokenizer (a *.json file, a JSON file with a
    "model" key, or a folder holding tokenizer.json), a tiktoken BPE-ranks file (first line
    "<base64> <rank>") or, failing those, a sentencepiece model. `setting` names the option that gave
    the path, in errors."""
    kind = tokenizer_format(path, setting)
    if kind is not SentencePieceTokenizer:
        return kind(path)
    try:
        return SentencePieceTokenizer(path)
    except (RuntimeError, OSError) as e:
        raise ValueError(f"{path} is not a tokenizer this trainer reads: expected a sentencepiece model, "
                         f"a tiktoken BPE-ranks file (lines of '<base64 token> <rank>') or a Hugging Face "
                         f"tokenizer.json") from e
