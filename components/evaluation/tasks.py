"""Multiple-choice task files, read into examples formatted as lm-evaluation-harness formats them.

A task file holds one record per example in one of four layouts, told apart by the fields of its
first record: hellaswag, arc (ARC-Easy/Challenge), piqa, as the Hugging Face datasets give them, or
generic (context, choices, gold, optional delimiter: used as they are). Files are .jsonl, .json (a
list of records), .parquet, or a folder written by `datasets`' save_to_disk. Every error names the
file and the line (jsonl), item (json) or row (parquet, datasets) it is about.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

DATASET_SPLITS = ("validation", "test", "train")
"""The split read from a saved DatasetDict: the first of these it has."""


@dataclass(frozen=True)
class Example:
    context: str
    """The prompt the choices continue."""
    choices: list[str]
    """As lm-eval's doc_to_choice gives them (acc_norm divides by their length in characters)."""
    gold: int
    """Index of the right choice."""
    delimiter: str = " "
    """lm-eval's target_delimiter: what goes between the context and each choice."""


@dataclass(frozen=True)
class Task:
    name: str
    layout: str
    path: Path
    examples: list[Example]


class RecordError(ValueError):
    """What is wrong with one record; read_task puts the file and line in front."""


class MissingField(RecordError):
    def __init__(self, name: str):
        super().__init__(name)
        self.name = name


def field(record: dict, name: str) -> object:
    if name not in record:
        raise MissingField(name)
    return record[name]


def text(record: dict, name: str) -> str:
    value = field(record, name)
    if not isinstance(value, str):
        raise RecordError(f"{name} must be a string, found {type(value).__name__}")
    return value


def strings(record: dict, name: str, value: object = None) -> list[str]:
    """A list-of-strings field; `value` is given for a nested one (ARC's choices.text), None if absent."""
    value = field(record, name) if value is None else value
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise RecordError(f"{name} must be a list of strings, found {value!r:.80}")
    return value


def index(record: dict, name: str) -> int:
    """An integer field, which some datasets store as a string ("3")."""
    value = field(record, name)
    if isinstance(value, str) and re.fullmatch(r"-?\d+", value.strip()):
        return int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise RecordError(f"{name} {value!r:.80} is not an integer")
    return value


def example(context: str, choices: list[str], gold: int, gold_field: str, delimiter: str = " ") -> Example:
    if len(choices) < 2:
        raise RecordError(f"a multiple-choice example needs at least 2 choices, found {len(choices)}")
    for i, choice in enumerate(choices):
        if not choice.strip():
            raise RecordError(f"choice {i + 1} is empty")
    if not 0 <= gold < len(choices):
        raise RecordError(f"{gold_field} {gold} is out of range for {len(choices)} choices")
    return Example(context, choices, gold, delimiter)


def clean_hellaswag(text: str) -> str:
    """lm-eval's hellaswag preprocess: WikiHow's " [title]" becomes a full stop, other [tags] go."""
    text = text.strip().replace(" [title]", ". ")
    return re.sub(r"\[.*?\]", "", text).replace("  ", " ")


def read_hellaswag(record: dict) -> Example:
    if "ctx_a" in record:
        ctx = text(record, "ctx_a") + " " + text(record, "ctx_b").capitalize()
    else:
        ctx = text(record, "ctx")
    endings = strings(record, "endings")
    label = index(record, "label")
    activity = record.get("activity_label")
    prompt = f"{activity}: {ctx}" if activity else ctx
    return example(clean_hellaswag(prompt), [clean_hellaswag(e) for e in endings], label, "label")


def read_arc(record: dict) -> Example:
    question = text(record, "question")
    choices = field(record, "choices")
    answer = text(record, "answerKey")
    if not isinstance(choices, dict):
        raise RecordError("choices must be an object with lists 'text' and 'label'")
    texts = strings(record, "choices.text", choices.get("text"))
    labels = strings(record, "choices.label", choices.get("label"))
    if len(texts) != len(labels):
        raise RecordError(f"choices has {len(texts)} texts but {len(labels)} labels")
    if answer not in labels:
        raise RecordError(f"answerKey {answer!r} is not among the choices' labels {labels}")
    return example(f"Question: {question}\nAnswer:", texts, labels.index(answer), "answerKey")


def read_piqa(record: dict) -> Example:
    goal = text(record, "goal")
    solutions = [text(record, "sol1"), text(record, "sol2")]
    return example(f"Question: {goal}\nAnswer:", solutions, index(record, "label"), "label")


def read_generic(record: dict) -> Example:
    delimiter = record.get("delimiter", " ")
    if not isinstance(delimiter, str):
        raise RecordError(f"delimiter must be a string, found {type(delimiter).__name__}")
    return example(text(record, "context"), strings(record, "choices"), index(record, "gold"), "gold", delimiter)


@dataclass(frozen=True)
class Layout:
    needs: str
    """Its fields, as error messages list them."""
    markers: frozenset[str]
    """Fields no other layout has: the first record's fields pick the layout by these."""
    read: Callable[[dict], Example]


