"""Build the shipped evaluation tasks, tasks/shakespeare_next_line.jsonl and shakespeare_word_order.jsonl.

    python tests/assets/build_eval_tasks.py [--output-dir DIR]

Multiple-choice tasks in the generic layout (components/evaluation/tasks.py), made from the held-out
validation split only, so they measure what a model learned about verse rather than what it memorised.
Each example opens a speech: the speaker line and its first 2 to 4 lines are the context (ending with
a newline, hence an empty delimiter); the answer is the speech's next line.
- next_line: the other choices are lines from speeches in other plays whose length is within a tenth
  of the answer's, so length alone does not give it away. Hard for a small model.
- word_order: the other choices are the answer with two neighbouring words swapped (three different
  swaps): the same words and length, only their order tells. The debug model learns it within 200 steps.
A seeded random.Random per task picks the speeches, context lengths, distractors and the position of
the answer: two runs write the same bytes. Stdlib only.
"""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

ASSETS = Path(__file__).parent
SOURCE = ASSETS / "shakespeare" / "validation.jsonl"
OUTPUT_DIR = ASSETS / "tasks"
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


def speech_openings(by_play: list, rng: random.Random, usable) -> list[tuple[str, str, str]]:
    """(play, context, next line) of each speech with a usable next line after 2 to 4 lines."""
    openings = []
    for play, (speaker, lines) in by_play:
        sizes = [n for n in CONTEXT_LINES if n < len(lines) and usable(lines[n])]
        if sizes:
            n = rng.choice(sizes)
            openings.append((play, speaker + "\n" + "".join(line + "\n" for line in lines[:n]), lines[n]))
    return openings


def example(context: str, answer: str, others: list[str], rng: random.Random) -> dict:
    gold = rng.randrange(CHOICES)
    return {"context": context, "choices": others[:gold] + [answer] + others[gold:], "gold": gold, "delimiter": ""}


def build_next_line(documents: list[dict]) -> list[dict]:
    rng = random.Random(SEED)
    by_play = [(doc["source"], speech) for doc in documents for speech in speeches(doc["text"])]
    pool = [(play, line) for play, (_, lines) in by_play for line in lines if is_choice(line)]
    openings = speech_openings(by_play, rng, is_choice)
    examples = []
    for index in sorted(rng.sample(range(len(openings)), EXAMPLES)):
        play, context, answer = openings[index]
        examples.append(example(context, answer, distractors(answer, play, pool, rng), rng))
    return examples


def swapped(line: str, rng: random.Random) -> set[str]:
    """CHOICES - 1 different copies of the line with one pair of neighbouring words swapped."""
    words, copies = line.split(" "), set()
    pairs = [i for i in range(len(words) - 1) if words[i] != words[i + 1]]
    for i in rng.sample(pairs, CHOICES - 1):
        copies.add(" ".join(words[:i] + [words[i + 1], words[i]] + words[i + 2:]))
    return copies


def build_word_order(documents: list[dict]) -> list[dict]:
    rng = random.Random(SEED + 1)
    by_play = [(doc["source"], speech) for doc in documents for speech in speeches(doc["text"])]
    openings = speech_openings(by_play, rng, lambda line: is_choice(line) and len(set(line.split(" "))) >= 5)
    examples = []
    for index in sorted(rng.sample(range(len(openings)), EXAMPLES)):
        _, context, answer = openings[index]
        others = sorted(swapped(answer, rng) - {answer})
        if len(others) == CHOICES - 1:
            examples.append(example(context, answer, rng.sample(others, len(others)), rng))
    return examples


TASKS = {"shakespeare_next_line.jsonl": build_next_line, "shakespeare_word_order.jsonl": build_word_order}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", type=Path, default=OUTPUT_DIR)
    args = parser.parse_args()

    documents = [json.loads(line) for line in SOURCE.read_text(encoding="utf-8").splitlines()]
    args.output_dir.mkdir(parents=True, exist_ok=True)
    for name, build in TASKS.items():
        examples = build(documents)
        path = args.output_dir / name
        lines = (json.dumps(e, ensure_ascii=False) + "\n" for e in examples)
        path.write_text("".join(lines), encoding="utf-8", newline="\n")
        print(f"{path}: {len(examples)} examples, {path.stat().st_size:,} bytes")


if __name__ == "__main__":
    main()
