"""Build tasks/shakespeare_next_line.jsonl: pick the next line of a speech among four.

    python tests/assets/build_next_line_task.py [--output PATH]

A multiple-choice task in the generic layout (components/evaluation/tasks.py), made from the held-out
validation split only, so it measures what a model learned about verse rather than what it memorised.
Each example opens a speech: the speaker line and its first 2 to 4 lines are the context (ending with
a newline, hence an empty delimiter); the choices are the speech's next line and three distractors,
lines from speeches in other plays whose length is within a tenth of the true line's, so length alone
does not give it away. A seeded random.Random picks the speeches, context lengths, distractors and
the position of the true line: two runs write the same bytes. Stdlib only.
"""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

ASSETS = Path(__file__).parent
SOURCE = ASSETS / "shakespeare" / "validation.jsonl"
OUTPUT = ASSETS / "tasks" / "shakespeare_next_line.jsonl"
SEED = 20250601
EXAMPLES = 400
CHOICES = 4
CONTEXT_LINES = (2, 3, 4)
MIN_LINE_CHARS = 16
"""Shortest line that can be the answer or a distractor: shorter ones ("O!", "Ay, my lord.") say little."""

# "HAMLET.", "First Citizen.", "Lady Capulet.", "Gon.": capitalised words and a full stop.
SPEAKER = re.compile(r"^[A-Z][A-Za-z'&-]*(?: [A-Z][A-Za-z'&-]*){0,3}\.$")
BLANK_LINE = re.compile(r"\n[ \t]*\n")


def speeches(text: str) -> list[tuple[str, list[str]]]:
    """(speaker line, lines of speech) of each paragraph that opens with a speaker and holds no stage
    direction."""
    found = []
    for paragraph in BLANK_LINE.split(text):
        speaker, *lines = paragraph.strip("\n").split("\n")
        if SPEAKER.match(speaker) and lines and not any("[" in line or "]" in line for line in lines):
            found.append((speaker, lines))
    return found


def is_choice(line: str) -> bool:
    """Long enough to say something, and without the stray edge spaces of some lines, which would mark
    a choice out."""
    return len(line) >= MIN_LINE_CHARS and line == line.strip()


def distractors(answer: str, source: str, pool: list[tuple[str, str]], rng: random.Random) -> list[str]:
    """CHOICES - 1 different lines of other plays, each within a tenth of the answer's length."""
    slack = max(2, len(answer) // 10)
    candidates = sorted({line for play, line in pool
                         if play != source and abs(len(line) - len(answer)) <= slack and line != answer})
    return rng.sample(candidates, CHOICES - 1)


def build(documents: list[dict]) -> list[dict]:
    rng = random.Random(SEED)
    by_play = [(doc["source"], speech) for doc in documents for speech in speeches(doc["text"])]
    pool = [(play, line) for play, (_, lines) in by_play for line in lines if is_choice(line)]
    openings = []
    for play, (speaker, lines) in by_play:
        sizes = [n for n in CONTEXT_LINES if n < len(lines) and is_choice(lines[n])]
        if sizes:
            n = rng.choice(sizes)
            openings.append((play, speaker + "\n" + "".join(line + "\n" for line in lines[:n]), lines[n]))
    examples = []
    for index in sorted(rng.sample(range(len(openings)), EXAMPLES)):
        play, context, answer = openings[index]
        choices = distractors(answer, play, pool, rng)
        gold = rng.randrange(CHOICES)
        choices.insert(gold, answer)
        examples.append({"context": context, "choices": choices, "gold": gold, "delimiter": ""})
    return examples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=OUTPUT)
    args = parser.parse_args()

    documents = [json.loads(line) for line in SOURCE.read_text(encoding="utf-8").splitlines()]
    examples = build(documents)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    lines = (json.dumps(example, ensure_ascii=False) + "\n" for example in examples)
    args.output.write_text("".join(lines), encoding="utf-8", newline="\n")
    print(f"{args.output}: {len(examples)} examples, {args.output.stat().st_size:,} bytes")


if __name__ == "__main__":
    main()