LAYOUTS: dict[str, Layout] = {
    "hellaswag": Layout("ctx or ctx_a/ctx_b, endings, label", frozenset({"ctx", "ctx_a", "ctx_b", "endings"}),
                        read_hellaswag),
    "arc": Layout("question, choices {text, label}, answerKey", frozenset({"question", "answerKey"}), read_arc),
    "piqa": Layout("goal, sol1, sol2, label", frozenset({"goal", "sol1", "sol2"}), read_piqa),
    "generic": Layout("context, choices, gold, optional delimiter", frozenset({"context", "gold"}), read_generic),
}


def detect_layout(record: dict, where: str) -> str:
    matches = [name for name, layout in LAYOUTS.items() if layout.markers & record.keys()]
    if len(matches) != 1:
        supported = "; ".join(f"{name} ({layout.needs})" for name, layout in LAYOUTS.items())
        raise ValueError(f"{where}: fields {sorted(record)} match no single task layout; supported layouts: "
                         f"{supported}")
    return matches[0]


def jsonl_records(path: Path) -> Iterator[tuple[str, object]]:
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if line.strip():
                try:
                    yield f"{path} line {number}", json.loads(line)
                except json.JSONDecodeError as error:
                    raise ValueError(f"{path} line {number}: invalid JSON ({error})") from None


def json_records(path: Path) -> Iterator[tuple[str, object]]:
    try:
        items = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: invalid JSON ({error})") from None
    if not isinstance(items, list):
        raise ValueError(f"{path}: a .json task is a list of records, found {type(items).__name__}")
    for number, item in enumerate(items, start=1):
        yield f"{path} item {number}", item


def parquet_records(path: Path) -> Iterator[tuple[str, object]]:
    import pyarrow
    import pyarrow.parquet

    try:
        rows = pyarrow.parquet.read_table(path).to_pylist()
    except pyarrow.ArrowException as error:
        raise ValueError(f"{path}: not a readable parquet file ({error})") from None
    for number, row in enumerate(rows, start=1):
        yield f"{path} row {number}", row


def dataset_records(path: Path) -> Iterator[tuple[str, object]]:
    """Rows of a save_to_disk folder; of a DatasetDict, its first split among DATASET_SPLITS."""
    from datasets import DatasetDict, load_from_disk

    try:
        dataset = load_from_disk(str(path))
    except FileNotFoundError:
        raise ValueError(f"{path}: a folder, but not one written by datasets' save_to_disk") from None
    if isinstance(dataset, DatasetDict):
        split = next((name for name in DATASET_SPLITS if name in dataset), None)
        if split is None:
            raise ValueError(f"{path}: a DatasetDict with splits {sorted(dataset)}, none of {list(DATASET_SPLITS)}")
        dataset = dataset[split]
    for number, row in enumerate(dataset, start=1):
        yield f"{path} row {number}", row


READERS = {".jsonl": jsonl_records, ".json": json_records, ".parquet": parquet_records}


def records(path: Path) -> Iterator[tuple[str, object]]:
    """(where, record) for each record; `where` names the file and the line, item or row."""
    if not path.exists():
        raise FileNotFoundError(f"task file {path} does not exist")
    if path.is_dir():
        return dataset_records(path)
    if path.suffix not in READERS:
        raise ValueError(f"{path}: unknown task file type {path.suffix!r}; a task is a .jsonl, .json or .parquet "
                         f"file, or a folder written by datasets' save_to_disk")
    return READERS[path.suffix](path)


def parse_task_spec(spec: str) -> tuple[str, Path]:
    """'name=path' or 'path' (name = the file's stem, or the folder's name). An '=' after a '/' belongs
    to the path; write ./a=b.jsonl for a file whose name has one."""
    name, separator, path = spec.partition("=")
    if separator and "/" not in name:
        if not name or not path:
            raise ValueError(f"task {spec!r}: expected 'name=path' or 'path'")
        return name, Path(path)
    if not spec:
        raise ValueError("task '': expected 'name=path' or 'path'")
    path = Path(spec)
    return (path.name if path.is_dir() else path.stem), path


def read_task(spec: str, limit: int = 0) -> Task:
    """Read a task file; limit > 0 keeps its first `limit` examples (records after them are not read).
    Raises ValueError, or FileNotFoundError for a missing path, with a message naming the file and line."""
    name, path = parse_task_spec(spec)
    examples: list[Example] = []
    layout = ""
    for where, record in records(path):
        if limit > 0 and len(examples) == limit:
            break
        if not isinstance(record, dict):
            raise ValueError(f"{where}: a record is a JSON object, found {type(record).__name__}")
        layout = layout or detect_layout(record, where)
        try:
            examples.append(LAYOUTS[layout].read(record))
        except MissingField as error:
            raise ValueError(f"{where}: no field '{error.name}' (the {layout} layout needs "
                             f"{LAYOUTS[layout].needs})") from None
        except RecordError as error:
            raise ValueError(f"{where}: {error}") from None
    if not examples:
        raise ValueError(f"{path}: the task file has no examples")
    return Task(name, layout, path, examples)
