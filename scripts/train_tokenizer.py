"""Train a small sentencepiece BPE tokenizer on the "text" field of JSONL files.

    python -m scripts.train_tokenizer --input tests/assets/shakespeare/train.jsonl \
        --vocab-size 4096 --output tests/assets/tokenizers/shakespeare_bpe_4k.model

The model is lossless: identity normalization, no dummy prefix, whitespace kept as is, and byte
fallback for characters it never saw, so decode(encode(text)) == text for any string. Special ids:
<unk> 0, <s> (BOS) 1, </s> (EOS) 2 and no pad token (pad_id -1): documents are packed, never padded.
Each document is one training "sentence", so pieces may span line breaks (".\n", "\n\n").
One thread and no sampling make the output byte-for-byte reproducible.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import sentencepiece as spm

MAX_DOCUMENT_BYTES = 1 << 16
"""sentencepiece drops longer sentences; passed as its max_sentence_length so none is lost silently."""


def read_documents(paths: list[Path], text_field: str) -> Iterator[str]:
    for path in paths:
        with path.open(encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if line.strip():
                    text = json.loads(line)[text_field]
                    if len(text.encode("utf-8")) > MAX_DOCUMENT_BYTES:
                        raise ValueError(f"{path}:{number}: document over {MAX_DOCUMENT_BYTES} bytes; split it first")
                    yield text


def train(paths: list[Path], vocab_size: int, text_field: str = "text") -> bytes:
    """The serialized sentencepiece model trained on the documents in `paths`."""
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=read_documents(paths, text_field),
        model_writer=model,
        model_type="bpe",
        vocab_size=vocab_size,
        character_coverage=1.0,
        byte_fallback=True,
        normalization_rule_name="identity",
        add_dummy_prefix=False,
        remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True,
        split_digits=True,
        max_sentence_length=MAX_DOCUMENT_BYTES,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        num_threads=1,
        minloglevel=1,
    )
    return model.getvalue()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.train_tokenizer", description=__doc__.splitlines()[0])
    parser.add_argument("--input", type=Path, nargs="+", required=True, help="JSONL files, one document per line")
    parser.add_argument("--vocab-size", type=int, required=True, help="total, special and byte tokens included")
    parser.add_argument("--output", type=Path, required=True, help="where to write the .model file")
    parser.add_argument("--text-field", default="text")
    args = parser.parse_args(argv)

    documents = sum(1 for _ in read_documents(args.input, args.text_field))
    sources = ", ".join(map(str, args.input))
    print(f"training a {args.vocab_size}-token BPE model on {documents} documents from {sources}")
    started = time.perf_counter()
    model = train(args.input, args.vocab_size, args.text_field)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_bytes(model)
    print(f"wrote {args.output} ({len(model):,} bytes, sha256 {hashlib.sha256(model).hexdigest()[:16]}) "
          f"in {time.perf_counter() - started:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
