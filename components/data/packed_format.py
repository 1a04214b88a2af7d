"""The packed token format: written once by `python -m scripts.preprocess`, read by the training
loader through memory maps.

    DIR/manifest.json         what is in DIR (see `read_manifest`); written last, so a DIR without
                              it was never finished
    DIR/train-00000.bin       tokens, little-endian uint16 when the vocabulary fits, else uint32;
                              every document stored as BOS + tokens + EOS, documents back to back
    DIR/train-00000.idx       little-endian int64 offsets, documents + 1 of them: document i of the
                              shard is tokens[idx[i]:idx[i + 1]]
    DIR/validation-00000.*    the same for the validation split

A run over several processes (torchrun) names its shards by rank too: train-r00001-00000.bin is rank 1's
first train shard. The shards of a split, in manifest order, form one token stream; a reader sees it as one
array.
"""

from __future__ import annotations

import bisect
import hashlib
import json
from pathlib import Path

import numpy as np

from components.checkpoint.durable import write_json_atomically
from components.data.tokenizer import tokenizer_files

FORMAT_NAME = "ingot-packed"
FORMAT_VERSION = 1
SPLITS = ("train", "validation")


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype("<u2") if vocab_size <= 2**16 else np.dtype("<u4")


def file_sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def tokenizer_fingerprint(tokenizer_path: str | Path) -> str:
    """What identifies a tokenizer: the SHA-256 of its file(s) (a HF tokenizer's tokenizer.json and
    tokenizer_config.json, which sets BOS/EOS), whether it is given as a file or a folder."""
    digest = hashlib.sha256()
    for path in tokenizer_files(tokenizer_path):
        digest.update(file_sha256(path).encode())
    return "sha256:" + digest.hexdigest()


class ShardWriter:
    """Appends documents (token arrays, BOS/EOS included) to the shards of one split, starting a
    new shard after `shard_tokens` tokens. `close()` returns the manifest entries of the shards.
    `rank` (a multi-process run's) goes into the shard names, so that ranks never write the same file."""

    def __init__(self, folder: str | Path, split: str, dtype: np.dtype, shard_tokens: int = 1 << 30,
                 rank: int | None = None):
        self.folder, self.split, self.dtype, self.shard_tokens = Path(folder), split, np.dtype(dtype), shard_tokens
        self.stem = split if rank is None else f"{split}-r{rank:05d}"
        self.shards: list[dict] = []
        self._bin = None

    def _open(self) -> None:
        name = f"{self.stem}-{len(self.shards):05d}"
        self._name, self._bin = name, open(self.folder / f"{name}.bin", "wb")
        self._offsets, self._tokens = [0], 0

    def _finish(self) -> None:
        self._bin.close()
        np.asarray(self._offsets, dtype="<i8").tofile(self.folder / f"{self._name}.idx")
        self.shards.append({
            "name": self._name,
            "documents": len(self._offsets) - 1,
            "tokens": self._tokens,
            "sha256": {ext: file_sha256(self.folder / f"{self._name}.{ext}") for ext in ("bin", "idx")},
        })
        self._bin = None

    def write(self, document: np.ndarray) -> None:
        if self._bin is None:
            self._open()
        self._bin.write(np.asarray(document, dtype=self.dtype).tobytes())
        self._tokens += len(document)
        self._offsets.append(self._tokens)
        if self._tokens >= self.shard_tokens:
            self._finish()

    def close(self) -> list[dict]:
        if self._bin is not None:
            self._finish()
        return self.shards


def write_manifest(folder: str | Path, manifest: dict) -> Path:
    """Write manifest.json atomically (a reader never sees half of it)."""
    path = Path(folder) / "manifest.json"
    write_json_atomically(path, {"format": FORMAT_NAME, "version": FORMAT_VERSION, **manifest})
    return path


def is_packed_folder(path: str | Path) -> bool:
    return (Path(path) / "manifest.json").is_file()


def read_manifest(folder: str | Path) -> dict:
    """The manifest of a packed folder, checked to be one this code reads. Keys: format, version,
    dtype, tokenizer {path, fingerprint, vocab_size, bos_id, eos_id}, splits {split: {documents,
    tokens, shards [{name, documents, tokens, sha256 {bin, idx}}]}}, plus what the writer recorded
    about its inputs (counts, skipped lines)."""
    path = Path(folder) / "manifest.json"
    if not Path(folder).exists():
        raise FileNotFoundError(f"{folder} does not exist")
    if not path.is_file():
        raise FileNotFoundError(
            f"{folder} is not a packed dataset: no manifest.json (write one with python -m scripts.preprocess)"
        )
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:  # invalid JSON or not UTF-8
        raise ValueError(f"{path}: not valid JSON ({e}); the dataset is damaged, preprocess it again") from e
    if not isinstance(manifest, dict):
        raise ValueError(f"{path}: not a JSON object; the dataset is damaged, preprocess it again")
    if manifest.get("format") != FORMAT_NAME or manifest.get("version") != FORMAT_VERSION:
        raise ValueError(
            f"{path}: format {manifest.get('format')!r} version {manifest.get('version')!r}; this ingot reads "
            f"{FORMAT_NAME!r} version {FORMAT_VERSION}"
        )
    return manifest


def check_tokenizer(folder: str | Path, manifest: dict, tokenizer_path: str | Path) -> None:
    """Refuse data tokenized with another tokenizer than the configured one."""
    expected, actual = manifest["tokenizer"]["fingerprint"], tokenizer_fingerprint(tokenizer_path)
    if actual != expected:
        raise ValueError(
            f"{folder} was tokenized with {manifest['tokenizer']['path']} ({expected}), but model.tokenizer_path "
            f"is {tokenizer_path} ({actual}); re-run python -m scripts.preprocess with --tokenizer "
            f"{tokenizer_path}, or set model.tokenizer_path to the data's tokenizer"
        )


class PackedSplit:
    """One split of a packed folder as a single token array (memory-mapped, nothing read up front)."""

    def __init__(self, folder: str | Path, split: str = "train", manifest: dict | None = None):
        self.folder = Path(folder)
        manifest = manifest or read_manifest(folder)
        if split not in manifest["splits"] or not manifest["splits"][split]["shards"]:
            raise ValueError(f"{folder}: packed dataset has no {split} documents")
        dtype = np.dtype(manifest["dtype"]).newbyteorder("<")
        self.tokens, self.offsets, self.starts = [], [], [0]
        for shard in manifest["splits"][split]["shards"]:
            bin_path, idx_path = self.folder / f"{shard['name']}.bin", self.folder / f"{shard['name']}.idx"
            sizes = ((bin_path, shard["tokens"] * dtype.itemsize), (idx_path, (shard["documents"] + 1) * 8))
            for path, expected in sizes:
                if not path.is_file() or path.stat().st_size != expected:
                    found = f"{path.stat().st_size} bytes" if path.is_file() else "no file"
                    raise ValueError(
                        f"{path}: expected {expected} bytes, found {found}; the dataset is damaged, preprocess it again"
                    )
            self.tokens.append(np.memmap(bin_path, dtype=dtype, mode="r"))
            self.offsets.append(np.memmap(idx_path, dtype="<i8", mode="r"))
            self.starts.append(self.starts[-1] + shard["tokens"])
        self.doc_starts = [0]
        for offsets in self.offsets:
            self.doc_starts.append(self.doc_starts[-1] + len(offsets) - 1)

    @property
    def num_tokens(self) -> int:
        return self.starts[-1]

    @property
    def num_documents(self) -> int:
        return self.doc_starts[-1]

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start + length) of the split's stream, across shard boundaries."""
        if start < 0 or start + length > self.num_tokens:
            raise IndexError(f"tokens [{start}, {start + length}) outside the split's {self.num_tokens}")
        pieces, shard = [], bisect.bisect_right(self.starts, start) - 1
        while length > 0:
            local = start - self.starts[shard]
            piece = self.tokens[shard][local : local + length]
            pieces.append(piece)
            start, length, shard = start + len(piece), length - len(piece), shard + 1
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)

    def document(self, index: int) -> np.ndarray:
        """Document `index` of the split (BOS and EOS included): O(1), from the index files."""
        if not 0 <= index < self.num_documents:
            raise IndexError(f"document {index} outside the split's {self.num_documents}")
        shard = bisect.bisect_right(self.doc_starts, index) - 1
        local = index - self.doc_starts[shard]
        begin, end = self.offsets[shard][local], self.offsets[shard][local + 1]
        return self.tokens[shard][begin:end]
